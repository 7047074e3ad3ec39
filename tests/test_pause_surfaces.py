"""A pause through every surface a user has (issue 26, item 5): the blocking client, the
MCP tools, and a run nested in the run paused. Each holds the tree for real (the kernel
says so) and lets it go. Real daemon, real processes, each way of tracking trees."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.client import AsyncClient, Client

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .pausing import COUNTER, kernel_holds
from .test_mcp import call, mcp_server


@pytest.fixture
async def client(tracking: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(tracking.socket) as client:
        yield client


async def test_the_blocking_client_pauses_and_unpauses_as_the_async_one(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        worker = await client.spawn(sh(COUNTER))
        child = await client.spawn(["sleep", "600"], parent=worker.id)
        await wait_output(client, worker.id, b"2\n")
        assert worker.pid is not None

        def blocking() -> tuple[list[str], list[str], bool, list[str]]:
            with Client(tracking.socket, timeout=30) as sync:
                paused = sync.pause(worker=worker.id)
                held = kernel_holds(info, worker.id, worker.pid or 0)
                again = sync.pause(worker=worker.id).already_paused
                unpaused = sync.unpause(run=worker.run).unpaused
            return paused.paused, again, held, unpaused

        paused, again, held, unpaused = await trio.to_thread.run_sync(blocking)
        both = sorted([worker.id, child.id])
        assert (paused, again, held, unpaused) == (both, both, True, both)
        assert not kernel_holds(info, worker.id, worker.pid)


async def test_the_mcp_tools_pause_and_unpause_for_real(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(60):
        info = await client.info()
        worker = await client.spawn(sh(COUNTER))
        await wait_output(client, worker.id, b"2\n")
        assert worker.pid is not None
        async with mcp_server(tracking) as session:
            paused = await call(session, "subagent_pause", worker=worker.id)
            assert (paused["paused"], paused["already_paused"]) == ([worker.id], [])
            assert kernel_holds(info, worker.id, worker.pid)
            shown = await call(session, "subagent_status", worker=worker.id)
            assert shown["paused"] is True
            unpaused = await call(session, "subagent_unpause", run=worker.run)
            assert unpaused["unpaused"] == [worker.id]
            assert not kernel_holds(info, worker.id, worker.pid)
        assert not (await client.status(worker.id)).paused


async def test_a_run_paused_holds_the_runs_nested_in_it(client: AsyncClient) -> None:
    with trio.fail_after(30):
        info = await client.info()
        outer = await client.new_run()
        inner = await client.new_run(outer)
        beside = await client.new_run()
        mine = await client.spawn(sh(COUNTER), run=outer)
        nested = await client.spawn(sh(COUNTER), run=inner)
        apart = await client.spawn(sh(COUNTER), run=beside)
        for w in (mine, nested, apart):
            await wait_output(client, w.id, b"2\n")
        assert (await client.pause(run=outer)).paused == sorted([mine.id, nested.id])
        for w, held in ((mine, True), (nested, True), (apart, False)):
            assert w.pid is not None
            assert kernel_holds(info, w.id, w.pid) is held, w
        # The inner run alone lets go of its own only.
        assert (await client.unpause(run=inner)).unpaused == [nested.id]
        assert (await client.status(mine.id)).paused
        assert (await client.unpause(run=outer)).unpaused == [mine.id]
