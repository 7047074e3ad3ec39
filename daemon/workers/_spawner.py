"""The spawn path: a spawn from its request to a supervised process. Its idempotency key
(found, written with the worker's registration, remembered), its archive (a spare one
made ahead where there is one), its launch, and its refusals (shutting down, reloading, a
full disk, no descriptor left). A resume's attempt starts down the same `launch`. The
scheduler of issues 26-28 (caps, a queue, after, retries) plugs in here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from subagentd.protocol import LimitError, Limits, Spawn, WorkerView
from subagentd.protocol.errors import Busy, Invalid, Refused, Reloading, RunStopped

from .._faults import Faults
from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry, WorkerRecord
from ..core._request_keys import AskedKey, KeyRecord, RequestKeys, asked_key
from ..processes._controllers import LimitPlan
from ..processes._launcher import Launcher
from ..processes._process import OutOfDescriptors, SpawnFailed, WorkerProcess
from ..processes._tree import DESCRIPTOR_ERRNOS
from ..store._archive import Archive, Snapshot, SpareArchives
from ..store._journal import Journal
from ..store._statedir import StateDir
from ..store._store import Change, Store
from ._agents import AgentDef, ConfigError, frozen_agent, load_agents
from ._command import Launch, inherited_env, own_bin_dir, resolve, worker_environment
from ._endings import Endings
from ._git import git_state
from ._grep import compile_pattern
from ._queue import Held, Queue
from ._reader import Reader
from ._readiness import Readiness
from ._supervisor import LiveWorker, Supervisor

log = get_logger()

#: What a client refused during a reload is told to wait before it tries again.
RELOAD_RETRY = 0.2
#: What a spawn refused for want of file descriptors is told to wait.
DESCRIPTORS_RETRY = 1.0
#: How often, and how many times, `lose-answer` asks for its reload (one refused `busy`,
#: the last reload a moment ago, is asked again).
LOSE_ANSWER_EVERY = 0.25
LOSE_ANSWER_TRIES = 40


class Spawner:
    """A spawn from request to supervised process; owns the request keys, the spare
    archives, the agents config and the launch gate (reloading, shutting down)."""

    def __init__(
        self,
        state_dir: StateDir,
        registry: Registry,
        store: Store,
        reader: Reader,
        supervisor: Supervisor,
        endings: Endings,
        problems: Problems,
        launcher: Launcher,
        *,
        socket_path: Path,
        config_path: Path,
        clock: Callable[[], float],
        faults: Faults,
        request_key_ttl: float,
        saved_runs: set[str],
    ) -> None:
        """`saved_runs`: the runs whose rows the store has, shared with the daemon's
        `save_runs` (a spawn into one writes no row for it)."""
        self._state_dir = state_dir
        self._registry = registry
        self._store = store
        self._reader = reader
        self._supervisor = supervisor
        self._endings = endings
        self._problems = problems
        self._launcher = launcher
        self._socket_path = socket_path
        self._config_path = config_path
        self._clock = clock
        self._faults = faults
        self._saved_runs = saved_runs
        self.agents: dict[str, AgentDef] = {}
        self.config_error: str | None = None
        #: While set, spawns are refused with `reloading` (a reload's launch fence).
        self.reloading = False
        #: Set once for good when the daemon begins to stop: no spawn, resume or reload.
        self.shutting_down = False
        #: The recent idempotency keys of spawns and resumes, as the store keeps them.
        self.request_keys = RequestKeys(request_key_ttl)
        #: Keys forgotten here and still in the store: dropped by the next keyed change.
        self._keys_to_drop = self.request_keys.load(store.request_keys(), clock())
        self.spares = SpareArchives(state_dir.archives)
        self._spares_wanted = trio.Event()
        #: What every worker inherits of the daemon's environment (read once: it never changes).
        self.inherited_env = inherited_env(os.environ)
        #: The daemon's own bin directory, put last on every worker's PATH (`subagentctl`).
        self.tools = own_bin_dir()
        #: Workers spawned over a cap, waiting their turn (the registry's schedule decides).
        self.queue = Queue(
            registry,
            store,
            reader,
            supervisor,
            problems,
            clock=clock,
            launch=lambda live, held: self.launch(
                live, held.argv, held.cwd, held.env, held.stdin, stdin_open=held.stdin_open
            ),
            end_unstarted=self.end_unstarted,
            end_unopened=self._endings.without_journal,
            environment=lambda env: worker_environment(self.inherited_env, env, self.tools),
            may_launch=lambda: not self.reloading and not self.shutting_down,
        )
        registry.schedule.agent_cap = self._agent_cap
        #: Workers spawned with a ready pattern, searched until it matches.
        self.readiness = Readiness(registry, store, reader, supervisor, problems, clock=clock)
        self.readiness.on_ready = self.queue.slot_freed  # whoever starts after it may go
        self.load_config()

    def _agent_cap(self, agent: str) -> int | None:
        """An agent's cap on its workers running at once (agents.toml's `max_running`)."""
        found = self.agents.get(agent)
        return None if found is None else found.max_running

    def load_config(self) -> None:
        try:
            self.agents = load_agents(self._config_path)
            self.config_error = None
        except ConfigError as exc:
            # The daemon serves on without agents; spawns of an agent say why.
            self.agents = {}
            self.config_error = str(exc)
            log.error("config.invalid", error=self.config_error)

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
        if request.ready is not None:
            try:
                compile_pattern(request.ready)
            except Invalid as exc:  # "pattern: ...": said of this field
                raise Invalid(f"ready: {exc.message.removeprefix('pattern: ')}") from None
        for named in (*request.after, *request.after_ok, *request.after_ready):
            self._reader.lookup(named)  # not_found for a worker never seen
        launch = resolve(
            request,
            agents=self.agents,
            config_path=self._config_path,
            config_error=self.config_error,
            inherited=self.inherited_env,
            tools=self.tools,
        )
        limits = self._limits_of(request, launch)
        if request.parent is not None and not self._registry.holds(request.parent):
            ended = self._reader.lookup(request.parent)  # released: it has ended
            raise RunStopped(
                f"worker {request.parent} has ended ({ended.state}); it cannot delegate"
            )
        with self._supervisor.launching(), trio.CancelScope(shield=True):
            view = await self._start(request, caller, launch, asked, limits)
        # Made again once this spawn is done, not while it competes for the CPU.
        self._spares_wanted.set()
        if ("lose-answer", request.name) in self._faults:
            await self._lose_the_answer()
        return view

    def _limits_of(self, request: Spawn, launch: Launch) -> Limits | None:
        """A spawn's own limits: its agent's, with the request's laid over them kind by
        kind; refused naming why where the kernel here cannot enforce one."""
        limits = Limits()
        if launch.agent is not None:
            try:
                limits = launch.agent.limits() or limits
            except LimitError as exc:  # checked at load: only a definition loaded around it
                raise Invalid(f"agent {request.agent!r}: {exc}") from exc
        if request.limits is not None:
            for kind in ("memory", "cpus", "pids"):
                if (value := getattr(request.limits, kind)) is not None:
                    setattr(limits, kind, value)
        if not limits:
            return None
        self._launcher.controllers.refuse_unenforced(limits, "the spawn")
        return limits

    def made_already(self, asked: AskedKey | None) -> WorkerView | None:
        """The worker a request with this key made (or resumed) already, as it is now;
        None if the key is new (or forgotten). Invalid if it came with another request."""
        if asked is None:
            return None
        known = self.request_keys.find(asked.caller, asked.key, self._clock())
        if known is None:
            return None
        if known.digest != asked.digest:
            raise Invalid(
                f"key {asked.key!r} was used for a different request (the one that made "
                f"worker {known.worker}): each request needs a key of its own"
            )
        log.info("request.repeated", worker=known.worker)
        return self._reader.lookup(known.worker).view()

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
        self,
        request: Spawn,
        caller: str | None,
        launch: Launch,
        asked: AskedKey | None,
        limits: Limits | None,
    ) -> WorkerView:
        argv, env, cwd = launch.argv, launch.env, launch.cwd
        now = self._clock()
        record = self._registry.register(
            now=now,
            argv=argv,
            cwd=cwd,
            archive_for=lambda worker_id: str(self._state_dir.archives / worker_id),
            run=request.run,
            parent=request.parent or caller,
            name=request.name,
            agent=request.agent,
            grace=launch.grace,
            timeout=launch.timeout,
            limits=limits,
            priority=request.priority,
            **_retry_policy(request, launch.agent),
            ready=request.ready,
            after=(request.after, request.after_ok, request.after_ready),
        )
        if record.stop_reason is None:
            self._registry.admit(record)  # over a cap, it waits: queued in its first write
        try:
            # In the store before its archive or process exists, so a crash at any point
            # after leaves a record for recovery to find. A run's row changes only when
            # the run does; an implicit run's is written only if it is stopped (recovery
            # takes a run without one as implicit).
            change = Change(workers=[record])
            if record.run not in self._saved_runs and not self._registry.run(record.run).implicit:
                change.runs.append(self._registry.run(record.run))
            # Its key in the same transaction: no crash leaves one without the other.
            key = self.keyed(change, asked, record.id, now)
            self._store.commit(change, "registering a worker")
            self.remember(key, now)
            self._saved_runs.update(r.id for r in change.runs)
            archive = self.spares.take(record.id)
            if archive is None:
                archive = self._reader.archive_of(record.id)
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
                    limits=limits,
                )
            )
            stdin = None if request.input is None else str(archive.write_input(request.input))
            journal = Journal.create(archive.file(Archive.JOURNAL))
        except OSError as exc:
            # A full disk: the worker never starts, and says why.
            self._registry.ended(record.id, None, now)
            # Its row says it ended, or a restart would bring it back `interrupted` and
            # wake its parent for a spawn its client was told was refused.
            refused = Change(workers=[record])
            if asked is not None:  # sent again, it is tried again: it was refused, not made
                self.request_keys.forget(asked.caller, asked.key)
                refused.dropped_keys.append((asked.caller, asked.key))
            with contextlib.suppress(OSError):
                self._store.commit(refused, "a refused spawn", redo=True)
            if exc.errno in DESCRIPTOR_ERRNOS:
                raise self._out_of_descriptors(
                    record.id, OutOfDescriptors(exc, "its archive")
                ) from exc
            self._problems.disk_failed(f"archive of {record.id}", exc)
            raise Refused(
                f"cannot create worker {record.id}'s archive in {self._state_dir.archives}: "
                f"{exc.strerror or exc}; free some space and spawn again"
            ) from exc
        live = LiveWorker(record=record, journal=journal)
        if record.queued is not None:
            held = Held(argv, cwd, launch.worker_env, stdin, request.stdin_open)
            return self.queue.hold(live, held)
        self._supervisor.add(live)
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
        archive = self._reader.archive_of(record.id)
        worker_env = base_env | {
            "PWD": cwd,  # the daemon's own PWD would name the wrong directory
            "SUBAGENTD_SOCKET": str(self._socket_path),
            "SUBAGENTD_WORKER_ID": record.id,
            "SUBAGENTD_RUN_ID": record.run,
            "SUBAGENTD_TOKEN": record.token,
            "SUBAGENTD_ARCHIVE": str(archive.path),
            "SUBAGENTD_RESULT": str(archive.file(Archive.RESULT)),
        }
        if record.attempt > 1:
            worker_env["SUBAGENTD_RESUME"] = str(record.attempt)
        plan = self._limit_plan(record)
        record.ready_since = live.journal.last_seq  # its ready line is this attempt's
        try:
            process = await self._launcher.start(
                record.id,
                argv,
                cwd=cwd,
                env=worker_env,
                stdin_path=stdin,
                stdin_open=stdin_open,
                limits=plan,
            )
        except SpawnFailed as exc:
            log.warning("worker.spawn_failed", worker=record.id, error=str(exc))
            self.end_unstarted(live, str(exc))
            if isinstance(exc, OutOfDescriptors):
                raise self._out_of_descriptors(record.id, exc) from exc
            return record.view()
        self._problems.descriptors = None
        self._registry.started(record.id, process.pid, process.starttime, _pipe_inodes(process))
        self._supervisor.supervise(
            live, process, after_start=lambda: self._write_start(live, process.pid, argv)
        )
        self.readiness.watch(record)
        return record.view()

    def _limit_plan(self, record: WorkerRecord) -> LimitPlan | None:
        """Where the worker's limit nodes go (its record keeps the path, for the image that
        ends it); None, and no node at all, when nothing on its way has a limit."""
        path, values = self._registry.limit_chain(record)
        parent = self._registry.handle(record.parent) if record.parent is not None else None
        plan = LimitPlan(path, values, nested=parent is not None and bool(parent.limit_path))
        if ("hold-in-nodes", record.name) in self._faults:
            plan = dataclasses.replace(plan, hold=self._state_dir.root / "hold-in-nodes")
        if not self._launcher.controllers.places(plan):
            record.limit_path = ""
            return None
        record.limit_path = plan.relative
        return plan

    def _write_start(self, live: LiveWorker, pid: int, argv: list[str]) -> None:
        """Write a worker's start down, after its spawn is answered: its journal's first
        state and its pid in the store. A crash before this leaves its registration
        without a pid, as a crash between registration and the fork always did:
        recovery ends its tree by its cgroup, else by its worker id, and the worker
        is `interrupted` (a reload carries the pid from memory)."""
        record = live.record
        if ("die-before-start-written", record.name) in self._faults:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash in this window, for the tests
        try:
            live.journal.append("state", f"running pid={pid}".encode(), self._clock())
            # Its pid, for recovery to end its tree by if the daemon dies.
            self._store.commit(Change(workers=[record]), "a worker's start")
        except OSError as exc:
            self._problems.disk_failed(f"archive of {record.id}", exc)
        else:
            self._problems.disk_ok()
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
            live.journal.append("note", why.encode(), self._clock())
        except OSError as exc:
            self._problems.disk_failed(f"journal of {live.record.id}", exc)
        self._supervisor.end_unstarted(live)
        self._endings.finish(live.record, live.journal, None, b"")
        live.ended.set()
        live.grown.set()

    async def make_spare_archives(self) -> None:
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
        self._problems.descriptors = f"{exc}; spawns fail until connections or workers close"
        log.error("daemon.out_of_descriptors", worker=worker_id, error=str(exc))
        return Busy(
            f"{exc}; worker {worker_id} ended failed. Close connections or raise the "
            "daemon's descriptor limit (ulimit -n, LimitNOFILE=), then spawn again",
            retry_after=DESCRIPTORS_RETRY,
        )


def _retry_policy(request: Spawn, agent: AgentDef | None) -> dict[str, Any]:
    """A spawn's retries, backoff and what else is retried: its own if it gives retries,
    else its agent's (agents.toml), else none."""
    source: Spawn | AgentDef = request
    if not request.retries and agent is not None and agent.retries:
        source = agent
    return {
        "retries": source.retries,
        "backoff": source.backoff,
        "backoff_max": source.backoff_max,
        "retry_on": list(source.retry_on),
    }


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
