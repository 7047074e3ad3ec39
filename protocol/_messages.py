"""Every message on the control socket, as tagged msgspec Structs.

Each message is a msgpack map whose "op" key names its type. Requests carry an
``id`` chosen by the client; replies and errors carry it back; a streaming
request (a followed watch) answers with several replies of the same id. Events
not tied to a request carry ``id = 0``. New fields always get defaults, so an
older peer keeps decoding what a newer one sends.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import msgspec

from ._framing import frame
from ._integers import check_integers
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
#: ``stdin``: what a `send` wrote to the worker's stdin (a worker spawned ``stdin_open``).
EntryKind = Literal["stdout", "stderr", "state", "note", "stdin"]
#: The kinds of entry that are the worker's own output, split into lines by grep.
OutputKind = Literal["stdout", "stderr"]


# -- limits: every number, string and list a request carries is checked as it is decoded

#: The largest integer a request may carry (an id, a cursor, a seq): a signed 64-bit one.
MAX_INT = 2**63 - 1
#: Seconds between TERM and KILL: at most a day.
MAX_GRACE = 86_400.0
#: Seconds before a worker is stopped as timed out: at most 30 days.
MAX_TIMEOUT = 30 * 86_400.0
#: Bytes of one argument or environment variable with its NUL: Linux's MAX_ARG_STRLEN.
MAX_ARG_BYTES = 128 * 1024
#: argv and env together as exec counts them (strings, their NULs, the pointers): what
#: Linux accepts with the usual 8 MiB stack.
MAX_EXEC_BYTES = 2 * 1024 * 1024
#: Arguments in an argv, variables in an env.
MAX_ARGS = 32 * 1024
#: A spawn's input (its stdin), well below the frame limit.
MAX_INPUT_BYTES = 8 * 1024 * 1024
#: A worker or run id, a token.
MAX_ID_LENGTH = 256
#: A name, an agent, a model, a scope, a client's description.
MAX_NAME_LENGTH = 1024
#: A path: Linux's PATH_MAX.
MAX_PATH_LENGTH = 4096
#: Wakes acknowledged by one ack.
MAX_ACK_WAKES = 64 * 1024
#: A spawn's or resume's idempotency key: clients send 32 hex digits (128 random bits).
MAX_KEY_LENGTH = 128
#: A grep's or wait-for's regular expression (RE2 syntax), in characters.
MAX_PATTERN_LENGTH = 1024
#: Lines of context a grep may ask for before, and after, each match.
MAX_CONTEXT_LINES = 100
#: Matches one grep answers at most.
MAX_GREP_MATCHES = 1000
#: The latest time a request may name, in seconds since the epoch: the end of the year
#: 9999, the last an ISO 8601 date can write.
MAX_EPOCH = 253_402_300_800.0
#: What one send may write to a worker's stdin: a pipe takes 64 KiB at once anyway.
MAX_SEND_BYTES = 1024 * 1024
#: The bytes of one answer built from a worker's output (a watch page, a grep's result),
#: as its msgpack body counts them: a request's `max_bytes` is 1 KiB to 8 MiB (half the
#: frame limit), 2 MiB unless asked (more than any journal entry holds, so a client that
#: does not ask never sees an entry split).
MIN_ANSWER_BYTES = 1024
MAX_ANSWER_BYTES = 8 * 1024 * 1024
DEFAULT_ANSWER_BYTES = 2 * 1024 * 1024

#: A request id: 1 and up (id 0 marks an event, never a request).
RequestId = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
#: Seconds between TERM and KILL: finite, 0 to a day (nan fails both bounds).
Grace = Annotated[float, msgspec.Meta(ge=0, le=MAX_GRACE)]
#: Seconds before a worker times out, 0 meaning none: finite, up to 30 days.
Timeout = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT)]
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_LENGTH)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LENGTH)]
PathText = Annotated[str, msgspec.Meta(max_length=MAX_PATH_LENGTH)]
# Counted in characters here; the daemon checks the bytes exec would take.
Argv = Annotated[
    list[Annotated[str, msgspec.Meta(max_length=MAX_ARG_BYTES)]],
    msgspec.Meta(max_length=MAX_ARGS),
]
Env = Annotated[
    dict[
        Annotated[str, msgspec.Meta(max_length=MAX_ARG_BYTES)],
        Annotated[str, msgspec.Meta(max_length=MAX_ARG_BYTES)],
    ],
    msgspec.Meta(max_length=MAX_ARGS),
]
Input = Annotated[bytes, msgspec.Meta(max_length=MAX_INPUT_BYTES)]
Pattern = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATTERN_LENGTH)]
ContextLines = Annotated[int, msgspec.Meta(ge=0, le=MAX_CONTEXT_LINES)]
#: A time, in seconds since the epoch: finite, from 1970 to the end of 9999.
Epoch = Annotated[float, msgspec.Meta(ge=0, le=MAX_EPOCH)]
#: A bound on an answer's bytes (see `MAX_ANSWER_BYTES`): an int, nothing else.
AnswerBytes = Annotated[int, msgspec.Meta(ge=MIN_ANSWER_BYTES, le=MAX_ANSWER_BYTES)]
#: An idempotency key: 1 to 128 printable ASCII characters, no space (see `Spawn.key`).
RequestKey = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_KEY_LENGTH, pattern=r"^[!-~]+$")
]

#: A memory limit, in bytes: 1 MiB (less would not hold a shell) to 2**50 (a PiB).
MIN_MEMORY = 1024 * 1024
MAX_MEMORY = 2**50
#: A CPU limit, in cores: a hundredth of one (the kernel's least quota, 1 ms of each
#: 100 ms period) to 1024.
MIN_CPUS = 0.01
MAX_CPUS = 1024.0
#: A process limit: 1 to Linux's most pids (PID_MAX_LIMIT, 2**22).
MAX_PIDS = 4_194_304
MemoryLimit = Annotated[int, msgspec.Meta(ge=MIN_MEMORY, le=MAX_MEMORY)]
#: Finite by its bounds: nan and inf fail them.
CpuLimit = Annotated[float, msgspec.Meta(ge=MIN_CPUS, le=MAX_CPUS)]
PidsLimit = Annotated[int, msgspec.Meta(ge=1, le=MAX_PIDS)]
#: A cap on workers running at once (a run's, an agent's, the daemon's): 1 to 100,000.
MAX_RUNNING = 100_000
MaxRunning = Annotated[int, msgspec.Meta(ge=1, le=MAX_RUNNING)]
#: A spawn's place among the queued: higher starts first; 0 unless given.
MAX_PRIORITY = 1_000_000
Priority = Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
#: Attempts a failed worker may be given again: 0 to 100.
MAX_RETRIES = 100
Retries = Annotated[int, msgspec.Meta(ge=0, le=MAX_RETRIES)]
#: Seconds before a retry (doubling each time up to its most): 0 to a day.
MAX_BACKOFF = 86_400.0
Backoff = Annotated[float, msgspec.Meta(ge=0, le=MAX_BACKOFF)]
#: The workers a spawn may wait for (`Spawn.after`...): at most 64 each.
MAX_AFTER = 64
AfterIds = Annotated[list[Id], msgspec.Meta(max_length=MAX_AFTER)]
#: What else a retry is made for, beyond `failed`: a timeout.
RetryOn = Annotated[list[Literal["timeout"]], msgspec.Meta(max_length=1)]
#: The kinds of limit, as `Limits` and `DaemonInfo.controls` name them.
LIMIT_KINDS = ("memory", "cpus", "pids")
#: What `DaemonInfo.controls` says beside the limits: how `pause` holds a tree still.
FREEZE_CONTROL = "freeze"


# -- values carried inside messages --------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    """What a live worker takes now (its whole tree: every process in its cgroup, else
    found by /proc), read when asked: `status` carries it for a live worker, a listing and
    `info` when they ask (``usage``). protocol/README.md, Usage, says where each figure
    comes from."""

    #: CPU time used since the worker's attempt began (its processes, those exited too).
    cpu_seconds: float
    #: CPU % of one core (200.0: two cores' worth): over the time since the daemon's
    #: previous reading of this worker's usage if that was 0.2 s to 60 s ago (the one
    #: before a reading within 0.2 s of it stands), else since the worker began. None:
    #: not measurable.
    cpu_percent: float | None = None
    #: Bytes of memory it holds now.
    memory: int
    #: The most it has held (None: not known).
    memory_peak: int | None = None
    #: Its processes now.
    processes: int
    #: "cgroup": the figures are the kernel's counters of its cgroup; "proc": memory (and,
    #: without a cgroup, CPU and the processes) summed over its processes from /proc.
    source: Literal["cgroup", "proc"]


class Limits(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker and everything it delegated (its subtree), or a run's workers together,
    may take, enforced by the kernel (`DaemonInfo.controls` says how). Unset: no limit of
    that kind; an unset field is not sent."""

    #: Bytes of memory (the kernel OOM-kills within the subtree past it).
    memory: MemoryLimit | None = None
    #: Cores of CPU time (a quota each period: 1.5 is a core and a half).
    cpus: CpuLimit | None = None
    #: Processes (and threads) at once: a fork past it fails (EAGAIN).
    pids: PidsLimit | None = None

    def __bool__(self) -> bool:
        return self.memory is not None or self.cpus is not None or self.pids is not None


class Control(msgspec.Struct, kw_only=True):
    """How this daemon enforces one kind of limit, or holds a tree still (a pause), as
    `DaemonInfo.controls` says: `enforced`, and `how`, a sentence naming the mechanism and
    its path, or why it cannot."""

    enforced: bool
    how: str = ""


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
    #: A stop is in flight: asked (TERM sent, or about to be), its tree not yet ended.
    #: A field, not a state: an older peer's decoder knows only the states above.
    stopping: bool = False
    #: Paused (`pause`): its processes frozen by the kernel, or stopped by SIGSTOP, until
    #: an `unpause`; its timeout does not run meanwhile. A field, as `stopping` is.
    paused: bool = False
    #: What it takes now (`Usage`): in `status` of a live worker, in a listing that asked
    #: (``usage``); None otherwise, and for an ended or starting worker.
    usage: Usage | None = None
    #: The worker's own limits, as enforced (None: none of its own; its parent's and its
    #: run's may still bound it).
    limits: Limits | None = None
    #: Why it ended as it did, beyond its state: "memory_limit" (it ended `failed`, the
    #: kernel having OOM-killed it at a memory limit), "never_started" (stopped while it
    #: was queued); empty otherwise.
    reason: str = ""
    #: Waiting in the queue for a slot under a cap (`Spawn` over `max_running`): its
    #: process not started. `state` is `starting`: a field, as `stopping` and `paused`
    #: are, so an older peer's decoder (which knows only the states above) reads it.
    queued: bool = False
    #: Its place in the queue while `queued`, from 1 (the next to start as caps allow).
    queue_position: int | None = None
    #: How many times it may be started again after failing (`Spawn.retries`).
    retries: int = 0
    #: While it waits out a retry's backoff: when its next attempt may start.
    retry_at: float | None = None
    #: Its output matched its spawn's `ready` pattern (this attempt's), and when.
    ready: bool = False
    ready_at: float | None = None


class Resumed(WorkerView, kw_only=True):
    """A worker as a resume answers it (the clients' `resume` and `resume_run`): its view,
    and ``changed``, what changed on disk since it was spawned (its agent's definition in
    agents.toml, its work tree's HEAD), in one line; empty when nothing did. The resume
    ran the frozen snapshot all the same."""

    changed: str = ""


class ResumableRun(msgspec.Struct, kw_only=True):
    """What the clients' `latest_resumable` answers: the newest run started in a directory
    that a resume would take (``resumable``), or else the newest there and ``reason``, why
    not. ``from_`` (``from`` on the wire and in JSON; a Python keyword): the workers a
    resume of ``run`` would carry on, each from the end of its own journal; empty when
    it would not resume."""

    run: str
    resumable: bool
    reason: str = ""
    from_: list[str] = msgspec.field(default_factory=list, name="from")


class Entry(msgspec.Struct, kw_only=True):
    """One journal entry. ``data`` is raw output for stdout/stderr, UTF-8 text otherwise."""

    seq: int
    kind: EntryKind
    data: bytes
    at: float


class GrepMatch(msgspec.Struct, kw_only=True):
    """One line of a worker's output that a grep matched, with its context.

    ``line_no`` counts from 1 over the worker's stdout and stderr lines together, in the
    order the journal took them (each stream split into lines on its own); ``before`` and
    ``after`` are the lines around it in that same order, either stream."""

    line_no: int
    kind: OutputKind
    line: str
    before: list[str] = []
    after: list[str] = []
    #: Alone over the answer's `max_bytes`, the match was cut to fit: context lines left
    #: out (the nearest kept), and the line itself cut if even it was too long.
    cut: bool = False


class GrepResult(msgspec.Struct, kw_only=True):
    """A grep's answer. ``truncated``: a bound was hit (the matches asked for, the answer's
    bytes, or the bytes of journal one grep scans), so there may be more matches than
    these. ``next``: where to go on, sent as the next grep's ``since`` (the line number of
    the last match here); None when going on would find nothing more: searched to the
    end, or stopped by the scan's bound (then ``truncated``). ``stopped_in_line``: the scan
    stopped at its bound inside a line, whose end lies past it (the line was not taken
    to end there: no ``$`` matched at the bound)."""

    matches: list[GrepMatch]
    truncated: bool = False
    next: int | None = None
    stopped_in_line: bool = False


WaitOutcome = Literal["matched", "ended", "timed_out"]


class WaitForResult(msgspec.Struct, kw_only=True):
    """A wait-for's answer: a line matched (``line``), the worker ended first, or the
    timeout passed first; ``worker`` as it was when answered."""

    outcome: WaitOutcome
    line: str | None = None
    worker: WorkerView


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
    #: As `WorkerView.reason`: "memory_limit", or empty.
    reason: str = ""


class OutputRelays(msgspec.Struct, kw_only=True):
    """The daemon's output relays (`DaemonInfo.relays`): `relay_above`, the descriptor
    number from which a new worker's pipes go to a relay; `pids` of the relays running;
    `streams`, the workers' pipes they hold (2 a live relayed worker); `capacity`, how
    many they could hold in all."""

    relay_above: int
    pids: list[int] = []
    streams: int = 0
    capacity: int = 0


class Recovery(msgspec.Struct, kw_only=True):
    """How far a restart's recovery has come (`DaemonInfo.recovering`): `phase` is what it
    does now (`reading the store`, `ending what was running`, `rebuilding the registry`,
    `sweeping`), `done` of `total` the workers it has taken back, `seconds` since it began,
    `answered` how many requests it has answered `recovering` meanwhile."""

    phase: str
    done: int
    total: int
    seconds: float
    answered: int = 0


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
    #: Who decides whom a connection acts as: "kernel" (workers have cgroups: a connection
    #: from inside a worker's is that worker, whatever its token) or "token" (no cgroups:
    #: the token alone says, advisory; a process that omits it acts for the user).
    authority: Literal["kernel", "token"] = "token"
    #: The worker the connection that asked acts as; None: the user.
    caller: str | None = None
    #: What the daemon waits for before it can serve in full, and since when (another
    #: process's lock on its store); None: nothing. Meanwhile only `info` is answered.
    store_wait: str | None = None
    #: Set while a restart takes its workers back (most requests are then answered
    #: `recovering`); None once it serves them all.
    recovering: Recovery | None = None
    #: The output relays holding workers' pipes past the descriptor threshold (None: an
    #: image before them).
    relays: OutputRelays | None = None
    #: What the live workers take together, when `info` asked (``usage``): the sum of each
    #: one's figures (its ``memory_peak``: the sum of their peaks, None if one is not
    #: known; ``cpu_percent``: of those that have one); ``source`` "proc" if any was.
    #: None: not asked, or an image before it.
    usage: Usage | None = None
    #: What this daemon can enforce, by kind, and how: the limits ("memory", "cpus",
    #: "pids"; a spawn or new_run asking for a kind not enforced is refused) and "freeze",
    #: how `pause` holds a worker's processes still ("cgroup v2 cgroup.freeze", or
    #: "SIGSTOP/SIGCONT over the process tree (scan)" where workers have no cgroups).
    #: Empty: an image before limits.
    controls: dict[str, Control] = {}
    #: Workers waiting in the queue (counted under "starting" in `workers` as well).
    queued: int = 0
    #: The daemon's own cap on workers running at once (`--max-running`); None: none.
    max_running: int | None = None


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
    #: A `resume`'s answer only: what changed on disk since the worker was spawned (see
    #: `Resumed`); empty when nothing did, and in every other answer.
    changed: str = ""


class WorkerList(Reply, tag="worker_list"):
    """Workers, one page of them for `list_workers`: ask again `after` ``next``
    until ``complete``."""

    workers: list[WorkerView]
    next: str | None = None
    complete: bool = True
    #: A `resume_run`'s answer only: for each worker resumed whose spawn's world changed on
    #: disk since, what changed (see `Resumed`).
    changed: dict[str, str] = {}


class RunReply(Reply, tag="run"):
    run: str


class Stopped(Reply, tag="stopped"):
    """``found`` is false for an id the daemon never saw; ``stopped`` lists the ids stopped."""

    found: bool
    stopped: list[str]
    #: The workers in reach whose stop was already in flight: left as they are.
    already_stopping: list[str] = []


class Paused(Reply, tag="paused"):
    """A pause's answer: ``paused``, the ids newly paused, sorted; ``already_paused``,
    the live workers in reach that were paused already (left as they are);
    ``held_outside``, for each worker newly paused with processes outside its cgroup
    (moved out of it), how many the pause held by SIGSTOP (its journal names them)."""

    paused: list[str]
    already_paused: list[str] = []
    held_outside: dict[str, int] = {}


class Unpaused(Reply, tag="unpaused"):
    """An unpause's answer: ``unpaused``, the ids newly let go on, sorted;
    ``already_unpaused``, the live workers in reach that were not paused."""

    unpaused: list[str]
    already_unpaused: list[str] = []


class Page(Reply, tag="page"):
    """Journal entries after a cursor. ``complete``: the journal will never grow again.

    The next page is asked with ``since=next`` and ``offset=next_offset``: ``next_offset``
    is not 0 only when the page ends with a piece of entry ``next + 1`` (an entry alone
    over the watch's `max_bytes`, sent in pieces under its own seq), and counts the bytes
    of its data sent so far. ``truncated``: the page stopped at a bound (its `max_bytes`
    or `limit`) with more of the journal already there: ask again at once."""

    entries: list[Entry]
    next: int
    complete: bool
    next_offset: int = 0
    truncated: bool = False


class ResultReply(Reply, tag="result"):
    result: WorkerResult


class InfoReply(Reply, tag="info"):
    info: DaemonInfo


class TurnReply(Reply, tag="turn"):
    turn: int


class Cancelled(Reply, tag="cancelled"):
    """The ids newly cancelled, sorted; ``already_stopping``: those in scope whose stop
    was already in flight, left as they are."""

    cancelled: list[str]
    already_stopping: list[str] = []


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
    #: ``from`` on the wire: the workers a resume of ``run`` would carry on (see `ResumableRun`).
    from_: list[str] = msgspec.field(default_factory=list, name="from")


class GrepReply(Reply, tag="grep_result"):
    result: GrepResult


class WaitForReply(Reply, tag="wait_for_result"):
    result: WaitForResult


class Sent(Reply, tag="sent"):
    """``written``: the bytes of a send's data the worker's stdin took (all of it, or as
    much as its pipe had room for)."""

    written: int


class Done(Reply, tag="done"):
    pass


class Error(Reply, tag="error"):
    code: str
    message: str
    retry_after: float | None = None
    #: A failed `reload`'s refusal only: the workers it had stopped, as it could not carry
    #: them, before it failed (ended `stopped_by_reload`, resumable by id).
    stopped_by_reload: list[str] = []


DaemonMessage = (
    Welcome
    | WorkerReply
    | WorkerList
    | RunReply
    | Stopped
    | Paused
    | Unpaused
    | Page
    | ResultReply
    | InfoReply
    | TurnReply
    | Cancelled
    | FenceReply
    | Wakes
    | ReloadReply
    | Latest
    | GrepReply
    | WaitForReply
    | Sent
    | Done
    | Error
)


# -- requests: client to daemon ------------------------------------------------


#: The reply that answers a request, the type parameter of its class.
R = TypeVar("R", bound=Reply, covariant=True)


class Request(msgspec.Struct, Generic[R], tag_field="op", kw_only=True):
    """A request, with what both sides need to know about it declared once on its class.

    ``Request[WorkerReply]`` as the base of a request class: it is answered by a `WorkerReply`
    (or an `Error`); a stream, by several. The class-level facts below are
    ClassVars (not fields: never encoded); those that depend on a field are methods.

    Answered `reloading` under its own id (a spawn or resume while the launch fence of
    a reload is up, or a request cut short on the connection that asked for the reload),
    a request is sent again after ``retry_after`` if it is `resendable` or
    `again_after_reloading`; the clients do (`retry_delay`). Nothing else is sent twice.
    """

    id: RequestId

    #: The reply type that answers it: `R`, set from the class's own parameter.
    reply: ClassVar[type[Reply]]
    #: A worker's connection may send it, reaching only the worker's own subtree (the
    #: daemon's `Authority` decides what that means for each request); the others belong
    #: to whoever runs the workflow.
    for_workers: ClassVar[bool] = False
    #: Answered without waiting for anything: the daemon answers it inline, without a task.
    at_once: ClassVar[bool] = False
    #: Changes something, yet is safe to send again when answered `reloading`: the launch
    #: fence refuses it before it does anything (and once under way, a reload waits for
    #: it), or a second asking answers the same.
    again_after_reloading: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (cls.reply,) = typing.get_args(base)
        if not hasattr(cls, "reply"):
            raise TypeError(f"{cls.__name__} must say which reply answers it: Request[TheReply]")

    @classmethod
    def answered_by(cls) -> type[R]:
        """`reply`, typed: what `expect`-style checks of an answer to this request want."""
        return typing.cast("type[R]", cls.reply)

    def resendable(self) -> bool:
        """Whether, lost with its connection, it may be sent again on the next one: it asks
        without changing anything, or carries a key the daemon remembers (a spawn, a
        resume), so a second asking answers the same."""
        return False

    def streams(self) -> bool:
        """Whether it is answered with many replies, carrying on from a cursor."""
        return False


class Hello(Request[Welcome], tag="hello"):
    """The first message of every connection."""

    version: int = PROTOCOL_VERSION
    token: Id | None = None
    client: Name = ""

    for_workers = True


class Spawn(Request[WorkerReply], tag="spawn"):
    argv: Argv = []
    agent: Name | None = None
    name: Name = ""
    run: Id | None = None
    parent: Id | None = None
    input: Input | None = None
    cwd: PathText | None = None
    env: Env = {}
    timeout: Timeout | None = None
    grace: Grace | None = None
    #: Chosen by the client, new for each spawn: a repeat with the same key (the answer
    #: was lost) answers the worker the first made, so it may be sent again.
    key: RequestKey | None = None
    #: Keep the worker's stdin a pipe the daemon holds open, for `Send` (with no
    #: ``input``): carried across a reload like its other pipes.
    stdin_open: bool = False
    #: What the worker and all it delegates may take together (over its agent's limits,
    #: kind by kind); None: its agent's, if any.
    limits: Limits | None = None
    #: Over a cap, where it waits in the queue: a higher priority first, then first in.
    priority: Priority = 0
    #: Attempts more a failed worker gets (same id, from its snapshot), after `backoff`
    #: seconds, doubling each time up to `backoff_max`; its parent is woken once, by the last.
    retries: Retries = 0
    backoff: Backoff = 1.0
    backoff_max: Backoff | None = None
    #: Retried too when it ends so: `timeout` (a timed-out worker).
    retry_on: RetryOn = []
    #: Marks the worker `ready` once a line of its output matches (RE2, as `wait_for`'s).
    ready: Pattern | None = None
    #: Start it (queued until then) once these workers have all ended; once these all
    #: finished with exit 0 (else it ends `stopped`, reason `skipped`, naming which did
    #: not); once these are all ready. Existing workers only, each within the caller's reach.
    after: AfterIds = []
    after_ok: AfterIds = []
    after_ready: AfterIds = []

    for_workers = True
    again_after_reloading = True

    def resendable(self) -> bool:
        return self.key is not None


class NewRun(Request[RunReply], tag="new_run"):
    outer: Id | None = None
    #: What the run's workers may take together; None: no limit of the run's own.
    limits: Limits | None = None
    #: How many of the run's own workers may run at once (more wait, queued); None: no cap.
    max_running: MaxRunning | None = None


class ListWorkers(Request[WorkerList], tag="list_workers"):
    """One page of workers; ``after``: the ``next`` of the page before (None: the first)."""

    all: bool = False
    run: Id | None = None
    after: Name | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] = 1000
    #: Each live worker of the page carries its `Usage` (read for the page: a few reads
    #: of the kernel's files a worker).
    usage: bool = False

    for_workers = True
    at_once = True

    def resendable(self) -> bool:
        return True


class Status(Request[WorkerReply], tag="status"):
    worker: Id

    for_workers = True
    at_once = True

    def resendable(self) -> bool:
        return True


class Stop(Request[Stopped], tag="stop"):
    worker: Id
    wait: bool = True

    for_workers = True


class StopRun(Request[Stopped], tag="stop_run"):
    run: Id
    wait: bool = True


class Pause(Request[Paused], tag="pause"):
    """Hold a worker's subtree (``worker``: it and every live worker it delegated, at any
    depth) or a run's live workers (``run``: the run's, and of the runs nested in it)
    still until an `Unpause`: exactly one of the two. Their processes keep their pids,
    pipes and memory; their timeouts stop running. A worker spawned later into a paused
    subtree is not paused."""

    worker: Id | None = None
    run: Id | None = None

    for_workers = True


class Unpause(Request[Unpaused], tag="unpause"):
    """Let what a `Pause` held go on: ``worker``'s subtree, or ``run``'s live workers."""

    worker: Id | None = None
    run: Id | None = None

    for_workers = True


class Watch(Request[Page], tag="watch"):
    worker: Id
    since: Count = 0
    follow: bool = False
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] = 1000
    #: At most this many bytes a page (see `Page`); an entry alone over it comes in pieces.
    max_bytes: AnswerBytes = DEFAULT_ANSWER_BYTES
    #: Bytes of entry ``since + 1`` already read: a page's ``next_offset``; less than
    #: that entry's length.
    offset: Count = 0

    for_workers = True

    def resendable(self) -> bool:
        return True

    def streams(self) -> bool:
        return self.follow


class Collect(Request[ResultReply], tag="collect"):
    worker: Id
    wait: bool = False

    for_workers = True
    again_after_reloading = True

    def resendable(self) -> bool:
        # A collect releases the handle, though a repeat answers the same: only one that
        # waits, which a reload must not cut short, is sent again.
        return self.wait


class Wait(Request[WorkerReply], tag="wait"):
    worker: Id
    #: Answer once the worker is ready (its spawn's `ready` matched) or has ended.
    ready: bool = False

    for_workers = True

    def resendable(self) -> bool:
        return True


class Grep(Request[GrepReply], tag="grep"):
    """The lines of a worker's output matching ``pattern`` (RE2 syntax: no backreferences
    or lookaround, linear time), searched in the daemon, with ``before`` and ``after``
    lines of context; at most ``limit`` matches and ``max_bytes`` of answer, and a bounded
    scan (see `GrepResult`). ``since``: only matches on lines after it (a result's
    ``next``, to go on); the lines up to it still count, and are context.
    ``written_since`` (seconds since the epoch) and ``stream``: only matches on lines
    written at or after that time, or of that stream; the others still count, and are
    context, so ``limit`` counts only the matches these let through."""

    worker: Id
    pattern: Pattern
    before: ContextLines = 0
    after: ContextLines = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_GREP_MATCHES)] = 100
    since: Count = 0
    max_bytes: AnswerBytes = DEFAULT_ANSWER_BYTES
    written_since: Epoch | None = None
    stream: OutputKind | None = None

    for_workers = True

    def resendable(self) -> bool:
        return True


class WaitFor(Request[WaitForReply], tag="wait_for"):
    """Answered once a line of the worker's output matches ``pattern`` (its output so far
    first, then what comes), once it ends, or after ``timeout`` seconds, whichever is
    first. Sent again across a reload, it carries the time left (the clients keep one
    deadline, fixed when they first sent it), never the time first asked."""

    worker: Id
    pattern: Pattern
    timeout: Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT)]

    for_workers = True

    def resendable(self) -> bool:
        return True


class Send(Request[Sent], tag="send"):
    """Write ``data`` to the stdin of a worker spawned ``stdin_open``, without waiting for
    room: answered with what its pipe took, or `busy` if it took nothing. ``eof``: close
    its stdin once all of ``data`` is written."""

    worker: Id
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_SEND_BYTES)] = b""
    eof: bool = False

    for_workers = True


class Info(Request[InfoReply], tag="info"):
    #: The answer carries the live workers' usage together (`DaemonInfo.usage`).
    usage: bool = False

    for_workers = True
    at_once = True

    def resendable(self) -> bool:
        return True


class BeginTurn(Request[TurnReply], tag="begin_turn"):
    """Advance the turn generation that new registrations are stamped with."""


class Cancel(Request[Cancelled], tag="cancel"):
    """Stop every worker in ``scope``: ``all``, ``turn:G``, ``run:R`` or ``worker:W``."""

    scope: Name

    for_workers = True


class SetFence(Request[FenceReply], tag="set_fence"):
    """Set a launch fence (replacing any other); answered with its epoch."""


class CancelFence(Request[Cancelled], tag="cancel_fence"):
    """Stop what registered under fence ``epoch``, and every later spawn until it is replaced."""

    epoch: Count


class ClearFence(Request[Done], tag="clear_fence"):
    pass


class WaitRunStopped(Request[Done], tag="wait_run_stopped"):
    """Answered (with done) once ``run`` is stopped, however that happened."""

    run: Id

    def resendable(self) -> bool:
        return True


class Resume(Request[WorkerReply], tag="resume"):
    """Carry an ended (not finished) worker on from its snapshot: same id, next attempt.

    Only ``timeout`` may be given again. Every other field a spawn takes is declared here
    only to be refused by name with `frozen` when given (the snapshot holds what the
    worker was given, its record where it belongs): left undeclared, it would be an
    unknown key, which a decoder ignores, and the resume would go ahead without it.
    """

    worker: Id
    timeout: Timeout | None = None
    input: Input | None = None
    argv: Argv | None = None
    model: Name | None = None
    env: Env | None = None
    cwd: PathText | None = None
    grace: Grace | None = None
    agent: Name | None = None
    name: Name | None = None
    run: Id | None = None
    parent: Id | None = None
    stdin_open: bool | None = None
    priority: Priority | None = None
    #: As `Spawn.key`: a repeat answers the attempt the first one started.
    key: RequestKey | None = None

    for_workers = True
    again_after_reloading = True

    #: The fields refused when given: all but `worker`, `timeout` and `key`.
    FROZEN: ClassVar[tuple[str, ...]] = (
        "input", "argv", "model", "env", "cwd", "grace", "agent", "name", "run", "parent",
        "stdin_open", "priority",
    )  # fmt: skip

    def resendable(self) -> bool:
        return self.key is not None

    def given_again(self) -> list[str]:
        """The fields given that only a spawn takes, in declaration order."""
        return [field for field in self.FROZEN if getattr(self, field) is not None]


class ResumeRun(Request[WorkerList], tag="resume_run"):
    """A new live attempt of a run: its highest unfinished workers carry on."""

    run: Id

    again_after_reloading = True


class ReopenRun(Request[Done], tag="reopen_run"):
    """Start a stopped run again: it and the runs nested in it take spawns once more.

    The one way a stop is undone: a resume (`resume`, `resume_run`) carries workers on
    and leaves their stopped run refusing every spawn but the resumed workers' own.
    """

    run: Id


class LatestResumable(Request[Latest], tag="latest_resumable"):
    """The newest run started in ``cwd`` that a resume would take, or the newest and why not."""

    cwd: PathText

    def resendable(self) -> bool:
        return True


class Reload(Request[ReloadReply], tag="reload"):
    """Re-exec the daemon's image in place, keeping every worker. Answered by the new image."""

    def resendable(self) -> bool:
        # Lost with its connection, it was not read (another reload paused the daemon
        # first: a requester's connection is kept): asked again, it reloads the image on
        # disk then, which is what was asked.
        return True


class Subscribe(Request[Wakes], tag="subscribe"):
    """The wakes for one parent: ``run`` (its top-level workers) or ``worker`` (its children).

    Answered with `Wakes` pages: first every wake not yet acknowledged; with
    ``follow``, then each new one as it is posted, until aborted.
    """

    run: Id | None = None
    worker: Id | None = None
    follow: bool = False

    for_workers = True

    def resendable(self) -> bool:
        return True

    def streams(self) -> bool:
        return True


class Ack(Request[Done], tag="ack"):
    """Acknowledge wakes by seq; each must have been delivered on this connection."""

    wakes: Annotated[list[Count], msgspec.Meta(max_length=MAX_ACK_WAKES)]

    for_workers = True


class Abort(Request[Done], tag="abort"):
    """End the stream opened by request ``request`` on this connection."""

    request: RequestId

    for_workers = True


ClientMessage = (
    Hello
    | Spawn
    | NewRun
    | ListWorkers
    | Status
    | Stop
    | StopRun
    | Pause
    | Unpause
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
    | ReopenRun
    | LatestResumable
    | Grep
    | WaitFor
    | Send
    | Abort
)


# -- encoding ------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
client_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
daemon_decoder: msgspec.msgpack.Decoder[DaemonMessage] = msgspec.msgpack.Decoder(DaemonMessage)


def encode(message: Request[Reply] | Reply) -> bytes:
    """The whole frame (length prefix and body) for one message; a request holding an
    integer msgpack cannot carry raises Invalid naming the field (`check_integers`)."""
    try:
        return frame(_encoder.encode(message))
    except OverflowError:
        check_integers(message)
        raise


def op(message: Request[Reply] | Reply | type[Request[Reply]] | type[Reply]) -> str:
    """A message's name on the wire ("new_run"), given the message or its class, for what a
    person reads: a text the daemon sends names the op, never the Python class."""
    kind = message if isinstance(message, type) else type(message)
    return str(kind.__struct_config__.tag)
