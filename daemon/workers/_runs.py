"""Runs, turns and fences as the store keeps them: a run made, stopped or reopened is
written before it is answered (its nesting and stop flag outlive a crash), and the
launch turn and fence with each change. The registry decides; this writes it down."""

from __future__ import annotations

from collections.abc import Callable

import trio

from subagentd.protocol import Limits

from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry
from ..store._store import Change, LaunchState, Store

log = get_logger()


class Runs:
    """Runs written down, turns and fences saved, and the waits for a run's stop."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        problems: Problems,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._store = store
        self._problems = problems
        self._clock = clock
        #: The runs whose rows the store has (a spawn into one writes none; retention
        #: drops a run released from the store).
        self.saved: set[str] = set()
        self._run_stopped: dict[str, trio.Event] = {}

    def new_run(
        self, outer: str | None, limits: Limits | None = None, max_running: int | None = None
    ) -> str:
        run = self._registry.new_run(self._clock(), outer, limits, max_running)
        # The outer run is no longer implicit: a restart must keep it too.
        self.save_runs([run.id] if outer is None else [run.id, outer])
        return run.id

    def save_runs(self, run_ids: list[str]) -> None:
        """Write runs to the store (their nesting and stop flags outlive a crash)."""
        runs = [self._registry.run(r) for r in run_ids]
        self._store.commit(Change(runs=runs), "a run")
        self.saved.update(run_ids)

    def save_launch(self) -> None:
        """Write the launch turn and fence (a restart starts from them)."""
        registry = self._registry
        launch = LaunchState(
            turn=registry.turn, fence=registry.fence, fence_epochs=registry.fence_epochs
        )
        try:
            self._store.commit(Change(launch=launch), "the launch turn and fence")
        except OSError as exc:
            self._problems.disk_failed("store (the launch fence)", exc)

    def begin_turn(self) -> int:
        turn = self._registry.begin_turn()
        self.save_launch()
        return turn

    def set_fence(self) -> int:
        epoch = self._registry.set_fence()
        self.save_launch()
        return epoch

    def clear_fence(self) -> None:
        self._registry.clear_fence()
        self.save_launch()

    def reopen_run(self, run_id: str) -> list[str]:
        """Start a stopped run again (and the runs nested in it): the one way a stop is
        undone. Written before it is answered; a store that cannot take it leaves them
        stopped."""
        opened = self._registry.reopen_run(run_id)
        if opened:
            try:
                self.save_runs(opened)
            except BaseException:
                for run in opened:
                    self._registry.run(run).stopped = True
                raise
        log.info("run.reopened", run=run_id, opened=opened)
        return opened

    async def wait_run_stopped(self, run_id: str) -> None:
        """Return once `run_id` is stopped, by whoever and through whichever outer run."""
        self._registry.run(run_id)
        if not self._registry.run_stopped(run_id):
            await self._run_stopped.setdefault(run_id, trio.Event()).wait()

    def stopped(self, run_id: str) -> None:
        """`run_id` and the runs nested in it were stopped: wake whoever waits for one."""
        for run in self._registry.runs_within(run_id):
            if (event := self._run_stopped.pop(run, None)) is not None:
                event.set()
