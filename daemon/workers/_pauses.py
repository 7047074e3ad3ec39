"""Pausing exactly what was asked: a worker's subtree (it and every live worker it
delegated, at any depth), or a run's live workers (the runs nested in it included); and
letting them go on. The registry says who is in reach; the supervisor keeps each
record's paused time (so a timeout does not run meanwhile) and its journal; the
launcher holds the processes still (`processes/_freezer.py`).

Only workers running, with a process, and not being stopped are paused or unpaused: a
worker starting has no tree yet, and one whose stop is in flight must take its TERM (a
stop thaws a paused worker first), as must what is left of one whose own process has
exited (its tree being ended: a pause of it would outlast it). A worker spawned later
into a paused subtree is not paused: its parent, frozen, cannot have asked for it, and
whoever did wants it to run.

One pause or unpause of a worker at a time, so two never cross in the kernel's freezer
(or in the signals sent over its tree); each holds the workers it reaches (`WorkerLocks`,
taken in id order, so two reaching overlapping sets cannot wait on each other in a
circle), never the others: a freeze that does not settle (the kernel's wait for
`frozen 1`, bounded at 5 s) holds up the pauses of those it reaches, not every pause.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import trio

from subagentd.protocol.errors import Invalid, Refused

from .._faults import Faults
from .._logging import get_logger
from ..core._registry import Registry
from ..processes._launcher import Launcher
from ..processes._process import WorkerProcess
from ._reader import Reader
from ._supervisor import LiveWorker, Supervisor

log = get_logger()


@dataclass(frozen=True)
class Pausing:
    """What a pause or an unpause did: ``changed``, the ids newly paused (or let go on);
    ``already``, those in reach that already were (or were not paused)."""

    changed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    #: A pause's: how many processes of each worker it held outside its cgroup.
    held_outside: dict[str, int] = field(default_factory=dict)


@dataclass
class _Lock:
    lock: trio.Lock = field(default_factory=trio.Lock)
    #: The pauses and unpauses holding or waiting for it: gone from `WorkerLocks` at 0.
    users: int = 0


class WorkerLocks:
    """A lock a worker, for those being paused or unpaused; kept only while in use."""

    def __init__(self) -> None:
        self._locks: dict[str, _Lock] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def holding(self, ids: Iterable[str]) -> AsyncIterator[frozenset[str]]:
        """Hold each worker's lock (taken in id order) for the body; the ids held."""
        ordered = sorted(set(ids))
        for worker_id in ordered:
            self._locks.setdefault(worker_id, _Lock()).users += 1
        try:
            async with contextlib.AsyncExitStack() as stack:
                for worker_id in ordered:
                    await stack.enter_async_context(self._locks[worker_id].lock)
                yield frozenset(ordered)
        finally:
            for worker_id in ordered:
                entry = self._locks[worker_id]
                entry.users -= 1
                if not entry.users:
                    del self._locks[worker_id]


class Pauses:
    """The pause verbs: pause and unpause, of a worker's subtree or of a run."""

    def __init__(
        self,
        registry: Registry,
        reader: Reader,
        supervisor: Supervisor,
        launcher: Launcher,
        faults: Faults,
    ) -> None:
        self._registry = registry
        self._reader = reader
        self._supervisor = supervisor
        self._launcher = launcher
        self._faults = faults
        self.locks = WorkerLocks()

    @contextlib.asynccontextmanager
    async def _holding(
        self, verb: str, worker: str | None, run: str | None
    ) -> AsyncIterator[list[LiveWorker]]:
        """The live workers in reach, their locks held for the body: found before the
        wait (refused then if none), and again once they are held, of those held (one
        spawned meanwhile is not reached; one ended or being stopped meanwhile is not)."""
        first = self._reach(verb, worker, run)
        async with self.locks.holding(live.record.id for live in first) as held:
            yield [live for live in self._reach(verb, worker, run) if live.record.id in held]

    async def pause(self, worker: str | None, run: str | None) -> Pausing:
        async with self._holding("pause", worker, run) as reached:
            fresh = [live for live in reached if live.record.paused_since is None]
            already = sorted(live.record.id for live in reached if live not in fresh)
            for live in fresh:
                self._supervisor.paused(live)
            for live in fresh:  # for the tests: a freeze the kernel is slow to settle
                await self._faults.hold_at("hold-pause", live.record.name)
            done = await self._launcher.pause(_targets(fresh))
            changed = sorted(live.record.id for live in fresh)
            if done.unsettled:
                log.warning("worker.pause_unsettled", workers=done.unsettled)
            for live in fresh:
                if pids := done.held_outside.get(live.record.id):
                    self._supervisor.held_outside(live, pids)
            log.info("worker.paused", paused=changed, already=already, outside=done.held_outside)
            held = {worker_id: len(pids) for worker_id, pids in done.held_outside.items()}
            return Pausing(changed=changed, already=already, held_outside=held)

    async def unpause(self, worker: str | None, run: str | None) -> Pausing:
        async with self._holding("unpause", worker, run) as reached:
            fresh = [live for live in reached if live.record.paused_since is not None]
            already = sorted(live.record.id for live in reached if live not in fresh)
            await self._launcher.unpause(_targets(fresh))
            for live in fresh:
                self._supervisor.unpaused(live)
            changed = sorted(live.record.id for live in fresh)
            log.info("worker.unpaused", unpaused=changed, already=already)
            return Pausing(changed=changed, already=already)

    def _reach(self, verb: str, worker: str | None, run: str | None) -> list[LiveWorker]:
        """The live workers a pause of `worker`'s subtree or of `run` reaches; Invalid
        unless exactly one is given, NotFound for one never seen, Refused if nothing in
        reach is running."""
        if (worker is None) == (run is None):
            raise Invalid(
                f"{verb} takes exactly one of worker (a worker and its subtree) and run "
                f"(a run's workers); {'both' if worker is not None else 'neither'} given"
            )
        if worker is not None:
            if not self._registry.holds(worker):
                self._reader.lookup(worker)  # not_found for an id never seen
                raise Refused(f"worker {worker} has ended (its handle released): nothing to {verb}")
            ids = list(self._registry.subtree(worker))
            what = f"worker {worker}'s subtree"
        else:
            assert run is not None
            run_id = self._registry.run(run).id  # not_found for a run never seen
            ids = [r.id for r in self._registry.listing(include_ended=False, run=run_id)]
            what = f"run {run_id}"
        reached = [
            live
            for worker_id in ids
            if (live := self._supervisor.get(worker_id)) is not None
            and live.process is not None
            and not live.record.ended
            and not live.stop_asked
            and not live.terminating  # its own process exited: its tree is being ended
        ]
        if not reached:
            states = {
                record.state
                for worker_id in ids
                if (record := self._registry.handle(worker_id)) is not None
            }
            why = ", ".join(sorted(states)) or "none"
            raise Refused(
                f"nothing running in {what} to {verb} (its workers: {why}; a worker ended, "
                "starting, being stopped or ending is not paused)"
            )
        return reached


def _targets(lives: list[LiveWorker]) -> list[tuple[str, WorkerProcess]]:
    return [(live.record.id, live.process) for live in lives if live.process is not None]
