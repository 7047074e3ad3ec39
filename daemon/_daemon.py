"""The composition root: it only builds and wires the daemon's parts and holds the verbs
that span them (send, shutdown, info, the housekeeping they run).

The registry decides; the parts in workers/ carry decisions out against real processes
and files, each owning its state (the spawner a spawn's path and keys, the supervisor
what is live, the stops and runs their verbs, the reader the open journals, the mailbox
the wakes, retention the releases, endings the ending's transaction). Other modules
reach a part through its methods, never its dicts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import trio

from subagentd.protocol import (
    FREEZE_CONTROL,
    PROTOCOL_VERSION,
    TERMINAL_STATES,
    DaemonInfo,
    Usage,
    WorkerView,
    package_version,
)
from subagentd.protocol.errors import NotFound, Refused

from ._faults import Faults
from ._logging import get_logger
from ._problems import Problems
from .core._recovering import RecoveryProgress
from .core._registry import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS, Registry, WorkerRecord
from .core._request_keys import DEFAULT_REQUEST_KEY_TTL
from .processes._controllers import LimitsHit
from .processes._launcher import Launcher
from .processes._relay import Relay
from .store._journal import Journal
from .store._statedir import StateDir
from .store._store import STORE_NAME, Store
from .workers._afterwards import Afterwards
from .workers._endings import Endings
from .workers._mailbox import Mailbox
from .workers._pauses import Pauses
from .workers._reader import Reader
from .workers._retention import Retention
from .workers._runs import Runs
from .workers._spawner import Spawner
from .workers._stops import Stops
from .workers._store_upkeep import StoreUpkeep
from .workers._supervisor import Supervisor

log = get_logger()


class Daemon:
    def __init__(
        self,
        state_dir: StateDir,
        *,
        socket_path: Path,
        config_path: Path,
        finished_ttl: float = DEFAULT_FINISHED_TTL,
        keep_archives_days: float = DEFAULT_KEEP_ARCHIVES_DAYS,
        request_key_ttl: float = DEFAULT_REQUEST_KEY_TTL,
        clock: Callable[[], float] = time.time,
        launcher: Launcher,
        faults: frozenset[tuple[str, str]] = frozenset(),
        store: Store | None = None,
        max_running: int | None = None,
    ) -> None:
        """`store`: opened already (the start waited for its lock); else opened here;
        `max_running`: the daemon's cap on workers running at once (None: none)."""
        self.state_dir = state_dir
        #: Where a test's fault is injected (see _faults.FAULT_ENV); empty but in tests.
        self.faults = Faults(faults, fifos=state_dir.root)
        #: How workers' processes are started and their trees ended (the port).
        self.launcher = launcher
        self.socket_path = socket_path
        self.config_path = config_path
        #: What a request's answer need not wait for (log lines, empty cgroups' removal).
        self.afterwards = Afterwards(launcher)
        self.pid = os.getpid()  # for `info`, asked at every call: one system call less
        self.registry = Registry()
        self.registry.schedule.daemon_cap = max_running
        #: What is wrong right now (reported by `info`).
        self.problems = Problems()
        #: The live workers and their supervision.
        self.supervisor = Supervisor(
            launcher,
            self.registry,
            ending=self._finish,
            ending_together=self._finish_together,
            clock=clock,
            faults=self.faults,
            disk_trouble=self.problems.disk_failed,
            disk_ok=self.problems.disk_ok,
            later=self.afterwards.later,
        )
        launcher.relays.on_lost = self._relay_lost
        self.image_generation = 1
        self.reloads = 0
        #: The wall clock, for the times written down (started_at, ended_at, journal
        #: entries). Waits are on trio's clock, each for a span worked out from this one,
        #: so a test whose wall clock follows trio's MockClock jumps retention, timeouts
        #: and pruning ahead with it (tests/inprocess.py).
        self.clock = clock
        #: While a restart takes its workers back (set by `serve`, moved on by `recover`):
        #: requests that need them are answered `recovering` (see `RecoveryProgress`).
        self.recovering: RecoveryProgress | None = None
        #: What the daemon knows, transactionally: records, runs, wakes, tombstones, turn.
        self.store = store if store is not None else Store.open(state_dir.root / STORE_NAME)
        self.store.on_written = self.problems.store_written
        self.store_upkeep = StoreUpkeep(self.store, self.problems)
        #: Runs, turns and fences written down.
        self.runs = Runs(self.registry, self.store, self.problems, clock=clock)
        #: Lookups, status, collect, journal pages and follows.
        self.reader = Reader(state_dir, self.registry, self.store, self.supervisor)
        #: Parents' wakes: posted with each ending, subscribed to, acknowledged.
        self.mailbox = Mailbox(
            self.store,
            self.registry,
            old_log=state_dir.root / "wakes.log",
            lookup=self.reader.lookup,
        )
        #: Releasing what ended: collected, expired, pruned.
        self.retention = Retention(
            self.registry,
            self.store,
            self.mailbox,
            state_dir,
            self.problems,
            clock=clock,
            finished_ttl=finished_ttl,
            keep_archives_days=keep_archives_days,
            stdout_tail=self.reader.stdout_tail,
            faults=self.faults,
            released=self.touch,
            run_dropped=self.runs.saved.discard,
        )
        self.reader.releasing_through(self.retention)
        #: Each ending written down whole: record, wake, retention.
        self.endings = Endings(
            self.registry,
            self.store,
            self.reader,
            self.mailbox,
            self.problems,
            clock=clock,
            faults=self.faults,
            ended=self._ended,
        )
        #: A spawn from request to supervised process: keys, spare archives, launch.
        self.spawner = Spawner(
            state_dir,
            self.registry,
            self.store,
            self.reader,
            self.supervisor,
            self.endings,
            self.problems,
            launcher,
            socket_path=socket_path,
            config_path=config_path,
            clock=clock,
            faults=self.faults,
            request_key_ttl=request_key_ttl,
            saved_runs=self.runs.saved,
        )
        #: The stop verbs: a worker, a run, a scope, a fence's launches.
        self.stops = Stops(
            self.registry, self.reader, self.supervisor, self.runs, self.problems, self.afterwards
        )
        # Whatever a stop reaches that waits in the queue ends there, never started.
        self.supervisor.queued_stopped = self.spawner.queue.end_stopped
        #: The pause verbs: a worker's subtree, a run.
        self.pauses = Pauses(self.registry, self.reader, self.supervisor, launcher, self.faults)
        #: Set and replaced whenever something happens that idle exit must notice.
        self.activity = trio.Event()

    def _finish(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        failure: str | None = None,
    ) -> None:
        """The supervisor's hand-over of an ending (made before the parts it needs); one
        given another attempt (`Registry.retry`) goes to the queue."""
        self.endings.finish(record, journal, returncode, stdout_tail, failure)
        if not record.ended:
            self.spawner.queue.retrying(record, journal)

    async def _finish_together(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        hit: LimitsHit | None = None,
        note: bytes | None = None,
    ) -> None:
        """`_finish`, in one transaction with the endings of the same scheduling batch."""
        await self.endings.finish_together(record, journal, returncode, stdout_tail, hit, note)
        if not record.ended:
            self.spawner.queue.retrying(record, journal)

    def _ended(self) -> None:
        """A worker ended: its handle's expiry is due, and idle exit may look again."""
        self.retention.ended()
        self.spawner.queue.slot_freed()
        self.touch()

    def touch(self) -> None:
        """Something happened: wake whoever waits for activity."""
        activity, self.activity = self.activity, trio.Event()
        activity.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the workers' supervision and the housekeeping timers until cancelled."""
        await self.retention.prune_archives_once()  # before serving: nobody reads a doomed one
        async with trio.open_nursery() as timers:
            for task in (
                self.retention.expire_handles,
                self.retention.prune_archives_daily,
                self.spawner.make_spare_archives,
                self.store_upkeep.write_what_the_store_kept_out,
                self.store_upkeep.check_the_store_is_linked,
                self.afterwards.do_after_answers,
                self.spawner.queue.run,
                self.spawner.readiness.run,
            ):
                timers.start_soon(_keep_running, task)
            await timers.start(self.launcher.relays.run)
            # In this task, handing it our task_status: serving starts one scheduling
            # batch sooner than through a nursery.start of its own (a batch in which a
            # reload's thousand adopted workers take their first step).
            await self.supervisor.run(task_status=task_status)

    def _relay_lost(self, relay: Relay, workers: int) -> None:
        """An output relay died: its workers' supervision ends each `interrupted`; said here."""
        if workers:
            self.problems.relay = (
                f"{relay.lost}; the {workers} workers whose output it held were ended "
                "interrupted (resume each by its id); the next relayed spawn starts a new relay"
            )

    def send(self, worker_id: str, data: bytes, *, eof: bool) -> int:
        """Write to a live worker's stdin (see `Supervisor.write_stdin`)."""
        found = self.reader.lookup(worker_id)
        live = self.supervisor.get(worker_id)
        if live is None or live.returncode is not None:  # reaped, its ending being written
            raise Refused(f"cannot send to worker {worker_id}: it has ended ({found.state})")
        return self.supervisor.write_stdin(live, data, eof=eof)

    async def shutdown(self) -> None:
        """Stop every worker and wait until all are gone; start none meanwhile."""
        self.spawner.shutting_down = True
        # A spawn already past its checks may still land: stop it too. The queued end
        # unstarted, as every stop ends them.
        while self.supervisor or self.registry.schedule.queued():
            ids = self.registry.stop_all("shutdown")
            self.supervisor.ask_stop(ids)
            self.spawner.queue.end_stopped(ids)  # whatever ask_stop's hook did not reach
            log.info("daemon.stopping_workers", count=len(ids))
            await self.supervisor.wait_ended(self.supervisor.ids())
        # What moved itself out of its worker's cgroup, or outlived a worker that ended by
        # itself, goes with the daemon (processes/_escapes.py); never a reason not to stop.
        try:
            await self.launcher.sweep_at_shutdown(self._worker_started)
        except Exception:
            log.exception("daemon.sweep_failed")

    def _worker_started(self, worker_id: str) -> int | None:
        """When one of this daemon's workers' process started (clock ticks after boot; 0 if
        not known), by its id; None for an id that is not one of its workers'."""
        if self.state_dir.archive(worker_id) is None:
            return None  # not an id at all: never worth a look in the store
        try:
            found = self.reader.lookup(worker_id)
        except (NotFound, OSError):
            return None
        start = getattr(found, "pid_start", None)
        return start if isinstance(start, int) else 0

    def usage(self, worker_ids: Iterable[str]) -> dict[str, Usage]:
        """What each of the live workers among `worker_ids` takes now (processes/_usage);
        one starting (no process yet) or ended (reaped) has none."""
        workers = []
        for worker_id in worker_ids:
            live = self.supervisor.get(worker_id)
            if live is not None and live.process is not None and not live.process.reaped:
                workers.append((worker_id, live.process))
        return self.launcher.usage(workers) if workers else {}

    def with_usage(self, views: Iterable[WorkerView]) -> None:
        """Each live one of `views` given its usage."""
        views = list(views)
        found = self.usage(view.id for view in views if view.state not in TERMINAL_STATES)
        for view in views:
            view.usage = found.get(view.id)

    def info(self, caller: str | None = None, *, usage: bool = False) -> DaemonInfo:
        """The daemon's state, as told to a connection acting as `caller` (None: the user);
        with `usage`, what the live workers take together."""
        return DaemonInfo(
            version=package_version(),
            protocol=PROTOCOL_VERSION,
            pid=self.pid,
            image_generation=self.image_generation,
            reloads=self.reloads,
            workers=self.registry.counts(),
            # Recovering, the registry is not yet what the store holds: say it may hold.
            holds_park=self.recovering is not None or self.registry.holds_park(),
            tree_tracking=self.launcher.tree_tracking,
            authority=self.launcher.authority,
            caller=caller,
            socket=str(self.socket_path),
            state_dir=str(self.state_dir.root),
            relays=self.launcher.relays.info(),
            controls={**self.launcher.controllers.controls, FREEZE_CONTROL: self.launcher.freeze},
            queued=self.registry.schedule.queued_count(),
            max_running=self.registry.schedule.daemon_cap,
            problems=self.problems.current()
            + self.store_upkeep.unwritten_problem()
            + self.store.problems
            + self.registry.damage,
            recovering=None
            if self.recovering is None
            else self.recovering.view(trio.current_time()),
            usage=total_usage(self.usage(self.supervisor.ids()).values()) if usage else None,
        )


def total_usage(each: Iterable[Usage]) -> Usage:
    """The usage of workers together (`DaemonInfo.usage`)."""
    each = list(each)
    percents = [u.cpu_percent for u in each if u.cpu_percent is not None]
    peaks = [u.memory_peak for u in each]
    return Usage(
        cpu_seconds=sum(u.cpu_seconds for u in each),
        cpu_percent=sum(percents) if percents or not each else None,
        memory=sum(u.memory for u in each),
        memory_peak=None if None in peaks else sum(p for p in peaks if p is not None),
        processes=sum(u.processes for u in each),
        source="proc" if any(u.source == "proc" for u in each) else "cgroup",
    )


#: A housekeeping task that raised starts again after this, doubling up to the max.
TASK_RETRY_FIRST = 1.0
TASK_RETRY_MAX = 60.0


async def _keep_running(task: Callable[[], Awaitable[None]]) -> None:
    """Run a housekeeping task for good: an exception is logged and the task started
    again after a pause, never the end of the daemon and every worker with it."""
    delay = TASK_RETRY_FIRST
    while True:
        try:
            await task()
        except Exception:
            log.exception("daemon.task_failed", task=task.__name__, retry_in=delay)
        await trio.sleep(delay)
        delay = min(delay * 2, TASK_RETRY_MAX)
