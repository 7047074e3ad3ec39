"""What a host writes on subagentd-mcp's stdin, read here before the MCP SDK reads it.

The SDK's stdio reader refuses a line whose JSON holds a lone surrogate (``"\\ud800"``:
valid JSON, but no text), and its server drops what it refused without a word, so the
host waits for ever on that request. Such a line is read here with Python's json, which
takes it, and the request is answered `invalid`, naming the field: a tool call whose
arguments hold one goes on to the SDK with them made text and `REFUSED_META` in its
`_meta` saying why, for `call_tool` to refuse it as the tool's error, as any invalid
argument is (so the SDK shapes that answer as it does every other); any other request
is answered here as a JSON-RPC error; a notification is dropped, as the SDK would.
Every other line goes on to the SDK as it came. `checked` decides (pure);
`CheckedStdin` is the SDK's stdin that asks it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio

#: Where a line may hold a lone surrogate: JSON writes one only as a `\u` escape (raw
#: surrogate bytes are no UTF-8, read as U+FFFD), so only such lines are read twice.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


#: JSON-RPC's codes for a request that is not one, and for parameters that are not.
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602


#: The key of a tool call's `_meta` that says why its arguments are refused (set here,
#: read by `call_tool`): "<field>: <why>".
REFUSED_META = "subagentd/refused"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request answered here, as a JSON-RPC error: its id (None: the id is not one to
    echo, so JSON-RPC's null), JSON-RPC's code, and the field at fault and why."""

    id: int | str | None
    code: int
    field: str
    why: str


#: What `checked` found a line to be: None (it goes to the SDK as it came), a str (the
#: line the SDK is to read instead), a Refusal to answer, or DROPPED (a notification or a
#: response holding a lone surrogate: nobody to answer).
DROPPED = Refusal(None, INVALID_REQUEST, "", "")


def checked(line: str) -> Refusal | str | None:
    """What to do with a line before the SDK reads it (see the module's docstring)."""
    if _SURROGATE_ESCAPE.search(line) is None:
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None  # the SDK's to refuse, as any line that is no JSON
    found = _first_surrogate(message, ())
    if found is None:
        return None
    path, character = found
    if not isinstance(message, dict) or "id" not in message or "method" not in message:
        return DROPPED
    if message["method"] == "tools/call" and path[:2] == ("params", "arguments"):
        params = message["params"]
        params["arguments"] = _as_text(params["arguments"])
        elsewhere = _first_surrogate(message, ())
        if elsewhere is None:
            meta = params.get("_meta")
            refused = f"{'.'.join(path[2:]) or 'arguments'}: {_why(character)}"
            params["_meta"] = {**(meta if isinstance(meta, dict) else {}), REFUSED_META: refused}
            return json.dumps(message)
        path, character = elsewhere  # its id or its name: answered here, as below
    given = message["id"]
    answerable = isinstance(given, str | int) and not isinstance(given, bool)
    request_id = given if answerable and path[:1] != ("id",) else None
    code = INVALID_PARAMS if path[:1] == ("params",) else INVALID_REQUEST
    return Refusal(request_id, code, ".".join(path), _why(character))


def _why(character: str) -> str:
    return f"holds a lone surrogate (\\u{ord(character):04x}), which is not text"


def _as_text(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys too) made U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_as_text(key): _as_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    return value


def _first_surrogate(value: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], str] | None:
    """The first string in `value` (keys too) holding a lone surrogate: where, and which."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (path, found.group()) if found else None
    items: Iterator[tuple[str, Any]]
    if isinstance(value, dict):
        for key in value:
            if (found := _SURROGATE.search(key)) is not None:
                return (*path, _shown(key)), found.group()
        items = iter(value.items())
    elif isinstance(value, list):
        items = ((str(index), item) for index, item in enumerate(value))
    else:
        return None
    for name, item in items:
        if (inner := _first_surrogate(item, (*path, name))) is not None:
            return inner
    return None


def _shown(key: str) -> str:
    """A key as an answer names it: its surrogates as escapes, so the answer is text."""
    return key.encode("utf-8", "backslashreplace").decode()


class CheckedStdin(anyio.AsyncFile[str]):
    """The host's lines, as the SDK's stdio reader takes them (`stdio_server(stdin=...)`),
    each first asked of `checked`: a refused request is handed to the answer `answering`
    gives (once the SDK's streams are made), not to the SDK."""

    def __init__(self, wire: io.TextIOBase) -> None:
        super().__init__(wire)  # type: ignore[arg-type]  # a text stream: what IO[str] is read for
        self._answer: Callable[[Refusal], Awaitable[None]] | None = None
        self._answering = anyio.Event()

    def answering(self, answer: Callable[[Refusal], Awaitable[None]]) -> None:
        self._answer = answer
        self._answering.set()

    async def __aiter__(self) -> AsyncIterator[str]:
        while line := await self.readline():
            found = checked(line)
            if found is None:
                yield line
            elif isinstance(found, str):
                yield found
            elif found is DROPPED:
                print("subagentd-mcp: dropped a message holding a lone surrogate", file=sys.stderr)
            else:
                await self._answering.wait()
                assert self._answer is not None
                await self._answer(found)


@contextlib.contextmanager
def claimed_stdin() -> Iterator[io.TextIOBase]:
    """The host's wire on fd 0 read from a private duplicate, as UTF-8 (what is not read
    as U+FFFD), fd 0 itself the null device meanwhile: as the SDK claims it when it
    reads stdin itself, so that nothing else in this process reads the host's lines.
    Best-effort as the SDK's: no stdin at start (fd 0 closed, so Python has none, and
    fd 0 may be another's by now) is a wire that has ended; no null device, fd 0 left
    as it is. The duplicate is never closed: a thread may still be reading it."""
    try:
        if sys.stdin is None or sys.stdin.fileno() != 0:
            raise OSError("no stdin")
        private = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    except (OSError, ValueError):
        yield io.StringIO()
        return
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    try:
        yield io.TextIOWrapper(os.fdopen(private, "rb", closefd=False), "utf-8", "replace")
    finally:
        with contextlib.suppress(OSError):
            os.dup2(private, 0)
