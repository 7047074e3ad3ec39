"""Resuming: carrying an ended worker or run on from its snapshot.

The rules of what may be resumed live in `workers/_resumable`; this module does it, on
the daemon: a worker comes back into memory (from the store, if its handle was
released) as its next attempt and starts down the same launch path as a new
spawn, and what changed on disk since its spawn is said in its answer and its
journal's resume note. Which runs were started where is a query on the store,
not a scan.
"""

from __future__ import annotations

import trio

from subagentd.protocol import ResumableRun, WorkerView
from subagentd.protocol.errors import Invalid, NotFound, Refused, Reloading

from .._daemon import Daemon
from .._logging import get_logger
from ..core._registry import WorkerRecord
from ..core._request_keys import AskedKey
from ..store._archive import STDOUT_TAIL_BYTES, Archive, Snapshot
from ..store._files import NotRegularFile
from ..store._journal import Journal
from ..store._store import Change
from ..workers._agents import AgentDef, ConfigError, load_agents
from ..workers._command import launch_problem, real_dir, worker_environment
from ..workers._resumable import (
    RESUMABLE,
    Resumption,
    changes_since_spawn,
    check_branch,
    read_snapshot,
)
from ..workers._spawner import RELOAD_RETRY
from ..workers._supervisor import LiveWorker

log = get_logger()


class Resumer:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def resume(
        self, worker_id: str, worker_timeout: float | None, asked: AskedKey | None = None
    ) -> Resumption:
        """Carry a stopped, failed, timed-out or interrupted worker on from its snapshot:
        same id, next attempt, same journal; only the timeout may be given anew.
        ``asked``: its idempotency key; a repeat answers the attempt the first started."""
        if (resumed := self.daemon.spawner.made_already(asked)) is not None:
            return Resumption(resumed, "")  # said to the first: see protocol/README.md
        self._check_fence()
        with self.daemon.supervisor.launching(), trio.CancelScope(shield=True):
            view = await self._resume_one(worker_id, worker_timeout, asked)
        return view

    def _check_fence(self) -> None:
        """Refuse a resume the daemon cannot start now; once past this, a reload's freeze
        waits for it (its launch is counted)."""
        if self.daemon.spawner.shutting_down:
            raise Refused("the daemon is shutting down: it resumes nothing")
        if self.daemon.spawner.reloading:
            raise Reloading("the daemon is reloading; resume again", retry_after=RELOAD_RETRY)

    async def _resume_one(
        self, worker_id: str, worker_timeout: float | None, asked: AskedKey | None = None
    ) -> Resumption:
        """`resume`, past the fence, its launch counted and shielded by the caller."""
        found = self.daemon.reader.lookup(worker_id)
        self._check_resumable(found.id, found.state)
        archive = self.daemon.reader.archive_of(found.id)
        snapshot = read_snapshot(archive, worker_id)
        self._check_runnable(snapshot, worker_id)
        check_branch(snapshot, worker_id)
        record = self.daemon.registry.handle(worker_id) or self.daemon.store.worker(worker_id)
        if record is None:
            raise Refused(f"worker {worker_id} cannot be resumed: its record is unreadable")
        if worker_timeout is not None and worker_timeout < 0:
            raise Invalid(f"timeout must be zero or more seconds, not {worker_timeout}")
        changed = changes_since_spawn(snapshot, *self._agents_on_disk(snapshot))
        view = await self._reopen(record, snapshot, archive, worker_timeout, changed, asked)
        return Resumption(view, changed)

    def _agents_on_disk(self, snapshot: Snapshot) -> tuple[dict[str, AgentDef] | None, str | None]:
        """agents.toml as it reads now (not as the daemon loaded it at its start or last
        reload): what the frozen definition is compared with; (None, why) if it does not
        load. Read only for an agent's worker."""
        if snapshot.agent is None:
            return {}, None
        try:
            return load_agents(self.daemon.config_path), None
        except ConfigError as exc:
            return None, str(exc)

    async def _reopen(
        self,
        record: WorkerRecord,
        snapshot: Snapshot,
        archive: Archive,
        worker_timeout: float | None,
        changed: str,
        asked: AskedKey | None,
    ) -> WorkerView:
        registry = self.daemon.registry
        # Its snapshot's limits, or none: a limit the kernel here cannot hold is refused.
        self.daemon.launcher.controllers.refuse_unenforced(snapshot.limits, "the resume")
        record.limits = snapshot.limits
        # Taken back into memory (its run as the store saved it: stopped, if it was), so
        # a stop that lands while its journal is verified reaches it and refuses this.
        saved_run = None if registry.has_run(record.run) else self.daemon.store.run(record.run)
        registry.begin_resume(record, saved_run)
        try:
            await self.daemon.faults.hold_at("hold-resume", record.name)
            # The journal first: if it cannot be opened, nothing has changed yet.
            journal = await self._open_journal(record.id, archive)
        except BaseException:
            registry.abandon_resume(record.id)
            raise
        try:
            record = registry.reopen(
                record,
                self.daemon.clock(),
                snapshot.timeout if worker_timeout is None else worker_timeout or None,
            )
        except Refused:  # stopped meanwhile: nothing ran, nothing was written
            journal.close()
            raise
        had_stone = registry.drop_tombstone(record.id)
        live = LiveWorker(record=record, journal=journal)
        self.daemon.supervisor.add(live)
        try:
            self.daemon.faults.raise_at("resume", record.name)
            # The new attempt, its run (taken back into memory, as stopped as it was), its
            # key, in one transaction; the last attempt's stdout tail no longer ends its stdout.
            change = Change(
                workers=[record],
                tails={record.id: b""},
                runs=[self.daemon.registry.run(record.run)],
                dropped_tombstones=[record.id] if had_stone else [],
            )
            now = self.daemon.clock()
            key = self.daemon.spawner.keyed(change, asked, record.id, now)
            self.daemon.store.commit(change, "a resume")
            self.daemon.spawner.remember(key, now)
            self.daemon.reader.forget_journal(record.id)  # its read-only view would go stale
            # The note is `attempt N: resumed` alone when nothing changed.
            note = f"attempt {record.attempt}: resumed"
            if changed:
                note += f"; changed since its spawn: {changed}"
            journal.append("note", note.encode(), self.daemon.clock())
            live.stdout_tail += journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
            stdin = str(archive.file(Archive.INPUT)) if snapshot.has_input else None
            base_env = self._environment(snapshot)
            return await self.daemon.spawner.launch(
                live, snapshot.argv, snapshot.cwd, base_env, stdin, stdin_open=snapshot.stdin_open
            )
        except Exception as exc:
            if live.process is None and record.id in self.daemon.supervisor:
                # Nothing started: the attempt ends here (its journal closed), never `starting`.
                log.exception("worker.resume_failed", worker=record.id)
                why = f"attempt {record.attempt} failed to start ({type(exc).__name__}: {exc})"
                self.daemon.spawner.end_unstarted(live, why)
            raise

    def _environment(self, snapshot: Snapshot) -> dict[str, str]:
        """The environment an attempt starts with, as a spawn's is made: the daemon's
        inherited one, the frozen env on top, the daemon's bin directory last on PATH."""
        return worker_environment(
            self.daemon.spawner.inherited_env, snapshot.env, self.daemon.spawner.tools
        )

    def _check_runnable(self, snapshot: Snapshot, worker_id: str) -> None:
        """Refuse, before anything runs (no attempt, no wake), a resume whose frozen command
        could not start now: its working directory gone, its program no longer found. A
        spawn is refused for the same before it is registered."""
        if problem := launch_problem(snapshot.argv, snapshot.cwd, self._environment(snapshot)):
            raise Refused(
                f"worker {worker_id} cannot be resumed: {problem}; "
                "put it back to resume, or start afresh"
            )

    async def _open_journal(self, worker_id: str, archive: Archive) -> Journal:
        """The journal, verified for writing in a thread (as long as its worker made
        it: the daemon serves meanwhile; a second resume of it is refused meanwhile:
        `Registry.begin_resume`)."""
        try:
            return await self.daemon.reader.open_journal(
                archive.file(Archive.JOURNAL), writable=True
            )
        except NotRegularFile:
            raise Refused(
                f"worker {worker_id} cannot be resumed: its journal is not a regular file "
                "of its own (a symlink, FIFO or hard link put in its place); start it afresh"
            ) from None

    @staticmethod
    def _check_resumable(worker_id: str, state: str) -> None:
        if state == "finished":
            raise Refused(f"worker {worker_id} ended well (finished): there is nothing to resume")
        if state not in RESUMABLE:
            raise Refused(f"worker {worker_id} is {state}: only an ended worker can be resumed")

    def _run_records(self, run_id: str) -> list[WorkerRecord]:
        """Every worker of a run, whether its handle is in memory or only in the store."""
        records = {r.id: r for r in self.daemon.store.workers_of_run(run_id)}
        records |= {r.id: r for r in self.daemon.registry.handles() if r.run == run_id}
        return list(records.values())

    def _resumable_heads(self, run_id: str) -> list[WorkerRecord]:
        """The highest unfinished workers of a run: those a resume of the run restarts.

        Refuses, with the reason, when the run ended well or a resume could not start.
        """
        records = self._run_records(run_id)
        if not records:
            raise NotFound(f"no run {run_id!r} in this state dir")
        if any(not r.ended for r in records):
            raise Refused(f"run {run_id} is still live: stop it, or resume its workers one by one")
        unfinished = {r.id: r for r in records if r.state in RESUMABLE}
        if not unfinished:
            raise Refused(f"run {run_id} ended well: every worker finished")
        heads = [r for r in unfinished.values() if r.parent not in unfinished]
        for record in heads:  # every head that would be refused refuses the run: none runs
            snapshot = read_snapshot(self.daemon.reader.archive_of(record.id), record.id)
            self._check_runnable(snapshot, record.id)
            check_branch(snapshot, record.id)
        return sorted(heads, key=lambda r: (r.started_at, r.id))

    async def resume_run(self, run_id: str) -> list[Resumption]:
        """A new live attempt of a run: its highest unfinished workers carry on.

        All of them or none as far as a reload goes: the fence is checked once, and the
        launches are counted (and shielded) together, so a reload asked meanwhile waits
        for every head rather than refusing the later ones after the earlier ran again.
        """
        self._check_fence()
        heads = self._resumable_heads(run_id)
        with self.daemon.supervisor.launching(), trio.CancelScope(shield=True):
            resumed = [await self._resume_one(record.id, None) for record in heads]
        return resumed

    def latest_resumable(self, cwd: str) -> ResumableRun:
        """The newest run started in `cwd` (by its real path, as a spawn keeps it) that a
        resume would take, with the workers it would carry on; else the newest run of `cwd`
        and why not. A run none of whose workers had a snapshot (spawns refused for want of
        disk or descriptors, or a snapshot removed) is no run a resume could start from."""
        try:
            here = real_dir(cwd)
        except ValueError:
            raise Invalid("cwd holds a NUL byte: no directory is named so") from None
        except RecursionError:  # a chain of symlinks deeper than realpath recurses
            raise Invalid(f"cwd {cwd!r} leads through too many symlinks") from None
        # run -> when its first worker was spawned: the index (cwd, spawned_at)
        started = self.daemon.store.runs_started_in(here)
        newest_first = sorted(started, key=lambda run: started[run], reverse=True)
        runs = [run for run in newest_first if self._has_snapshot(run)]
        if not runs:
            raise NotFound(f"no run with a snapshot to resume from was started in {here}")
        why_not = ""
        for run in runs:
            try:
                heads = self._resumable_heads(run)
            except (Refused, NotFound) as exc:
                why_not = why_not or exc.message  # the newest run's
                continue
            return ResumableRun(run=run, resumable=True, from_=[head.id for head in heads])
        return ResumableRun(run=runs[0], resumable=False, reason=why_not)

    def _has_snapshot(self, run_id: str) -> bool:
        return any(
            self.daemon.reader.archive_of(record.id).has_snapshot()
            for record in self._run_records(run_id)
        )
