"""The stop switch: one run that a trio workflow spawns into, stops piece by piece or whole,
and obeys however it was stopped.

Made of `AsyncClient` requests alone (spawn, stop, stop_run, wait_run_stopped,
events); it owns no connection and closes nothing it did not open.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING

from subagentd.protocol import Wake, WorkerView

if TYPE_CHECKING:
    from ._async import AsyncClient


class StopSwitch:
    """The switch of one run, as ``async with daemon.stop_switch() as switch:`` gives it.

    ``run`` is the run's id; ``ids`` the workers spawned through this switch, in
    order. `one` stops one of them, `all` the whole run, `wait_stopped`
    returns once the run is stopped by anyone, and `wakes` tells each ending of
    the run's top-level workers. Nothing here closes the client.
    """

    def __init__(self, client: AsyncClient, run: str) -> None:
        self.run = run
        self._client = client
        self._ids: dict[str, None] = {}  # a set that keeps the order of spawning

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        parent: str | None = None,
        agent: str | None = None,
        input: str | bytes | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109  the worker's time limit, not this call's
        grace: float | None = None,
    ) -> WorkerView:
        """Start a worker in this run, as `AsyncClient.spawn` does.

        Raises `RunStopped` once the run (or an outer one) is stopped. Under a
        cancelled launch fence the worker comes back already ``stopped``; it is
        still one of this switch's ``ids``.
        """
        worker = await self._client.spawn(
            argv,
            name=name,
            run=self.run,
            parent=parent,
            agent=agent,
            input=input,
            cwd=cwd,
            env=env,
            timeout=timeout,
            grace=grace,
        )
        self._ids[worker.id] = None
        return worker

    async def one(self, worker_id: str) -> bool:
        """Stop one worker spawned through this switch and every worker it delegated, and
        return once their processes are gone: True. For an id that did not come through
        this switch: False, and the daemon is not asked."""
        if worker_id not in self._ids:
            return False
        # The daemon may answer False for a worker collected and let go: it came through
        # this switch all the same, and is not running.
        await self._client.stop(worker_id)
        return True

    async def all(self) -> list[str]:
        """Stop the run: every worker in flight (delegated ones and nested runs' too), and
        every spawn into it from now on (`RunStopped`). Returns once the processes are
        gone, with the ids newly stopped, sorted; a repeat stops nothing more."""
        return await self._client.stop_run(self.run)

    async def wait_stopped(self) -> None:
        """Return once the run is stopped, however that happened: `all`, another client's
        `stop_run`, or the stop of a run this one is nested in. A workflow waits on
        this to know it must stop."""
        await self._client.wait_run_stopped(self.run)

    def wakes(self) -> AsyncGenerator[Wake, None]:
        """The wakes of this run's top-level workers, as they end (one per worker, ended
        by itself or stopped), each acknowledged once handed over; it goes on until the
        caller leaves. Wakes of delegated workers go to their parent worker, not here.

            async with contextlib.aclosing(switch.wakes()) as wakes:
                async for wake in wakes: ...
        """
        return self._client.events(run=self.run, follow=True)
