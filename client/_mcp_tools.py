"""subagentd-mcp's tools: each one or a few `AsyncClient` calls, answering a short text for a
model and the structured content of its output schema.

Each call has a connection of its own (so a daemon down at start, or reloaded between
calls, costs nothing). A tool raises `Refusal` (or lets a daemon's `SubagentdError`
through) for what it will not do; the server turns either into a tool error. What each
tool is called, takes and answers is declared once, in `TOOLS`.
"""

from __future__ import annotations

import collections
import contextlib
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import trio
from mcp.types import ToolAnnotations

from subagentd.protocol import (
    Cancel,
    Collect,
    Entry,
    Grep,
    LatestResumable,
    ListWorkers,
    Request,
    Resume,
    Send,
    Spawn,
    Status,
    Stop,
    StopRun,
    Subscribe,
    Wait,
    WaitFor,
    Wake,
    Watch,
    WorkerView,
)
from subagentd.protocol.errors import RemoteError

from . import _core
from . import _mcp_args as args
from . import _mcp_bounds as bounds
from . import _mcp_shapes as shapes
from . import _mcp_text as text
from ._async import AsyncClient
from ._mcp_caller import caller
from ._text import printable

#: The journal entries one page read asks for when reading a whole tail.
TAIL_READ_LIMIT = 1000
#: Pages a filtered watch (since, stream) skips through at most in one call before it
#: answers where it got to.
SKIP_PAGES = 64
#: Lines of output a spawn's `ready` answers when no line matched.
READY_TAIL_LINES = 20

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
STOPS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


class Refusal(Exception):
    """A refusal of this server's own (a bad combination of arguments, a wait that timed
    out): a tool error ``code: message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Answer:
    """A tool's success: the text a model reads, and the structured content."""

    text: str
    structured: dict[str, Any]


@contextlib.asynccontextmanager
async def _daemon() -> AsyncIterator[AsyncClient]:
    """A connection for one tool call: it reconnects across a reload by itself."""
    async with AsyncClient() as daemon:
        yield daemon


def _budget(max_bytes: int) -> bounds.Budget:
    return bounds.Budget(max_bytes)


# -- starting and restarting -------------------------------------------------------------


async def subagent_spawn(a: args.SpawnArguments) -> Answer:
    """Start a worker process under the subagentd supervisor and return its id and run.

    Give `argv` (a command) or `agent` (a named agent); `env`, `grace`, `timeout`, `cwd`,
    `input` as a process takes them. The worker runs in the background, outliving this
    call: read its output with subagent_watch or subagent_grep, wait for it with
    subagent_wait, stop it with subagent_stop, get its result with subagent_collect.
    With `ready` (a regular expression), this call also waits, up to `ready_timeout`
    seconds (keep it under 50: a host gives up on a call after its own timeout), until a
    line of its output matches, and answers that line, or how it ended and the tail of
    its output, or that it timed out (it still runs). Inside a worker, the new worker is
    that worker's child."""
    if not a.argv and a.agent is None:
        raise args.Invalid("argv", "give argv (a command) or agent (a named agent)")
    if a.ready is not None:
        _check_pattern("ready", a.ready)
    async with _daemon() as daemon:
        options: dict[str, Any] = {
            "name": a.name,
            "run": a.run,
            "agent": a.agent,
            "input": a.input,
            "cwd": a.cwd,
            "env": a.env,
            "timeout": a.timeout,
            "grace": a.grace,
            "key": a.key,
        }
        if a.stdin_open:
            options["stdin_open"] = True
        view = await daemon.spawn(a.argv or [], **options)
        if a.ready is None:
            return Answer(f"spawned {text.worker_line(view)}", shapes.worker(view))
        try:
            waited = await daemon.wait_for(view.id, a.ready, timeout=a.ready_timeout)
        except RemoteError as exc:
            raise Refusal(
                str(exc.code), f"{exc.message} (worker {view.id} was started and runs on)"
            ) from exc
        tail = "" if waited.outcome == "matched" else await _ready_tail(daemon, view.id, a)
    ready = {"outcome": waited.outcome, "line": waited.line, "tail": tail}
    said = {
        "matched": f"ready: {printable(waited.line or '')}",
        "ended": "ended before a line matched; the tail of its output:\n",
        "timed_out": f"no line matched within {a.ready_timeout:g} s (it runs on); the "
        "tail of its output:\n",
    }[waited.outcome]
    body = text.lines_text(tail) if tail else ""
    return Answer(
        f"spawned {text.worker_line(waited.worker)}\n{said}{body}",
        {**shapes.worker(waited.worker), "ready": ready},
    )


def _check_pattern(field: str, pattern: str) -> None:
    """Refuse a pattern RE2 will not compile, before anything is started with it (the
    daemon checks it again, as it checks every pattern)."""
    import re2  # type: ignore[import-untyped]  # google-re2 ships no types

    options = re2.Options()
    options.log_errors = False
    try:
        re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args else str(exc)
        raise args.Invalid(
            field, f"{reason} (patterns are RE2 syntax: no backreferences or lookaround)"
        ) from None


async def _ready_tail(daemon: AsyncClient, worker: str, a: args.SpawnArguments) -> str:
    tail, _, _ = await _read_tail(daemon, worker, READY_TAIL_LINES, None, None)
    kept = bounds.tail_within(tail, _budget(a.max_bytes))
    return b"".join(data for _, data, _ in kept.entries).decode(errors="replace")


async def subagent_restart(a: args.RestartArguments) -> Answer:
    """Restart a worker: stop it (and its subtree: TERM, then KILL after its grace), wait
    until it has ended, then start a new attempt of it, same id, running what it was
    spawned with (its frozen snapshot), with a new `timeout` if given. A worker that
    finished well (exit 0) is refused: there is nothing to resume; spawn it afresh."""
    async with _daemon() as daemon:
        asked = Stop(id=0, worker=a.worker, wait=True)
        stopped = _core.answer(asked, await daemon.request(asked))
        if not stopped.found:
            raise _core.unknown_worker(a.worker)
        await daemon.wait(a.worker)
        view = await daemon.resume(a.worker, timeout=a.timeout)
    line = f"restarted {text.worker_line(view)} (stopped: {text.ids(stopped.stopped)})"
    if view.changed:
        line += f"; changed since its spawn: {printable(view.changed)}"
    return Answer(line, {"stopped": stopped.stopped, "worker": shapes.resumed(view)})


# -- seeing ------------------------------------------------------------------------------


async def subagent_list(a: args.ListArguments) -> Answer:
    """List the supervised workers: the running ones, or with `all` the ended ones too.

    Inside a worker, only that worker and those it delegated to are listed."""
    async with _daemon() as daemon:
        views = await daemon.ls(all=a.all, run=a.run)
    lines = "\n".join(text.worker_line(view) for view in views) or "no workers"
    return Answer(lines, {"workers": [shapes.worker(view) for view in views]})


async def subagent_status(a: args.StatusArguments) -> Answer:
    """Show one worker: its state (running, finished, failed, stopped...), pid, exit code,
    its command, its working directory and how long it has run."""
    async with _daemon() as daemon:
        view = await daemon.status(a.worker)
    structured = shapes.worker(view)
    budget = _budget(a.max_bytes)
    if not budget.take(0, bounds.json_size(structured)):
        # A command too long to carry whole: its first arguments, as a listing gives them.
        kept: list[str] = []
        room = a.max_bytes - bounds.FOOTER - bounds.json_size({**structured, "argv": []})
        for argument in view.argv:
            room -= bounds.json_size(argument) + 2
            if room < 0:
                break
            kept.append(argument)
        structured |= {"argv": kept, "argv_cut": True}
    return Answer(text.status_text(view), structured)


async def subagent_watch(a: args.WatchArguments) -> Answer:
    """Read a worker's journal: its stdout and stderr output, state changes and notes.

    One page of entries after `cursor` (from the start when absent), with `next`, the
    cursor to pass for the following page; `complete` is true once the worker has ended
    and nothing follows. `since` keeps only what was written since then (10m, an ISO
    time); `stream` only stdout or stderr. Or, with `last`, its last N output lines. At
    most `max_bytes` of output: a cut answer says the cursor (and offset) to read on
    from. Does not wait: use subagent_wait to wait for output or for the end."""
    if a.last is not None and (a.cursor is not None or a.offset):
        raise args.Invalid("last", "give cursor (and offset) or last, not both")
    since = None if a.since is None else args.parse_since(a.since, time.time())
    async with _daemon() as daemon:
        if a.last is not None:
            return await _tail(daemon, a, since)
        return await _page(daemon, a, since)


def _wanted(stream: str | None, since: float | None) -> Callable[[Entry], bool]:
    def wanted(entry: Entry) -> bool:
        if stream is not None and entry.kind != stream:
            return False
        return since is None or entry.at >= since

    return wanted


async def _page(daemon: AsyncClient, a: args.WatchArguments, since: float | None) -> Answer:
    wanted = _wanted(a.stream, since)
    cursor = a.cursor or 0
    offset = a.offset
    for _ in range(SKIP_PAGES):
        page = await daemon.watch_page(a.worker, since=cursor, limit=a.limit)
        if offset and page.entries and page.entries[0].seq != cursor + 1:
            offset = 0  # the entry it was cut in is not the one after the cursor
        entries = [entry for entry in page.entries if wanted(entry)]
        if entries or page.complete or not page.entries:
            break
        cursor, offset = page.next, 0
    kept = bounds.page_within(entries, offset, _budget(a.max_bytes), cursor)
    if not kept.truncated:
        kept.next, kept.offset = page.next, 0
    complete = page.complete and not kept.truncated
    if kept.truncated:
        more = f"truncated at max_bytes: call subagent_watch with cursor={kept.next}" + (
            f" and offset={kept.offset}" if kept.offset else ""
        )
    elif complete:
        more = "the worker has ended"
    else:
        more = f"next cursor: {kept.next}"
    return Answer(
        text.with_footer(kept.text(), more, "no entries"),
        {
            "entries": kept.structured(),
            "next": kept.next,
            "offset": kept.offset,
            "complete": complete,
            "truncated": kept.truncated,
        },
    )


async def _read_tail(
    daemon: AsyncClient, worker: str, lines: int, stream: str | None, since: float | None
) -> tuple[list[tuple[Entry, bytes]], int, bool]:
    """The output entries holding the last `lines` lines (the first one cut to start at
    its line), read through the journal page by page, keeping only the tail; and the
    cursor after them, and whether the journal is complete."""
    wanted = _wanted(stream, since)
    tail: collections.deque[tuple[Entry, bytes]] = collections.deque()
    cursor, complete = 0, False
    while True:
        page = await daemon.watch_page(worker, since=cursor, limit=TAIL_READ_LIMIT)
        for entry in page.entries:
            if entry.kind in ("stdout", "stderr") and wanted(entry):
                tail.append((entry, entry.data))
                _trim(tail, lines)
        cursor, complete = page.next, page.complete
        if complete or not page.entries:
            break
    return list(tail), cursor, complete


async def _tail(daemon: AsyncClient, a: args.WatchArguments, since: float | None) -> Answer:
    assert a.last is not None
    tail, cursor, complete = await _read_tail(daemon, a.worker, a.last, a.stream, since)
    kept = bounds.tail_within(tail, _budget(a.max_bytes))
    body = "".join(text.entry_text(entry, data) for entry, data, _ in kept.entries)
    more = "the worker has ended" if complete else f"next cursor: {cursor}"
    if kept.truncated:
        more = (
            f"truncated at max_bytes: only the end of these lines is here; call "
            f"subagent_watch with cursor={kept.next} for what comes before; {more}"
        )
    return Answer(
        text.with_footer(body, more, "no output yet"),
        {
            "entries": kept.structured(),
            "next": cursor,
            "offset": 0,
            "complete": complete,
            "truncated": kept.truncated,
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


async def subagent_grep(a: args.GrepArguments) -> Answer:
    """Search a worker's output (stdout and stderr, line by line) for a regular expression.

    Runs in the daemon over the whole journal, bounded: `truncated` says a bound was hit
    (`limit`, `max_bytes`, or the daemon's on its work). Each match has its 1-based line
    number and the lines around it; `stream` keeps the matches of one stream only."""
    async with _daemon() as daemon:
        found = await daemon.grep(
            a.worker, a.pattern, before=a.before, after=a.after, limit=a.limit
        )
    matches = [m for m in found.matches if a.stream is None or m.kind == a.stream]
    kept, cut = bounds.matches_within(matches, _budget(a.max_bytes))
    truncated = found.truncated or cut
    body = "".join(text.match_text(match) for match in kept) or "no match\n"
    if cut:
        last = kept[-1].line_no if kept else 0
        body += (
            f"[truncated at max_bytes after line {last}: narrow the pattern, ask fewer "
            "before/after lines, or raise max_bytes]"
        )
    elif found.truncated:
        body += "[truncated: there may be more matches; narrow the pattern or raise limit]"
    return Answer(
        body.rstrip("\n"),
        {"matches": [msgspec.to_builtins(m) for m in kept], "truncated": truncated},
    )


# -- waiting -----------------------------------------------------------------------------


async def subagent_wait(a: args.WaitArguments) -> Answer:
    """Wait until a worker ends, or (with `pattern`) until a line of its output matches,
    for at most `timeout` seconds (default 30; keep it under 50, as a host gives up on a
    call after its own timeout, and call again to wait longer). `outcome` says which
    happened: matched (with the line), ended, or timed_out; `worker` is its state then.
    Sends progress notifications while it waits, to a host that asks for them."""
    async with _daemon() as daemon:
        if a.pattern is not None:
            waited = await daemon.wait_for(a.worker, a.pattern, timeout=a.timeout)
            outcome: str = waited.outcome
            line: str | None = waited.line
            view: WorkerView = waited.worker
        else:
            outcome, line = "timed_out", None
            with trio.move_on_after(a.timeout):
                view = await daemon.wait(a.worker)
                outcome = "ended"
            if outcome == "timed_out":
                view = await daemon.status(a.worker)
    said = {
        "matched": f"matched: {printable(line or '')}",
        "ended": "ended",
        "timed_out": f"timed out after {a.timeout:g} s (call again to wait on)",
    }.get(outcome, outcome)
    return Answer(
        f"{said}; {text.worker_line(view)}",
        {"outcome": outcome, "line": line, "worker": shapes.worker(view)},
    )


async def subagent_collect(a: args.CollectArguments) -> Answer:
    """Get a worker's result (what it wrote to $SUBAGENTD_RESULT, else the tail of its
    stdout) and mark it collected; a repeat answers the same. Without `wait`, a worker
    still running is refused `busy`; with it, waits at most `timeout` seconds (default
    30; keep it under 50 and call again). At most `max_bytes` of the result."""
    async with _daemon() as daemon:
        with trio.move_on_after(a.timeout if a.wait else args.MAX_TOOL_WAIT):
            result = await daemon.collect(a.worker, wait=a.wait)
            raw, cut = bounds.text_within(result.result, _budget(a.max_bytes))
            structured = {**msgspec.structs.asdict(result), "result": raw, "truncated": cut}
            body = text.lines_text(raw) if raw else f"(no result; {result.state})"
            if cut:
                body += (
                    f"\n[truncated at max_bytes: {bounds.size(raw)} of "
                    f"{bounds.size(result.result)} bytes; call subagent_collect again with a "
                    f"larger max_bytes (at most {args.MAX_MAX_BYTES})]"
                )
            return Answer(body, structured)
    raise Refusal(
        "timed_out", f"worker {a.worker} did not end within {a.timeout:g} s: call again to wait on"
    )


async def subagent_events(a: args.EventsArguments) -> Answer:
    """The wakes of one parent: one per worker of it that ended (id, state, exit code and
    a preview of its result), each returned once: returned wakes are acknowledged and never
    returned again, here or to any other subscriber. With `timeout`, waits that long for
    one if none is pending (keep it under 50 s and call again)."""
    run, worker = a.run, a.worker
    if run is None and worker is None:
        worker = await caller()
    if (run is None) == (worker is None):
        raise args.Invalid("run", "give run or worker (one of them)")
    async with _daemon() as daemon:
        wakes = await _pending_wakes(daemon, run, worker)
        if not wakes and a.timeout > 0:
            with trio.move_on_after(a.timeout):
                wakes = await _pending_wakes(daemon, run, worker, follow=True)
        if wakes:
            with trio.CancelScope(shield=True):
                await daemon.ack(wake.seq for wake in wakes)
    lines = "\n".join(text.wake_line(wake) for wake in wakes)
    return Answer(lines or "no wakes", {"wakes": [shapes.wake(wake) for wake in wakes]})


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


# -- acting ------------------------------------------------------------------------------


async def subagent_send(a: args.SendArguments) -> Answer:
    """Write text to a running worker's stdin; it must have been spawned with stdin_open.
    Never blocks: `written` may be less than all of it when the worker is not reading
    (send the rest later), and a worker whose pipe is full is refused `busy`. With `eof`,
    its stdin is closed once all is written (many programs then finish)."""
    async with _daemon() as daemon:
        written: int = await daemon.send(a.worker, a.text, eof=a.eof)
    closed = "; stdin closed" if a.eof else ""
    return Answer(
        f"wrote {written} bytes to {a.worker}{closed}",
        {"worker": a.worker, "written": written, "eof": a.eof},
    )


async def subagent_stop(a: args.StopArguments) -> Answer:
    """Stop a worker and every worker it delegated to (TERM, then KILL after its grace).

    Inside a worker, only that worker's own subtree can be stopped."""
    asked = Stop(id=0, worker=a.worker, wait=a.wait)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    if not answer.found:
        raise _core.unknown_worker(a.worker)
    return _stopped(answer.stopped, answer.already_stopping)


def _stopped(found: list[str], already: list[str]) -> Answer:
    said = f"stopped: {text.ids(found)}" + (
        f"; already stopping: {text.ids(already)}" if already else ""
    )
    return Answer(said, {"stopped": found, "already_stopping": already})


async def subagent_stop_run(a: args.StopRunArguments) -> Answer:
    """Stop a whole run: every worker in it and in the runs nested in it. Not offered
    inside a worker: a run belongs to whoever started the workflow."""
    asked = StopRun(id=0, run=a.run, wait=a.wait)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    if not answer.found:
        raise _core.unknown_run(a.run)
    return _stopped(answer.stopped, answer.already_stopping)


async def subagent_cancel(a: args.CancelArguments) -> Answer:
    """Stop every worker in a scope; answers the ids cancelled. Inside a worker only
    `worker:W` within its own subtree is allowed (the rest is forbidden)."""
    asked = Cancel(id=0, scope=a.scope)
    async with _daemon() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    already = answer.already_stopping
    said = f"cancelled: {text.ids(answer.cancelled)}" + (
        f"; already stopping: {text.ids(already)}" if already else ""
    )
    return Answer(said, {"cancelled": answer.cancelled, "already_stopping": already})


async def subagent_resume(a: args.ResumeArguments) -> Answer:
    """Carry a stopped, failed or timed-out worker (or, for the user, a run) on from where
    it stopped: same id, next attempt, running what it was spawned with. `changed` says
    what changed on disk since its spawn. A worker that finished well, or still runs, is
    refused."""
    if (a.worker is None) == (a.run is None):
        raise args.Invalid("worker", "give worker or run (one of them)")
    async with _daemon() as daemon:
        if a.worker is not None:
            views = [await daemon.resume(a.worker, timeout=a.timeout)]
        else:
            if a.timeout is not None:
                raise args.Invalid("timeout", "only with a worker")
            assert a.run is not None
            views = await daemon.resume_run(a.run)
    lines = "\n".join(
        f"resumed {text.worker_line(view)}"
        + (f"; changed: {printable(view.changed)}" if view.changed else "")
        for view in views
    )
    return Answer(
        lines or "nothing was left to resume",
        {"resumed": [shapes.resumed(view) for view in views]},
    )


async def subagent_latest_resumable(a: args.LatestArguments) -> Answer:
    """The newest run started in a directory that subagent_resume(run=...) would carry on,
    and the workers it would; or the newest there and why it would not."""
    async with _daemon() as daemon:
        latest = await daemon.latest_resumable(a.cwd)
    verdict = "resumable" if latest.resumable else f"not resumable: {latest.reason}"
    return Answer(f"run {latest.run}: {printable(verdict)}", msgspec.to_builtins(latest))


# -- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A tool as the server offers it."""

    run: Callable[[Any], Awaitable[Answer]]
    arguments: type[args.Arguments]
    output: type[shapes.Shape]
    hints: ToolAnnotations
    #: The requests it sends: offered inside a worker only if a worker may send each.
    requests: Sequence[type[Request[Any]]]
    #: It can wait (for an end, a line, a stop): progress goes to a host that asks.
    blocks: bool = False

    @property
    def name(self) -> str:
        return self.run.__name__

    @property
    def description(self) -> str:
        return " ".join((self.run.__doc__ or "").split())

    @property
    def for_workers(self) -> bool:
        return all(request.for_workers for request in self.requests)

    def waits(self, arguments: args.Arguments) -> float | None:
        """The seconds this call may wait (for a progress total), None if unknown."""
        for name in ("timeout", "ready_timeout"):
            value = getattr(arguments, name, None)
            if isinstance(value, float) and name in type(arguments).model_fields:
                return value
        return None


def _tool(
    run: Callable[[Any], Awaitable[Answer]],
    output: type[shapes.Shape],
    hints: ToolAnnotations,
    *requests: type[Request[Any]],
    blocks: bool = False,
) -> Tool:
    arguments = cast("type[args.Arguments]", typing.get_type_hints(run)["a"])
    return Tool(run, arguments, output, hints, requests, blocks)


TOOLS: tuple[Tool, ...] = (
    _tool(subagent_spawn, shapes.SpawnedOut, CHANGES, Spawn, WaitFor, Watch, blocks=True),
    _tool(subagent_restart, shapes.RestartedOut, STOPS, Stop, Wait, Resume, blocks=True),
    _tool(subagent_list, shapes.WorkersOut, READ_ONLY, ListWorkers),
    _tool(subagent_status, shapes.WorkerOut, READ_ONLY, Status),
    _tool(subagent_watch, shapes.PageOut, READ_ONLY, Watch),
    _tool(subagent_grep, shapes.GrepOut, READ_ONLY, Grep),
    _tool(subagent_wait, shapes.WaitOut, READ_ONLY, Wait, WaitFor, Status, blocks=True),
    _tool(subagent_send, shapes.SentOut, CHANGES, Send),
    _tool(subagent_stop, shapes.StoppedOut, STOPS, Stop, blocks=True),
    _tool(subagent_stop_run, shapes.StoppedOut, STOPS, StopRun, blocks=True),
    _tool(subagent_cancel, shapes.CancelledOut, STOPS, Cancel, blocks=True),
    _tool(subagent_collect, shapes.ResultOut, CHANGES, Collect, blocks=True),
    _tool(subagent_events, shapes.WakesOut, CHANGES, Subscribe, blocks=True),
    _tool(subagent_resume, shapes.ResumedListOut, CHANGES, Resume),
    _tool(subagent_latest_resumable, shapes.LatestOut, READ_ONLY, LatestResumable),
)
