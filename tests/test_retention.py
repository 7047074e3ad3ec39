"""Retention: handles kept until collected or past the TTL; the archive answers after."""

from __future__ import annotations

import shutil

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import NotFound, RunStopped

from .conftest import DaemonProcess
from .helpers import sh

TTL = 0.5


async def _past_the_ttl() -> None:
    # The TTL is a clock: the behaviour under test is what happens once it has passed.
    await trio.sleep(TTL * 3)


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


async def test_an_uncollected_handle_expires_after_the_ttl(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start("--finished-ttl", str(TTL))
    with trio.fail_after(20):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(sh("echo late"))
            await client.wait(worker.id)
            assert (await client.info()).holds_park
            await _past_the_ttl()
            assert worker.id not in {w.id for w in await client.ls(all=True)}
            assert not (await client.info()).holds_park
            assert (await client.collect(worker.id)).result == "late\n"


async def test_an_expired_handle_a_live_parent_needs_becomes_a_tombstone(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--finished-ttl", str(TTL))
    with trio.fail_after(20):
        async with AsyncClient(daemon_dirs.socket) as client:
            parent = await client.spawn(["sleep", "60"])
            child = await client.spawn(sh("echo for my parent"), parent=parent.id)
            await client.wait(child.id)
            await _past_the_ttl()
            assert {w.id for w in await client.ls(all=True)} == {parent.id}
            shutil.rmtree(child.archive)  # only the tombstone is left to answer
            assert (await client.status(child.id)).state == "finished"
            result = await client.collect(child.id)
            assert (result.state, result.result) == ("finished", "for my parent\n")
            await client.stop(parent.id)


async def test_idle_exit_waits_for_every_worker_and_result(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start("--idle-exit", "0.3")
    assert daemon_dirs.proc is not None
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(["sleep", "60"])
        await trio.sleep(1.0)  # three idle periods with a worker running: it must stay
        assert daemon_dirs.proc.poll() is None
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.stop(worker.id)
            await client.collect(worker.id)
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
