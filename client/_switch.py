"""The stop switch: one run that a workflow spawns into, stops piece by piece or whole, and
obeys however it was stopped. `StopSwitch` for trio (`AsyncClient.stop_switch`), and its
blocking twin `BlockingStopSwitch` (`Client.stop_switch`).

Made of client requests alone (spawn, status, stop, stop_run, wait_run_stopped, events);
what the twins know and decide lives once, without I/O, in `_Switch`. A switch owns no
connection and closes nothing it did not open.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Mapping, Sequence
from typing import Protocol

import trio

from subagentd.protocol import Wake, WorkerView
from subagentd.protocol.errors import NotFound, SubagentdError

from ._tasks import running


class SwitchRequests(Protocol):
    """The requests a `StopSwitch` is made of: what `AsyncClient` answers (declared here,
    so that the switch stands below the clients that hand it out)."""

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str = ...,
        run: str | None = ...,
        parent: str | None = ...,
        agent: str | None = ...,
        input: str | bytes | None = ...,
        cwd: str | os.PathLike[str] | None = ...,
        env: Mapping[str, str] | None = ...,
        timeout: float | None = ...,  # noqa: ASYNC109  the worker's time limit
        grace: float | None = ...,
        key: str | None = ...,
    ) -> WorkerView: ...

    async def status(self, worker_id: str) -> WorkerView: ...

    async def stop(self, worker_id: str, wait: bool = ...) -> bool: ...

    async def stop_run(self, run_id: str, wait: bool = ...) -> list[str]: ...

    async def wait_run_stopped(self, run_id: str) -> None: ...

    def events(
        self, run: str | None = ..., worker: str | None = ..., follow: bool = ...
    ) -> AsyncGenerator[Wake, None]: ...


class BlockingSwitchRequests(Protocol):
    """The requests a `BlockingStopSwitch` is made of: what `Client` answers."""

    def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str = ...,
        run: str | None = ...,
        parent: str | None = ...,
        agent: str | None = ...,
        input: str | bytes | None = ...,
        cwd: str | os.PathLike[str] | None = ...,
        env: Mapping[str, str] | None = ...,
        timeout: float | None = ...,
        grace: float | None = ...,
        key: str | None = ...,
    ) -> WorkerView: ...

    def status(self, worker_id: str) -> WorkerView: ...

    def stop(self, worker_id: str, wait: bool = ...) -> bool: ...

    def stop_run(self, run_id: str, wait: bool = ...) -> list[str]: ...

    def wait_run_stopped(self, run_id: str) -> None: ...

    def events(
        self, run: str | None = ..., worker: str | None = ..., follow: bool = ...
    ) -> Generator[Wake, None, None]: ...


class _Switch:
    """What both switches hold and decide: the run, the ids spawned through the switch, and
    which workers `one` may stop (those the daemon registered in the run)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._ids: dict[str, None] = {}  # a set that keeps the order of spawning

    @property
    def ids(self) -> list[str]:
        """The workers spawned through this switch, in order (not those that joined the
        run otherwise: `one` stops those too)."""
        return list(self._ids)

    def _spawned(self, worker: WorkerView) -> WorkerView:
        self._ids[worker.id] = None
        return worker

    def _holds(self, worker: WorkerView | None) -> bool:
        """Whether `one` may stop `worker` (None: an id the daemon does not know): the
        daemon registered it in this run, however it came there. A worker of a run nested
        in this one belongs to that run (its own switch stops it one by one; `all` takes
        it with the rest)."""
        return worker is not None and worker.run == self.run


class StopSwitch(_Switch):
    """The switch of one run, as ``async with daemon.stop_switch() as switch:`` gives it.

    ``run`` is the run's id; ``ids`` the workers spawned through this switch, in
    order. `one` stops one worker of the run, `all` the whole run, `wait_stopped`
    returns once the run is stopped by anyone, `move_on_stopped` is a cancel scope
    that does so for a trio workflow, and `wakes` tells each ending of the run's
    top-level workers. Nothing here closes the client.
    """

    def __init__(self, client: SwitchRequests, run: str) -> None:
        super().__init__(run)
        self._client = client

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
        key: str | None = None,
    ) -> WorkerView:
        """Start a worker in this run, as `AsyncClient.spawn` does.

        Raises `RunStopped` once the run (or an outer one) is stopped. Under a
        cancelled launch fence the worker comes back already ``stopped``; it is
        still one of this switch's ``ids``.
        """
        return self._spawned(
            await self._client.spawn(
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
                key=key,
            )
        )

    async def one(self, worker_id: str) -> bool:
        """Stop one worker of this run and every worker it delegated, and return once their
        processes are gone: True. Any worker the daemon registered in the run counts,
        however it got there: spawned through this switch, by a worker of the run on its
        own (its token), or by another client naming the run. Ended or collected already,
        it is found and nothing more is stopped. For an id of another run (a nested one
        too), or one the daemon never saw: False, and nothing is stopped."""
        if not self._holds(await self._looked_up(worker_id)):
            return False
        await self._client.stop(worker_id)
        return True

    async def all(self) -> list[str]:
        """Stop the run: every worker in flight (delegated ones and nested runs' too), and
        every spawn into it from now on (`RunStopped`). Returns once the processes are
        gone, with the ids newly stopped, sorted; a repeat stops nothing more."""
        return await self._client.stop_run(self.run)

    async def wait_stopped(self) -> None:
        """Return once the run is stopped, however that happened: `all`, another client's
        `stop_run` (``subagentctl stop --run``), or the stop of a run this one is nested
        in."""
        await self._client.wait_run_stopped(self.run)

    @contextlib.asynccontextmanager
    async def move_on_stopped(self) -> AsyncIterator[trio.CancelScope]:
        """A cancel scope cancelled once the run is stopped, however (as `wait_stopped`
        says): a workflow inside it obeys the stop with no watchdog of its own.

            async with switch.move_on_stopped() as scope:
                ...  # the workflow
            if scope.cancelled_caught: ...  # the run was stopped under it

        Like `trio.move_on_after`, the block is then left quietly. Should the daemon
        become unreachable meanwhile, so that a stop could no longer be heard, the block
        is cancelled all the same and the error (`ConnectionLost`, say) raised from it.
        """
        scope = trio.CancelScope()
        unheard: list[SubagentdError] = []

        async def cancel_once_stopped() -> None:
            try:
                await self.wait_stopped()
            except SubagentdError as exc:
                unheard.append(exc)
            scope.cancel()

        async with running(cancel_once_stopped):
            with scope:
                yield scope
        if unheard:
            raise unheard[0]

    def wakes(self) -> AsyncGenerator[Wake, None]:
        """The wakes of this run's top-level workers, as they end (one per worker, ended
        by itself or stopped), each acknowledged once handed over; it goes on until the
        caller leaves. Wakes of delegated workers go to their parent worker, not here.

            async with contextlib.aclosing(switch.wakes()) as wakes:
                async for wake in wakes: ...
        """
        return self._client.events(run=self.run, follow=True)

    async def _looked_up(self, worker_id: str) -> WorkerView | None:
        try:
            return await self._client.status(worker_id)
        except NotFound:
            return None


class BlockingStopSwitch(_Switch):
    """The blocking twin of `StopSwitch`, as ``with daemon.stop_switch() as switch:`` gives
    it: the same methods, each returning once done (`wait_stopped` within the client's
    ``timeout``, as every call). A trio workflow has `StopSwitch.move_on_stopped`; a
    blocking one waits in `wait_stopped`, in a thread of its own if it must."""

    def __init__(self, client: BlockingSwitchRequests, run: str) -> None:
        super().__init__(run)
        self._client = client

    def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        parent: str | None = None,
        agent: str | None = None,
        input: str | bytes | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        grace: float | None = None,
        key: str | None = None,
    ) -> WorkerView:
        """As `StopSwitch.spawn`."""
        return self._spawned(
            self._client.spawn(
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
                key=key,
            )
        )

    def one(self, worker_id: str) -> bool:
        """As `StopSwitch.one`: any worker the daemon registered in this run."""
        if not self._holds(self._looked_up(worker_id)):
            return False
        self._client.stop(worker_id)
        return True

    def all(self) -> list[str]:
        """As `StopSwitch.all`."""
        return self._client.stop_run(self.run)

    def wait_stopped(self) -> None:
        """As `StopSwitch.wait_stopped`; bounded by the client's ``timeout``."""
        self._client.wait_run_stopped(self.run)

    def wakes(self) -> Generator[Wake, None, None]:
        """As `StopSwitch.wakes`; leave it inside ``contextlib.closing(switch.wakes())``."""
        return self._client.events(run=self.run, follow=True)

    def _looked_up(self, worker_id: str) -> WorkerView | None:
        try:
            return self._client.status(worker_id)
        except NotFound:
            return None
