"""subagentd-mcp's tools that wait: for a worker's end or a line (wait), for its result
(collect), for a wake (events). Each waits a short while by default and says so, so that
no call outlives the host's own timeout; the server posts progress meanwhile.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import trio

from subagentd.protocol import Wake, WorkerView

from . import _mcp_args as args
from . import _mcp_bounds as bounds
from . import _mcp_shapes as shapes
from . import _mcp_text as text
from ._async import AsyncClient
from ._mcp_answer import Answer, Refusal, connection
from ._mcp_caller import caller
from ._text import printable

#: Pending wakes one subagent_events call reads at most: far more than one answer carries,
#: and enough to say how many are left (past it: "at least").
EVENTS_COUNTED = 10_000


async def subagent_wait(a: args.WaitArguments) -> Answer:
    """Wait until a worker ends, or (with `pattern`) until a line of its output matches, or
    (with `ready`) until it is ready (the `ready` pattern it was spawned with matched),
    for at most `timeout` seconds (default 30; keep it under 50, as a host gives up on a
    call after its own timeout, and call again to wait longer). `outcome` says which
    happened: matched (with the line), ended, or timed_out; `worker` is its state then.
    Sends progress notifications while it waits, to a host that asks for them."""
    outcome: str
    line: str | None
    view: WorkerView
    async with connection() as daemon:
        if a.ready:
            outcome, line = "timed_out", None
            with trio.move_on_after(a.timeout):
                view = await daemon.wait(a.worker, ready=True)
                outcome = "matched" if view.ready else "ended"
            if outcome == "timed_out":
                view = await daemon.status(a.worker)
        elif a.pattern is not None:
            waited = await daemon.wait_for(a.worker, a.pattern, timeout=a.timeout)
            outcome, line, view = waited.outcome, waited.line, waited.worker
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
        {"outcome": outcome, "line": line, "worker": shapes.worker(view, time.time())},
    )


async def subagent_collect(a: args.CollectArguments) -> Answer:
    """Get a worker's result (what it wrote to $SUBAGENTD_RESULT, else the tail of its
    stdout) and mark it collected; a repeat answers the same. Without `wait`, a worker
    still running is refused `busy`; with it, waits at most `timeout` seconds (default
    30; keep it under 50 and call again). At most `max_bytes` of the result."""
    async with connection() as daemon:
        with trio.move_on_after(a.timeout if a.wait else args.MAX_TOOL_WAIT):
            result = await daemon.collect(a.worker, wait=a.wait)
            raw, cut = bounds.text_within(result.result, bounds.Budget(a.max_bytes))
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
    a preview of its result), oldest first, each returned once: returned wakes are
    acknowledged and never returned again, here or to any other subscriber. At most
    `max_bytes`: the wakes that do not fit stay pending, unacknowledged, and `pending`
    says how many are left; call again for them. With `timeout`, waits that long for
    one if none is pending (keep it under 50 s and call again)."""
    run, worker = a.run, a.worker
    if run is None and worker is None:
        worker = await caller() or None
    if (run is None) == (worker is None):
        raise args.Invalid("run", "give run or worker (one of them)")
    async with connection() as daemon:
        wakes = await _pending_wakes(daemon, run, worker)
        if not wakes and a.timeout > 0:
            with trio.move_on_after(a.timeout):
                wakes = await _pending_wakes(daemon, run, worker, follow=True)
        kept = bounds.wakes_within(wakes, bounds.Budget(a.max_bytes))
        if kept:
            # Only what this answer carries: the rest stay for the next call.
            with trio.CancelScope(shield=True):
                await daemon.ack(wake.seq for wake in kept)
    pending = len(wakes) - len(kept)
    lines = "\n".join(text.wake_line(wake) for wake in kept)
    if pending:
        counted = f"at least {pending}" if len(wakes) >= EVENTS_COUNTED else str(pending)
        lines = text.with_footer(
            lines,
            f"truncated at max_bytes: {counted} more wakes pending, not acknowledged; "
            "call subagent_events again for them",
            "no wakes",
        )
    return Answer(
        lines or "no wakes",
        {
            "wakes": [shapes.wake(wake) for wake in kept],
            "pending": pending,
            "truncated": pending > 0,
        },
    )


async def _pending_wakes(
    daemon: AsyncClient, run: str | None, worker: str | None, *, follow: bool = False
) -> list[Wake]:
    """The wakes pending now (the first EVENTS_COUNTED of them); with `follow`, the first
    one to come. None is acknowledged: the caller acknowledges what it returns, so what
    it does not stays pending."""
    wakes: list[Wake] = []
    async with contextlib.aclosing(
        daemon.events(run=run, worker=worker, follow=follow, ack=False)
    ) as stream:
        async for wake in stream:
            wakes.append(wake)
            if follow or len(wakes) >= EVENTS_COUNTED:
                break
    return wakes
