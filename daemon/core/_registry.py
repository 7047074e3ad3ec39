"""The registry: every worker and run the daemon knows, and the decisions about them.

A sans-I/O core: plain synchronous objects that take events (a spawn asked, a
process started, a process ended, a stop asked) and return decisions (which
ids to stop, which state a worker ended in). No trio and no clock in here:
callers pass ``now``. Its records are msgspec Structs, so a checkpoint can
write the whole registry as it is.
"""

from __future__ import annotations

import bisect
import heapq
import math
import secrets
import weakref
from collections.abc import Callable, Iterable, Iterator

import msgspec

from subagentd.protocol import (
    MAX_BACKOFF,
    MAX_GRACE,
    TERMINAL_STATES,
    Limits,
    ListWorkers,
    Spawn,
    WorkerState,
    WorkerView,
    op,
)
from subagentd.protocol.errors import Invalid, NotFound, Refused, RunStopped

from ._schedule import Queued, Schedule

#: Seconds between TERM and KILL when a spawn names none.
DEFAULT_GRACE = 5.0
#: Seconds a finished worker's handle is kept uncollected (`--finished-ttl`).
DEFAULT_FINISHED_TTL = 900.0
#: Days an ended worker's archive is kept on disk (`--keep-archives`).
DEFAULT_KEEP_ARCHIVES_DAYS = 14.0
#: A tombstone keeps this much of the end of its worker's stdout.
TOMBSTONE_OUTPUT = 32 * 1024
#: A listing shows this many of a worker's arguments, each cut to this many characters.
LISTED_ARGS = 16
LISTED_ARG_CHARS = 256
#: A page of a listing holds at most this many workers, and about this many bytes.
LIST_PAGE_WORKERS = 1000
LIST_PAGE_BYTES = 4 * 1024 * 1024


def new_id(prefix: str) -> str:
    """A short, url-safe, unguessable id: 'w-' or 'r-' and 10 base32 characters."""
    return f"{prefix}-{secrets.token_bytes(8).hex()[:10]}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


class WorkerRecord(msgspec.Struct, kw_only=True, weakref=True):
    id: str
    run: str
    parent: str | None
    name: str
    state: WorkerState
    argv: list[str]
    cwd: str
    agent: str | None
    grace: float
    timeout: float | None
    token: str
    archive: str
    attempt: int = 1
    turn: int = 0
    pid: int | None = None
    #: The process's start time (clock ticks after boot): tells it from a recycled pid.
    pid_start: int | None = None
    #: The inodes of its stdin, stdout and stderr pipes as it was started (0: none of the
    #: daemon's): which inherited pipes are its when a reload's checkpoint is unreadable
    #: (its fds may since hold another worker's: `lifecycle/_rebuilt.py`).
    pipes: tuple[int, int, int] | None = None
    exit_code: int | None = None
    started_at: float
    ended_at: float | None = None
    #: Why a stop was asked ("user", "run", "timeout", "shutdown"); None while nobody asked.
    stop_reason: str | None = None
    collected: bool = False
    #: The epoch of the launch fence in force when it registered, if any.
    fence: int | None = None
    #: Left uncollected past the retention TTL (released once nothing needs it).
    expired: bool = False
    #: When its first attempt started: its place in a listing, which a resume keeps
    #: (0: a record from before this was kept, placed by its start).
    spawned_at: float = 0.0
    #: Paused since then (the daemon's wall clock); None while not paused.
    paused_since: float | None = None
    #: The seconds it spent paused before: what its timeout's deadline moved by.
    paused_for: float = 0.0
    #: Its own limits (its snapshot's: a resume keeps them); None: none of its own.
    limits: Limits | None = None
    #: Where its limit nodes are below each hierarchy's base (`LimitPlan.relative`):
    #: empty when nothing on its way had a limit, so it was placed in none.
    limit_path: str = ""
    #: Why it ended as it did beyond its state ("memory_limit"); empty otherwise.
    reason: str = ""
    #: Waiting in the queue for a slot under the caps (`core/_schedule.py`): its seq
    #: there, which keeps its order across restarts; None once started (or never queued).
    queued: int | None = None
    #: Its place among the queued: higher first (`Spawn.priority`).
    priority: int = 0
    #: Attempts more it may be given after failing, the first backoff and its most, and
    #: the endings beyond `failed` retried too (`Spawn.retries`...).
    retries: int = 0
    backoff: float = 1.0
    backoff_max: float | None = None
    retry_on: list[str] = msgspec.field(default_factory=list)
    #: While it waits out a retry's backoff (queued): when its next attempt may start.
    retry_at: float | None = None
    #: Its spawn's ready pattern; when this attempt's output matched it (None: not yet);
    #: the journal seq this attempt's output comes after (what is searched for it).
    ready_pattern: str | None = None
    ready_at: float | None = None
    ready_since: int = 0
    #: The workers it starts after: once ended, once finished (exit 0), once ready
    #: (`Spawn.after`...); it waits queued, held back, until they are (`blocked`).
    after: list[str] = msgspec.field(default_factory=list)
    after_ok: list[str] = msgspec.field(default_factory=list)
    after_ready: list[str] = msgspec.field(default_factory=list)

    @property
    def waits_for_others(self) -> bool:
        return bool(self.after or self.after_ok or self.after_ready)

    def __setattr__(self, name: str, value: object) -> None:
        # Every change of state (or of whether a result is owed), wherever it is made,
        # moves the counts of the registry holding the record (`StateCounts`): `info`
        # reads counts, never walks the workers.
        counts = _counts_of(self) if name in _COUNTED_FIELDS else None
        if counts is None:
            msgspec.Struct.__setattr__(self, name, value)
            return
        before, owed = self.state, self.owes_result
        msgspec.Struct.__setattr__(self, name, value)
        counts.moved(before, self.state, self.owes_result - owed)

    def __post_init__(self) -> None:
        # A grace carried from before numbers were checked at the door (nan, inf) would
        # make the ending of its worker raise: such a record ends with the default.
        if not 0 <= self.grace <= MAX_GRACE:
            self.grace = DEFAULT_GRACE
        if not 0 < self.spawned_at < math.inf:
            self.spawned_at = self.started_at

    @property
    def place(self) -> tuple[float, str]:
        """Where it comes in a listing: by first start, then id."""
        return self.spawned_at, self.id

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def paused(self) -> bool:
        return self.paused_since is not None and not self.ended

    def pause(self, now: float) -> None:
        if self.paused_since is None:
            self.paused_since = now

    def unpause(self, now: float) -> None:
        """Paused no longer: the time it was paused moves its timeout's deadline."""
        if self.paused_since is not None:
            self.paused_for += max(0.0, now - self.paused_since)
            self.paused_since = None

    def next_attempt(self) -> None:
        """Its next attempt (a resume's, a retry's): `starting`, nothing of the last
        attempt's process, end or pause left."""
        self.attempt += 1
        self.state = "starting"
        self.stop_reason = None
        self.exit_code = None
        self.reason = ""
        self.pid = self.pid_start = self.pipes = None
        self.ended_at = None
        self.paused_since, self.paused_for = None, 0.0
        self.ready_at = None

    def timeout_left(self, now: float) -> float | None:
        """Seconds until its timeout, not counting the time it spent paused; None if it
        has none (or is paused: its timeout does not run)."""
        if self.timeout is None or self.paused_since is not None:
            return None
        return self.started_at + self.timeout + self.paused_for - now

    @property
    def owes_result(self) -> bool:
        """Ended on its own, and neither collected nor past its TTL: a shutdown now would
        lose the result its parent (or the user) is owed."""
        return self.ended_on_its_own and not self.collected and not self.expired

    @property
    def ended_on_its_own(self) -> bool:
        """Finished or failed with nobody asking it to stop: it owes its parent a result.
        Stopped, cancelled, timed out, stopped by a reload or interrupted, it owes none."""
        return self.state in ("finished", "failed") and self.stop_reason is None

    def view(self) -> WorkerView:
        return WorkerView(
            id=self.id,
            run=self.run,
            parent=self.parent,
            name=self.name,
            state=self.state,
            pid=self.pid,
            exit_code=self.exit_code,
            attempt=self.attempt,
            turn=self.turn,
            started_at=self.started_at,
            ended_at=self.ended_at,
            archive=self.archive,
            argv=self.argv,
            cwd=self.cwd,
            agent=self.agent,
            stopping=self.stop_reason is not None and not self.ended,
            paused=self.paused,
            limits=self.limits,
            reason=self.reason,
            queued=self.queued is not None and not self.ended,
            queue_position=self.queue_position,
            retries=self.retries,
            retry_at=None if self.ended else self.retry_at,
            ready=self.ready_at is not None,
            ready_at=self.ready_at,
        )

    @property
    def queue_position(self) -> int | None:
        """Its place in its registry's queue, from 1; None when not queued."""
        if self.queued is None or self.ended:
            return None
        counts = _counts_of(self)
        return (
            None if counts is None or counts.schedule is None else counts.schedule.position(self.id)
        )

    def summary(self) -> WorkerView:
        """Its view in a listing: a bounded summary of its argv (`status` has the whole)."""
        view = self.view()
        shown = [arg[:LISTED_ARG_CHARS] for arg in self.argv[:LISTED_ARGS]]
        if shown != self.argv:
            view.argv, view.argv_cut = shown, True
        return view


class StateCounts:
    """How many held workers are in each state, kept as they change (see
    `WorkerRecord.__setattr__`), so `info` costs the same at 10 workers as at 10,000."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        #: Held workers owing a result (`WorkerRecord.owes_result`).
        self.owed = 0
        #: The schedule of the registry holding these records: their queue positions.
        self.schedule: Schedule | None = None

    def add(self, record: WorkerRecord) -> None:
        key = id(record)

        def gone(ref: weakref.ref[WorkerRecord]) -> None:
            # Dropped without `remove` (its registry gone): its id may be another's next.
            if _COUNTED.get(key, (None,))[0] is ref:
                del _COUNTED[key]

        _COUNTED[key] = (weakref.ref(record, gone), self)
        self._counts[record.state] = self._counts.get(record.state, 0) + 1
        self.owed += record.owes_result

    def remove(self, record: WorkerRecord) -> None:
        if _counts_of(record) is self:
            del _COUNTED[id(record)]
            self._take(record.state)
            self.owed -= record.owes_result

    def moved(self, before: WorkerState, after: WorkerState, owed: int) -> None:
        """A held record's state went from `before` to `after`, and `owed` more results
        are owed (-1, 0 or 1)."""
        if before != after:
            self._take(before)
            self._counts[after] = self._counts.get(after, 0) + 1
        self.owed += owed

    def live(self) -> bool:
        """Whether any held worker is live (not in a terminal state)."""
        return any(state not in TERMINAL_STATES for state in self._counts)

    def _take(self, state: str) -> None:
        left = self._counts[state] - 1
        if left:
            self._counts[state] = left
        else:
            del self._counts[state]

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)


#: The counts each held record is counted in, by the record's id(): a record is held
#: by one registry at a time (a registry adds it when it takes it, removes it when it
#: lets it go). A registry dropped whole (a test's in-process daemon) removes none: the
#: weak reference tells the record itself from a later one given the same id once it
#: is freed, and its entry goes with it.
_COUNTED: dict[int, tuple[weakref.ref[WorkerRecord], StateCounts]] = {}


def _counts_of(record: WorkerRecord) -> StateCounts | None:
    entry = _COUNTED.get(id(record))
    return entry[1] if entry is not None and entry[0]() is record else None


#: The fields a record's counts depend on (see `WorkerRecord.__setattr__`).
_COUNTED_FIELDS = frozenset({"state", "stop_reason", "collected", "expired"})


def listing_page(
    records: Iterable[WorkerRecord], after: str | None, limit: int
) -> tuple[list[WorkerView], str | None, bool]:
    """The page of a sorted listing after cursor `after`: (views, next cursor, complete).

    `records` are in listing order, from the first after `after` (see
    `Registry.listed_after`): the page takes what it needs of them, so a first page
    costs its own workers, not every worker's. A page holds at most `limit` workers
    (and LIST_PAGE_WORKERS) and stops once it passes LIST_PAGE_BYTES, so it always
    fits in a frame. The cursor names a place in the order (spawned_at, id), not a
    worker: a worker released between pages moves nothing, and one resumed keeps its
    place.
    """
    if limit < 1:
        raise Invalid(f"{op(ListWorkers)} needs limit >= 1, not {limit}")
    views: list[WorkerView] = []
    size = 0
    most = min(limit, LIST_PAGE_WORKERS)
    last: WorkerRecord | None = None
    for record in records:
        if len(views) >= most or (views and size >= LIST_PAGE_BYTES):
            assert last is not None
            return views, f"{last.spawned_at.hex()}/{last.id}", False
        view = record.summary()
        size += len(_encoder.encode(view))
        views.append(view)
        last = record
    return views, None, True


def cursor_place(cursor: str | None) -> tuple[float, str] | None:
    """The place in the listing order a page's `next` names (None: from the start)."""
    return None if cursor is None else _cursor_key(cursor)


def _cursor_key(cursor: str) -> tuple[float, str]:
    started, _, worker_id = cursor.partition("/")
    try:
        place = float.fromhex(started), worker_id
        if not math.isfinite(place[0]):  # no start time is: a nan would match nowhere
            raise ValueError(started)
        return place
    except (ValueError, OverflowError):
        raise Invalid(
            f"{op(ListWorkers)} after={cursor!r} is not a cursor this daemon gave: "
            "pass back a page's `next`"
        ) from None


_encoder = msgspec.msgpack.Encoder()


class Tombstone(WorkerView, kw_only=True):
    """What is kept of an expired, uncollected worker that a live parent may still
    collect: its last view, and the end of its stdout. Once collected it keeps what
    the collect answered, so every repeat answers the same for as long as it lasts
    (until its parent's handle goes, or the worker is resumed)."""

    output: bytes = b""
    #: The result the first collect answered (None: not collected yet).
    answered: str | None = None

    @classmethod
    def of(cls, record: WorkerRecord, stdout: bytes) -> Tombstone:
        return cls(**msgspec.structs.asdict(record.view()), output=stdout[-TOMBSTONE_OUTPUT:])

    def view(self) -> WorkerView:
        fields = msgspec.structs.asdict(self)
        del fields["output"], fields["answered"]
        return WorkerView(**fields)


class LaunchFence(msgspec.Struct, kw_only=True):
    """Set by a client; cancelling it by epoch stops what registered under it and
    stops at birth what registers later, until another fence replaces it."""

    epoch: int
    cancelled: bool = False


CANCEL_SCOPES = "`all`, `turn:G`, `run:R` or `worker:W`"


class RunRecord(msgspec.Struct, kw_only=True):
    id: str
    outer: str | None
    created_at: float
    stopped: bool = False
    #: Made for one spawn that named no run: nobody else holds its id, so it
    #: may go once its workers have. A run asked for by name, or nested in, stays.
    implicit: bool = False
    #: What its workers may take together (`new_run`'s); None: no limit of its own.
    limits: Limits | None = None
    #: How many of its own workers may run at once (`new_run`'s); None: no cap.
    max_running: int | None = None


class Registry:
    """Workers and runs by id, and the rules that govern them."""

    def __init__(self, make_id: Callable[[str], str] = new_id) -> None:
        self._workers: dict[str, WorkerRecord] = {}
        #: Every held worker's place in a listing, (spawned_at, id), kept sorted: a page
        #: is read from its cursor on, never sorted from every worker.
        self._places: list[tuple[float, str]] = []
        self._counts = StateCounts()
        self._runs: dict[str, RunRecord] = {}
        #: What may run now under the caps, and the queue (a run's cap read from its record).
        self.schedule = Schedule(run_cap=self._run_cap)
        self._counts.schedule = self.schedule
        self._make_id = make_id
        self._children: dict[str, list[str]] = {}  # worker id -> ids it delegated to
        self._run_members: dict[str, list[str]] = {}  # run id -> worker ids
        self._inner_runs: dict[str, list[str]] = {}  # run id -> runs nested in it
        self._by_token: dict[str, str] = {}  # worker token -> worker id
        #: Workers a resume is under way for (between `begin_resume` and `reopen`), each
        #: with the reason of the first stop that reached it meanwhile (None: none did).
        self._resuming: dict[str, str | None] = {}
        self._tombstones: dict[str, Tombstone] = {}
        #: (ended_at, id) of ended handles, soonest to expire first. Stale
        #: entries (collected, released, resumed) are dropped when they surface.
        self._endings: list[tuple[float, str]] = []
        self.turn = 0
        self.fence: LaunchFence | None = None
        self.fence_epochs = 0  # the last epoch handed out
        #: Loops cut when records were restored (a worker may rewrite its own record).
        self.damage: list[str] = []

    # -- runs ----------------------------------------------------------------

    def new_run(
        self,
        now: float,
        outer: str | None = None,
        limits: Limits | None = None,
        max_running: int | None = None,
    ) -> RunRecord:
        if outer is not None:
            outer_run = self.run(outer)
            if outer_run.stopped:
                raise RunStopped(f"run {outer} was stopped; a run cannot be nested in it")
            # Whoever nests a run in it holds its id now: it stays when its workers go.
            outer_run.implicit = False
        run = RunRecord(
            id=self._fresh_id("r"),
            outer=outer,
            created_at=now,
            limits=limits,
            max_running=max_running,
        )
        self._runs[run.id] = run
        self._run_members[run.id] = []
        self._inner_runs[run.id] = []
        if outer is not None:
            self._inner_runs[outer].append(run.id)
        return run

    def _run_cap(self, run_id: str) -> int | None:
        run = self._runs.get(run_id)
        return None if run is None else run.max_running

    def run(self, run_id: str) -> RunRecord:
        try:
            return self._runs[run_id]
        except KeyError:
            raise NotFound(f"no run {run_id!r}") from None

    def runs_within(self, run_id: str) -> Iterator[str]:
        """`run_id` and every run nested in it, at any depth (each once, loops or not)."""
        return _reachable(run_id, self._inner_runs)

    def has_run(self, run_id: str) -> bool:
        return run_id in self._runs

    def limit_chain(
        self, record: WorkerRecord
    ) -> tuple[tuple[str, ...], tuple[Limits | None, ...]]:
        """Where a worker's limit nodes go, and the limits of each (`LimitPlan`): below its
        parent's nodes where its parent was placed in some, else its run's node, below the
        nodes of the runs it is nested in (a run covers its nested runs, as its stop stops
        them), outermost first; then its delegation chain root first, itself last."""
        parent = self._workers.get(record.parent) if record.parent is not None else None
        if parent is not None and parent.limit_path:
            path: tuple[str, ...] = (*parent.limit_path.split("/"), record.id)
        else:
            chain = [record.id]
            seen = {record.id}
            current = parent
            while current is not None and current.id not in seen:
                seen.add(current.id)
                chain.append(current.id)
                current = self._workers.get(current.parent) if current.parent else None
            path = (*self._runs_around(record.run), *reversed(chain))
        # An empty Limits for a run or worker known to have none of its own, None for one
        # whose record is gone (its limits unknown: `Controllers.nodes` places a worker
        # below it in every hierarchy, as its nodes may be in any).
        values: list[Limits | None] = []
        for name in path:
            if (run := self._runs.get(name)) is not None:
                values.append(run.limits or Limits())
            else:
                found = record if name == record.id else self._workers.get(name)
                values.append((found.limits or Limits()) if found is not None else None)
        return path, tuple(values)

    def _runs_around(self, run_id: str) -> list[str]:
        """`run_id` and the runs it is nested in, outermost first (each once)."""
        chain: list[str] = []
        current: str | None = run_id
        while current is not None and current not in chain:
            chain.append(current)
            run = self._runs.get(current)
            current = run.outer if run is not None else None
        return chain[::-1]

    # -- workers -------------------------------------------------------------

    def handle(self, worker_id: str) -> WorkerRecord | None:
        """The worker's record while its handle is held (live, or ended and not released)."""
        return self._workers.get(worker_id)

    def holds(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def handles(self) -> list[WorkerRecord]:
        """Every held handle, in the order they were registered."""
        return list(self._workers.values())

    def tombstone(self, worker_id: str) -> Tombstone | None:
        return self._tombstones.get(worker_id)

    def tombstones(self) -> dict[str, Tombstone]:
        """The tombstones by worker id (a copy: what changes is told by comparing two)."""
        return dict(self._tombstones)

    def drop_tombstone(self, worker_id: str) -> bool:
        """Forget a tombstone (collected, or its worker resumed); whether there was one."""
        return self._tombstones.pop(worker_id, None) is not None

    def worker(self, worker_id: str) -> WorkerRecord:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFound(f"no worker {worker_id!r}") from None

    def register(
        self,
        *,
        now: float,
        argv: list[str],
        cwd: str,
        archive_for: Callable[[str], str],
        run: str | None = None,
        parent: str | None = None,
        name: str = "",
        agent: str | None = None,
        grace: float | None = None,
        timeout: float | None = None,
        limits: Limits | None = None,
        priority: int = 0,
        retries: int = 0,
        backoff: float = 1.0,
        backoff_max: float | None = None,
        retry_on: list[str] | None = None,
        ready: str | None = None,
        after: tuple[list[str], list[str], list[str]] = ([], [], []),
    ) -> WorkerRecord:
        """A new worker in state `starting` (`admit` then says whether it starts or waits).
        Refuses with `run_stopped` into a stopped run.

        A stopped run refuses every spawn but the delegation of a worker of it that is
        live and not being stopped: its stop asked every worker it had to stop, so such a
        worker is one the user resumed since (or one that worker delegated), and what it
        delegates is that resumed work's, not a new start of the run (`reopen_run` is).
        Under a cancelled launch fence the worker is born already asked to stop
        (``stop_reason == "fence"``): the shell never starts its process.
        """
        if not argv:
            raise Invalid(f"{op(Spawn)} needs a command (argv) or an agent")
        if grace is not None and grace < 0:
            raise Invalid(f"grace must be zero or more seconds, not {grace}")
        if timeout is not None and timeout < 0:
            raise Invalid(f"timeout must be zero or more seconds, not {timeout}")
        if backoff_max is not None and backoff_max < backoff:
            raise Invalid(
                f"backoff_max ({backoff_max:g} s) is less than backoff ({backoff:g} s): the "
                "backoff doubles from backoff up to backoff_max"
            )
        if parent is not None:
            parent_record = self.worker(parent)
            if run is not None and run != parent_record.run:
                raise Invalid(
                    f"worker {parent} belongs to run {parent_record.run}, not {run}: "
                    "a delegated worker joins its parent's run"
                )
            run = parent_record.run
            if parent_record.ended or parent_record.stop_reason is not None:
                raise RunStopped(
                    f"worker {parent} has ended ({parent_record.state}); it cannot delegate"
                )
        if run is None:
            run_record = self.new_run(now)
            run_record.implicit = True
        else:
            run_record = self.run(run)
        if parent is None and self.run_stopped(run_record.id):
            raise RunStopped(
                f"run {run_record.id} was stopped; it starts no new workers "
                "(a resume carries its workers on, not the run: reopen_run starts it again)"
            )
        worker_id = self._fresh_id("w")
        record = WorkerRecord(
            id=worker_id,
            run=run_record.id,
            parent=parent,
            name=name,
            state="starting",
            argv=list(argv),
            cwd=cwd,
            agent=agent,
            grace=DEFAULT_GRACE if grace is None else grace,
            timeout=timeout or None,
            token=new_token(),
            archive=archive_for(worker_id),
            started_at=now,
            turn=self.turn,
            limits=limits or None,
            priority=priority,
            retries=retries,
            backoff=backoff,
            backoff_max=backoff_max,
            retry_on=list(retry_on or ()),
            ready_pattern=ready,
            after=list(after[0]),
            after_ok=list(after[1]),
            after_ready=list(after[2]),
        )
        if self.fence is not None:
            record.fence = self.fence.epoch
            if self.fence.cancelled:
                record.stop_reason = "fence"
        self._hold(record)
        self._by_token[record.token] = worker_id
        self._children[worker_id] = []
        self._run_members[run_record.id].append(worker_id)
        if parent is not None:
            self._children[parent].append(worker_id)
        return record

    # -- the queue -----------------------------------------------------------

    def admit(self, record: WorkerRecord) -> bool:
        """Whether a worker just registered may start now under the caps; else it waits in
        the queue, its seq there kept in its record (`queued`). One that starts after
        others waits held back until `unblock`."""
        record.queued = self.schedule.admit(
            record.id, record.run, record.agent, record.priority, record.waits_for_others
        )
        return record.queued is None

    def blocked(self) -> list[WorkerRecord]:
        """The queued workers held back until others have ended or are ready."""
        return [self._workers[w] for w in self.schedule.blocked()]

    def unblock(self, worker_id: str) -> None:
        """What it waited for has come: it takes its place in the queue."""
        self.schedule.unblock(worker_id)

    def retry(self, record: WorkerRecord, now: float) -> float | None:
        """A worker just ended (`ended`): if it ended `failed` (or `timed_out`, asked so)
        on its own with attempts left, it is given its next attempt instead: the same id,
        back in the queue until its backoff has passed (`retry_at`), not ended; answers
        that backoff. None: its ending stands."""
        retried = record.state == "failed" and record.stop_reason is None
        retried |= record.state == "timed_out" and "timeout" in record.retry_on
        if not retried or record.attempt > record.retries or self.run_stopped(record.run):
            return None
        most = MAX_BACKOFF if record.backoff_max is None else record.backoff_max
        delay = min(record.backoff * (1 << min(record.attempt - 1, 64)), most)
        record.next_attempt()
        record.retry_at = now + delay
        record.queued = self.schedule.retry(
            record.id, record.run, record.agent, record.priority, record.retry_at
        )
        return delay

    def dequeue(self, now: float, most: int | None = None) -> list[WorkerRecord]:
        """The queued workers that may start now (at most `most`), in order, each out of
        the queue and counted as running (its start time now); a stopped one is left to
        its ending."""
        starting: list[WorkerRecord] = []
        skipped = True
        while skipped:  # a stopped one's slot goes to the next in line
            skipped = False
            left = None if most is None else most - len(starting)
            for worker_id in self.schedule.to_start(left, now):
                record = self._workers.get(worker_id)
                if record is None or record.ended or record.stop_reason is not None:
                    self.schedule.ended(worker_id)
                    skipped = True
                    continue
                record.queued = record.retry_at = None
                record.started_at = now
                starting.append(record)
        return starting

    def queued_among(self, ids: Iterable[str]) -> list[WorkerRecord]:
        """Those of `ids` that wait in the queue (not started, not ended)."""
        found = (self._workers.get(worker_id) for worker_id in ids)
        return [r for r in found if r is not None and r.queued is not None and not r.ended]

    def _restore_schedule(self) -> None:
        """The schedule again from the records held: what runs, and the queue in order."""
        live = [r for r in self._workers.values() if not r.ended]
        self.schedule.restore(
            ((r.id, r.run, r.agent) for r in live if r.queued is None),
            (
                Queued(
                    r.id,
                    r.run,
                    r.agent,
                    r.priority,
                    r.queued,
                    r.retry_at or 0.0,
                    blocked=r.waits_for_others and r.attempt == 1,
                )
                for r in live
                if r.queued is not None
            ),
        )

    def worker_for_token(self, token: str) -> str | None:
        return self._by_token.get(token)

    def run_stopped(self, run_id: str) -> bool:
        """Whether `run_id` or any run it is nested in was stopped."""
        current: str | None = run_id
        seen: set[str] = set()
        while current is not None and current not in seen:
            seen.add(current)
            run = self._runs[current]
            if run.stopped:
                return True
            current = run.outer
        return False

    def started(
        self, worker_id: str, pid: int, pid_start: int, pipes: tuple[int, int, int] | None = None
    ) -> None:
        record = self._workers[worker_id]
        record.pid = pid
        record.pid_start = pid_start
        record.pipes = pipes
        if record.state == "starting":
            record.state = "running"

    def ended(self, worker_id: str, exit_code: int | None, now: float) -> WorkerRecord:
        """The worker's process is gone: decide its terminal state.

        ``exit_code`` is the returncode (negative: killed by that signal; None:
        never started). A worker someone asked to stop ends `stopped` (or
        `timed_out`) whatever its code; otherwise 0 is `finished`, the rest `failed`.
        """
        record = self._workers[worker_id]
        if record.ended:
            return record
        if record.stop_reason == "timeout":
            record.state = "timed_out"
        elif record.stop_reason == "reload":
            record.state = "stopped_by_reload"
        elif record.stop_reason == "relay":  # its output relay died: as a crash takes it
            record.state = "interrupted"
        elif record.stop_reason is not None:
            record.state = "stopped"
        elif exit_code == 0:
            record.state = "finished"
        else:
            record.state = "failed"
        record.exit_code = exit_code
        record.ended_at = now
        self.schedule.ended(worker_id)
        heapq.heappush(self._endings, (now, worker_id))
        if len(self._endings) > 2 * len(self._workers) + 1024:
            # Collected handles leave stale entries that surface only at their
            # expiry, never with a huge TTL: start again from the retained ones.
            self._endings = [
                (r.ended_at, r.id)
                for r in self._workers.values()
                if r.ended_at is not None and self._retained(r)
            ]
            heapq.heapify(self._endings)
        return record

    def subtree(self, worker_id: str) -> Iterator[str]:
        """`worker_id` and every worker it delegated to, at any depth (each once)."""
        return _reachable(worker_id, self._children)

    def stop(self, worker_id: str, reason: str = "user") -> list[str]:
        """Ask a worker and its subtree to stop; answers the ids newly asked, sorted.

        Ended workers and workers already stopping are left as they are, so a
        second stop changes nothing. Raises NotFound for an id never seen. A
        worker that timed out takes its subtree with it; only it is `timed_out`.
        """
        self.worker(worker_id)
        root, *delegated = self.subtree(worker_id)
        newly = self._mark_stopping([root], reason)
        newly += self._mark_stopping(delegated, "ancestor" if reason == "timeout" else reason)
        return sorted(newly)

    def interrupt(self, worker_id: str) -> list[str]:
        """Stop this worker alone (not its delegates), to end `interrupted`: what
        supervised it is gone (its output relay). The ids newly asked: it, or none."""
        return self._mark_stopping([worker_id], "relay")

    def begin_turn(self) -> int:
        self.turn += 1
        return self.turn

    def cancel(self, scope: str) -> list[str]:
        """Stop every worker in `scope` not yet ended or stopping; the ids, sorted."""
        return self._mark_stopping(self.in_scope(scope), "cancel")

    def in_scope(self, scope: str) -> list[str]:
        """The held workers a cancel of `scope` reaches.

        Scopes: ``all``, ``turn:G`` (registered in turn G), ``run:R`` (R and the
        runs nested in it), ``worker:W`` (W and its subtree).
        """
        kind, _, value = scope.partition(":")
        ids: list[str]
        if scope == "all":
            ids = list(self._workers)
        elif kind == "turn" and value.isdigit():
            ids = [w for w, r in self._workers.items() if r.turn == int(value)]
        elif kind == "run" and value:
            self.run(value)
            ids = [w for r in self.runs_within(value) for w in self._run_members[r]]
        elif kind == "worker" and value:
            self.worker(value)
            ids = list(self.subtree(value))
        else:
            raise Invalid(f"cannot cancel {scope!r}: a scope is {CANCEL_SCOPES}")
        return ids

    def set_fence(self) -> int:
        """Set a new launch fence, replacing any other; its epoch."""
        self.fence_epochs += 1
        self.fence = LaunchFence(epoch=self.fence_epochs)
        return self.fence_epochs

    def cancel_fence(self, epoch: int) -> list[str]:
        """Stop what registered under fence `epoch`; a stale epoch cancels nothing."""
        if self.fence is None or self.fence.epoch != epoch:
            return []
        self.fence.cancelled = True
        return self._mark_stopping(self.under_fence(epoch), "fence")

    def under_fence(self, epoch: int) -> list[str]:
        """The held workers a cancel of fence `epoch` reaches: none for a stale epoch."""
        if self.fence is None or self.fence.epoch != epoch:
            return []
        return [w for w, r in self._workers.items() if r.fence == epoch]

    def clear_fence(self) -> None:
        self.fence = None

    def stop_all(self, reason: str) -> list[str]:
        """Ask every worker not yet ended to stop (the daemon is shutting down)."""
        return self._mark_stopping(list(self._workers), reason)

    def stop_run(self, run_id: str) -> list[str]:
        """Stop a run and every run nested in it; they refuse spawns from now on."""
        self.run(run_id)
        ids: list[str] = []
        for current in self.runs_within(run_id):
            self._runs[current].stopped = True
            ids.extend(self._run_members[current])
        return self._mark_stopping(ids, "run")

    def _mark_stopping(self, ids: list[str], reason: str) -> list[str]:
        newly: list[str] = []
        for worker_id in ids:
            record = self._workers[worker_id]
            if record.ended and worker_id in self._resuming and not self._resuming[worker_id]:
                self._resuming[worker_id] = reason  # its resume is refused: see `reopen`
            if record.ended or record.stop_reason is not None:
                continue
            record.stop_reason = reason
            newly.append(worker_id)
        return sorted(newly)

    def stopping(self, worker_id: str) -> bool:
        record = self._workers[worker_id]
        return record.stop_reason is not None and not record.ended

    def stopping_among(self, ids: Iterable[str]) -> list[str]:
        """Those of `ids` whose stop is in flight (asked, not yet ended), sorted: what a
        stop or cancel reaching them leaves as it is, and says so."""
        return sorted(w for w in set(ids) if w in self._workers and self.stopping(w))

    def collect(self, worker_id: str) -> WorkerRecord:
        record = self.worker(worker_id)
        if record.ended:
            record.collected = True
        return record

    # -- carrying across a reload ----------------------------------------------

    def restore(
        self,
        *,
        runs: list[RunRecord],
        records: list[WorkerRecord],
        tombstones: list[Tombstone],
        turn: int,
        fence: LaunchFence | None,
        fence_epochs: int,
    ) -> None:
        """Rebuild the registry as a checkpoint or the archives describe it.

        Records read from archives are in workers' reach: a parent or an outer run
        that loops back is cut (and said in `damage`), so no walk ever goes round.
        """
        self.damage += _cut_loops(records, runs)
        # An implicit run no held worker is in was released with its last one: its row
        # (kept for its stop) is read again only when a resume takes a worker of it back.
        held_in = {record.run for record in records}
        runs = [run for run in runs if not run.implicit or run.id in held_in]
        for run in runs:
            self._runs[run.id] = run
            self._run_members.setdefault(run.id, [])
            self._inner_runs.setdefault(run.id, [])
        # Runs no file describes: named runs are written when made, so one that
        # holds workers was implicit; one that other runs nest in stays, whatever it was.
        for outer in {run.outer for run in runs if run.outer is not None}:
            self._describe_run(outer, implicit=False)
        for record in records:
            self._describe_run(record.run, implicit=True)
        for run in runs:
            if run.outer is not None:
                self._inner_runs[run.outer].append(run.id)
        for record in sorted(records, key=lambda r: (r.started_at, r.id)):
            self._hold(record)
            self._by_token[record.token] = record.id
            self._children.setdefault(record.id, [])
            self._run_members[record.run].append(record.id)
        for record in self._workers.values():
            if record.parent is not None and record.parent in self._children:
                self._children[record.parent].append(record.id)
            if record.ended_at is not None:
                heapq.heappush(self._endings, (record.ended_at, record.id))
        self._tombstones = {t.id: t for t in tombstones}
        self.turn, self.fence, self.fence_epochs = turn, fence, fence_epochs
        self._restore_schedule()

    def _describe_run(self, run_id: str, *, implicit: bool) -> None:
        if run_id not in self._runs:
            self._runs[run_id] = RunRecord(id=run_id, outer=None, created_at=0.0, implicit=implicit)
            self._run_members[run_id] = []
            self._inner_runs[run_id] = []

    # -- resuming ------------------------------------------------------------

    def begin_resume(self, record: WorkerRecord, saved_run: RunRecord | None) -> None:
        """A resume of this ended worker is under way (its journal being verified): from
        now until `reopen` (or `abandon_resume`), a stop that reaches it refuses the resume.

        `record` may come from the store when its handle was released: it is taken back
        into memory, with its run as the store saved it (`saved_run`: see
        `restore_worker`), so a stop of its run or of it lands here too. Refused while
        another resume of it is under way (its journal open could cut, as a torn tail,
        what the first appends).
        """
        if record.id in self._resuming:
            raise Refused(f"worker {record.id} is being resumed already")
        if record.id not in self._workers:
            self.restore_worker(record, saved_run)
        self._resuming[record.id] = None

    def abandon_resume(self, worker_id: str) -> None:
        """The resume went no further: the worker is as it was (a handle taken back from
        the store only for it is let go again, in memory: the store never saw it held)."""
        self._resuming.pop(worker_id, None)
        record = self._workers.get(worker_id)
        if record is not None and self._releasable(worker_id):
            self.release(worker_id)

    def reopen(self, record: WorkerRecord, now: float, timeout: float | None) -> WorkerRecord:
        """The next attempt of an ended worker being resumed: same id, run, parent, token.

        Its run stays as it is: a stopped run still refuses every spawn but this
        attempt's own delegations (see `register`). Refused, nothing having run, if a
        stop reached the worker since `begin_resume` (a stop of its run, of it, a
        cancel): that stop came after the resume was asked, and a stopped attempt never
        starts (`run_stopped` for a stop of its run).
        """
        stop = self._resuming.get(record.id)
        if stop is not None:
            self.abandon_resume(record.id)
            if stop == "run":
                raise RunStopped(
                    f"run {record.run} was stopped while worker {record.id} was being "
                    "resumed: nothing ran; resume it again to carry it on"
                )
            raise Refused(
                f"worker {record.id} was stopped ({stop}) while it was being resumed: "
                "nothing ran; resume it again to carry it on"
            )
        self._resuming.pop(record.id, None)
        record.next_attempt()
        record.started_at = now
        record.collected = record.expired = False
        record.timeout = timeout
        record.turn = self.turn
        record.queued = None
        self.schedule.running(record.id, record.run, record.agent)  # a resume is not queued
        return record

    def reopen_run(self, run_id: str) -> list[str]:
        """Start a stopped run again: it and the runs nested in it take spawns from now on
        (the one way a stop is undone; a resume is not). The runs that were stopped, sorted.
        Refused with `run_stopped` while a run it is nested in is stopped."""
        run = self.run(run_id)
        if run.outer is not None and self.run_stopped(run.outer):
            raise RunStopped(
                f"run {run_id} is nested in run {run.outer}, which is stopped: "
                "reopen the outer run to start it again"
            )
        opened = []
        for current in self.runs_within(run_id):
            if self._runs[current].stopped:
                self._runs[current].stopped = False
                opened.append(current)
        return sorted(opened)

    def restore_worker(self, record: WorkerRecord, saved_run: RunRecord | None = None) -> None:
        """Take a worker back into memory from its archived record. A run no longer held
        (an implicit run goes with its last worker) comes back as `saved_run`, its row in
        the store (written when it was stopped, reopened or resumed, and kept when it was
        let go), so a resume never opens a stopped run again. Without a row (a state dir
        from before rows were kept, a write that failed) it is stopped if its stop is what
        ended this worker."""
        if record.run not in self._runs:
            self._runs[record.run] = saved_run or RunRecord(
                id=record.run,
                outer=None,
                created_at=record.started_at,
                stopped=record.stop_reason == "run",
                implicit=True,
            )
            self._run_members[record.run] = []
            self._inner_runs[record.run] = []
        self._hold(record)
        self._by_token[record.token] = record.id
        self._children.setdefault(record.id, [])
        self._run_members[record.run].append(record.id)
        if record.parent is not None and record.parent in self._children:
            self._children[record.parent].append(record.id)
        if record.ended_at is not None:
            heapq.heappush(self._endings, (record.ended_at, record.id))

    # -- retention -----------------------------------------------------------

    def expired(self, now: float, ttl: float) -> list[str]:
        """Ended workers left uncollected for `ttl` seconds; each is named once, then forgotten."""
        due: list[str] = []
        while self._endings and self._endings[0][0] + ttl <= now:
            ended_at, worker_id = heapq.heappop(self._endings)
            if self._expires(ended_at, worker_id) and worker_id not in due:
                due.append(worker_id)
        return due

    def next_expiry(self, ttl: float) -> float | None:
        """When the next uncollected handle expires, if any does."""
        while self._endings:
            ended_at, worker_id = self._endings[0]
            if self._expires(ended_at, worker_id):
                return ended_at + ttl
            heapq.heappop(self._endings)
        return None

    def _expires(self, ended_at: float, worker_id: str) -> bool:
        """Whether this entry still stands for a retained handle (not a stale one)."""
        record = self._workers.get(worker_id)
        return record is not None and self._retained(record) and record.ended_at == ended_at

    @staticmethod
    def _retained(record: WorkerRecord) -> bool:
        """Ended, waiting to be collected, and not yet past its TTL."""
        return record.ended and not record.collected and not record.expired

    def needs_tombstone(self, worker_id: str) -> bool:
        """An expired handle whose parent is still live: the parent may yet collect it."""
        parent = self._workers[worker_id].parent
        return parent is not None and parent in self._workers and not self._workers[parent].ended

    def release(self, worker_id: str, tombstone: Tombstone | None = None) -> list[str]:
        """Let go of ended handles no longer needed in memory; the ids released.

        A handle goes once it is ended and collected (or expired), and only
        after the workers it delegated: the tree above a live worker stays
        whole, so stops and authority keep walking it. A released parent takes
        its children's tombstones with it; an implicit run with nothing left
        goes too, while runs made by name stay (a caller may still hold them).
        """
        released: list[str] = []
        current: str | None = worker_id
        while current is not None and current not in released and self._releasable(current):
            record = self._let_go(current)
            released.append(current)
            del self._by_token[record.token]
            del self._children[current]
            self._run_members[record.run].remove(current)
            for child in [t for t, stone in self._tombstones.items() if stone.parent == current]:
                del self._tombstones[child]
            if record.parent is not None and record.parent in self._children:
                self._children[record.parent].remove(current)
            self._release_run(record.run)
            if current == worker_id and tombstone is not None:
                self._tombstones[current] = tombstone
            current = record.parent
        return released

    def _releasable(self, worker_id: str) -> bool:
        record = self._workers.get(worker_id)
        if record is None or not record.ended or self._children[worker_id]:
            return False
        return record.collected or record.expired

    def _release_run(self, run_id: str) -> None:
        """Forget an implicit run with nothing left in it (never nested, never named)."""
        run = self._runs[run_id]
        if run.implicit and not self._run_members[run_id]:
            del self._runs[run_id]
            del self._run_members[run_id]
            del self._inner_runs[run_id]

    # -- views ---------------------------------------------------------------

    def listing(self, *, include_ended: bool, run: str | None = None) -> list[WorkerRecord]:
        return list(self.listed_after(None, include_ended=include_ended, run=run))

    def listed_after(
        self,
        place: tuple[float, str] | None,
        *,
        include_ended: bool,
        run: str | None = None,
        sees: Callable[[str], bool] | None = None,
    ) -> Iterator[WorkerRecord]:
        """The held workers a listing shows, in its order (spawned_at, id), from the first
        after `place` (None: from the start), as they are asked for: a page takes the
        first thousand of 10,000 for what those thousand cost. `sees`: whether the asker
        may see a worker (by id); `run`: that run's and those nested in it only."""
        runs = None if run is None else set(self.runs_within(self.run(run).id))
        start = 0 if place is None else bisect.bisect_right(self._places, place)
        for index in range(start, len(self._places)):
            record = self._workers[self._places[index][1]]
            if (
                (include_ended or not record.ended)
                and (runs is None or record.run in runs)
                and (sees is None or sees(record.id))
            ):
                yield record

    def counts(self) -> dict[str, int]:
        """How many held workers are in each state: kept as they change, not counted."""
        return self._counts.as_dict()

    def _hold(self, record: WorkerRecord) -> None:
        """Take a record in: by id, in the listing order, and in the counts."""
        if record.id in self._workers:  # the same worker again: its old record goes
            self._let_go(record.id)
        self._workers[record.id] = record
        bisect.insort(self._places, record.place)
        self._counts.add(record)

    def _let_go(self, worker_id: str) -> WorkerRecord:
        record = self._workers.pop(worker_id)
        index = bisect.bisect_left(self._places, record.place)
        if index < len(self._places) and self._places[index] == record.place:
            del self._places[index]
        self._counts.remove(record)
        return record

    def holds_park(self) -> bool:
        """Whether shutting down now would cost a worker: one live (stopping included:
        its tree still runs), or a result owed: a worker that ended on its own, not yet
        collected, within its TTL. A stopped or cancelled worker owes no result. Read
        from the counts, kept as workers change: `info` asks it each time."""
        return self._counts.live() or self._counts.owed > 0

    def _fresh_id(self, prefix: str) -> str:
        while True:
            candidate = self._make_id(prefix)
            if candidate not in self._workers and candidate not in self._runs:
                return candidate


def _cut_loops(records: list[WorkerRecord], runs: list[RunRecord]) -> list[str]:
    """Cut every parent and outer link that leads round in a loop; what was cut.

    Records restored from archives are in their workers' reach, and a parent
    that is its own ancestor would send every walk up the tree round forever.
    """
    cut: list[str] = []
    parents = {r.id: r.parent for r in records}
    for record in records:
        if _loops(record.id, parents):
            cut.append(f"worker {record.id}'s record names a parent that loops back to it")
            record.parent = parents[record.id] = None
    outers = {r.id: r.outer for r in runs}
    for run in runs:
        if _loops(run.id, outers):
            cut.append(f"run {run.id} is nested in a run that loops back to it")
            run.outer = outers[run.id] = None
    return cut


def _loops(start: str, up: dict[str, str | None]) -> bool:
    """Whether following `up` from `start` comes back to `start`."""
    seen = {start}
    current = up.get(start)
    while current is not None:
        if current in seen:
            return current == start
        seen.add(current)
        current = up.get(current)
    return False


def _reachable(start: str, edges: dict[str, list[str]]) -> Iterator[str]:
    """`start` and everything reachable from it through `edges`, each once (a loop, as a
    restored record may make, ends the walk rather than running it forever)."""
    pending, seen = [start], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        pending.extend(edges.get(current, ()))
