"""Attacks on the store from a review of issue 12: what a full disk, a kill -9 or a
hostile old state dir does to what the daemon knows."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME
from subagentd.protocol.errors import Refused

from .conftest import BIN, DaemonProcess, tmpfs_state_dir
from .helpers import alive, pending_wakes, sh, wait_output, write_old_record


def _fill(path: Path) -> None:
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


async def test_an_ending_on_a_full_disk_is_written_once_the_disk_is_back(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    """A worker that ends while the store cannot be written is still known to have ended,
    as what it ended, once the disk has room again: a kill -9 after its wake was acked
    neither turns it `interrupted` nor wakes its parent a second time."""
    daemon_dirs.start()
    ballast = small_disk / "ballast"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh("exec sleep 600"), run=run)
            _fill(ballast)
            await client.stop(worker.id)  # its ending finds the disk full
            assert any("No space left" in p for p in (await client.info()).problems)
            ballast.unlink()
            wakes = [w async for w in client.events(run=run)]  # handed over and acked
            assert [(w.id, w.state) for w in wakes] == [(worker.id, "stopped")]
        daemon_dirs.kill()
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"
        assert await pending_wakes(daemon_dirs, run) == []


async def test_a_request_the_store_cannot_take_is_refused_saying_so(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    """A request whose change the store cannot take (a full disk) is refused with what to
    do, not answered "internal error", and `info` says why; with room again it goes."""
    daemon_dirs.start()
    ballast = small_disk / "ballast"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            _fill(ballast)
            with pytest.raises(Refused, match="free some space"):
                await client.new_run()
            assert any("No space left" in p for p in (await client.info()).problems)
            ballast.unlink()
            assert (await client.new_run()).startswith("r-")


@pytest.fixture
def few_inodes(daemon_dirs: DaemonProcess) -> Iterator[Path]:
    """A tmpfs over the daemon's state dir with room for bytes but few files."""
    with tmpfs_state_dir(daemon_dirs, "size=16m,nr_inodes=400") as state_dir:
        yield state_dir


async def test_a_spawn_refused_after_its_registration_is_not_resurrected_by_recovery(
    daemon_dirs: DaemonProcess, few_inodes: Path
) -> None:
    """A spawn is written to the store before its archive is made. If the archive then
    cannot be made (no inode left, while the store still has room), the client is told
    the spawn was refused: a kill -9 after must not bring that worker back `interrupted`,
    nor wake its parent for it."""
    daemon_dirs.start()
    ballast = few_inodes / "ballast"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            ballast.mkdir()
            with contextlib.suppress(OSError):  # every inode taken; bytes to spare
                for n in range(100_000):
                    (ballast / str(n)).touch()
            refused = None
            for _ in range(20):  # the spare archives made ahead go first
                try:
                    await client.spawn(["true"], run=run)
                except Refused as exc:
                    refused = re.search(r"worker (w-[0-9a-f]+)", str(exc))
                    break
            assert refused is not None, "no spawn was refused"
            worker_id = refused[1]
        daemon_dirs.kill()
        shutil.rmtree(ballast)
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(worker_id)).state != "interrupted"
        assert worker_id not in {w.id for w in await pending_wakes(daemon_dirs, run)}


#: A worker that says when it is asked to stop, and does not stop.
_TERMED = """
import signal
def termed(*_):
    with open({!r}, "w") as fifo:
        fifo.write("termed")
signal.signal(signal.SIGTERM, termed)
print("ready", flush=True)
while True:
    signal.pause()
"""


async def test_a_crash_before_recovery_rebuilds_an_unread_old_record_loses_no_worker(
    daemon_dirs: DaemonProcess,
) -> None:
    """An older image's record.json that does not read is rebuilt by recovery from the
    snapshot. A kill -9 while recovery is still busy with another worker (a grace to
    wait out) must not make that worker unknown for good: the next start rebuilds it,
    says it was interrupted, and ends what was left of its tree."""
    state, archives = daemon_dirs.state_dir, daemon_dirs.state_dir / "archives"
    signals = daemon_dirs.root / "signals"
    os.mkfifo(signals)
    reader = os.open(signals, os.O_RDWR)  # held open: a writer never blocks
    try:
        daemon_dirs.start()
        with trio.fail_after(60):
            async with AsyncClient(daemon_dirs.socket) as client:
                slow = await client.spawn([sys.executable, "-c", _TERMED.format(str(signals))])
                await wait_output(client, slow.id, b"ready")
                unread = await client.spawn(sh("exec sleep 600"))
                slow_view = msgspec.to_builtins(await client.status(slow.id))
            daemon_dirs.kill()
            # As an image before the store left it: record.json files, no state.db.
            for suffix in ("", "-wal", "-shm"):
                (state / f"{STORE_NAME}{suffix}").unlink(missing_ok=True)
            write_old_record(archives / slow.id, slow_view)
            (archives / unread.id / "record.json").write_bytes(b"{ not a record")
            # Killed while recovery waits out the slow worker's grace: by then the
            # unread one was imported as done, and rebuilt in memory only.
            recovering = await trio.lowlevel.open_process(
                [str(BIN / "subagentd"), "--socket", str(daemon_dirs.socket),
                 "--state-dir", str(state), "--config", str(daemon_dirs.config)],
                env=daemon_dirs.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                said = await trio.to_thread.run_sync(os.read, reader, 64, abandon_on_cancel=True)
                assert said == b"termed"
            finally:
                recovering.kill()
                await recovering.wait()
            await trio.to_thread.run_sync(daemon_dirs.start)
            async with AsyncClient(daemon_dirs.socket) as client:
                assert (await client.status(unread.id)).state == "interrupted"
        assert unread.pid is not None
        assert not alive(unread.pid)
    finally:
        os.close(reader)


async def test_an_ending_the_disk_kept_out_goes_in_with_nothing_else_written(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    """With room again, the daemon writes a kept-out ending by itself (no other change
    comes to carry it), and says meanwhile that it is not yet in the store: a kill -9
    then finds it written, and the parent's wake is pending once, not lost, not twice."""
    daemon_dirs.start()
    ballast = small_disk / "ballast"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh("exec sleep 600"), run=run)
            _fill(ballast)
            await client.stop(worker.id)  # its ending finds the disk full
            problems = (await client.info()).problems
            assert any("not yet in the store" in p for p in problems), problems
            ballast.unlink()
            # Nothing announces the daemon's retry (backing off from 0.1 s) but info.
            while any("not yet in the store" in p for p in (await client.info()).problems):  # noqa: ASYNC110
                await trio.sleep(0.05)
        daemon_dirs.kill()
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"
        assert [w.id for w in await pending_wakes(daemon_dirs, run)] == [worker.id]


def _disk_trouble(problems: list[str]) -> list[str]:
    return [p for p in problems if "No space left" in p or "not yet in the store" in p]


async def test_a_full_disk_problem_clears_once_what_it_kept_out_is_written(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    """`info` stops reporting a full disk once the store has taken every change it kept
    out, with nothing else written to carry them; nothing kept out is lost. A request
    the full store refused is reported until the store takes a write again."""
    daemon_dirs.start()
    ballast = small_disk / "ballast"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh("exec sleep 600"), run=run)
            _fill(ballast)
            await client.stop(worker.id)  # its ending finds the disk full
            problems = (await client.info()).problems
            assert any("No space left" in p for p in problems), problems
            assert any("not yet in the store" in p for p in problems), problems
            ballast.unlink()
            # Nothing announces the daemon's retry (backing off from 0.1 s) but info.
            while any("not yet in the store" in p for p in problems):
                await trio.sleep(0.05)
                problems = (await client.info()).problems
            assert _disk_trouble(problems) == []
            wakes = [w async for w in client.events(run=run)]
            assert [(w.id, w.state) for w in wakes] == [(worker.id, "stopped")]

            _fill(ballast)
            with pytest.raises(Refused, match="free some space"):
                await client.new_run()
            assert any("No space left" in p for p in (await client.info()).problems)
            ballast.unlink()
            await client.new_run()
            assert _disk_trouble((await client.info()).problems) == []
        daemon_dirs.kill()
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"
        assert await pending_wakes(daemon_dirs, run) == []
