"""The daemon's log: JSON lines on stderr when not a TTY, structlog's console renderer when it is.

Every module logs through `get_logger()`, whose events are structlog's in shape (the
call's keywords, `event`, the bound context, `level`, an ISO UTC `timestamp`, a
formatted `exception`) but which imports nothing beyond the standard library and
msgspec: structlog's own import (rich for the console, asyncio for its stdlib
bridge) cost a reload's new image about 150 ms before it could serve. JSON lines are
written here; the console renderer is structlog's, imported only for a terminal.
An event logged before `configure_logging` is kept, with its own time, and written
once the log is configured: nothing is lost to the order of start-up.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal, TextIO

import msgspec

LogFormat = Literal["json", "console"]

#: The standard library's numbers (logging.INFO...), without importing logging.
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
INFO = LEVELS["info"]
#: Events kept while the log is not configured (a library use that never configures
#: it must not grow without end): beyond this, the oldest go.
UNCONFIGURED_KEPT = 10_000

_json = msgspec.json.Encoder(enc_hook=str)  # paths, exceptions: their text
#: What `bind_contextvars` bound in this task (each trio task runs in its own context):
#: never mutated, replaced, so a child task's binding never reaches its parent.
_bound: ContextVar[dict[str, Any]] = ContextVar("subagentd_log_bound", default={})  # noqa: B039


def bind_contextvars(**values: Any) -> None:
    """Add `values` to every event this task (and the tasks it starts) logs from now on."""
    _bound.set({**_bound.get(), **values})


class _Sink:
    """Where events go: written at once once configured, else kept until then."""

    def __init__(self) -> None:
        self.level = INFO
        self.render: Callable[[str, dict[str, Any]], str] | None = None
        self.file: TextIO = sys.stderr
        self.kept: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()  # a thread may log (trio.to_thread)

    def emit(self, level: str, event_dict: dict[str, Any]) -> None:
        with self.lock:
            if self.render is None:
                self.kept.append((level, event_dict))
                if len(self.kept) > UNCONFIGURED_KEPT:
                    del self.kept[0]
                return
            if LEVELS[level] >= self.level:
                self.file.write(self.render(level, event_dict) + "\n")
                self.file.flush()

    def configure(self, render: Callable[[str, dict[str, Any]], str], level: int) -> None:
        with self.lock:
            self.render, self.level, self.file = render, level, sys.stderr
            kept, self.kept = self.kept, []
        for name, event_dict in kept:
            self.emit(name, event_dict)


_sink = _Sink()


class Logger:
    """structlog's filtering bound logger, as the daemon uses it: `log.info("event", k=v)`."""

    def debug(self, event: str, **kw: Any) -> None:
        self._log("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log("error", event, kw)

    def critical(self, event: str, **kw: Any) -> None:
        self._log("critical", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """`error`, with the exception being handled (structlog's `exception`)."""
        kw.setdefault("exc_info", True)
        self._log("error", event, kw)

    @staticmethod
    def _log(level: str, event: str, kw: dict[str, Any]) -> None:
        if _sink.render is not None and LEVELS[level] < _sink.level:
            return
        # structlog's order: the keywords, the event, the bound context (not overriding
        # a keyword), the level, the time, the exception.
        exc_info = kw.pop("exc_info", None)
        event_dict = {**kw, "event": event}
        for key, value in _bound.get().items():
            event_dict.setdefault(key, value)
        event_dict["level"] = level
        now = datetime.datetime.now(tz=datetime.UTC)
        event_dict["timestamp"] = now.isoformat().replace("+00:00", "Z")
        exception = _format_exception(exc_info)
        if exception is not None:
            event_dict["exception"] = exception
        _sink.emit(level, event_dict)


_logger = Logger()


def get_logger(name: str = "subagentd") -> Logger:
    """The daemon's logger (one for all: the name is not rendered)."""
    return _logger


def _format_exception(exc_info: Any) -> str | None:
    """structlog's `format_exc_info`: the traceback as `traceback` prints it, or None."""
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif not (isinstance(exc_info, tuple) and len(exc_info) == 3):
        if not exc_info:
            return None
        exc_info = sys.exc_info()
        if exc_info[1] is None:
            return None
    import traceback  # only when there is one to format: off the start-up path

    text = "".join(traceback.format_exception(*exc_info))
    return text.removesuffix("\n")


def _render_json(level: str, event_dict: dict[str, Any]) -> str:
    return _json.encode(event_dict).decode()


def configure_logging(fmt: LogFormat | None = None, level: int = INFO) -> None:
    """Write events (those kept until now first) to stderr in `fmt`: JSON lines, or the
    console renderer; by default, the console for a terminal, else JSON."""
    if fmt is None:
        fmt = "console" if sys.stderr.isatty() else "json"
    _sink.configure(_render_json if fmt == "json" else _console_renderer(), level)


def _console_renderer() -> Callable[[str, dict[str, Any]], str]:
    """structlog's console renderer (imports structlog and rich: for a terminal only)."""
    from structlog.dev import ConsoleRenderer

    renderer = ConsoleRenderer()

    def render(level: str, event_dict: dict[str, Any]) -> str:
        return str(renderer(None, level, dict(event_dict)))

    return render
