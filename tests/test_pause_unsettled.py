"""A pause the kernel is slow to settle (it never says the tree is frozen, as for a
process in uninterruptible sleep: the wait is bounded at 5 s) holds up the pauses of the
workers it reaches, never those of the others. Real processes, each way of tracking
trees; the slow settle is held by a fault point (`hold-pause`), deterministically."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from subagentd.client import AsyncClient
from subagentd.daemon.processes import _freezer
from subagentd.daemon.processes._tree import ProcStat, read_stat
from subagentd.daemon.workers._pauses import WorkerLocks

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .pausing import COUNTER, kernel_holds, wait_journaled


@pytest.mark.parametrize("cgroups", ["on", "off"])
async def test_a_pause_that_does_not_settle_holds_up_no_other_workers_pause(
    daemon_dirs: DaemonProcess, cgroups: str
) -> None:
    daemon_dirs.start(
        *(["--cgroups", "off"] if cgroups == "off" else []),
        env={"SUBAGENTD_FAULT": "hold-pause:held"},
    )
    hold = daemon_dirs.state_dir / "hold-pause"
    os.mkfifo(hold)
    with trio.fail_after(40):
        async with AsyncClient(daemon_dirs.socket) as client:
            info = await client.info()
            if cgroups == "on" and not info.tree_tracking.startswith("cgroup "):
                pytest.skip(f"this machine gives the daemon no cgroup: {info.tree_tracking}")
            held = await client.spawn(sh(COUNTER), name="held")
            other = await client.spawn(sh(COUNTER))
            sibling = await client.spawn(["sleep", "600"], parent=held.id)
            await wait_output(client, other.id, b"2\n")
            async with AsyncClient(daemon_dirs.socket) as second, trio.open_nursery() as nursery:
                nursery.start_soon(lambda: second.pause(worker=held.id))
                await wait_journaled(client, held.id, "state", b"paused")  # its lock held
                # Another worker's pause, and an unpause, are answered meanwhile.
                assert (await client.pause(worker=other.id)).paused == [other.id]
                assert other.pid is not None
                assert kernel_holds(info, other.id, other.pid)
                assert (await client.unpause(worker=other.id)).unpaused == [other.id]
                # What the held pause reaches waits for it: its delegated child too.
                with trio.move_on_after(0.5) as waited:
                    await client.pause(worker=sibling.id)
                assert waited.cancelled_caught
                await trio.to_thread.run_sync(hold.write_bytes, b"")  # the kernel settles
            assert (await client.pause(worker=sibling.id)).already_paused == [sibling.id]
            assert (await client.unpause(worker=held.id)).unpaused == sorted([held.id, sibling.id])


async def test_worker_locks_cross_no_circle_and_are_given_back() -> None:
    locks = WorkerLocks()
    got: list[str] = []
    first_in = trio.Event()

    async def hold(ids: list[str], name: str, release: trio.Event) -> None:
        async with locks.holding(ids) as held:
            assert held == frozenset(ids)
            got.append(name)
            first_in.set()
            await release.wait()

    with trio.fail_after(5):
        release = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, ["w-b", "w-a"], "ba", release)
            await first_in.wait()
            nursery.start_soon(hold, ["w-a", "w-b"], "ab", release)  # overlapping, reversed
            nursery.start_soon(hold, ["w-c"], "c", release)  # apart: not held up
            await trio.testing.wait_all_tasks_blocked()
            assert got == ["ba", "c"]
            assert len(locks) == 3
            release.set()
        assert got == ["ba", "c", "ab"]
        assert len(locks) == 0


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child of the test's own: the kernel tells its parent when it stops (waitid)."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


async def test_a_pause_whose_search_outlasts_its_bound_still_stops_what_it_found(
    monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen[bytes]
) -> None:
    # Past its bound before its first search returns (as on a loaded machine with
    # thousands of processes): it answers unsettled, yet what it found is stopped.
    monkeypatch.setattr(_freezer, "SETTLE_SECONDS", 0.0)

    async def find() -> list[ProcStat]:
        await trio.lowlevel.checkpoint()  # a search awaits (its scan, in a thread)
        stat = read_stat(sleeper.pid)
        return [stat] if stat is not None else []

    with trio.fail_after(10):
        assert not await _freezer.stop_found(find)
        stopped = await trio.to_thread.run_sync(
            functools.partial(os.waitid, os.P_PID, sleeper.pid, os.WSTOPPED),
            abandon_on_cancel=True,
        )
    assert stopped is not None
    assert stopped.si_code == os.CLD_STOPPED
