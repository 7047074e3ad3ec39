"""Retention: handles kept until collected or past the TTL; the archive answers after.

The tests of the TTL, of pruning by age and of when idle exit comes run the daemon
in-process on the mock clock (tests/inprocess.py); that idle exit ends the process,
and pruning at start, are tested on a subagentd process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.daemon.lifecycle._serve import _until_idle
from subagentd.protocol.errors import NotFound, RunStopped

from .conftest import DaemonProcess
from .helpers import sh
from .inprocess import at, held, in_process

#: An hour: on the mock clock it passes at once, and a test can look a second before it.
TTL = 3600.0
DAY = 86400.0


async def test_a_collected_worker_leaves_memory_but_answers_from_its_archive(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(20):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo kept on disk"))
            assert (await client.collect(worker.id, wait=True)).result == "kept on disk\n"
            assert worker.id not in {w.id for w in await client.ls(all=True)}
            assert (await client.status(worker.id)).state == "finished"
            again = await client.collect(worker.id)  # a repeat answers the same
            assert (again.state, again.result) == ("finished", "kept on disk\n")
            page = await client.watch_page(worker.id)
            assert b"kept on disk\n" in b"".join(e.data for e in page.entries)
            assert page.complete
            assert not (await client.info()).holds_park


async def test_an_uncollected_handle_expires_after_the_ttl(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp, finished_ttl=TTL) as d, d.client() as client:
        with held(autojump_clock):  # the worker's real run must not jump time
            worker = await client.spawn(sh("echo late"))
            await client.wait(worker.id)
        ended = d.ended(worker.id)
        await trio.sleep_until(ended + TTL - 1)
        assert worker.id in {w.id for w in await client.ls(all=True)}  # not a second early
        assert (await client.info()).holds_park
        await trio.sleep_until(ended + TTL + 1)
        assert worker.id not in {w.id for w in await client.ls(all=True)}
        assert not (await client.info()).holds_park
        assert (await client.collect(worker.id)).result == "late\n"


async def test_an_expired_handle_a_live_parent_needs_becomes_a_tombstone(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp, finished_ttl=TTL) as d, d.client() as client:
        with held(autojump_clock):
            parent = await client.spawn(["sleep", "100000"])
            child = await client.spawn(sh("echo for my parent"), parent=parent.id)
            await client.wait(child.id)
        await trio.sleep_until(d.ended(child.id) + TTL + 1)
        assert {w.id for w in await client.ls(all=True)} == {parent.id}
        shutil.rmtree(child.archive)  # only the tombstone is left to answer
        assert (await client.status(child.id)).state == "finished"
        result = await client.collect(child.id)
        assert (result.state, result.result) == ("finished", "for my parent\n")


async def test_a_collected_tombstone_answers_the_same_again_across_a_reload_and_a_crash(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp, finished_ttl=TTL) as d:
        async with d.client() as client:
            with held(autojump_clock):
                parent = await client.spawn(["sleep", "100000"])
                child = await client.spawn(sh("echo for my parent; exit 3"), parent=parent.id)
                await client.wait(child.id)
        await trio.sleep_until(d.ended(child.id) + TTL + 1)
        shutil.rmtree(child.archive)  # only the tombstone is left to answer
        async with d.client() as client:
            first = await client.collect(child.id)
            assert (first.state, first.exit_code, first.result) == ("failed", 3, "for my parent\n")
            assert await client.collect(child.id) == first  # a repeat answers the same
        with held(autojump_clock):
            await d.reload_in_place()
        async with d.client() as client:
            assert await client.collect(child.id) == first
        with held(autojump_clock):
            await d.crash_and_restart()
        async with d.client() as client:
            assert await client.collect(child.id) == first
            assert (await client.status(child.id)).state == "failed"
            assert (await client.status(parent.id)).state == "interrupted"


async def test_an_archive_is_pruned_once_older_than_the_days_kept(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp, keep_archives_days=2) as d, d.client() as client:
        started = trio.current_time()  # the daily pruning counts its days from its start
        autojump_clock.jump(3600)  # so no pruning falls on the very second it ended
        with held(autojump_clock):
            worker = await client.spawn(["true"])
            await client.collect(worker.id, wait=True)
        archive = Path(worker.archive)
        # Ended an hour in, kept two days: the daily pruning of day 3 is the first past
        # them. Day by day, each pruning settled before the clock moves on (a leap over
        # a pruning's thread would put it, and every later one, behind the test).
        for day, kept in ((1, True), (2, True), (3, False)):
            async with at(autojump_clock, started + day * DAY + 1):
                await d.settle_threads()  # that day's pruning is done
                assert archive.exists() == kept, f"day {day}"  # noqa: ASYNC240 - a stat
        with pytest.raises(NotFound):
            await client.status(worker.id)


async def test_idle_exit_waits_for_running_workers_and_owed_results_not_stopped_ones(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    idle = 300.0
    async with in_process(short_tmp, finished_ttl=TTL) as d:
        async with d.client() as client:
            with held(autojump_clock):
                owed = await client.spawn(sh("echo owed"))  # ends on its own: owes a result
                runner = await client.spawn(["sleep", "100000"])
                await client.wait(owed.id)
        done = trio.CancelScope()  # what idle exit cancels: the daemon's serving
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_idle, d.daemon, d.server, idle, done)
            await trio.sleep(3 * idle)
            assert not done.cancel_called  # a worker runs
            async with d.client() as client:
                with held(autojump_clock):
                    await client.stop(runner.id)
            await trio.sleep(3 * idle)
            assert not done.cancel_called  # the result owed waits to be collected
            async with d.client() as client:
                assert (await client.info()).holds_park
                await client.collect(owed.id)
                # The stopped runner's handle waits uncollected: it owes no result.
                assert [w.id for w in await client.ls(all=True)] == [runner.id]
                assert not (await client.info()).holds_park
            quiet = trio.current_time()
        assert done.cancel_called
        assert idle <= trio.current_time() - quiet < idle + 1


async def test_idle_exit_comes_with_only_stopped_and_cancelled_workers_uncollected(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    idle = 300.0
    async with in_process(short_tmp) as d:
        async with d.client() as client:
            with held(autojump_clock):
                stopped = await client.spawn(["sleep", "100000"])
                cancelled = await client.spawn(["sleep", "100000"])
        done = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_idle, d.daemon, d.server, idle, done)
            await trio.sleep(3 * idle)
            assert not done.cancel_called  # two workers run
            async with d.client() as client:
                with held(autojump_clock):
                    await client.stop(stopped.id)
                    assert await client.cancel(f"worker:{cancelled.id}") == [cancelled.id]
                    await client.wait(cancelled.id)
                held_handles = {w.id: w.state for w in await client.ls(all=True)}
                assert held_handles == {stopped.id: "stopped", cancelled.id: "stopped"}
                assert not (await client.info()).holds_park
            quiet = trio.current_time()
        assert done.cancel_called
        assert idle <= trio.current_time() - quiet < idle + 1


async def test_idle_exit_comes_once_the_owed_result_passes_its_ttl(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    idle = 300.0
    async with in_process(short_tmp, finished_ttl=TTL) as d:
        async with d.client() as client:
            with held(autojump_clock):
                owed = await client.spawn(sh("echo owed"))
                runner = await client.spawn(["sleep", "100000"])
                await client.wait(owed.id)
        expiry = d.ended(owed.id) + TTL
        done = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_idle, d.daemon, d.server, idle, done)
            await trio.sleep_until(expiry - idle)
            async with d.client() as client:
                with held(autojump_clock):
                    await client.stop(runner.id)  # uncollected, its TTL long after: owes nothing
            await trio.sleep_until(expiry - 1)
            assert not done.cancel_called  # the result is owed until its TTL
        assert done.cancel_called
        assert expiry + idle <= trio.current_time() < expiry + idle + 1
        async with d.client() as client:
            assert [w.id for w in await client.ls(all=True)] == [runner.id]


async def test_idle_exit_ends_a_daemon_holding_only_a_stopped_worker(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--idle-exit", "0.3")
    assert daemon_dirs.proc is not None
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(["sleep", "60"])
            await client.stop(worker.id)
            assert [w.state for w in await client.ls(all=True)] == ["stopped"]
            assert not (await client.info()).holds_park
        code = await trio.to_thread.run_sync(daemon_dirs.proc.wait, 10)
        assert code == 0


async def test_idle_exit_stops_the_daemon_and_removes_its_socket(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--idle-exit", "0.3")
    assert daemon_dirs.proc is not None
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.collect((await client.spawn(["true"])).id, wait=True)
        code = await trio.to_thread.run_sync(daemon_dirs.proc.wait, 10)
        assert code == 0
        assert not daemon_dirs.socket.exists()


def test_old_archives_are_pruned_at_start(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start()
    done = daemon_dirs.ctl("spawn", "--", "true").stdout.split()[0]
    assert daemon_dirs.ctl("collect", "--wait", done).returncode == 0
    daemon_dirs.terminate()
    archive = daemon_dirs.state_dir / "archives" / done
    assert archive.exists()
    daemon_dirs.start("--keep-archives", "0")  # ready only once pruned
    assert not archive.exists()
    status = daemon_dirs.ctl("status", done)
    assert status.returncode == 1
    assert "not_found" in status.stderr


async def test_a_released_worker_is_ended_not_unknown(daemon: DaemonProcess) -> None:
    with trio.fail_after(20):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["true"])
            await client.collect(worker.id, wait=True)
            assert await client.stop(worker.id)  # found: ended, so nothing to stop
            assert await client.cancel(f"worker:{worker.id}") == []
            with pytest.raises(RunStopped, match="has ended"):
                await client.spawn(["true"], parent=worker.id)
            assert not await client.stop("w-never-seen")


async def test_a_lone_spawns_run_goes_once_collected_and_stopped_and_named_runs_outlive_a_crash(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["true"])
            await client.collect(worker.id, wait=True)
            # Stopped, a lone spawn's run has something to say: it refuses spawns.
            sleeper = await client.spawn(["sleep", "60"])
            await client.stop_run(sleeper.run)
            named = await client.new_run()
            kept = await client.spawn(["true"], run=named)
            await client.collect(kept.id, wait=True)
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            with pytest.raises(NotFound):
                await client.stop_run(worker.run)  # gone with its worker
            with pytest.raises(RunStopped):
                await client.spawn(["true"], run=sleeper.run)  # even after a crash
            await client.collect((await client.spawn(["true"], run=named)).id, wait=True)
