"""The composition root: the daemon's parts built and wired together, and the verbs that
span them (spawn, stop, runs, turns and fences, shutdown, info).

The registry decides; the parts in workers/ carry decisions out against real processes
and files, each owning its state (the supervisor what is live, the reader the open
journals, the mailbox the wakes, retention the releases, endings the ending's
transaction). Other modules reach a part through its methods, never its dicts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from subagentd.protocol import (
    PROTOCOL_VERSION,
    DaemonInfo,
    Spawn,
    WorkerView,
    package_version,
)
from subagentd.protocol.errors import (
    Busy,
    Invalid,
    NotFound,
    Refused,
    Reloading,
    RunStopped,
)

from ._logging import get_logger
from ._problems import Problems
from .core._recovering import RecoveryProgress
from .core._registry import (
    DEFAULT_FINISHED_TTL,
    DEFAULT_KEEP_ARCHIVES_DAYS,
    Registry,
    WorkerRecord,
)
from .core._request_keys import (
    DEFAULT_REQUEST_KEY_TTL,
    AskedKey,
    KeyRecord,
    RequestKeys,
    asked_key,
)
from .processes._launcher import Launcher
from .processes._process import OutOfDescriptors, SpawnFailed, WorkerProcess
from .processes._relay import Relay
from .processes._tree import DESCRIPTOR_ERRNOS
from .store._archive import Archive, Snapshot, SpareArchives
from .store._journal import Journal
from .store._statedir import StateDir
from .store._store import STORE_NAME, Change, LaunchState, Store
from .workers._agents import AgentDef, ConfigError, frozen_agent, load_agents
from .workers._command import Launch, inherited_env, own_bin_dir, resolve
from .workers._endings import Endings
from .workers._git import git_state
from .workers._mailbox import Mailbox
from .workers._reader import Reader
from .workers._retention import Retention
from .workers._supervisor import LiveWorker, Supervisor

log = get_logger()

#: What a client refused during a reload is told to wait before it tries again.
RELOAD_RETRY = 0.2
#: What a spawn refused for want of file descriptors is told to wait.
DESCRIPTORS_RETRY = 1.0
#: How often, and how many times, `lose-answer` asks for its reload (one refused `busy`,
#: the last reload a moment ago, is asked again).
LOSE_ANSWER_EVERY = 0.25
LOSE_ANSWER_TRIES = 40


@dataclass(frozen=True)
class Stopping:
    """What a stop or cancel did: ``stopped``, the ids newly asked to stop; ``already``,
    those it reached whose stop was already in flight (left as they are); ``found``,
    false for an id or run the daemon never saw."""

    stopped: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    found: bool = True


class InjectedFault(Exception):
    """Raised where SUBAGENTD_FAULT asks: a stand-in for any unexpected exception."""


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
    ) -> None:
        """`store`: opened already (the start waited for its lock); else opened here."""
        self.state_dir = state_dir
        #: Where to raise InjectedFault (see _settings.FAULT_ENV); empty but in tests.
        self.faults = faults
        #: How workers' processes are started and their trees ended (the port).
        self.launcher = launcher
        self.socket_path = socket_path
        self.config_path = config_path
        self.pid = os.getpid()  # for `info`, asked at every call: one system call less
        self.registry = Registry()
        #: What is wrong right now (reported by `info`).
        self.problems = Problems()
        #: The live workers and their supervision.
        self.supervisor = Supervisor(
            launcher,
            self.registry,
            ending=self._finish,
            ending_together=self._finish_together,
            clock=clock,
            fault=self.fault,
            disk_trouble=self.problems.disk_failed,
            disk_ok=self.problems.disk_ok,
            later=self.after_answer,
        )
        launcher.relays.on_lost = self._relay_lost
        self.image_generation = 1
        self.reloads = 0
        #: The wall clock, for the times written down (started_at, ended_at, journal
        #: entries). Waits are on trio's clock, each for a span worked out from this one,
        #: so a test whose wall clock follows trio's MockClock jumps retention, timeouts
        #: and pruning ahead with it (tests/inprocess.py).
        self.clock = clock
        self.agents: dict[str, AgentDef] = {}
        self.config_error: str | None = None
        #: While set, spawns are refused with `reloading` (a reload's launch fence).
        self.reloading = False
        #: Set once for good when the daemon begins to stop: no spawn, resume or reload.
        self.shutting_down = False
        #: While a restart takes its workers back (set by `serve`, moved on by `recover`):
        #: requests that need them are answered `recovering` (see `RecoveryProgress`).
        self.recovering: RecoveryProgress | None = None
        self._run_stopped: dict[str, trio.Event] = {}
        #: What a request's answer need not wait for (log lines): see `after_answer`.
        self._after_answer: list[Callable[[], None]] = []
        self._after_answer_wanted = trio.Event()
        self._saved_runs: set[str] = set()
        #: What the daemon knows, transactionally: records, runs, wakes, tombstones, turn.
        self.store = store if store is not None else Store.open(state_dir.root / STORE_NAME)
        self.store.on_written = self.problems.store_written
        #: The recent idempotency keys of spawns and resumes, as the store keeps them.
        self.request_keys = RequestKeys(request_key_ttl)
        #: Keys forgotten here and still in the store: dropped by the next keyed change.
        self._keys_to_drop = self.request_keys.load(self.store.request_keys(), clock())
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
            fault=self.fault,
            released=self.touch,
            run_dropped=self._saved_runs.discard,
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
            fault=self.fault,
            faults=lambda: self.faults,
            ended=self._ended,
        )
        self.spares = SpareArchives(state_dir.archives)
        self._spares_wanted = trio.Event()
        #: What every worker inherits of the daemon's environment (read once: it never changes).
        self.inherited_env = inherited_env(os.environ)
        #: The daemon's own bin directory, put last on every worker's PATH (`subagentctl`).
        self.tools = own_bin_dir()
        #: Set and replaced whenever something happens that idle exit must notice.
        self.activity = trio.Event()
        self.load_config()

    def fault(self, point: str, target: str, *, once: bool = False) -> None:
        """Raise InjectedFault if SUBAGENTD_FAULT asked for one here (`once`: the first time)."""
        if (point, target) in self.faults:
            if once:
                self.faults -= {(point, target)}
            raise InjectedFault(f"injected fault at {point}:{target}")

    async def held(self, point: str, target: str) -> None:
        """Wait here if SUBAGENTD_FAULT asked to hold at this point: until a writer of the
        FIFO named `point` in the state dir has opened and closed it (for the tests: a
        request held where it awaits, deterministically, while another lands)."""
        if (point, target) in self.faults:
            fifo = self.state_dir.root / point
            await trio.to_thread.run_sync(fifo.read_bytes, abandon_on_cancel=True)

    def _finish(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        failure: str | None = None,
    ) -> None:
        """The supervisor's hand-over of an ending (made before the parts it needs)."""
        self.endings.finish(record, journal, returncode, stdout_tail, failure)

    async def _finish_together(
        self, record: WorkerRecord, journal: Journal, returncode: int | None, stdout_tail: bytes
    ) -> None:
        """`_finish`, in one transaction with the endings of the same scheduling batch."""
        await self.endings.finish_together(record, journal, returncode, stdout_tail)

    def _ended(self) -> None:
        """A worker ended: its handle's expiry is due, and idle exit may look again."""
        self.retention.ended()
        self.touch()

    def touch(self) -> None:
        """Something happened: wake whoever waits for activity."""
        activity, self.activity = self.activity, trio.Event()
        activity.set()

    def load_config(self) -> None:
        try:
            self.agents = load_agents(self.config_path)
            self.config_error = None
        except ConfigError as exc:
            # The daemon serves on without agents; spawns of an agent say why.
            self.agents = {}
            self.config_error = str(exc)
            log.error("config.invalid", error=self.config_error)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the workers' supervision and the housekeeping timers until cancelled."""
        await self.retention.prune_archives_once()  # before serving: nobody reads a doomed one
        async with trio.open_nursery() as timers:
            for task in (
                self.retention.expire_handles,
                self.retention.prune_archives_daily,
                self._make_spare_archives,
                self._write_what_the_store_kept_out,
                self._check_the_store_is_linked,
                self._do_after_answers,
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

    def after_answer(self, step: Callable[[], None]) -> None:
        """Do `step` (a log line, an empty cgroup's removal) once the answer being made
        has been sent: a stop's TERM and its answer wait for no log line. One written to
        stderr costs 0.05 to 0.17 ms, a third of a stop's path in the daemon. A crash first
        loses the line, or leaves the empty cgroup to the next start's sweep; nothing else."""
        # In the context it was asked in: the line keeps its bound `conn`.
        self._after_answer.append(functools.partial(contextvars.copy_context().run, step))
        self._after_answer_wanted.set()

    async def _do_after_answers(self) -> None:
        while True:
            await self._after_answer_wanted.wait()
            self._after_answer_wanted = trio.Event()
            # Woken with the handler whose answer this waits for: let it send first.
            await trio.lowlevel.checkpoint()
            self._do_after_answers_steps()

    def do_after_answers_now(self) -> None:
        """Do every step still waiting for an answer to go out: the image is about to
        end (an exec, a stop), and takes no step with it, nor a cgroup left to remove."""
        self._do_after_answers_steps()
        self.launcher.remove_released_now()  # ended workers' cgroups, else in a thread

    def _do_after_answers_steps(self) -> None:
        """The steps waiting; an ended worker's cgroup they release is removed in a
        thread (`Supervisor._remove_released`), never here on the event loop: an rmdir
        costs 40-90 us, and one a worker left full of nested cgroups ~0.1 ms each."""
        steps, self._after_answer = self._after_answer, []
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("daemon.after_answer_failed")

    # -- spawning ------------------------------------------------------------

    async def spawn(self, request: Spawn, caller: str | None) -> WorkerView:
        """Register a worker and start its process; refusals raise RemoteError.

        From registration to the supervise task, nothing may interrupt: a
        client that hangs up mid-spawn must not leave a process unsupervised.
        """
        if request.stdin_open and request.input is not None:
            raise Invalid(
                "stdin_open: a worker's stdin is either its input or a pipe kept open for "
                "send, not both"
            )
        asked = asked_key(request, caller)
        if (made := self.made_already(asked)) is not None:
            return made
        if self.shutting_down:
            raise Refused("the daemon is shutting down: it starts no new workers")
        if self.reloading:
            raise Reloading("the daemon is reloading; spawn again", retry_after=RELOAD_RETRY)
        launch = resolve(
            request,
            agents=self.agents,
            config_path=self.config_path,
            config_error=self.config_error,
            inherited=self.inherited_env,
            tools=self.tools,
        )
        if request.parent is not None and not self.registry.holds(request.parent):
            ended = self.reader.lookup(request.parent)  # released: it has ended
            raise RunStopped(
                f"worker {request.parent} has ended ({ended.state}); it cannot delegate"
            )
        with self.supervisor.launching(), trio.CancelScope(shield=True):
            view = await self._start(request, caller, launch, asked)
        # Made again once this spawn is done, not while it competes for the CPU.
        self._spares_wanted.set()
        if ("lose-answer", request.name) in self.faults:
            await self._lose_the_answer()
        return view

    def made_already(self, asked: AskedKey | None) -> WorkerView | None:
        """The worker a request with this key made (or resumed) already, as it is now;
        None if the key is new (or forgotten). Invalid if it came with another request."""
        if asked is None:
            return None
        known = self.request_keys.find(asked.caller, asked.key, self.clock())
        if known is None:
            return None
        if known.digest != asked.digest:
            raise Invalid(
                f"key {asked.key!r} was used for a different request (the one that made "
                f"worker {known.worker}): each request needs a key of its own"
            )
        log.info("request.repeated", worker=known.worker)
        return self.reader.lookup(known.worker).view()

    def keyed(
        self, change: Change, asked: AskedKey | None, worker_id: str, now: float
    ) -> KeyRecord | None:
        """Put a request's key, with the worker it made, in `change` (the transaction that
        writes that worker down), with the keys forgotten since the last; the key to
        `remember` once the change is in."""
        if asked is None:
            return None
        record = asked.made(worker_id, now)
        change.keys.append(record)
        change.dropped_keys += self._keys_to_drop
        return record

    def remember(self, key: KeyRecord | None, now: float) -> None:
        """A keyed change went in: its key is known from now on, and the dropped ones gone."""
        if key is not None:
            self._keys_to_drop = self.request_keys.remember(key, now)

    async def _lose_the_answer(self) -> None:
        """Fault `lose-answer`: reload before this spawn is answered; the reload's pause
        cancels this request, whose answer is never sent."""
        for _ in range(LOSE_ANSWER_TRIES):
            os.kill(os.getpid(), signal.SIGHUP)
            await trio.sleep(LOSE_ANSWER_EVERY)

    async def _start(
        self, request: Spawn, caller: str | None, launch: Launch, asked: AskedKey | None
    ) -> WorkerView:
        argv, env, cwd = launch.argv, launch.env, launch.cwd
        now = self.clock()
        record = self.registry.register(
            now=now,
            argv=argv,
            cwd=cwd,
            archive_for=lambda worker_id: str(self.state_dir.archives / worker_id),
            run=request.run,
            parent=request.parent or caller,
            name=request.name,
            agent=request.agent,
            grace=launch.grace,
            timeout=launch.timeout,
        )
        try:
            # In the store before its archive or process exists, so a crash at any point
            # after leaves a record for recovery to find. A run's row changes only when
            # the run does; an implicit run's is written only if it is stopped (recovery
            # takes a run without one as implicit).
            change = Change(workers=[record])
            if record.run not in self._saved_runs and not self.registry.run(record.run).implicit:
                change.runs.append(self.registry.run(record.run))
            # Its key in the same transaction: no crash leaves one without the other.
            key = self.keyed(change, asked, record.id, now)
            self.store.commit(change, "registering a worker")
            self.remember(key, now)
            self._saved_runs.update(r.id for r in change.runs)
            archive = self.spares.take(record.id)
            if archive is None:
                archive = self.reader.archive_of(record.id)
                archive.create()
            branch, head = git_state(cwd)
            archive.write_snapshot(
                Snapshot(
                    id=record.id,
                    run=record.run,
                    parent=record.parent,
                    name=record.name,
                    argv=argv,
                    cwd=cwd,
                    env=env,
                    agent=request.agent,
                    model=launch.model,
                    timeout=record.timeout,
                    grace=record.grace,
                    has_input=request.input is not None,
                    created_at=now,
                    branch=branch,
                    head=head,
                    agent_def=frozen_agent(launch.agent) if launch.agent else None,
                    stdin_open=request.stdin_open,
                )
            )
            stdin = None if request.input is None else str(archive.write_input(request.input))
            journal = Journal.create(archive.file(Archive.JOURNAL))
        except OSError as exc:
            # A full disk: the worker never starts, and says why.
            self.registry.ended(record.id, None, now)
            # Its row says it ended, or a restart would bring it back `interrupted` and
            # wake its parent for a spawn its client was told was refused.
            refused = Change(workers=[record])
            if asked is not None:  # sent again, it is tried again: it was refused, not made
                self.request_keys.forget(asked.caller, asked.key)
                refused.dropped_keys.append((asked.caller, asked.key))
            with contextlib.suppress(OSError):
                self.store.commit(refused, "a refused spawn", redo=True)
            if exc.errno in DESCRIPTOR_ERRNOS:
                raise self._out_of_descriptors(
                    record.id, OutOfDescriptors(exc, "its archive")
                ) from exc
            self.problems.disk_failed(f"archive of {record.id}", exc)
            raise Refused(
                f"cannot create worker {record.id}'s archive in {self.state_dir.archives}: "
                f"{exc.strerror or exc}; free some space and spawn again"
            ) from exc
        live = LiveWorker(record=record, journal=journal)
        self.supervisor.add(live)
        if record.stop_reason is not None:
            self.end_unstarted(live, f"stopped at birth: launch fence {record.fence} was cancelled")
            return record.view()
        return await self.launch(
            live, argv, cwd, launch.worker_env, stdin, stdin_open=request.stdin_open
        )

    async def launch(
        self,
        live: LiveWorker,
        argv: list[str],
        cwd: str,
        base_env: dict[str, str],
        stdin: str | None,
        *,
        stdin_open: bool = False,
    ) -> WorkerView:
        """Start the process of a registered worker (a new one, or a resumed attempt);
        `stdin_open`: its stdin a pipe the daemon holds, for `send`."""
        record = live.record
        archive = self.reader.archive_of(record.id)
        worker_env = base_env | {
            "PWD": cwd,  # the daemon's own PWD would name the wrong directory
            "SUBAGENTD_SOCKET": str(self.socket_path),
            "SUBAGENTD_WORKER_ID": record.id,
            "SUBAGENTD_RUN_ID": record.run,
            "SUBAGENTD_TOKEN": record.token,
            "SUBAGENTD_ARCHIVE": str(archive.path),
            "SUBAGENTD_RESULT": str(archive.file(Archive.RESULT)),
        }
        if record.attempt > 1:
            worker_env["SUBAGENTD_RESUME"] = str(record.attempt)
        try:
            process = await self.launcher.start(
                record.id, argv, cwd=cwd, env=worker_env, stdin_path=stdin, stdin_open=stdin_open
            )
        except SpawnFailed as exc:
            log.warning("worker.spawn_failed", worker=record.id, error=str(exc))
            self.end_unstarted(live, str(exc))
            if isinstance(exc, OutOfDescriptors):
                raise self._out_of_descriptors(record.id, exc) from exc
            return record.view()
        self.problems.descriptors = None
        self.registry.started(record.id, process.pid, process.starttime, _pipe_inodes(process))
        self.supervisor.supervise(
            live, process, after_start=lambda: self._write_start(live, process.pid, argv)
        )
        return record.view()

    def _write_start(self, live: LiveWorker, pid: int, argv: list[str]) -> None:
        """Write a worker's start down, after its spawn is answered: its journal's first
        state and its pid in the store. A crash before this leaves its registration
        without a pid, as a crash between registration and the fork always did:
        recovery ends its tree by its cgroup, else by its worker id, and the worker
        is `interrupted` (a reload carries the pid from memory)."""
        record = live.record
        if ("die-before-start-written", record.name) in self.faults:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash in this window, for the tests
        try:
            live.journal.append("state", f"running pid={pid}".encode(), self.clock())
            # Its pid, for recovery to end its tree by if the daemon dies.
            self.store.commit(Change(workers=[record]), "a worker's start")
        except OSError as exc:
            self.problems.disk_failed(f"archive of {record.id}", exc)
        else:
            self.problems.disk_ok()
        log.info(
            "worker.started",
            worker=record.id,
            run=record.run,
            pid=pid,
            attempt=record.attempt,
            argv=argv,
        )

    def end_unstarted(self, live: LiveWorker, why: str) -> None:
        """End a registered worker whose process never started (saying why in its journal)."""
        try:
            live.journal.append("note", why.encode(), self.clock())
        except OSError as exc:
            self.problems.disk_failed(f"journal of {live.record.id}", exc)
        self.supervisor.end_unstarted(live)
        self.endings.finish(live.record, live.journal, None, b"")
        live.ended.set()
        live.grown.set()

    # -- supervising ---------------------------------------------------------

    async def _write_what_the_store_kept_out(self) -> None:
        """Retry, backing off, the changes a failing disk kept out of the store (an
        ending, an ack) until they go in: a daemon with nothing else to write must not
        leave them to a crash, which would end those workers again and wake twice."""
        while True:
            wanted = trio.Event()
            self.store.on_unwritten = wanted.set
            delay = STORE_RETRY_FIRST
            while self.store.unwritten:  # kept out before this task began, too
                await trio.sleep(delay)
                delay = min(delay * 2, STORE_RETRY_MAX)
                try:
                    self.store.flush()
                except OSError as exc:
                    self.problems.disk_failed("store", exc)
            await wanted.wait()

    async def _check_the_store_is_linked(self) -> None:
        """Each commit checks that the store's files are still the ones linked in the state
        dir; this checks a daemon that writes nothing too, so that a store unlinked while
        it idles is put back before a crash could lose it (`Store.check_linked`)."""
        while True:
            await trio.sleep(STORE_LINK_CHECK_EVERY)
            self.store.check_linked()

    async def _make_spare_archives(self) -> None:
        """Keep archive directories made ahead for the next spawns, in a thread."""
        await trio.to_thread.run_sync(self.spares.reuse_left)
        failing = False
        while True:
            if self.spares.wanted > 0:
                try:
                    made = await trio.to_thread.run_sync(self.spares.make, self.spares.wanted)
                except OSError as exc:
                    # A full disk: spawns make their own (and say so if they cannot).
                    if not failing:
                        log.warning("archives.no_spares", error=str(exc))
                    failing = True
                else:
                    failing = False
                    self.spares.ready.extend(made)
                    continue
            await self._spares_wanted.wait()
            self._spares_wanted = trio.Event()

    def _out_of_descriptors(self, worker_id: str, exc: OutOfDescriptors) -> Busy:
        """Report a spawn that found no descriptor; the refusal its client gets."""
        self.problems.descriptors = f"{exc}; spawns fail until connections or workers close"
        log.error("daemon.out_of_descriptors", worker=worker_id, error=str(exc))
        return Busy(
            f"{exc}; worker {worker_id} ended failed. Close connections or raise the "
            "daemon's descriptor limit (ulimit -n, LimitNOFILE=), then spawn again",
            retry_after=DESCRIPTORS_RETRY,
        )

    # -- stopping ------------------------------------------------------------

    def send(self, worker_id: str, data: bytes, *, eof: bool) -> int:
        """Write to a live worker's stdin (see `Supervisor.write_stdin`)."""
        found = self.reader.lookup(worker_id)
        live = self.supervisor.get(worker_id)
        if live is None or live.returncode is not None:  # reaped, its ending being written
            raise Refused(f"cannot send to worker {worker_id}: it has ended ({found.state})")
        return self.supervisor.write_stdin(live, data, eof=eof)

    def stop(self, worker_id: str) -> Stopping:
        """Stop a worker and its subtree. `wait_stopped` waits for them to end.

        An id whose handle was released (collected, expired) is found, ended,
        and so stops nothing; only an id never seen is not found.
        """
        if not self.registry.holds(worker_id):
            try:
                self.reader.lookup(worker_id)
            except NotFound:
                return Stopping(found=False)
            return Stopping()
        already = self.registry.stopping_among(self.registry.subtree(worker_id))
        stopped = self.registry.stop(worker_id)
        self.supervisor.ask_stop(stopped)
        self.after_answer(
            functools.partial(
                log.info, "worker.stop_asked", worker=worker_id, stopped=stopped, already=already
            )
        )
        return Stopping(stopped=stopped, already=already)

    async def wait_stopped(self, worker_id: str) -> None:
        """Return once a worker and its subtree have ended (a stop's wait)."""
        if self.registry.holds(worker_id):
            await self.supervisor.wait_ended(list(self.registry.subtree(worker_id)))

    def new_run(self, outer: str | None) -> str:
        run = self.registry.new_run(self.clock(), outer)
        # The outer run is no longer implicit: a restart must keep it too.
        self.save_runs([run.id] if outer is None else [run.id, outer])
        return run.id

    def save_runs(self, run_ids: list[str]) -> None:
        """Write runs to the store (their nesting and stop flags outlive a crash)."""
        runs = [self.registry.run(r) for r in run_ids]
        self.store.commit(Change(runs=runs), "a run")
        self._saved_runs.update(run_ids)

    def _save_launch(self) -> None:
        """Write the launch turn and fence (a restart starts from them)."""
        registry = self.registry
        launch = LaunchState(
            turn=registry.turn, fence=registry.fence, fence_epochs=registry.fence_epochs
        )
        try:
            self.store.commit(Change(launch=launch), "the launch turn and fence")
        except OSError as exc:
            self.problems.disk_failed("store (the launch fence)", exc)

    def begin_turn(self) -> int:
        turn = self.registry.begin_turn()
        self._save_launch()
        return turn

    def set_fence(self) -> int:
        epoch = self.registry.set_fence()
        self._save_launch()
        return epoch

    def clear_fence(self) -> None:
        self.registry.clear_fence()
        self._save_launch()

    def stop_run(self, run_id: str) -> Stopping:
        """Stop a run and the runs nested in it: workers in flight, and every later spawn.
        `wait_run_ended` waits for them to end."""
        if not self.registry.has_run(run_id):
            return Stopping(found=False)
        members = self.registry.listing(include_ended=False, run=run_id)
        already = self.registry.stopping_among(r.id for r in members)
        stopped = self.registry.stop_run(run_id)
        try:
            self.save_runs(list(self.registry.runs_within(run_id)))
        except OSError as exc:  # stopped in memory regardless: a crash would forget it
            self.problems.disk_failed("store (a run)", exc)
        self.supervisor.ask_stop(stopped)
        for run in self.registry.runs_within(run_id):
            if (event := self._run_stopped.pop(run, None)) is not None:
                event.set()
        log.info("run.stop_asked", run=run_id, stopped=stopped, already=already)
        return Stopping(stopped=stopped, already=already)

    def reopen_run(self, run_id: str) -> list[str]:
        """Start a stopped run again (and the runs nested in it): the one way a stop is
        undone. Written before it is answered; a store that cannot take it leaves them
        stopped."""
        opened = self.registry.reopen_run(run_id)
        if opened:
            try:
                self.save_runs(opened)
            except BaseException:
                for run in opened:
                    self.registry.run(run).stopped = True
                raise
        log.info("run.reopened", run=run_id, opened=opened)
        return opened

    async def wait_run_ended(self, run_id: str) -> None:
        """Return once every live worker of a run (and of the runs nested in it) has ended
        (a stop_run's wait)."""
        if self.registry.has_run(run_id):
            members = [r.id for r in self.registry.listing(include_ended=False, run=run_id)]
            await self.supervisor.wait_ended(members)

    async def wait_run_stopped(self, run_id: str) -> None:
        """Return once `run_id` is stopped, by whoever and through whichever outer run."""
        self.registry.run(run_id)
        if not self.registry.run_stopped(run_id):
            await self._run_stopped.setdefault(run_id, trio.Event()).wait()

    def cancel(self, scope: str) -> Stopping:
        kind, _, target = scope.partition(":")
        if kind == "worker" and not self.registry.holds(target):
            self.reader.lookup(target)  # not_found for an id never seen
            return Stopping()  # ended and released: nothing to cancel
        already = self.registry.stopping_among(self.registry.in_scope(scope))
        cancelled = self.registry.cancel(scope)
        self.supervisor.ask_stop(cancelled)
        log.info("scope.cancelled", scope=scope, cancelled=cancelled, already=already)
        return Stopping(stopped=cancelled, already=already)

    def cancel_fence(self, epoch: int) -> Stopping:
        already = self.registry.stopping_among(self.registry.under_fence(epoch))
        cancelled = self.registry.cancel_fence(epoch)
        self._save_launch()
        self.supervisor.ask_stop(cancelled)
        log.info("fence.cancelled", epoch=epoch, cancelled=cancelled, already=already)
        return Stopping(stopped=cancelled, already=already)

    async def shutdown(self) -> None:
        """Stop every worker and wait until all are gone; start none meanwhile."""
        self.shutting_down = True
        while self.supervisor:  # a spawn already past its checks may still land: stop it too
            ids = self.registry.stop_all("shutdown")
            self.supervisor.ask_stop(ids)
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

    def info(self, caller: str | None = None) -> DaemonInfo:
        """The daemon's state, as told to a connection acting as `caller` (None: the user)."""
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
            problems=self.problems.current()
            + self._unwritten_problem()
            + self.store.problems
            + self.registry.damage,
            recovering=None
            if self.recovering is None
            else self.recovering.view(trio.current_time()),
        )

    def _unwritten_problem(self) -> list[str]:
        count = self.store.unwritten
        if not count:
            return []
        return [
            f"{count} change(s) (endings, acknowledgements) are not yet in the store "
            f"{self.store.path}: a failing disk kept them out; retried until they go in"
        ]


#: A change the store's disk kept out is tried again after this, doubling up to the max.
STORE_RETRY_FIRST = 0.1
STORE_RETRY_MAX = 5.0
#: How often an idle daemon checks that its store's files are still linked (two stats).
STORE_LINK_CHECK_EVERY = 5.0
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


def _pipe_inodes(process: WorkerProcess) -> tuple[int, int, int]:
    """The inodes of a worker's stdin, stdout and stderr pipes (0: none), as the daemon
    holds their other ends: written with its start, what tells its pipes after a reload
    whose checkpoint does not read (`lifecycle/_rebuilt.py`)."""
    inodes = []
    for fd in (process.stdin, process.stdout, process.stderr):
        try:
            inodes.append(os.fstat(fd).st_ino if fd is not None else 0)
        except OSError:
            inodes.append(0)
    return inodes[0], inodes[1], inodes[2]
