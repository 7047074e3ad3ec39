"""Stopping exactly what was asked: a worker and its subtree, a run and the runs nested
in it, a scope, a fence's launches; and the waits for them to end. The registry decides
who stops; the supervisor sends the signals; what a stop changes of a run is written
through `Runs`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from subagentd.protocol.errors import NotFound

from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry
from ._afterwards import Afterwards
from ._reader import Reader
from ._runs import Runs
from ._supervisor import Supervisor

log = get_logger()


@dataclass(frozen=True)
class Stopping:
    """What a stop or cancel did: ``stopped``, the ids newly asked to stop; ``already``,
    those it reached whose stop was already in flight (left as they are); ``found``,
    false for an id or run the daemon never saw."""

    stopped: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    found: bool = True


class Stops:
    """The stop verbs: stop, stop_run, cancel, cancel_fence, and their waits."""

    def __init__(
        self,
        registry: Registry,
        reader: Reader,
        supervisor: Supervisor,
        runs: Runs,
        problems: Problems,
        afterwards: Afterwards,
    ) -> None:
        self._registry = registry
        self._reader = reader
        self._supervisor = supervisor
        self._runs = runs
        self._problems = problems
        self._afterwards = afterwards

    def stop(self, worker_id: str) -> Stopping:
        """Stop a worker and its subtree. `wait_stopped` waits for them to end.

        An id whose handle was released (collected, expired) is found, ended,
        and so stops nothing; only an id never seen is not found.
        """
        if not self._registry.holds(worker_id):
            try:
                self._reader.lookup(worker_id)
            except NotFound:
                return Stopping(found=False)
            return Stopping()
        already = self._registry.stopping_among(self._registry.subtree(worker_id))
        stopped = self._registry.stop(worker_id)
        self._supervisor.ask_stop(stopped)
        self._afterwards.later(
            functools.partial(
                log.info, "worker.stop_asked", worker=worker_id, stopped=stopped, already=already
            )
        )
        return Stopping(stopped=stopped, already=already)

    async def wait_stopped(self, worker_id: str) -> None:
        """Return once a worker and its subtree have ended (a stop's wait)."""
        if self._registry.holds(worker_id):
            await self._supervisor.wait_ended(list(self._registry.subtree(worker_id)))

    def stop_run(self, run_id: str) -> Stopping:
        """Stop a run and the runs nested in it: workers in flight, and every later spawn.
        `wait_run_ended` waits for them to end."""
        if not self._registry.has_run(run_id):
            return Stopping(found=False)
        members = self._registry.listing(include_ended=False, run=run_id)
        already = self._registry.stopping_among(r.id for r in members)
        stopped = self._registry.stop_run(run_id)
        try:
            self._runs.save_runs(list(self._registry.runs_within(run_id)))
        except OSError as exc:  # stopped in memory regardless: a crash would forget it
            self._problems.disk_failed("store (a run)", exc)
        self._supervisor.ask_stop(stopped)
        self._runs.stopped(run_id)
        log.info("run.stop_asked", run=run_id, stopped=stopped, already=already)
        return Stopping(stopped=stopped, already=already)

    async def wait_run_ended(self, run_id: str) -> None:
        """Return once every live worker of a run (and of the runs nested in it) has ended
        (a stop_run's wait)."""
        if self._registry.has_run(run_id):
            members = [r.id for r in self._registry.listing(include_ended=False, run=run_id)]
            await self._supervisor.wait_ended(members)

    def cancel(self, scope: str) -> Stopping:
        kind, _, target = scope.partition(":")
        if kind == "worker" and not self._registry.holds(target):
            self._reader.lookup(target)  # not_found for an id never seen
            return Stopping()  # ended and released: nothing to cancel
        already = self._registry.stopping_among(self._registry.in_scope(scope))
        cancelled = self._registry.cancel(scope)
        self._supervisor.ask_stop(cancelled)
        log.info("scope.cancelled", scope=scope, cancelled=cancelled, already=already)
        return Stopping(stopped=cancelled, already=already)

    def cancel_fence(self, epoch: int) -> Stopping:
        already = self._registry.stopping_among(self._registry.under_fence(epoch))
        cancelled = self._registry.cancel_fence(epoch)
        self._runs.save_launch()
        self._supervisor.ask_stop(cancelled)
        log.info("fence.cancelled", epoch=epoch, cancelled=cancelled, already=already)
        return Stopping(stopped=cancelled, already=already)
