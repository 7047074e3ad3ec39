"""Pause and unpause attacked (issue 26, item 5, review): a pause racing a stop, the
worker's own ending, a shutdown, a reload; a worker pausing itself; a leader killed from
outside while frozen; a worker that stopped itself is not taken for paused. Real
processes, each way of tracking trees."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Refused

from .conftest import BIN, DaemonProcess
from .helpers import alive, pending_wakes, sh, wait_output
from .pausing import (
    COUNTER,
    cgroup_of,
    frozen_left,
    kernel_holds,
    proc_state,
    wait_journaled,
)


@pytest.fixture
async def client(tracking: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(tracking.socket) as client:
        yield client


async def test_a_worker_that_stopped_itself_is_not_taken_for_paused_by_a_reload(
    client: AsyncClient,
) -> None:
    # Its leader stopped (state T) by itself, not by a pause: after a reload its record
    # says not paused, and its timeout must still end it. A child of it says once the
    # kernel has it stopped.
    stopped = '[ "$(cut -d" " -f3 /proc/$$/stat)" = T ]'
    watcher = f"(until {stopped}; do sleep 0.01; done; echo stopped) &"
    with trio.fail_after(30):
        worker = await client.spawn(sh(f"{watcher} kill -STOP $$; exec sleep 600"), timeout=4)
        await wait_output(client, worker.id, b"stopped\n")
        assert worker.pid is not None
        assert proc_state(worker.pid) == "T"
        assert not (await client.status(worker.id)).paused
        await client.reload()
        assert not (await client.status(worker.id)).paused
        ended = await client.wait(worker.id)
        assert ended.state == "timed_out"


async def test_a_paused_worker_whose_leader_is_killed_from_outside_ends_once_and_thaws(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        worker = await client.spawn(sh(f"trap 'exit 0' TERM; sleep 600 & {COUNTER}"), grace=600)
        child = await client.spawn(["sleep", "600"], parent=worker.id, grace=600)
        await wait_output(client, worker.id, b"2\n")
        await client.pause(worker=worker.id)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        ended = await client.wait(worker.id)
        assert (ended.state, ended.paused) == ("failed", False)
        assert not frozen_left(info, worker.id)
        # Its delegated child is still paused: a stop of it ends it at once.
        assert (await client.status(child.id)).paused
        assert await client.stop(child.id)
        assert child.pid is not None
        assert not alive(child.pid)
        wakes = [w for w in await pending_wakes(tracking, worker.run) if w.id == worker.id]
        assert len(wakes) == 1


async def test_a_pause_racing_a_stop_ends_the_worker_at_once_with_one_wake(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(40):
        info = await client.info()
        for _ in range(5):
            worker = await client.spawn(sh(f"trap 'exit 0' TERM; {COUNTER}"), grace=600)
            await wait_output(client, worker.id, b"2\n")
            async with AsyncClient(tracking.socket) as other, trio.open_nursery() as nursery:
                nursery.start_soon(_pause_quietly, other, worker.id)
                await client.stop(worker.id)
            ended = await client.status(worker.id)
            assert (ended.state, ended.paused) == ("stopped", False)
            assert worker.pid is not None
            assert not alive(worker.pid)
            assert not frozen_left(info, worker.id)
            wakes = [w for w in await pending_wakes(tracking, worker.run) if w.id == worker.id]
            assert len(wakes) == 1


async def _pause_quietly(client: AsyncClient, worker_id: str) -> None:
    with contextlib.suppress(Refused):  # its stop came first
        await client.pause(worker=worker_id)


async def test_a_worker_pausing_itself_is_held_and_goes_on_once_unpaused(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        ctl = BIN / "subagentctl"
        worker = await client.spawn(
            sh(f'echo before; {ctl} pause "$SUBAGENTD_WORKER_ID"; echo after; exec sleep 600')
        )
        await wait_output(client, worker.id, b"before\n")
        await wait_journaled(client, worker.id, "state", b"paused")
        # A pause of its own waits for the one under way to be held, then says so.
        assert (await client.pause(worker=worker.id)).already_paused == [worker.id]
        assert worker.pid is not None
        assert kernel_holds(info, worker.id, worker.pid)
        await client.unpause(worker=worker.id)
        await wait_output(client, worker.id, b"after\n")
        assert (await client.status(worker.id)).state == "running"


async def test_shutdown_with_paused_workers_leaves_no_process_and_nothing_frozen(
    tracking: DaemonProcess,
) -> None:
    with trio.fail_after(40):
        async with AsyncClient(tracking.socket) as client:
            info = await client.info()
            worker = await client.spawn(sh(f"trap 'exit 0' TERM; {COUNTER}"), grace=600)
            child = await client.spawn(
                sh("trap 'exit 0' TERM; while :; do sleep 0.1; done"), parent=worker.id, grace=600
            )
            await wait_output(client, worker.id, b"2\n")
            await client.pause(worker=worker.id)
        started = time.monotonic()
        code = await trio.to_thread.run_sync(tracking.terminate)
        assert code == 0
        assert time.monotonic() - started < 15
        assert worker.pid is not None
        assert child.pid is not None
        assert not alive(worker.pid)
        assert not alive(child.pid)
        group = cgroup_of(info, worker.id)
        assert group is None or not group.exists()


async def test_a_pause_of_a_subtree_with_a_starting_and_an_ended_child(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        parent = await client.spawn(["sleep", "600"])
        ended = await client.spawn(["true"], parent=parent.id)
        await client.wait(ended.id)
        answer = await client.pause(worker=parent.id)
        assert answer.paused == [parent.id]
        assert (await client.unpause(worker=parent.id)).unpaused == [parent.id]


async def test_many_concurrent_pauses_and_stops_end_every_worker(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(60):
        info = await client.info()
        run = await client.new_run()
        workers = [await client.spawn(sh(COUNTER), run=run) for _ in range(8)]
        for w in workers:
            await wait_output(client, w.id, b"1\n")
        async with trio.open_nursery() as nursery:
            for w in workers:
                for _ in range(3):
                    nursery.start_soon(_pause_quietly, client, w.id)
            nursery.start_soon(client.stop_run, run)
        for w in workers:
            status = await client.wait(w.id)
            assert (status.state, status.paused) == ("stopped", False)
            assert w.pid is not None
            assert not alive(w.pid)
            assert not frozen_left(info, w.id)
        wakes = await pending_wakes(tracking, run)
        assert sorted(w.id for w in wakes) == sorted(w.id for w in workers)


async def test_a_forking_worker_is_held_by_a_pause_and_ended_by_a_stop(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    # Forks without pause: a SIGSTOP pause must catch what was forked during its scans.
    with trio.fail_after(40):
        info = await client.info()
        worker = await client.spawn(
            sh("echo up; while :; do sh -c 'sleep 0.2' & sleep 0.001; done"), grace=2
        )
        await wait_output(client, worker.id, b"up\n")
        await trio.sleep(0.5)
        await client.pause(worker=worker.id)
        assert worker.pid is not None
        assert kernel_holds(info, worker.id, worker.pid)
        assert await client.stop(worker.id)
        assert not alive(worker.pid)
        assert not frozen_left(info, worker.id)
