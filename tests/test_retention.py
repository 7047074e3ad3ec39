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


async def test_idle_exit_waits_for_every_worker_and_result(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    idle = 300.0
    async with in_process(short_tmp) as d:
        async with d.client() as client:
            with held(autojump_clock):
                worker = await client.spawn(["sleep", "100000"])
        done = trio.CancelScope()  # what idle exit cancels: the daemon's serving
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_idle, d.daemon, d.server, idle, done)
            await trio.sleep(3 * idle)
            assert not done.cancel_called  # a worker runs
            async with d.client() as client:
                await client.stop(worker.id)
            await trio.sleep(3 * idle)
            assert not done.cancel_called  # its result waits to be collected
            async with d.client() as client:
                await client.collect(worker.id)
            quiet = trio.current_time()
        assert done.cancel_called
        assert idle <= trio.current_time() - quiet < idle + 1


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
