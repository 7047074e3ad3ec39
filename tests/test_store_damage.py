"""A damaged store loses nothing its archives still hold: an empty state.db beside its WAL,
a WAL cut short or corrupted, a companion file that is not the daemon's, the store
unlinked while the daemon runs, and all of it with `--cgroups off`. Each time every
finished worker comes back finished with its result, every live one is ended and comes
back `interrupted` (resumable), nothing with an archive is `not_found`, and `info` names
the damage. Archives that are damaged themselves are reported and skipped, never followed.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME, Store
from subagentd.daemon.workers._store_upkeep import STORE_LINK_CHECK_EVERY

from .conftest import DaemonProcess
from .helpers import alive, pending_wakes, sh, wait_output
from .inprocess import held, in_process

FINISHED = 4


@dataclass
class Made:
    """What a test's workers were, before the damage."""

    run: str
    finished: list[str]
    live: str
    live_pid: int
    wakes: Sequence[tuple[str, str]]


async def _make_workers(daemon: DaemonProcess) -> Made:
    """FINISHED workers that wrote a result and ended, then one still running."""
    async with AsyncClient(daemon.socket) as client:
        run = await client.new_run()
        finished = []
        for i in range(FINISHED):
            worker = await client.spawn(sh(f'echo "result {i}" > "$SUBAGENTD_RESULT"'), run=run)
            await client.wait(worker.id)
            finished.append(worker.id)
        live = await client.spawn(sh("echo up; exec sleep 600"), run=run)
        await wait_output(client, live.id, b"up")
        pid = (await client.status(live.id)).pid
    assert pid is not None
    wakes = sorted((w.id, w.state) for w in await pending_wakes(daemon, run))
    return Made(run, finished, live.id, pid, wakes)


async def _clean_restart(daemon: DaemonProcess) -> None:
    """Stop and start again: the store's schema is checkpointed into state.db, so the WAL
    the next kill -9 leaves holds only the test's own commits."""
    await trio.to_thread.run_sync(daemon.terminate)
    await trio.to_thread.run_sync(daemon.start)


async def _assert_nothing_lost(daemon: DaemonProcess, made: Made, damage: str | None) -> list[str]:
    """Every finished worker finished with its result, the live one ended and interrupted,
    none not_found, `damage` named in `info`'s problems (None: nothing to name); the
    problems."""
    async with AsyncClient(daemon.socket) as client:
        for i, worker_id in enumerate(made.finished):
            view = await client.status(worker_id)  # not_found raises
            assert (view.state, view.exit_code) == ("finished", 0), view
            assert (await client.collect(worker_id)).result == f"result {i}\n"
        assert (await client.status(made.live)).state == "interrupted"
        problems = (await client.info()).problems
    assert not alive(made.live_pid)
    assert damage is None or any(damage in problem for problem in problems), problems
    pending = await pending_wakes(daemon, made.run)
    woken = {w.id: w.state for w in pending}
    assert len(woken) == len(pending), pending  # once each
    for worker_id in made.finished:  # every parent is woken: again, if need be
        assert woken.get(worker_id) == "finished", woken
    assert woken.get(made.live) == "interrupted", woken
    return problems


def _wal(daemon: DaemonProcess) -> Path:
    return daemon.state_dir / f"{STORE_NAME}-wal"


def _frames(wal: Path) -> tuple[int, int]:
    """The WAL's frame size and how many whole frames it holds."""
    page_size = struct.unpack(">I", wal.read_bytes()[8:12])[0]
    frame = 24 + page_size
    return frame, (wal.stat().st_size - 32) // frame


# -- (a) an empty state.db beside its WAL ---------------------------------------------


async def test_an_empty_state_db_beside_its_wal_loses_no_worker(daemon: DaemonProcess) -> None:
    """SQLite deletes a WAL beside a 0-byte database and starts empty, saying nothing:
    the daemon sets both aside, says so, and rebuilds every worker from its archive."""
    with trio.fail_after(90):
        await _clean_restart(daemon)
        made = await _make_workers(daemon)
        await trio.to_thread.run_sync(daemon.kill)
        assert _wal(daemon).stat().st_size > 0
        os.truncate(daemon.state_dir / STORE_NAME, 0)
        await trio.to_thread.run_sync(daemon.start)
        await _assert_nothing_lost(daemon, made, "was empty (0 bytes) beside its WAL")
        assert list(daemon.state_dir.glob(f"{STORE_NAME}.damaged-*-wal"))  # kept
        async with AsyncClient(daemon.socket) as client:
            await client.wait((await client.spawn(["true"], run=made.run)).id)
        # No seq is given twice: the fresh store's numbering skipped ahead.
        fresh = max(w.seq for w in await pending_wakes(daemon, made.run))
        assert fresh > 2**32


# -- (b) a WAL cut short or corrupted ---------------------------------------------


@pytest.mark.parametrize("damage", ["cut", "corrupted"])
async def test_a_wal_cut_short_or_corrupted_loses_no_worker(
    daemon: DaemonProcess, damage: str
) -> None:
    """SQLite replays a WAL up to its first frame that does not verify and drops every
    later commit, saying nothing: the workers whose rows or endings went with them come
    back from their archives as they ended, and the damage is named."""
    with trio.fail_after(90):
        await _clean_restart(daemon)
        made = await _make_workers(daemon)
        await trio.to_thread.run_sync(daemon.kill)
        wal = _wal(daemon)
        frame, count = _frames(wal)
        assert count > 8, count
        at = 32 + (count // 3) * frame  # a third in: the later workers' rows are after it
        if damage == "cut":
            os.truncate(wal, at + frame // 2)
        else:
            fd = os.open(wal, os.O_WRONLY)
            try:  # inside that frame's page: its checksum fails
                os.pwrite(fd, b"\xa5" * 64, at + 24 + 100)
            finally:
                os.close(fd)
        await trio.to_thread.run_sync(daemon.start)
        problems = await _assert_nothing_lost(daemon, made, "had no row for")
    if damage == "corrupted":
        assert any("cut short or corrupted" in p and "dropped" in p for p in problems), problems


# -- (c) a companion file that is not the daemon's -----------------------------------


@pytest.mark.parametrize("planted", ["fifo", "directory", "symlink"])
async def test_a_companion_file_not_the_daemons_costs_only_itself(
    daemon: DaemonProcess, planted: str
) -> None:
    """A FIFO, a directory or a symlink at state.db-shm sets that file aside alone: the
    store and its WAL are kept, and with them every worker."""
    victim = daemon.root / "victim"
    victim.write_bytes(b"precious, outside the state dir\n")
    with trio.fail_after(90):
        await _clean_restart(daemon)
        made = await _make_workers(daemon)
        await trio.to_thread.run_sync(daemon.kill)
        shm = daemon.state_dir / f"{STORE_NAME}-shm"
        shm.unlink(missing_ok=True)
        if planted == "fifo":
            os.mkfifo(shm)
        elif planted == "directory":
            shm.mkdir()
        else:
            shm.symlink_to(victim)
        await trio.to_thread.run_sync(daemon.start)
        problems = await _assert_nothing_lost(daemon, made, f"{STORE_NAME}-shm is")
    assert any("set aside alone" in p for p in problems), problems
    assert not any("had no row" in p for p in problems), problems  # the store was kept
    assert victim.read_bytes() == b"precious, outside the state dir\n"
    assert list(daemon.state_dir.glob(f"{STORE_NAME}.not-ours-*-shm"))


# -- (d) the store unlinked while the daemon runs ------------------------------------


@pytest.mark.parametrize("unlinked", ["", "-wal"])
async def test_the_store_unlinked_while_the_daemon_runs_is_put_back_whole(
    daemon: DaemonProcess, unlinked: str
) -> None:
    """state.db (or its WAL) unlinked under the running daemon: the next change notices,
    says so, and puts a whole copy back in place, so a kill -9 after loses nothing
    written before or since, wakes included (the store itself has every row: nothing
    needs rebuilding from the archives)."""
    with trio.fail_after(90):
        await _clean_restart(daemon)
        before = await _make_workers(daemon)
        (daemon.state_dir / f"{STORE_NAME}{unlinked}").unlink()
        since = await _make_workers(daemon)
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
        assert any("no longer linked" in p and "put back" in p for p in problems), problems
        await trio.to_thread.run_sync(daemon.kill)
        db = sqlite3.connect(daemon.state_dir / STORE_NAME)
        try:
            rows = {str(row[0]) for row in db.execute("SELECT id FROM workers")}
        finally:
            db.close()
        for made in (before, since):
            assert {*made.finished, made.live} <= rows, rows
        await trio.to_thread.run_sync(daemon.start)
        for made in (before, since):
            # Put back before the kill: this start found nothing wrong, nothing rebuilt.
            assert await _assert_nothing_lost(daemon, made, None) == []


async def test_an_idle_daemon_puts_its_unlinked_store_back(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    """A daemon that writes nothing still notices, within STORE_LINK_CHECK_EVERY, that
    its state.db was unlinked, and puts it back whole before a crash could lose it."""
    async with in_process(short_tmp) as d, d.client() as client:
        run = await client.new_run()  # a named run: a row only the store holds
        (d.state_dir / STORE_NAME).unlink()
        await trio.sleep(STORE_LINK_CHECK_EVERY * 1.5)
        problems = (await client.info()).problems
        assert any("no longer linked" in p and "put back" in p for p in problems), problems
        assert (d.state_dir / STORE_NAME).is_file()
        assert d.daemon.store.run(run) is not None  # the whole store, in the file put back


# -- (e) with --cgroups off ------------------------------------------------------


async def test_live_workers_of_lost_rows_are_ended_without_cgroups(
    daemon_dirs: DaemonProcess,
) -> None:
    """With `--cgroups off` nothing but the store knew a live worker's tree: its row
    lost (an empty state.db), it is found by the worker id its processes carry, ended,
    and comes back `interrupted`, resumable by id."""
    daemon_dirs.extra_args += ["--cgroups", "off"]
    with trio.fail_after(90):
        await trio.to_thread.run_sync(daemon_dirs.start)
        await _clean_restart(daemon_dirs)
        made = await _make_workers(daemon_dirs)
        await trio.to_thread.run_sync(daemon_dirs.kill)
        assert alive(made.live_pid)  # orphaned: running on, unknown to any store
        os.truncate(daemon_dirs.state_dir / STORE_NAME, 0)
        await trio.to_thread.run_sync(daemon_dirs.start)
        await _assert_nothing_lost(daemon_dirs, made, "was empty (0 bytes)")
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.info()).tree_tracking.startswith("/proc scan")
            resumed = await client.resume(made.live)
            assert (resumed.id, resumed.attempt) == (made.live, 2)
            await client.stop(made.live)


# -- archives damaged themselves --------------------------------------------------


async def test_damaged_archives_without_rows_are_reported_and_never_followed(
    daemon: DaemonProcess,
) -> None:
    """Archives the store has no row for, damaged themselves: a FIFO for a snapshot,
    garbage for one, a symlink for the whole directory (to a directory outside the state
    dir holding a good snapshot), a plain file. Each is reported and skipped; the FIFO
    is never waited on, nothing is written through the symlink, the workers beside
    them are rebuilt."""
    with trio.fail_after(90):
        await _clean_restart(daemon)
        made = await _make_workers(daemon)
        await trio.to_thread.run_sync(daemon.kill)
        archives = daemon.state_dir / "archives"
        outside = daemon.root / "outside"
        outside.mkdir()
        good = archives / made.finished[0]
        for name in ("snapshot.json", "journal"):
            (outside / name).write_bytes((good / name).read_bytes())
        before = {name: (outside / name).read_bytes() for name in os.listdir(outside)}
        (archives / "w-fifo").mkdir()
        os.mkfifo(archives / "w-fifo" / "snapshot.json")
        (archives / "w-garbage").mkdir()
        (archives / "w-garbage" / "snapshot.json").write_bytes(b'{"not": json')
        (archives / "w-link").symlink_to(outside)
        (archives / "w-file").write_bytes(b"not a directory\n")
        os.truncate(daemon.state_dir / STORE_NAME, 0)
        await trio.to_thread.run_sync(daemon.start)
        problems = await _assert_nothing_lost(daemon, made, "had no row for")
        for name, said in [
            ("w-fifo", "not a regular file"),
            ("w-garbage", "no longer reads"),
            ("w-link", "is a symlink: skipped, not followed"),
            ("w-file", "is not a directory: skipped"),
        ]:
            assert any(name in p and said in p for p in problems), (name, problems)
        async with AsyncClient(daemon.socket) as client:
            assert {w.id for w in await client.ls(all=True)}.isdisjoint(
                {"w-fifo", "w-garbage", "w-link", "w-file"}
            )
    after = {name: (outside / name).read_bytes() for name in os.listdir(outside)}
    assert after == before  # nothing written there


# -- what is no damage -------------------------------------------------------------


async def test_an_archive_a_pruning_left_is_pruned_again_not_taken_for_a_lost_row(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    """A pruning deletes a worker's archive, then its row: an archive it could not delete
    whole is found without a row at the next start, and is the pruning's leftover (its
    worker ended before the keep period), not a row the store lost: pruned again, said
    nowhere, no seq skipped."""
    async with in_process(short_tmp, keep_archives_days=1) as d:
        async with d.client() as client:
            with held(autojump_clock):
                worker = await client.spawn(["true"])
                await client.collect(worker.id, wait=True)
        archive = Path(worker.archive)
        kept = short_tmp / "kept"
        shutil.copytree(archive, kept)
        await trio.sleep(1.5 * 86400)  # past the keep period, before a daily pruning
        await d.daemon.retention.prune_archives_once()
        assert not await trio.Path(archive).exists()
        shutil.copytree(kept, archive)  # as though that pruning had not deleted it whole
        await d.crash_and_restart()
        async with d.client() as client:
            problems = (await client.info()).problems
        assert not any("had no row" in p for p in problems), problems
        assert not await trio.Path(archive).exists()
        assert not d.daemon.store.damaged


async def test_a_kill_9_alone_is_no_damage(daemon: DaemonProcess) -> None:
    """A WAL a kill -9 left (its last transaction perhaps half written) drops no commit:
    nothing is reported, nothing rebuilt, and an ending whose commit the kill forestalled
    stays `interrupted` (its journal's ending never reached the store)."""
    with trio.fail_after(90):
        await _clean_restart(daemon)
        made = await _make_workers(daemon)
        await trio.to_thread.run_sync(daemon.kill)
        await trio.to_thread.run_sync(daemon.start)
        assert await _assert_nothing_lost(daemon, made, None) == []


def test_stale_frames_of_a_reset_wal_are_not_dropped_commits(tmp_path: Path) -> None:
    """After a checkpoint the WAL starts again from its head with new salts, the older
    frames left behind it; a process killed then (here: one that never closes the store)
    leaves them, and they are no damage."""
    script = f"""
import os
from subagentd.daemon.store._store import Change, Store
from subagentd.daemon.core._registry import WorkerRecord
def record(i, size):
    return WorkerRecord(id=f"w-{{i}}", run="r-1", parent=None, name="", state="running",
        argv=["x" * size], cwd="/", agent=None, grace=1.0, timeout=None, token=f"t-{{i}}",
        archive=f"/a/w-{{i}}", started_at=1.0)
store = Store.open(__import__("pathlib").Path({str(tmp_path / STORE_NAME)!r}))
for i in range(200):
    store.commit(Change(workers=[record(i, 10)]), "before")
store._db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # the next commit starts it again
for i in range(3):
    store.commit(Change(workers=[record(10_000 + i, 10)]), "after")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    wal = tmp_path / f"{STORE_NAME}-wal"
    _, count = _frames(wal)
    assert count > 100  # the last commits' frames, and the stale ones behind them
    store = Store.open(tmp_path / STORE_NAME)
    try:
        assert store.problems == []
        assert not store.damaged
        assert not store.tail_unsure  # the stale frames hide no commit of ours
        assert len(store.known_workers()) == 203
    finally:
        store.close()
