"""subagentd-mcp's tools that start, see and act on workers: a new run (with a cap),
spawn (with a ready line), restart, list, status, send, stop, stop a run, cancel, resume,
and the latest resumable run.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import trio

from subagentd.protocol import (
    Cancel,
    ListWorkers,
    Stop,
    StopRun,
    WorkerList,
    WorkerView,
    parse_limits,
)
from subagentd.protocol.errors import RemoteError

from . import _core
from . import _mcp_args as args
from . import _mcp_bounds as bounds
from . import _mcp_shapes as shapes
from . import _mcp_text as text
from ._async import AsyncClient
from ._mcp_answer import Answer, Refusal, connection
from ._mcp_reading import read_tail
from ._text import printable

#: Lines of output a spawn's `ready` answers when no line matched.
READY_TAIL_LINES = 20


async def subagent_new_run(a: args.NewRunArguments) -> Answer:
    """Create a run to spawn workers into (subagent_spawn's `run`) and return its id.

    With `max_running` N, at most N of its workers run at once: a spawn over the cap is
    answered at once, its worker queued (`queued`, with its `queue_position`), and
    started in its turn as a running one ends (first in first out, a higher `priority`
    first); hand it 40 workers and it runs them N at a time. `memory`, `cpus` and `pids`
    bound what its workers may take together. Not offered inside a worker: a run
    belongs to whoever started the workflow (a worker's agent may carry its own
    `max_running` in agents.toml)."""
    limits = parse_limits(a.memory, a.cpus, a.pids)
    async with connection() as daemon:
        run = await daemon.new_run(a.outer, limits=limits, max_running=a.max_running)
    cap = "no cap" if a.max_running is None else f"at most {a.max_running} running at once"
    return Answer(f"new run {run} ({cap})", {"run": run, "max_running": a.max_running})


async def subagent_spawn(a: args.SpawnArguments) -> Answer:
    """Start a worker process under the subagentd supervisor and return its id and run.

    Give `argv` (a command) or `agent` (a named agent); `env`, `grace`, `timeout`, `cwd`,
    `input` as a process takes them; `memory` ("2G"), `cpus` (1.5) and `pids` (100) bound
    what it and every worker it delegates may take together, enforced by the kernel (a
    worker killed at its memory limit ends failed, reason "memory_limit"). The worker
    runs in the background, outliving this call: read its output with subagent_watch or
    subagent_grep, wait for it with subagent_wait, stop it with subagent_stop, get its
    result with subagent_collect. With `ready` (a regular expression), this call also
    waits, up to `ready_timeout` seconds (keep it under 50: a host gives up on a call
    after its own timeout), until a line of its output matches, and answers that line,
    or how it ended and the tail of its output, or that it timed out (it still runs).
    Inside a worker, the new worker is that worker's child."""
    if not a.argv and a.agent is None:
        raise args.Invalid("argv", "give argv (a command) or agent (a named agent)")
    if a.ready is not None:
        _check_pattern("ready", a.ready)
    async with connection() as daemon:
        view = await daemon.spawn(
            a.argv or [],
            name=a.name,
            run=a.run,
            agent=a.agent,
            input=a.input,
            cwd=a.cwd,
            env=a.env,
            timeout=a.timeout,
            grace=a.grace,
            key=a.key,
            stdin_open=a.stdin_open,
            limits=parse_limits(a.memory, a.cpus, a.pids),
            priority=a.priority,
            retries=a.retries,
            backoff=a.backoff,
            backoff_max=a.backoff_max,
            retry_on=a.retry_on,
            ready=a.ready,
            after=a.after,
            after_ok=a.after_ok,
            after_ready=a.after_ready,
        )
        if a.ready is None:
            return Answer(f"spawned {text.worker_line(view)}", shapes.worker(view, time.time()))
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
        {**shapes.worker(waited.worker, time.time()), "ready": ready},
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
    tail, _, _ = await read_tail(daemon, worker, READY_TAIL_LINES, None, None)
    kept = bounds.tail_within(tail, bounds.Budget(a.max_bytes))
    return b"".join(data for _, data, _ in kept.entries).decode(errors="replace")


async def subagent_restart(a: args.RestartArguments) -> Answer:
    """Restart a worker: stop it (and its subtree: TERM, then KILL after its grace), wait
    until it has ended, then start a new attempt of it, same id, running what it was
    spawned with (its frozen snapshot), with a new `timeout` if given. Waits for the stop
    at most `wait_timeout` seconds (default 30): if it has not finished by then (a long
    grace), the stop goes on and the answer says so (`timed_out`); call subagent_restart
    again, which waits on the stop under way (or on nothing, for a worker already ended)
    and then starts the new attempt. A worker that finished well (exit 0) is refused:
    there is nothing to resume; spawn it afresh."""
    async with connection() as daemon:
        # Asked to stop without waiting, so the answer says what it stopped at once; a
        # worker already stopping (a call before this one) or ended is left as it is.
        asked = Stop(id=0, worker=a.worker, wait=False)
        stopped = _core.answer(asked, await daemon.request(asked))
        if not stopped.found:
            raise _core.unknown_worker(a.worker)
        with trio.move_on_after(a.wait_timeout) as waiting:
            again = Stop(id=0, worker=a.worker, wait=True)  # until its processes are gone
            _core.answer(again, await daemon.request(again))
            await daemon.wait(a.worker)
        if waiting.cancelled_caught:
            under_way = text.ids([*stopped.stopped, *stopped.already_stopping])
            raise Refusal(
                "timed_out",
                f"worker {a.worker} is still stopping after {a.wait_timeout:g} s (stopping: "
                f"{under_way}); its stop goes on: call subagent_restart again to wait for it "
                "and start the new attempt",
            )
        view = await daemon.resume(a.worker, timeout=a.timeout)
    line = f"restarted {text.worker_line(view)} (stopped: {text.ids(stopped.stopped)})"
    if view.changed:
        line += f"; changed since its spawn: {printable(view.changed)}"
    return Answer(line, {"stopped": stopped.stopped, "worker": shapes.resumed(view, time.time())})


# -- seeing ------------------------------------------------------------------------------


async def subagent_list(a: args.ListArguments) -> Answer:
    """List the supervised workers: the running ones, or with `all` the ended ones too,
    oldest first, each running one with its CPU % and memory now. Inside a worker, only
    that worker and those it delegated to are listed. At most `max_bytes`: a listing cut
    short says `truncated` and `next`; call again with the same arguments and `cursor` =
    `next` for the workers after (the text says how)."""
    now = time.time()
    budget = bounds.Budget(a.max_bytes)
    lines: list[str] = []
    workers: list[dict[str, Any]] = []
    after = a.cursor
    async with connection() as daemon:
        while True:
            page = await _list_page(daemon, a, after)
            costs = [_listed_costs(view, now) for view in page.workers]
            fits = next((i for i, cost in enumerate(costs) if not budget.take(*cost)), len(costs))
            if fits < len(page.workers) and fits:
                # Cut inside the page: ask for just those, for the cursor after them.
                page = await _list_page(daemon, a, after, limit=fits)
            elif fits < len(page.workers):
                if not workers:
                    raise args.Invalid(
                        "max_bytes",
                        f"worker {page.workers[0].id} alone takes {max(costs[0])} bytes "
                        f"listed: ask for more",
                    )
                break
            lines += [text.listed_line(view) for view in page.workers]
            workers += [shapes.worker(view, now) for view in page.workers]
            after = page.next
            if page.complete or page.next is None:
                after = None
                break
            if fits < len(costs):
                break
    more = (
        f"truncated at max_bytes: call subagent_list with the same arguments and "
        f"cursor={json.dumps(after)}"
        if after is not None
        else ""
    )
    body = "\n".join(lines) or "no workers"
    return Answer(
        f"{body}\n[{more}]" if more else body,
        {"workers": workers, "next": after, "truncated": after is not None},
    )


async def _list_page(
    daemon: AsyncClient, a: args.ListArguments, after: str | None, limit: int = 1000
) -> WorkerList:
    asked = ListWorkers(id=0, all=a.all, run=a.run, after=after, limit=limit, usage=True)
    return _core.answer(asked, await daemon.request(asked))


def _listed_costs(view: WorkerView, now: float) -> tuple[int, int]:
    """What a worker costs in a listing's text (its line) and structured content."""
    return (
        bounds.size(text.listed_line(view)) + 1,
        bounds.json_size(shapes.worker(view, now)) + 2,
    )


async def subagent_status(a: args.StatusArguments) -> Answer:
    """Show one worker: its state (running, finished, failed, stopped...), pid, exit code,
    its command, its working directory, how long it has run and, while it runs, what it
    takes (CPU seconds and %, memory now and at peak, processes: its whole tree)."""
    async with connection() as daemon:
        view = await daemon.status(a.worker)
    now = time.time()
    structured = shapes.worker(view, now)
    if bounds.json_size(structured) > a.max_bytes - bounds.FOOTER:
        # A command too long to carry whole: its first arguments, as a listing gives them.
        kept: list[str] = []
        room = a.max_bytes - bounds.FOOTER - bounds.json_size({**structured, "argv": []})
        for argument in view.argv:
            room -= bounds.json_size(argument) + 2
            if room < 0:
                break
            kept.append(argument)
        structured |= {"argv": kept, "argv_cut": True}
    return Answer(text.status_text(view, now), structured)


# -- acting ------------------------------------------------------------------------------


async def subagent_send(a: args.SendArguments) -> Answer:
    """Write text to a running worker's stdin; it must have been spawned with stdin_open.
    Never blocks: `written` may be less than all of it when the worker is not reading
    (send the rest later), and a worker whose pipe is full is refused `busy`. With `eof`,
    its stdin is closed once all is written (many programs then finish)."""
    async with connection() as daemon:
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
    async with connection() as daemon:
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
    async with connection() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    if not answer.found:
        raise _core.unknown_run(a.run)
    return _stopped(answer.stopped, answer.already_stopping)


async def subagent_cancel(a: args.CancelArguments) -> Answer:
    """Stop every worker in a scope; answers the ids cancelled. Inside a worker only
    `worker:W` within its own subtree is allowed (the rest is forbidden)."""
    asked = Cancel(id=0, scope=a.scope)
    async with connection() as daemon:
        answer = _core.answer(asked, await daemon.request(asked))
    already = answer.already_stopping
    said = f"cancelled: {text.ids(answer.cancelled)}" + (
        f"; already stopping: {text.ids(already)}" if already else ""
    )
    return Answer(said, {"cancelled": answer.cancelled, "already_stopping": already})


async def subagent_pause(a: args.PauseArguments) -> Answer:
    """Pause a worker and every worker it delegated to (or, for the user, a whole run):
    their processes are held still, keeping their pids, output and memory, and their
    time limits stop running, until subagent_unpause. Inside a worker, only that
    worker's own subtree can be paused."""
    worker, run = _one_target(a)
    async with connection() as daemon:
        answer = await daemon.pause(worker=worker, run=run)
    said = f"paused: {text.ids(answer.paused)}" + (
        f"; already paused: {text.ids(answer.already_paused)}" if answer.already_paused else ""
    )
    if answer.held_outside:
        held = ", ".join(f"{w}: {n}" for w, n in sorted(answer.held_outside.items()))
        said += f"; processes outside their cgroup held by SIGSTOP: {held}"
    return Answer(
        said,
        {
            "paused": answer.paused,
            "already_paused": answer.already_paused,
            "held_outside": answer.held_outside,
        },
    )


async def subagent_unpause(a: args.PauseArguments) -> Answer:
    """Let a paused worker and what it delegated to (or, for the user, a run) go on."""
    worker, run = _one_target(a)
    async with connection() as daemon:
        answer = await daemon.unpause(worker=worker, run=run)
    already = answer.already_unpaused
    said = f"unpaused: {text.ids(answer.unpaused)}" + (
        f"; not paused: {text.ids(already)}" if already else ""
    )
    return Answer(said, {"unpaused": answer.unpaused, "already_unpaused": already})


def _one_target(a: args.PauseArguments) -> tuple[str | None, str | None]:
    worker, run = a.worker, getattr(a, "run", None)
    if (worker is None) == (run is None):
        raise args.Invalid("worker", "give worker or run (one of them)")
    return worker, run


async def subagent_resume(a: args.ResumeArguments) -> Answer:
    """Carry a stopped, failed or timed-out worker (or, for the user, a run) on from where
    it stopped: same id, next attempt, running what it was spawned with. `changed` says
    what changed on disk since its spawn. A worker that finished well, or still runs, is
    refused."""
    if (a.worker is None) == (a.run is None):
        raise args.Invalid("worker", "give worker or run (one of them)")
    async with connection() as daemon:
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
        {"resumed": [shapes.resumed(view, time.time()) for view in views]},
    )


async def subagent_latest_resumable(a: args.LatestArguments) -> Answer:
    """The newest run started in a directory that subagent_resume(run=...) would carry on,
    and the workers it would; or the newest there and why it would not."""
    async with connection() as daemon:
        latest = await daemon.latest_resumable(a.cwd)
    verdict = "resumable" if latest.resumable else f"not resumable: {latest.reason}"
    return Answer(f"run {latest.run}: {printable(verdict)}", msgspec.to_builtins(latest))
