"""structlog set-up: JSON lines on stderr when not a TTY, the console renderer when it is."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import msgspec
import structlog

LogFormat = Literal["json", "console"]

_json = msgspec.json.Encoder(enc_hook=str)  # paths, exceptions: their text


def _serialize(event: Any, **kwargs: Any) -> str:
    # structlog passes json.dumps-style keywords (default=...); msgspec takes none.
    return _json.encode(event).decode()


def configure_logging(fmt: LogFormat | None = None, level: int = logging.INFO) -> None:
    if fmt is None:
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer()
        if fmt == "console"
        else structlog.processors.JSONRenderer(serializer=_serialize)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
