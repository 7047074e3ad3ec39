"""Every message on the control socket, as tagged msgspec Structs.

Each message is a msgpack map whose "op" key names its type. Requests carry an
``id`` chosen by the client; replies and errors carry it back; a streaming
request (a followed watch) answers with several replies of the same id. Events
not tied to a request carry ``id = 0``. New fields always get defaults, so an
older peer keeps decoding what a newer one sends.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ._framing import frame
from ._version import PROTOCOL_VERSION

WorkerState = Literal[
    "starting",
    "running",
    "finished",
    "failed",
    "stopped",
    "timed_out",
    "stopped_by_reload",
    "interrupted",
]
TERMINAL_STATES: frozenset[str] = frozenset(
    {"finished", "failed", "stopped", "timed_out", "stopped_by_reload", "interrupted"}
)
EntryKind = Literal["stdout", "stderr", "state", "note"]


# -- values carried inside messages --------------------------------------------


class WorkerView(msgspec.Struct, kw_only=True):
    """What a client sees of one worker."""

    id: str
    run: str
    parent: str | None = None
    name: str = ""
    state: WorkerState
    pid: int | None = None
    exit_code: int | None = None
    attempt: int = 1
    turn: int = 0
    started_at: float
    ended_at: float | None = None
    archive: str = ""
    argv: list[str] = []
    cwd: str = ""
    agent: str | None = None
    #: True in a listing whose `argv` is a summary (the first arguments, each cut
    #: short); `status` carries the whole.
    argv_cut: bool = False


class Entry(msgspec.Struct, kw_only=True):
    """One journal entry. ``data`` is raw output for stdout/stderr, UTF-8 text otherwise."""

    seq: int
    kind: EntryKind
    data: bytes
    at: float


class WorkerResult(msgspec.Struct, kw_only=True):
    id: str
    state: WorkerState
    exit_code: int | None = None
    result: str = ""


class Wake(msgspec.Struct, kw_only=True):
    """A worker ended: posted once for its parent (the parent worker, or its run).

    ``seq`` numbers wakes across the daemon's life; acknowledge by it.
    """

    seq: int
    id: str
    run: str
    parent: str | None = None
    state: WorkerState
    exit_code: int | None = None
    preview: str = ""
    attempt: int = 1


class DaemonInfo(msgspec.Struct, kw_only=True):
    version: str
    protocol: int
    pid: int
    image_generation: int
    reloads: int
    workers: dict[str, int]
    holds_park: bool
    #: How workers' process trees are tracked: "cgroup <path>", or "/proc scan (<why>)".
    tree_tracking: str = ""
    socket: str = ""
    state_dir: str = ""
    #: What is wrong right now that a person should know (a full disk, say).
    problems: list[str] = []


# -- requests: client to daemon ------------------------------------------------


class Request(msgspec.Struct, tag_field="op", kw_only=True):
    id: int


class Hello(Request, tag="hello"):
    """The first message of every connection."""

    version: int = PROTOCOL_VERSION
    token: str | None = None
    client: str = ""


class Spawn(Request, tag="spawn"):
    argv: list[str] = []
    agent: str | None = None
    name: str = ""
    run: str | None = None
    parent: str | None = None
    input: bytes | None = None
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout: float | None = None
    grace: float | None = None


class NewRun(Request, tag="new_run"):
    outer: str | None = None


class ListWorkers(Request, tag="list_workers"):
    """One page of workers; ``after``: the ``next`` of the page before (None: the first)."""

    all: bool = False
    run: str | None = None
    after: str | None = None
    limit: int = 1000


class Status(Request, tag="status"):
    worker: str


class Stop(Request, tag="stop"):
    worker: str
    wait: bool = True


class StopRun(Request, tag="stop_run"):
    run: str
    wait: bool = True


class Watch(Request, tag="watch"):
    worker: str
    since: int = 0
    follow: bool = False
    limit: int = 1000


class Collect(Request, tag="collect"):
    worker: str
    wait: bool = False


class Wait(Request, tag="wait"):
    worker: str


class Info(Request, tag="info"):
    pass


class BeginTurn(Request, tag="begin_turn"):
    """Advance the turn generation that new registrations are stamped with."""


class Cancel(Request, tag="cancel"):
    """Stop every worker in ``scope``: ``all``, ``turn:G``, ``run:R`` or ``worker:W``."""

    scope: str


class SetFence(Request, tag="set_fence"):
    """Set a launch fence (replacing any other); answered with its epoch."""


class CancelFence(Request, tag="cancel_fence"):
    """Stop what registered under fence ``epoch``, and every later spawn until it is replaced."""

    epoch: int


class ClearFence(Request, tag="clear_fence"):
    pass


class WaitRunStopped(Request, tag="wait_run_stopped"):
    """Answered (with done) once ``run`` is stopped, however that happened."""

    run: str


class Resume(Request, tag="resume"):
    """Carry an ended (not finished) worker on from its snapshot: same id, next attempt.

    Only ``timeout`` may be given again; ``input``, ``argv`` or ``model`` are
    refused with `frozen` (the snapshot holds what the worker was given).
    """

    worker: str
    timeout: float | None = None
    input: bytes | None = None
    argv: list[str] | None = None
    model: str | None = None


class ResumeRun(Request, tag="resume_run"):
    """A new live attempt of a run: its highest unfinished workers carry on."""

    run: str


class LatestResumable(Request, tag="latest_resumable"):
    """The newest run started in ``cwd`` that a resume would take, or the newest and why not."""

    cwd: str


class Reload(Request, tag="reload"):
    """Re-exec the daemon's image in place, keeping every worker. Answered by the new image."""


class Subscribe(Request, tag="subscribe"):
    """The wakes for one parent: ``run`` (its top-level workers) or ``worker`` (its children).

    Answered with `Wakes` pages: first every wake not yet acknowledged; with
    ``follow``, then each new one as it is posted, until aborted.
    """

    run: str | None = None
    worker: str | None = None
    follow: bool = False


class Ack(Request, tag="ack"):
    """Acknowledge wakes by seq; each must have been delivered on this connection."""

    wakes: list[int]


class Abort(Request, tag="abort"):
    """End the stream opened by request ``request`` on this connection."""

    request: int


ClientMessage = (
    Hello
    | Spawn
    | NewRun
    | ListWorkers
    | Status
    | Stop
    | StopRun
    | Watch
    | Collect
    | Wait
    | Info
    | BeginTurn
    | Cancel
    | SetFence
    | CancelFence
    | ClearFence
    | WaitRunStopped
    | Subscribe
    | Ack
    | Reload
    | Resume
    | ResumeRun
    | LatestResumable
    | Abort
)


# -- replies and events: daemon to client --------------------------------------


class Reply(msgspec.Struct, tag_field="op", kw_only=True):
    id: int


class Welcome(Reply, tag="welcome"):
    version: int
    daemon_version: str
    pid: int
    worker: str | None = None


class WorkerReply(Reply, tag="worker"):
    worker: WorkerView


class WorkerList(Reply, tag="worker_list"):
    """Workers, one page of them for `list_workers`: ask again `after` ``next``
    until ``complete``."""

    workers: list[WorkerView]
    next: str | None = None
    complete: bool = True


class RunReply(Reply, tag="run"):
    run: str


class Stopped(Reply, tag="stopped"):
    """``found`` is false for an id the daemon never saw; ``stopped`` lists the ids stopped."""

    found: bool
    stopped: list[str]


class Page(Reply, tag="page"):
    """Journal entries after a cursor. ``complete``: the journal will never grow again."""

    entries: list[Entry]
    next: int
    complete: bool


class ResultReply(Reply, tag="result"):
    result: WorkerResult


class InfoReply(Reply, tag="info"):
    info: DaemonInfo


class TurnReply(Reply, tag="turn"):
    turn: int


class Cancelled(Reply, tag="cancelled"):
    """The ids newly cancelled, sorted."""

    cancelled: list[str]


class FenceReply(Reply, tag="fence"):
    epoch: int


class Wakes(Reply, tag="wakes"):
    """Wakes for a subscription. ``complete``: no more will come on this subscription."""

    wakes: list[Wake]
    complete: bool = False


class ReloadReply(Reply, tag="reloaded"):
    """The new image serves: it carried ``carried_live`` workers and had to stop the rest."""

    image_generation: int
    carried_live: int
    stopped_by_reload: list[str] = []


class Latest(Reply, tag="latest"):
    """``resumable``: a resume of ``run`` would go ahead; else ``reason`` says why not."""

    run: str
    resumable: bool
    reason: str = ""


class Done(Reply, tag="done"):
    pass


class Error(Reply, tag="error"):
    code: str
    message: str
    retry_after: float | None = None


DaemonMessage = (
    Welcome
    | WorkerReply
    | WorkerList
    | RunReply
    | Stopped
    | Page
    | ResultReply
    | InfoReply
    | TurnReply
    | Cancelled
    | FenceReply
    | Wakes
    | ReloadReply
    | Latest
    | Done
    | Error
)


# -- encoding ------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
client_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
daemon_decoder: msgspec.msgpack.Decoder[DaemonMessage] = msgspec.msgpack.Decoder(DaemonMessage)


def encode(message: Request | Reply) -> bytes:
    """The whole frame (length prefix and body) for one message."""
    return frame(_encoder.encode(message))
