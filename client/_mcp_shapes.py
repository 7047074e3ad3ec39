"""subagentd-mcp's results: the structured content each tool answers, and its schema.

Each model is the output schema a host validates a success against: the shapes
`subagentctl --json` prints, with `state`, `outcome` and `kind` as enums and every
timestamp saying what it is. Structured content keeps the raw data (a worker's output as
it wrote it, decoded); the text a model reads is built elsewhere, sanitised. A refusal
carries no structured content at all (see `_mcp_server`), so no schema need admit it.
Pure: no I/O, no clock (each caller passes `now`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from subagentd.protocol import (
    Entry,
    EntryKind,
    OutputKind,
    Resumed,
    WaitOutcome,
    Wake,
    WorkerState,
    WorkerView,
)

#: What every timestamp in a result is.
EPOCH = "seconds since the epoch, UTC"


class Shape(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class UsageOut(Shape):
    """What a live worker takes now, its whole tree (protocol/README.md, Usage)."""

    cpu_seconds: float = Field(description="CPU time used since its attempt began")
    cpu_percent: float | None = Field(
        description="CPU % of one core, recent: since the daemon's previous reading of it "
        "(0.2 s to 60 s before), else since it began; null: not measurable"
    )
    memory: int = Field(description="bytes of memory it holds now")
    memory_peak: int | None = Field(description="the most bytes it has held; null: not known")
    processes: int = Field(description="its processes now")
    source: Literal["cgroup", "proc"] = Field(
        description="cgroup: the kernel's counters of its cgroup; proc: summed from /proc"
    )


class LimitsOut(Shape):
    """What a worker and all it delegates may take together (absent: no limit of that kind)."""

    memory: int | None = Field(default=None, description="bytes of memory")
    cpus: float | None = Field(default=None, description="cores of CPU")
    pids: int | None = Field(default=None, description="processes at once")


class WorkerOut(Shape):
    """A worker, as `subagentctl --json status` prints it."""

    id: str
    run: str
    parent: str | None = Field(description="the worker that spawned it (null: top-level)")
    name: str
    state: WorkerState
    pid: int | None
    exit_code: int | None
    attempt: int
    turn: int
    started_at: float = Field(description=f"when this attempt started: {EPOCH}")
    ended_at: float | None = Field(description=f"when it ended: {EPOCH}; null while it runs")
    uptime: float = Field(description="seconds it has run (to its end, if it ended)")
    archive: str
    argv: list[str] = Field(description="its command (in a listing, its first arguments)")
    argv_cut: bool = Field(description="argv is cut short: subagent_status has the whole")
    cwd: str
    agent: str | None
    stopping: bool = Field(description="a stop is in flight: TERM sent, its tree not yet gone")
    paused: bool = Field(
        default=False, description="paused (subagent_pause): held still until unpaused"
    )
    usage: UsageOut | None = Field(
        default=None, description="what it takes now, if live (null: ended or starting)"
    )
    limits: LimitsOut | None = Field(
        default=None, description="its own limits, as enforced (null: none of its own)"
    )
    reason: str = Field(
        default="",
        description='why it ended as it did beyond its state: "memory_limit" (failed, the '
        'kernel having killed it at a memory limit), "never_started" (stopped while it was '
        'queued), "skipped" (stopped unstarted: a worker it was to start after did not end, '
        "finish or get ready as asked); empty otherwise",
    )
    queued: bool = Field(
        default=False,
        description="waiting in the queue for a slot under a cap on workers running at once "
        "(state is starting; its process not started)",
    )
    queue_position: int | None = Field(
        default=None, description="its place in the queue while queued, from 1 (the next)"
    )
    ready_at: float | None = Field(
        default=None,
        description=f"when the `ready` pattern it was spawned with matched its output: {EPOCH}; "
        "null: not ready (yet)",
    )
    retries: int = Field(
        default=0, description="how many times it may be started again after failing"
    )
    retry_at: float | None = Field(
        default=None,
        description=f"while it waits out a retry's backoff: when its next attempt starts: {EPOCH}",
    )


class WorkersOut(Shape):
    workers: list[WorkerOut]
    next: str | None = Field(
        default=None,
        description="pass as `cursor`, with the same arguments, for the workers after "
        "these; null: the listing is complete",
    )
    truncated: bool = Field(default=False, description="max_bytes cut the listing short")


class EntryOut(Shape):
    seq: int
    kind: EntryKind
    data: str = Field(description="as written (invalid UTF-8 as U+FFFD); cut if `cut`")
    at: float = Field(description=f"when it was written: {EPOCH}")
    cut: bool = Field(default=False, description="only part of this entry's data is here")


class PageOut(Shape):
    entries: list[EntryOut]
    next: int = Field(description="the cursor to pass as `cursor` for what comes after")
    offset: int = Field(
        default=0, description="with `next`: bytes of its next entry already given, to pass on"
    )
    complete: bool = Field(description="the worker has ended and nothing follows")
    truncated: bool = Field(default=False, description="max_bytes cut this answer short")


class GrepMatchOut(Shape):
    line_no: int = Field(description="1-based over the worker's stdout and stderr lines")
    kind: OutputKind
    line: str
    before: list[str]
    after: list[str]
    cut: bool = Field(
        default=False,
        description="alone over max_bytes, it was cut to fit (context left out, or the "
        "line itself cut)",
    )


class GrepOut(Shape):
    matches: list[GrepMatchOut]
    truncated: bool = Field(
        description="a bound was hit (limit, max_bytes, or the daemon's on its work): "
        "there may be more matches"
    )
    next: int | None = Field(
        default=None,
        description="pass as `cursor`, with the same arguments, for the matches after "
        "these; null: nothing more to be had",
    )


class WaitOut(Shape):
    outcome: WaitOutcome
    line: str | None = Field(description="the line that matched, for `matched`")
    worker: WorkerOut


class ReadyOut(Shape):
    outcome: WaitOutcome = Field(description="matched, ended (before a line matched) or timed_out")
    line: str | None = Field(description="the line that matched, for `matched`")
    tail: str = Field(description="unless matched: the last lines of its output")


class SpawnedOut(WorkerOut):
    ready: ReadyOut | None = Field(default=None, description="with `ready`: what the wait saw")


class RunOut(Shape):
    run: str = Field(description="the run's id, to pass as subagent_spawn's `run`")
    max_running: int | None = Field(
        description="how many of its workers may run at once; null: no cap"
    )


class SentOut(Shape):
    worker: str
    written: int = Field(description="bytes written to the worker's stdin")
    eof: bool = Field(description="its stdin was closed after")


class StoppedOut(Shape):
    stopped: list[str]
    already_stopping: list[str]


class PausedOut(Shape):
    paused: list[str]
    already_paused: list[str]
    held_outside: dict[str, int]


class UnpausedOut(Shape):
    unpaused: list[str]
    already_unpaused: list[str]


class CancelledOut(Shape):
    cancelled: list[str]
    already_stopping: list[str]


class ResultOut(Shape):
    id: str
    state: WorkerState
    exit_code: int | None
    result: str = Field(description="what it wrote to $SUBAGENTD_RESULT, else its stdout's tail")
    truncated: bool = Field(default=False, description="max_bytes cut `result` short")


class WakeOut(Shape):
    id: str
    run: str
    parent: str | None
    state: WorkerState
    exit_code: int | None
    preview: str
    attempt: int = Field(
        default=1,
        description="the attempt that ended it for good (a retried or resumed worker's is "
        "past 1): a worker is woken for once, by its last attempt",
    )
    reason: str = Field(
        default="",
        description='why it ended as it did beyond its state: "memory_limit" (failed, the '
        'kernel having killed it at a memory limit), "never_started" (stopped while it '
        'was queued), "skipped" (stopped unstarted: a worker it was to start after did not '
        "end, finish or get ready as asked); empty otherwise",
    )


class WakesOut(Shape):
    wakes: list[WakeOut]
    pending: int = Field(
        default=0,
        description="wakes left pending after these (max_bytes left them out, "
        "unacknowledged): call again for them",
    )
    truncated: bool = Field(default=False, description="max_bytes left wakes out")


class ResumedOut(WorkerOut):
    changed: str = Field(description="what changed on disk since its spawn; empty: nothing")


class ResumedListOut(Shape):
    resumed: list[ResumedOut]


class RestartedOut(Shape):
    stopped: list[str] = Field(description="what the stop ended: it and its subtree")
    worker: ResumedOut


class LatestOut(Shape):
    run: str
    resumable: bool
    reason: str
    from_: list[str] = Field(alias="from", description="the workers a resume would carry on")


def output_schema(shape: type[Shape]) -> dict[str, Any]:
    return shape.model_json_schema(by_alias=True, mode="serialization")


# -- builders: protocol values as structured content -------------------------------------

_WORKER_FIELDS = tuple(name for name in WorkerOut.model_fields if name not in ("uptime", "usage"))


def uptime(view: WorkerView, now: float) -> float:
    """Seconds `view` has run: to its end, or to `now` (seconds since the epoch)."""
    end = view.ended_at if view.ended_at is not None else now
    return max(0.0, end - view.started_at)


def worker(view: WorkerView, now: float) -> dict[str, Any]:
    """`view` as structured content, its uptime counted to `now`."""
    fields = {name: getattr(view, name) for name in _WORKER_FIELDS}
    fields["limits"] = msgspec.to_builtins(view.limits) if view.limits else None
    usage = None if view.usage is None else msgspec.to_builtins(view.usage)
    return {**fields, "uptime": uptime(view, now), "usage": usage}


def resumed(view: Resumed, now: float) -> dict[str, Any]:
    return {**worker(view, now), "changed": view.changed}


def wake(found: Wake) -> dict[str, Any]:
    return {name: getattr(found, name) for name in WakeOut.model_fields}


def entry(found: Entry, data: bytes | None = None, *, cut: bool = False) -> dict[str, Any]:
    raw = found.data if data is None else data
    return {
        "seq": found.seq,
        "kind": found.kind,
        "data": raw.decode(errors="replace"),
        "at": found.at,
        "cut": cut,
    }


def state_of(view: WorkerView) -> str:
    if view.stopping:
        return "stopping"
    if view.paused:
        return "paused"
    if view.queued:
        return "queued" if view.queue_position is None else f"queued #{view.queue_position}"
    return f"{view.state} ({view.reason})" if view.reason else view.state
