"""The StopSwitch under trio against a real daemon: one run, stopped piece by piece or whole,
and obeyed however it was stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.client import AsyncClient, Client, RunStopped, StopSwitch, WorkerView

from .conftest import DaemonProcess
from .helpers import alive, sh


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def _ended(client: AsyncClient, worker_id: str) -> str:
    """The state the worker ended in, and that its process is gone."""
    view = await client.wait(worker_id)
    assert view.pid is None or not alive(view.pid)
    return view.state


async def _running(client: AsyncClient, worker_id: str) -> bool:
    view = await client.status(worker_id)
    return view.state == "running" and view.pid is not None and alive(view.pid)


async def _wait_stopped_in_background(switch: StopSwitch, nursery: trio.Nursery) -> trio.Event:
    """Start `switch.wait_stopped()` in `nursery`; the event it sets once that returns.

    Returns after giving the request time to reach the daemon, so that what the
    test does next exercises the waiting, not an answer given at once.
    """
    fired = trio.Event()

    async def wait(task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await switch.wait_stopped()
        fired.set()

    await nursery.start(wait)
    await trio.sleep(0.2)  # let the request reach the daemon; the test checks it has not fired
    return fired


async def test_one_stops_its_worker_and_leaves_the_others_running(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            a = await switch.spawn(sh("sleep 60"), name="a")
            b = await switch.spawn(["sleep", "60"], name="b")
            assert (a.run, b.run) == (switch.run, switch.run)
            assert switch.ids == [a.id, b.id]
            assert await switch.one(a.id)
            assert await _ended(client, a.id) == "stopped"
            assert await _running(client, b.id)
            assert await switch.one(a.id)  # a repeat finds it and stops nothing more
            assert await _running(client, b.id)


async def test_one_takes_the_subtree_of_its_worker(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            a = await switch.spawn(["sleep", "60"])
            delegated = await switch.spawn(["sleep", "60"], parent=a.id)
            other = await switch.spawn(["sleep", "60"])
            assert delegated.parent == a.id
            assert await switch.one(a.id)
            assert await _ended(client, delegated.id) == "stopped"
            assert await _running(client, other.id)


async def test_one_refuses_a_worker_that_did_not_come_through_the_switch(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        outsider = await client.spawn(["sleep", "60"])
        async with client.stop_switch() as switch:
            inside = await switch.spawn(["sleep", "60"])
            assert not await switch.one(outsider.id)
            assert not await switch.one("w-never-seen")
            assert await _running(client, outsider.id)
            assert await _running(client, inside.id)
            # Not even a worker of its run: only what this switch spawned.
            joined = await client.spawn(["sleep", "60"], run=switch.run)
            assert not await switch.one(joined.id)
            assert await _running(client, joined.id)
        assert await _ended(client, joined.id) == "stopped"  # the run's stop takes it all the same
        assert await _running(client, outsider.id)
        await client.stop(outsider.id)


async def test_all_stops_the_run_and_later_spawns_are_refused(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            a = await switch.spawn(["sleep", "60"])
            b = await switch.spawn(["sleep", "60"])
            assert await switch.all() == sorted([a.id, b.id])
            assert [await _ended(client, w) for w in (a.id, b.id)] == ["stopped", "stopped"]
            with pytest.raises(RunStopped, match=switch.run):
                await switch.spawn(["sleep", "60"])
            assert switch.ids == [a.id, b.id]
            assert await switch.all() == []  # one-way, and a repeat is no error
            await switch.wait_stopped()  # already stopped: returns at once


async def test_wait_stopped_fires_when_another_client_stops_the_run(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch, trio.open_nursery() as nursery:
            worker = await switch.spawn(["sleep", "60"])
            fired = await _wait_stopped_in_background(switch, nursery)
            assert not fired.is_set()
            async with AsyncClient(daemon.socket) as other:
                assert await other.stop_run(switch.run) == [worker.id]
            await fired.wait()
            assert await _ended(client, worker.id) == "stopped"


async def test_wait_stopped_fires_when_the_outer_run_is_stopped(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        outer = await client.new_run()
        async with client.stop_switch(outer=outer) as switch, trio.open_nursery() as nursery:
            assert switch.run != outer
            worker = await switch.spawn(["sleep", "60"])
            fired = await _wait_stopped_in_background(switch, nursery)
            assert not fired.is_set()
            async with AsyncClient(daemon.socket) as other:
                assert await other.stop_run(outer) == [worker.id]
            await fired.wait()
            assert await _ended(client, worker.id) == "stopped"
            with pytest.raises(RunStopped):
                await switch.spawn(["sleep", "60"])


async def test_wait_stopped_fires_on_the_switchs_own_all(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch, trio.open_nursery() as nursery:
            fired = await _wait_stopped_in_background(switch, nursery)
            assert not fired.is_set()
            await switch.all()
            await fired.wait()


async def test_leaving_the_block_stops_what_is_left_and_keeps_the_client(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            stopped = await switch.spawn(["sleep", "60"])
            left = await switch.spawn(sh("sleep 60"))
            done = await switch.spawn(["true"])
            await switch.one(stopped.id)
            assert (await client.wait(done.id)).state == "finished"
        # Once out of the block, the processes are already gone: no wait needed.
        view = await client.status(left.id)
        assert view.state == "stopped"
        assert view.pid is not None
        assert not alive(view.pid)
        assert (await client.status(done.id)).state == "finished"
        with pytest.raises(RunStopped):
            await client.spawn(["true"], run=switch.run)
        assert (await client.info()).workers == {"stopped": 2, "finished": 1}  # still connected


async def test_a_block_left_by_an_error_or_a_cancel_still_stops_its_run(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        spawned: list[WorkerView] = []

        async def failing_workflow() -> None:
            async with client.stop_switch() as switch:
                spawned.append(await switch.spawn(["sleep", "60"]))
                raise KeyError("from the body")

        with pytest.raises(KeyError, match="from the body"):
            await failing_workflow()
        assert (await client.status(spawned[0].id)).state == "stopped"

        with trio.CancelScope() as scope:
            async with client.stop_switch() as switch:
                cancelled = await switch.spawn(["sleep", "60"])
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        view = await client.status(cancelled.id)
        assert view.state == "stopped"
        assert view.pid is not None
        assert not alive(view.pid)


async def test_a_nested_switch_is_stopped_with_its_outer_switch(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with (
            client.stop_switch() as outer,
            client.stop_switch(outer=outer.run) as inner,
        ):
            worker = await inner.spawn(["sleep", "60"])
            assert await outer.all() == [worker.id]
            await inner.wait_stopped()
            assert await _ended(client, worker.id) == "stopped"


async def test_the_blocking_client_waits_for_a_run_to_stop_within_its_timeout(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run = await client.new_run()

        def wait_briefly() -> str:
            with Client(daemon.socket, timeout=0.3) as blocking:
                try:
                    blocking.wait_run_stopped(run)
                except TimeoutError:
                    pass
                else:
                    raise AssertionError("wait_run_stopped returned while the run was live")
                return blocking.new_run()  # the connection is still good after the timeout

        assert (await trio.to_thread.run_sync(wait_briefly)).startswith("r-")
        await client.stop_run(run)

        def wait_stopped() -> None:
            with Client(daemon.socket, timeout=5) as blocking:
                blocking.wait_run_stopped(run)

        await trio.to_thread.run_sync(wait_stopped)


async def test_a_switch_outlives_the_collection_of_all_its_workers(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            first = [await switch.spawn(sh(f"echo {i}")) for i in range(3)]
            for worker in first:
                assert (
                    await client.collect(worker.id, wait=True)
                ).result == f"{first.index(worker)}\n"
            # Collected, so let go by the daemon: the run is all that is left of them.
            assert not {w.id for w in first} & {w.id for w in await client.ls(all=True)}
            assert await switch.one(first[0].id)  # it came through this switch: stopped already
            again = await switch.spawn(["sleep", "60"])
            assert again.run == switch.run
            assert await _running(client, again.id)
        assert await _ended(client, again.id) == "stopped"
        with pytest.raises(RunStopped):
            await client.spawn(["true"], run=switch.run)


#: A workflow whose cancel scope holds the whole client, reader task and all. Run in a
#: process of its own: what it guards against is a hang no trio.fail_after can end.
CANCELLED_WORKFLOW = """
import trio
from subagentd.client import AsyncClient

async def main():
    with trio.CancelScope() as scope:
        async with AsyncClient() as daemon, daemon.stop_switch() as switch:
            worker = await switch.spawn(["sleep", "60"])
            print(worker.id, flush=True)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    print("left", flush=True)

trio.run(main)
"""


def test_a_cancel_that_takes_the_client_with_it_still_stops_the_run(
    daemon: DaemonProcess,
) -> None:
    workflow = subprocess.run(
        [sys.executable, "-c", CANCELLED_WORKFLOW],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert workflow.returncode == 0, workflow.stderr
    worker, left = workflow.stdout.split()
    assert left == "left"
    view = json.loads(daemon.ctl("--json", "status", worker).stdout)
    assert view["state"] == "stopped"
    assert not alive(view["pid"])
