"""subagentd-mcp: the daemon's tools for an agent, served over MCP on stdio.

Each tool is one or a few `AsyncClient` calls on a connection of its own (so a
daemon down at start, or reloaded between calls, costs nothing); its result is
the shape `subagentctl --json` prints, with a short text for a model to read.
A daemon refusal is a tool error carrying the daemon's code, never a crash.
Inside a worker ($SUBAGENTD_TOKEN) every tool acts as that worker, as any client
there does: the daemon keeps it to its own subtree. Needs the `mcp` extra.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Annotated, Any, ParamSpec

import anyio
import msgspec
import trio
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from subagentd.protocol import (
    MAX_TIMEOUT,
    Cancel,
    Entry,
    Resumed,
    Stop,
    StopRun,
    Wake,
    WorkerView,
    package_version,
)
from subagentd.protocol.errors import (
    ConnectionLost,
    DaemonUnavailable,
    ProtocolError,
    RemoteError,
    SubagentdError,
)

from . import _core
from ._async import AsyncClient
from ._cli import WAKE_FIELDS, WORKER_FIELDS, _one_line

P = ParamSpec("P")

#: The longest any one tool call waits (subagent_wait, a collect or events that wait): an
#: MCP host times a call out long before this, and a model can always call again.
MAX_TOOL_WAIT = 3600.0
#: Entries of one watch page at most, and lines of a tail: what a model can read at once.
MAX_PAGE = 1000
#: The journal entries a tail (`last`) reads back at most, from the start of the journal.
TAIL_READ_LIMIT = 1000

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
STOPS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


# -- the results: the shapes of `subagentctl --json` (client/_cli.py, Json) -------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class WorkerOut(_Shape):
    """A worker, as `subagentctl --json status` prints it."""

    id: str
    run: str
    parent: str | None
    name: str
    state: str = Field(description="running, finished, failed, stopped, timed_out, ...")
    pid: int | None
    exit_code: int | None
    attempt: int
    turn: int
    started_at: float
    ended_at: float | None
    archive: str
    stopping: bool = Field(description="a stop is in flight: TERM sent, its tree not yet gone")


class WorkersOut(_Shape):
    workers: list[WorkerOut]


class EntryOut(_Shape):
    seq: int
    kind: str = Field(description="stdout, stderr, state or note")
    data: str
    at: float


class PageOut(_Shape):
    entries: list[EntryOut]
    next: int = Field(description="the cursor to pass as `cursor` for what comes after")
    complete: bool = Field(description="the worker has ended and nothing follows")


class GrepMatchOut(_Shape):
    line_no: int = Field(description="1-based over the worker's stdout and stderr lines")
    kind: str
    line: str
    before: list[str]
    after: list[str]


class GrepOut(_Shape):
    matches: list[GrepMatchOut]
    truncated: bool = Field(description="the bound on matches or on the daemon's work was hit")


class WaitOut(_Shape):
    outcome: str = Field(description="matched, ended or timed_out")
    line: str | None = Field(description="the line that matched, for `matched`")
    worker: WorkerOut


class SentOut(_Shape):
    worker: str
    written: int = Field(description="bytes written to the worker's stdin")
    eof: bool = Field(description="its stdin was closed after")


class StoppedOut(_Shape):
    stopped: list[str]
    already_stopping: list[str]


class CancelledOut(_Shape):
    cancelled: list[str]
    already_stopping: list[str]


class ResultOut(_Shape):
    id: str
    state: str
    exit_code: int | None
    result: str = Field(description="what it wrote to $SUBAGENTD_RESULT, else its stdout's tail")


class WakeOut(_Shape):
    id: str
    run: str
    parent: str | None
    state: str
    exit_code: int | None
    preview: str


class WakesOut(_Shape):
    wakes: list[WakeOut]


class ResumedOut(WorkerOut):
    changed: str = Field(description="what changed on disk since its spawn; empty: nothing")


class ResumedListOut(_Shape):
    resumed: list[ResumedOut]


class LatestOut(_Shape):
    run: str
    resumable: bool
    reason: str
    from_: list[str] = Field(alias="from", description="the workers a resume would carry on")


# -- the boundary: a daemon refusal becomes a tool error carrying its code ---------------


class ToolRefusal(Exception):
    """A refusal of this server's own (a bad combination of arguments): a tool error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _error(code: str, message: str) -> CallToolResult:
    """A tool error: `code: message` for the model, and `{"error": ...}` as the CLI prints it."""
    return CallToolResult(
        content=[TextContent(type="text", text=f"{code}: {message}")],
        structured_content={"error": {"code": code, "message": message}},
        is_error=True,
    )


def _as_tool_error(exc: SubagentdError | ToolRefusal) -> CallToolResult:
    match exc:
        case RemoteError():
            return _error(str(exc.code), exc.message)
        case ToolRefusal():
            return _error(exc.code, exc.message)
        case DaemonUnavailable():
            return _error("daemon_unavailable", str(exc))
        case ConnectionLost():
            return _error("connection_lost", str(exc))
        case ProtocolError():
            return _error("protocol", str(exc))
        case _:
            return _error("error", str(exc))


def _refusals_as_errors(
    tool: Callable[P, Awaitable[CallToolResult]],
) -> Callable[P, Awaitable[CallToolResult]]:
    """`tool`, answering what the daemon (or this server) refuses as a tool error; the
    SDK turns anything else into a tool error too, so no call crashes the server."""

    @functools.wraps(tool)
    async def answered(*args: P.args, **kwargs: P.kwargs) -> CallToolResult:
        try:
            return await tool(*args, **kwargs)
        except (SubagentdError, ToolRefusal) as exc:
            return _as_tool_error(exc)

    return answered


@contextlib.asynccontextmanager
async def _daemon() -> AsyncIterator[AsyncClient]:
    """A connection for one tool call: it reconnects across a reload by itself."""
    async with AsyncClient() as daemon:
        yield daemon


def _result(text: str, structured: dict[str, Any]) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=structured
    )


def _worker(view: WorkerView) -> dict[str, Any]:
    return {field: getattr(view, field) for field in WORKER_FIELDS}


def _resumed(view: Resumed) -> dict[str, Any]:
    return {**_worker(view), "changed": view.changed}


def _wake(wake: Wake) -> dict[str, Any]:
    return {field: getattr(wake, field) for field in WAKE_FIELDS}


def _entry(entry: Entry, data: bytes | None = None) -> dict[str, Any]:
    text = (entry.data if data is None else data).decode(errors="replace")
    return {"seq": entry.seq, "kind": entry.kind, "data": text, "at": entry.at}


def _state(view: WorkerView) -> str:
    return "stopping" if view.stopping else view.state


def _one_worker_line(view: WorkerView) -> str:
    exit_code = "" if view.exit_code is None else f" exit={view.exit_code}"
    name = f" {view.name!r}" if view.name else ""
    return f"{view.id} (run {view.run}){name} {_state(view)}{exit_code}"


def _ids(ids: Iterable[str]) -> str:
    return ", ".join(ids) or "none"


# -- the tools ---------------------------------------------------------------------------

WorkerId = Annotated[str, Field(description="a worker id, as subagent_spawn or subagent_list gave")]
RunId = Annotated[str, Field(description="a run id, as subagent_spawn or subagent_list gave")]
Seconds = Annotated[float, Field(ge=0, le=MAX_TOOL_WAIT, allow_inf_nan=False)]


async def subagent_spawn(
    argv: Annotated[
        list[str] | None,
        Field(description='the command and its arguments, e.g. ["pytest", "-x"]'),
    ] = None,
    agent: Annotated[
        str | None, Field(description="an agent named in the user's agents.toml, instead of argv")
    ] = None,
    name: Annotated[str, Field(description="a name to tell the worker by")] = "",
    cwd: Annotated[
        str | None, Field(description="its working directory (default: this server's)")
    ] = None,
    input: Annotated[str | None, Field(description="text given on its stdin")] = None,
    timeout: Annotated[  # noqa: ASYNC109  a tool argument
        float | None,
        Field(
            ge=0,
            le=MAX_TIMEOUT,
            allow_inf_nan=False,
            description="seconds before the daemon stops it (0 or absent: never)",
        ),
    ] = None,
    run: Annotated[
        str | None, Field(description="an existing run to start it in (default: a new run)")
    ] = None,
    stdin_open: Annotated[
        bool, Field(description="keep its stdin open, for subagent_send to write to")
    ] = False,
) -> Annotated[CallToolResult, WorkerOut]:
    """Start a worker process under the subagentd supervisor and return its id and run.

    Give `argv` (a command) or `agent` (a named agent). The worker runs in the background,
    outliving this call; read its output with subagent_watch or subagent_grep, wait for it
    with subagent_wait, stop it with subagent_stop, and get its result with
    subagent_collect. Inside a worker, the new worker is that worker's child."""
    if not argv and agent is None:
        raise ToolRefusal("invalid", "give argv (a command) or agent (a named agent)")
    async with _daemon() as daemon:
        common: dict[str, Any] = {
            "name": name,
            "run": run,
            "agent": agent,
            "input": input,
            "cwd": cwd,
            "timeout": timeout,
        }
        if stdin_open:
            # spawn(stdin_open=) is issue 14's (helper A); only asked for when wanted.
            view = await daemon.spawn(argv or [], stdin_open=True, **common)
        else:
            view = await daemon.spawn(argv or [], **common)
    return _result(f"spawned {_one_worker_line(view)}", _worker(view))


async def subagent_list(
    all: Annotated[bool, Field(description="include ended workers the daemon retains")] = False,
    run: Annotated[str | None, Field(description="only the workers of this run")] = None,
) -> Annotated[CallToolResult, WorkersOut]:
    """List the supervised workers: the running ones, or with `all` the ended ones too.

    Inside a worker, only that worker and those it delegated to are listed."""
    async with _daemon() as daemon:
        views = await daemon.ls(all=all, run=run)
    text = "\n".join(_one_worker_line(view) for view in views) or "no workers"
    return _result(text, {"workers": [_worker(view) for view in views]})


async def subagent_status(worker: WorkerId) -> Annotated[CallToolResult, WorkerOut]:
    """Show one worker: its state (running, finished, failed, stopped...), pid, exit code."""
    async with _daemon() as daemon:
        view = await daemon.status(worker)
    return _result(_one_worker_line(view), _worker(view))


async def subagent_watch(
    worker: WorkerId,
    cursor: Annotated[
        int | None,
        Field(ge=0, description="read the entries after this cursor (0: from the start)"),
    ] = None,
    last: Annotated[
        int | None,
        Field(ge=1, le=MAX_PAGE, description="instead: the last N lines of its stdout and stderr"),
    ] = None,
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE, description="entries per page")] = 200,
) -> Annotated[CallToolResult, PageOut]:
    """Read a worker's journal: its stdout and stderr output, state changes and notes.

    One page of entries after `cursor` (from the start when absent), with `next`, the
    cursor to pass for the following page; `complete` is true once the worker has ended
    and nothing follows. Or, with `last`, its last N output lines. Does not wait: use
    subagent_wait to wait for output or for the end."""
    if cursor is not None and last is not None:
        raise ToolRefusal("invalid", "give cursor or last, not both")
    async with _daemon() as daemon:
        if last is not None:
            return await _tail(daemon, worker, last)
        page = await daemon.watch_page(worker, since=cursor or 0, limit=limit)
    entries = [_entry(entry) for entry in page.entries]
    text = "".join(_entry_text(entry) for entry in page.entries)
    more = "the worker has ended" if page.complete else f"next cursor: {page.next}"
    return _result(
        _with_footer(text, more, "no entries"),
        {"entries": entries, "next": page.next, "complete": page.complete},
    )


def _with_footer(text: str, more: str, none: str) -> str:
    """The output as the model reads it, then where the reading stands, on a line of its own."""
    return f"{text.rstrip(chr(10))}\n[{more}]" if text else f"[{none}; {more}]"


def _entry_text(entry: Entry) -> str:
    if entry.kind in ("stdout", "stderr"):
        return entry.data.decode(errors="replace")
    return f"[{entry.kind}] {entry.data.decode(errors='replace').rstrip()}\n"


async def _tail(daemon: AsyncClient, worker: str, lines: int) -> CallToolResult:
    """The output entries holding the last `lines` lines (the first one cut to start at
    its line), read through the journal page by page, keeping only the tail."""
    tail: collections.deque[tuple[Entry, bytes]] = collections.deque()
    since, complete = 0, False
    while True:
        page = await daemon.watch_page(worker, since=since, limit=TAIL_READ_LIMIT)
        for entry in page.entries:
            if entry.kind in ("stdout", "stderr"):
                tail.append((entry, entry.data))
                _trim(tail, lines)
        since, complete = page.next, page.complete
        if complete or not page.entries:
            break
    text = b"".join(data for _, data in tail).decode(errors="replace")
    more = "the worker has ended" if complete else f"next cursor: {since}"
    return _result(
        _with_footer(text, more, "no output yet"),
        {
            "entries": [_entry(entry, data) for entry, data in tail],
            "next": since,
            "complete": complete,
        },
    )


def _trim(tail: collections.deque[tuple[Entry, bytes]], lines: int) -> None:
    """Drop from the front of `tail` what comes before its last `lines` lines."""
    total = sum(_lines_in(data) for _, data in tail)
    while tail and total > lines:
        entry, data = tail[0]
        extra = total - lines
        count = _lines_in(data)
        if count <= extra:
            tail.popleft()
            total -= count
            continue
        # Cut the oldest entry to its last (count - extra) lines.
        parts = data.splitlines(keepends=True)
        tail[0] = (entry, b"".join(parts[len(parts) - (count - extra) :]))
        total = lines


def _lines_in(data: bytes) -> int:
    return len(data.splitlines())


async def subagent_grep(
    worker: WorkerId,
    pattern: Annotated[
        str,
        Field(
            description="a regular expression in RE2 syntax (no backreferences or lookaround), "
            "searched line by line"
        ),
    ],
    before: Annotated[int, Field(ge=0, le=100, description="lines of context before")] = 0,
    after: Annotated[int, Field(ge=0, le=100, description="lines of context after")] = 0,
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE, description="matches at most")] = 100,
) -> Annotated[CallToolResult, GrepOut]:
    """Search a worker's output (stdout and stderr, line by line) for a regular expression.

    Runs in the daemon over the whole journal, bounded: `truncated` says a bound was hit.
    Each match has its 1-based line number and the lines around it."""
    async with _daemon() as daemon:
        found = await daemon.grep(worker, pattern, before=before, after=after, limit=limit)
    structured: dict[str, Any] = msgspec.to_builtins(found)
    text = "\n".join(_match_text(match) for match in structured["matches"]) or "no match"
    if structured["truncated"]:
        text += "\n[truncated: narrow the pattern or raise limit]"
    return _result(text, structured)


def _match_text(match: dict[str, Any]) -> str:
    lines = [f"  {line}" for line in match["before"]]
    lines.append(f"{match['line_no']}: {match['line']}")
    lines += [f"  {line}" for line in match["after"]]
    return "\n".join(lines)


async def subagent_wait(
    worker: WorkerId,
    timeout: Annotated[  # noqa: ASYNC109  a tool argument
        Seconds, Field(description="seconds to wait at most; then the outcome is timed_out")
    ],
    pattern: Annotated[
        str | None,
        Field(
            description="instead, wait for an output line matching this regular expression "
            "(RE2 syntax); lines already written count"
        ),
    ] = None,
) -> Annotated[CallToolResult, WaitOut]:
    """Wait until a worker ends, or (with `pattern`) until a line of its output matches,
    for at most `timeout` seconds. `outcome` says which happened: matched (with the
    line), ended, or timed_out; `worker` is its state then. Survives a daemon reload."""
    async with _daemon() as daemon:
        if pattern is not None:
            waited = await daemon.wait_for(worker, pattern, timeout=timeout)
            outcome: str = waited.outcome
            line: str | None = waited.line
            view: WorkerView = waited.worker
        else:
            outcome, line = "timed_out", None
            with trio.move_on_after(timeout):
                view = await daemon.wait(worker)
                outcome = "ended"
            if outcome == "timed_out":
                view = await daemon.status(worker)
    said = {
        "matched": f"matched: {line}",
        "ended": "ended",
        "timed_out": f"timed out after {timeout:g} s",
    }.get(outcome, outcome)
    return _result(
        f"{said}; {_one_worker_line(view)}",
        {"outcome": outcome, "line": line, "worker": _worker(view)},
    )


async def subagent_send(
    worker: WorkerId,
    text: Annotated[str, Field(description="what to write to its stdin (add \\n for a line)")],
    eof: Annotated[bool, Field(description="close its stdin after writing")] = False,
) -> Annotated[CallToolResult, SentOut]:
    """Write text to a running worker's stdin; it must have been spawned with stdin_open.
    Never blocks: `written` may be less than all of it when the worker is not reading
    (send the rest later), and a worker whose pipe is full is refused `busy`. With `eof`,
    its stdin is closed once all is written (many programs then finish)."""
    async with _daemon() as daemon:
        written: int = await daemon.send(worker, text, eof=eof)
    closed = "; stdin closed" if eof else ""
    return _result(
        f"wrote {written} bytes to {worker}{closed}",
        {"worker": worker, "written": written, "eof": eof},
    )


async def subagent_stop(
    worker: WorkerId,
    wait: Annotated[bool, Field(description="return once its processes are gone")] = True,
) -> Annotated[CallToolResult, StoppedOut]:
    """Stop a worker and every worker it delegated to (TERM, then KILL after its grace).

    Inside a worker, only that worker's own subtree can be stopped."""
    asked = Stop(id=0, worker=worker, wait=wait)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    if not answer.found:
        raise _core.unknown_worker(worker)
    return _stopped(answer.stopped, answer.already_stopping)


def _stopped(ids: list[str], already: list[str]) -> CallToolResult:
    text = f"stopped: {_ids(ids)}" + (f"; already stopping: {_ids(already)}" if already else "")
    return _result(text, {"stopped": ids, "already_stopping": already})


async def subagent_stop_run(
    run: RunId,
    wait: Annotated[bool, Field(description="return once its processes are gone")] = True,
) -> Annotated[CallToolResult, StoppedOut]:
    """Stop a whole run: every worker in it and in the runs nested in it. Refused
    (forbidden) inside a worker: a run belongs to whoever started the workflow."""
    asked = StopRun(id=0, run=run, wait=wait)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    if not answer.found:
        raise _core.unknown_run(run)
    return _stopped(answer.stopped, answer.already_stopping)


async def subagent_cancel(
    scope: Annotated[
        str,
        Field(
            description="`worker:W` (W and its subtree), `run:R` (R and its nested runs), "
            "`turn:G` (the workers of turn G) or `all`"
        ),
    ],
) -> Annotated[CallToolResult, CancelledOut]:
    """Stop every worker in a scope; answers the ids cancelled. Inside a worker only
    `worker:W` within its own subtree is allowed (the rest is forbidden)."""
    asked = Cancel(id=0, scope=scope)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    already = answer.already_stopping
    text = f"cancelled: {_ids(answer.cancelled)}" + (
        f"; already stopping: {_ids(already)}" if already else ""
    )
    return _result(text, {"cancelled": answer.cancelled, "already_stopping": already})


async def subagent_collect(
    worker: WorkerId,
    wait: Annotated[bool, Field(description="wait for it to end first")] = False,
    timeout: Annotated[  # noqa: ASYNC109  a tool argument
        Seconds, Field(description="with wait: seconds to wait at most (then timed_out)")
    ] = 600.0,
) -> Annotated[CallToolResult, ResultOut]:
    """Get a worker's result (what it wrote to $SUBAGENTD_RESULT, else the tail of its
    stdout) and mark it collected; a repeat answers the same. Without `wait`, a worker
    still running is refused `busy`. Survives a daemon reload while waiting."""
    async with _daemon() as daemon:
        with trio.move_on_after(timeout if wait else MAX_TOOL_WAIT):
            result = await daemon.collect(worker, wait=wait)
            text = result.result or f"(no result; {result.state})"
            return _result(text, msgspec.structs.asdict(result))
    raise ToolRefusal("timed_out", f"worker {worker} did not end within {timeout:g} s")


async def subagent_events(
    run: Annotated[
        str | None, Field(description="the wakes of this run's top-level workers")
    ] = None,
    worker: Annotated[
        str | None,
        Field(
            description="the wakes of the workers this worker delegated to (default inside "
            "a worker: its own)"
        ),
    ] = None,
    timeout: Annotated[  # noqa: ASYNC109  a tool argument
        Seconds, Field(description="if none is pending, wait this long for one (0: do not wait)")
    ] = 0.0,
) -> Annotated[CallToolResult, WakesOut]:
    """The wakes of one parent: one per worker of it that ended (id, state, exit code and
    a preview of its result), each returned once: returned wakes are acknowledged and never
    returned again, here or to any other subscriber."""
    if run is None and worker is None:
        worker = os.environ.get("SUBAGENTD_WORKER_ID") if _core.token() else None
    if (run is None) == (worker is None):
        raise ToolRefusal("invalid", "give run or worker (one of them)")
    async with _daemon() as daemon:
        wakes = await _pending_wakes(daemon, run, worker)
        if not wakes and timeout > 0:
            with trio.move_on_after(timeout):
                wakes = await _pending_wakes(daemon, run, worker, follow=True)
        if wakes:
            with trio.CancelScope(shield=True):
                await daemon.ack(wake.seq for wake in wakes)
    # As `subagentctl events` prints them: the preview on the wake's one line.
    text = "\n".join(
        f"{wake.id} {wake.state} exit={wake.exit_code} {_one_line(wake.preview)}".rstrip()
        for wake in wakes
    )
    return _result(text or "no wakes", {"wakes": [_wake(wake) for wake in wakes]})


async def _pending_wakes(
    daemon: AsyncClient, run: str | None, worker: str | None, *, follow: bool = False
) -> list[Wake]:
    """The wakes pending now; with `follow`, the first one to come. None is acknowledged:
    the caller acknowledges what it returns, so what it does not stays pending."""
    wakes: list[Wake] = []
    async with contextlib.aclosing(
        daemon.events(run=run, worker=worker, follow=follow, ack=False)
    ) as stream:
        async for wake in stream:
            wakes.append(wake)
            if follow:
                break
    return wakes


async def subagent_resume(
    worker: Annotated[
        str | None, Field(description="an ended (not finished) worker to carry on")
    ] = None,
    run: Annotated[
        str | None, Field(description="instead: a run, whose unfinished workers carry on")
    ] = None,
    timeout: Annotated[  # noqa: ASYNC109  a tool argument
        float | None,
        Field(ge=0, le=MAX_TIMEOUT, allow_inf_nan=False, description="a new time limit"),
    ] = None,
) -> Annotated[CallToolResult, ResumedListOut]:
    """Carry a stopped, failed or timed-out worker (or a run) on from where it stopped:
    same id, next attempt, running what it was spawned with. `changed` says what changed
    on disk since its spawn. A worker that finished well, or still runs, is refused."""
    if (worker is None) == (run is None):
        raise ToolRefusal("invalid", "give worker or run (one of them)")
    async with _daemon() as daemon:
        if worker is not None:
            views = [await daemon.resume(worker, timeout=timeout)]
        else:
            if timeout is not None:
                raise ToolRefusal("invalid", "timeout: only with a worker")
            assert run is not None
            views = await daemon.resume_run(run)
    text = "\n".join(
        f"resumed {_one_worker_line(view)}" + (f"; changed: {view.changed}" if view.changed else "")
        for view in views
    )
    return _result(text or "nothing was left to resume", {"resumed": [_resumed(v) for v in views]})


async def subagent_latest_resumable(
    cwd: Annotated[str | None, Field(description="the directory (default: this server's)")] = None,
) -> Annotated[CallToolResult, LatestOut]:
    """The newest run started in a directory that subagent_resume(run=...) would carry on,
    and the workers it would; or the newest there and why it would not."""
    async with _daemon() as daemon:
        latest = await daemon.latest_resumable(cwd)
    structured: dict[str, Any] = msgspec.to_builtins(latest)
    verdict = "resumable" if latest.resumable else f"not resumable: {latest.reason}"
    return _result(f"run {latest.run}: {verdict}", structured)


# -- the server ----------------------------------------------------------------------------

TOOLS: Sequence[tuple[Callable[..., Awaitable[CallToolResult]], ToolAnnotations]] = (
    (subagent_spawn, CHANGES),
    (subagent_list, READ_ONLY),
    (subagent_status, READ_ONLY),
    (subagent_watch, READ_ONLY),
    (subagent_grep, READ_ONLY),
    (subagent_wait, READ_ONLY),
    (subagent_send, CHANGES),
    (subagent_stop, STOPS),
    (subagent_stop_run, STOPS),
    (subagent_cancel, STOPS),
    (subagent_collect, CHANGES),
    (subagent_events, CHANGES),
    (subagent_resume, CHANGES),
    (subagent_latest_resumable, READ_ONLY),
)


def instructions() -> str:
    """What the host tells its model about this server: whom the tools act for."""
    if _core.token():
        me = os.environ.get("SUBAGENTD_WORKER_ID", "this worker")
        who = (
            f"These tools act as subagentd worker {me}: what you spawn is its child, and you "
            "can see and stop only it and the workers it delegated to."
        )
    else:
        who = "These tools act for the user: every worker of the daemon is in reach."
    return (
        "subagentd supervises background worker processes (agents, builds, servers): "
        "spawn them, read and search their output, wait for a line or for the end, write to "
        "their stdin, stop a worker with its whole subtree, collect results. " + who
    )


def server() -> MCPServer[Any]:
    mcp = MCPServer(
        "subagentd", instructions=instructions(), version=package_version(), log_level="WARNING"
    )
    for tool, hints in TOOLS:
        mcp.add_tool(_refusals_as_errors(tool), name=tool.__name__, annotations=hints)
    return mcp


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: serve MCP on stdin and stdout until the host closes them."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        asked = args[0] in ("-h", "--help")
        print(
            "usage: subagentd-mcp  (no arguments: an MCP host runs it and speaks MCP on "
            "stdin/stdout; $SUBAGENTD_SOCKET picks the daemon)",
            file=sys.stdout if asked else sys.stderr,
        )
        return 0 if asked else 2
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(server().run_stdio_async, backend="trio")
    return 0
