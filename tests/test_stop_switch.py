"""The StopSwitch under trio against a real daemon: one run, stopped piece by piece or whole,
and obeyed however it was stopped."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient, Client, NotFound, RunStopped, StopSwitch, WorkerView

from .conftest import BIN, DaemonProcess
from .helpers import alive, sh, wait_output

CTL = str(BIN / "subagentctl")


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


async def test_one_refuses_a_worker_of_another_run(client: AsyncClient) -> None:
    with trio.fail_after(20):
        outsider = await client.spawn(["sleep", "60"])
        async with client.stop_switch() as switch:
            inside = await switch.spawn(["sleep", "60"])
            async with client.stop_switch(outer=switch.run) as nested:
                in_nested = await nested.spawn(["sleep", "60"])
                assert not await switch.one(outsider.id)
                assert not await switch.one("w-never-seen")
                assert not await switch.one(in_nested.id)  # its own switch's to stop
                assert await _running(client, outsider.id)
                assert await _running(client, inside.id)
                assert await _running(client, in_nested.id)
        assert await _ended(client, in_nested.id) == "stopped"  # the run's stop takes it
        assert await _running(client, outsider.id)
        await client.stop(outsider.id)


async def test_one_stops_any_worker_registered_in_its_run_however_it_got_there(
    client: AsyncClient, tmp_path: Path
) -> None:
    """A worker of the run delegates with its own subagentctl (its token puts the child in
    the run), and another client spawns into the run by naming it: neither came through
    the switch, and `one` stops each of them, one at a time."""
    with trio.fail_after(20):
        child_json = tmp_path / "child.json"
        delegating = f'"{CTL}" --json spawn -- sleep 60 > "{child_json}" && echo delegated; '
        async with client.stop_switch() as switch:
            parent = await switch.spawn(sh(delegating + "exec sleep 60"))
            await wait_output(client, parent.id, b"delegated")
            child = json.loads(child_json.read_text())
            assert (child["run"], child["parent"]) == (switch.run, parent.id)
            joined = await client.spawn(["sleep", "60"], run=switch.run)
            assert switch.ids == [parent.id]
            assert await switch.one(child["id"])
            assert await _ended(client, child["id"]) == "stopped"
            assert await _running(client, parent.id)  # the child's stop goes no higher
            assert await _running(client, joined.id)
            assert await switch.one(joined.id)
            assert await _ended(client, joined.id) == "stopped"
            assert await _running(client, parent.id)
            assert await switch.one(child["id"])  # a repeat finds it and stops nothing more


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


# -- the trio form: a cancel scope that obeys the run's stop ---------------------------------


async def _stop_run_with_the_cli(daemon: DaemonProcess, run: str) -> None:
    """``subagentctl stop --run``, from a process of its own, as a person would type it."""
    said = await trio.run_process(
        [CTL, "stop", "--run", run], env=daemon.env, capture_stdout=True, capture_stderr=True
    )
    assert said.returncode == 0, said.stderr


async def test_move_on_stopped_cancels_the_workflow_when_another_process_stops_the_run(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch, trio.open_nursery() as nursery:
            worker = await switch.spawn(["sleep", "60"])
            async with switch.move_on_stopped() as scope:
                nursery.start_soon(_stop_run_with_the_cli, daemon, switch.run)
                await trio.sleep_forever()  # the workflow, waiting on nothing of the switch's
            assert scope.cancelled_caught
            assert await _ended(client, worker.id) == "stopped"
            with pytest.raises(RunStopped):
                await switch.spawn(["sleep", "60"])


async def test_move_on_stopped_cancels_the_workflow_when_the_outer_run_is_stopped(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        outer = await client.new_run()
        async with (
            client.stop_switch(outer=outer) as switch,
            trio.open_nursery() as nursery,
        ):
            worker = await switch.spawn(["sleep", "60"])
            async with switch.move_on_stopped() as scope:
                nursery.start_soon(_stop_run_with_the_cli, daemon, outer)
                await trio.sleep_forever()
            assert scope.cancelled_caught
            assert await _ended(client, worker.id) == "stopped"


async def test_move_on_stopped_obeys_the_switchs_own_all_and_is_quiet_otherwise(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            async with switch.move_on_stopped() as untouched:
                done = await switch.spawn(["true"])
                await client.wait(done.id)
            assert not untouched.cancelled_caught  # the run is live: the workflow ran out
            async with switch.move_on_stopped() as scope:
                await switch.all()
                await trio.sleep_forever()
            assert scope.cancelled_caught
            async with switch.move_on_stopped() as already:
                await trio.sleep_forever()  # a run stopped before the scope: cancelled at once
            assert already.cancelled_caught
        # The client is as it was, the worker that ended on its own as it ended.
        assert (await client.info()).workers == {"finished": 1}


async def test_move_on_stopped_cancels_and_raises_when_the_stop_cannot_be_heard(
    client: AsyncClient,
) -> None:
    """A switch whose run the daemon cannot watch (here: one it never made) cannot hear a
    stop: the workflow is cancelled all the same, and told why."""
    with trio.fail_after(20):
        blind = StopSwitch(client, "r-never-made")
        cancelled: list[bool] = []

        async def workflow() -> None:
            async with blind.move_on_stopped():
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    cancelled.append(True)
                    raise

        with pytest.raises(NotFound, match="r-never-made"):
            await workflow()
        assert cancelled == [True]
        assert (await client.info()).pid > 0  # the client goes on


# -- what leaving the block does ---------------------------------------------------------


async def test_with_stop_on_exit_false_the_run_outlives_the_block(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch(stop_on_exit=False) as switch:
            left = await switch.spawn(["sleep", "60"])
        assert await _running(client, left.id)

        spawned: list[WorkerView] = []

        async def failing_workflow() -> None:
            async with client.stop_switch(stop_on_exit=False) as failed:
                spawned.append(await failed.spawn(["sleep", "60"]))
                raise KeyError("from the body")

        with pytest.raises(KeyError, match="from the body"):
            await failing_workflow()
        assert await _running(client, spawned[0].id)

        again = await client.spawn(["sleep", "60"], run=switch.run)  # the run takes spawns
        assert await client.stop_run(switch.run) == sorted([left.id, again.id])
        assert await client.stop_run(spawned[0].run) == [spawned[0].id]


# -- the blocking client's switch ----------------------------------------------------------


def _printed(blocking: Client, worker_id: str, marker: bytes) -> None:
    """Follow the worker's stdout until it holds `marker`."""
    seen = b""
    with contextlib.closing(blocking.watch(worker_id, follow=True)) as entries:
        for entry in entries:
            seen += entry.data if entry.kind == "stdout" else b""
            if marker in seen:
                return
    raise AssertionError(f"worker {worker_id} ended before printing {marker!r}: {seen!r}")


def test_the_blocking_client_has_a_stop_switch_with_the_same_methods(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    child_json = tmp_path / "child.json"
    delegating = f'"{CTL}" --json spawn -- sleep 60 > "{child_json}" && echo delegated; '
    with Client(daemon.socket, timeout=20) as blocking:
        outsider = blocking.spawn(["sleep", "60"])
        with blocking.stop_switch() as switch:
            parent = switch.spawn(sh(delegating + "exec sleep 60"), name="parent")
            other = switch.spawn(["sleep", "60"])
            assert (parent.run, other.run) == (switch.run, switch.run)
            assert switch.ids == [parent.id, other.id]
            _printed(blocking, parent.id, b"delegated")
            child = json.loads(child_json.read_text())
            assert switch.one(child["id"])  # spawned by a worker of the run, on its own
            assert blocking.wait(child["id"]).state == "stopped"
            assert not switch.one(outsider.id)
            assert not switch.one("w-never-seen")
            assert switch.one(parent.id)
            assert blocking.wait(parent.id).state == "stopped"
            assert blocking.status(other.id).state == "running"
            with contextlib.closing(switch.wakes()) as wakes:
                wake = next(wakes)  # one per top-level worker of the run, as each ends
            assert (wake.id, wake.state) == (parent.id, "stopped")
            assert switch.all() == [other.id]
            switch.wait_stopped()  # stopped: returns at once
            with pytest.raises(RunStopped):
                switch.spawn(["true"])
        assert blocking.status(outsider.id).state == "running"
        blocking.stop(outsider.id)


def test_the_blocking_switch_stops_its_run_on_leaving_unless_told_not_to(
    daemon: DaemonProcess,
) -> None:
    with Client(daemon.socket, timeout=20) as blocking:
        spawned: list[WorkerView] = []

        def failing_workflow() -> None:
            with blocking.stop_switch() as switch:
                spawned.append(switch.spawn(["sleep", "60"]))
                raise KeyError("from the body")

        with pytest.raises(KeyError, match="from the body"):
            failing_workflow()
        view = blocking.status(spawned[0].id)
        assert view.state == "stopped"  # and its process gone once the block is left
        assert view.pid is not None
        assert not alive(view.pid)
        with pytest.raises(RunStopped):
            blocking.spawn(["true"], run=spawned[0].run)

        with blocking.stop_switch(stop_on_exit=False) as kept:
            left = kept.spawn(["sleep", "60"])
        assert blocking.status(left.id).state == "running"
        assert blocking.stop_run(kept.run) == [left.id]


async def test_a_switchs_spawn_sent_again_with_its_key_answers_the_worker_it_made(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            first = await switch.spawn(["sleep", "60"], key="step-1")
            again = await switch.spawn(["sleep", "60"], key="step-1")
            assert again.id == first.id
            assert switch.ids == [first.id]
