"""A second look at the store's reconciliation with archives/ (issue 24, item 2): what is
no damage must not be reported or rebuilt as damage, and what is must not be handled
twice."""

from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME, Store

from .conftest import DaemonProcess
from .helpers import alive, pending_wakes, sh, wait_output
from .inprocess import held, in_process


async def test_a_prunings_leftover_without_its_snapshot_is_no_damage(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    """A pruning that cannot delete an archive whole (its worker left a file there that
    cannot be unlinked: a directory its user cannot write, or, run as root as the tests
    are, an immutable file) deletes its snapshot and journal, then its row. What is left
    is the pruning's, not a row the store lost: no start after may say the store lost
    rows or that an archive cannot be rebuilt, nor skip seqs."""
    async with in_process(short_tmp, keep_archives_days=1) as d:
        async with d.client() as client:
            with held(autojump_clock):
                worker = await client.spawn(sh('mkdir "${SUBAGENTD_RESULT%/*}/kept"'))
                await client.collect(worker.id, wait=True)
        kept = Path(worker.archive) / "kept" / "file"
        kept.write_bytes(b"")
        undeletable = _undeletable(kept) if os.geteuid() == 0 else None
        if os.geteuid() != 0:
            kept.parent.chmod(0o500)
        elif undeletable is None:
            pytest.skip("no immutable files here (chattr +i) to make a pruning fail with")
        try:
            await trio.sleep(1.5 * 86400)  # past the keep period, before a daily pruning
            await d.daemon.retention.prune_archives_once()
            assert not d.daemon.store.known_workers()  # its row is forgotten
            assert list(d.state_dir.glob("archives/*/kept/file"))  # not deleted whole
            await d.crash_and_restart()
            async with d.client() as client:
                problems = (await client.info()).problems
            assert problems == [], problems
            assert not d.daemon.store.damaged
        finally:
            for left in d.state_dir.glob("archives/*/kept/file"):
                if undeletable is not None:
                    undeletable(left)
                left.parent.chmod(0o700)


def _undeletable(path: Path) -> Callable[[Path], None] | None:
    """Make `path` immutable (chattr +i), if this file system can; what undoes it."""
    if shutil.which("chattr") is None:
        return None
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if made.returncode != 0:
        return None

    def undo(left: Path) -> None:
        subprocess.run(["chattr", "-i", str(left)], check=True)

    return undo


async def test_an_old_state_dirs_unread_record_is_rebuilt_once_not_as_a_lost_row(
    daemon_dirs: DaemonProcess,
) -> None:
    """An older image's record.json that does not read is rebuilt from its snapshot by
    recovery (`unread`). Its archive has no row, as a lost row's has none: it must be
    rebuilt once, its parent woken once, and the store not said to have lost rows (it
    had none to lose: there was no store)."""
    state, archives = daemon_dirs.state_dir, daemon_dirs.state_dir / "archives"
    with trio.fail_after(90):
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            live = await client.spawn(sh("echo up; exec sleep 600"), run=run)
            await wait_output(client, live.id, b"up")
            pid = (await client.status(live.id)).pid
        await trio.to_thread.run_sync(daemon_dirs.kill)
        # As an image before the store left it: record.json files, no state.db.
        for suffix in ("", "-wal", "-shm"):
            (state / f"{STORE_NAME}{suffix}").unlink(missing_ok=True)
        (archives / live.id / "record.json").write_bytes(b"{ not a record")
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(live.id)).state == "interrupted"
            problems = (await client.info()).problems
        assert pid is not None
        assert not alive(pid)
        assert not any("had no row" in p for p in problems), problems
        rebuilt = [p for p in problems if live.id in p and "rebuilt" in p]
        assert len(rebuilt) == 1, problems  # rebuilt once
        woken = [w for w in await pending_wakes(daemon_dirs, run) if w.id == live.id]
        assert len(woken) == 1, woken
        assert woken[0].seq < 2**32, woken  # no store lost its seqs: none skipped


async def test_a_store_unlinked_just_before_a_reload_is_put_back_not_lost(
    daemon: DaemonProcess,
) -> None:
    """state.db unlinked, then a reload before the idle check's next round (or any change)
    noticed: the reload must not hand the new image a name that links nothing (it would
    start a fresh store, and every row only the store held, a named run's, a wake's seq,
    would be lost, the rest rebuilt from the archives as after damage)."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh('echo done > "$SUBAGENTD_RESULT"'), run=run)
            await client.wait(worker.id)
        (daemon.state_dir / STORE_NAME).unlink()
        async with AsyncClient(daemon.socket) as client:
            await client.reload()
            problems = (await client.info()).problems
            assert (await client.collect(worker.id)).result == "done\n"
        assert not any("had no row" in p for p in problems), problems
        woken = [w for w in await pending_wakes(daemon, run) if w.id == worker.id]
        assert len(woken) == 1, woken
        assert woken[0].seq < 2**32, woken  # the store's own seqs, none skipped
        await trio.to_thread.run_sync(daemon.kill)
    db = sqlite3.connect(daemon.state_dir / STORE_NAME)
    try:
        runs = {str(row[0]) for row in db.execute("SELECT id FROM runs")}
    finally:
        db.close()
    assert run in runs, runs  # the named run's row, which only the store held


async def test_a_store_unlinked_just_before_a_stop_is_put_back_not_lost(
    daemon: DaemonProcess,
) -> None:
    """state.db unlinked, then the daemon stopped (SIGTERM) before anything noticed: the
    next start must find the store whole at its name, not start afresh from the
    archives."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh('echo done > "$SUBAGENTD_RESULT"'), run=run)
            await client.wait(worker.id)
        (daemon.state_dir / STORE_NAME).unlink()
        await trio.to_thread.run_sync(daemon.terminate)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
            assert (await client.collect(worker.id)).result == "done\n"
        assert problems == [], problems
        woken = [w for w in await pending_wakes(daemon, run) if w.id == worker.id]
        assert len(woken) == 1, woken
        assert woken[0].seq < 2**32, woken


_TORN_SCRIPT = """
import os, shutil, pathlib
from subagentd.daemon.store._store import Change, Store
from subagentd.daemon.core._registry import WorkerRecord
def record(i):
    return WorkerRecord(id=f"w-{{i}}", run="r-1", parent=None, name="", state="running",
        argv=["x" * 10], cwd="/", agent=None, grace=1.0, timeout=None, token=f"t-{{i}}",
        archive=f"/a/w-{{i}}", started_at=1.0)
path = pathlib.Path({path!r})
store = Store.open(path)
for i in range(200):
    store.commit(Change(workers=[record(i)]), "before")
store._db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # the next commit starts it again
shutil.copyfile(f"{{path}}-wal", {before!r})
store.commit(Change(workers=[record(10_000)]), "in flight when killed")
os._exit(0)
"""


def test_a_kill_9_between_a_commit_frames_header_and_page_is_no_damage(tmp_path: Path) -> None:
    """SQLite writes each WAL frame as two writes: its 24-byte header, then its page. A
    kill -9 between them, the WAL's space reused after a checkpoint, leaves the header of
    the in-flight commit (current salts, a commit mark) over the stale page that was
    there: that commit never returned, nothing was lost, and nothing may be reported."""
    path, before = tmp_path / STORE_NAME, tmp_path / "wal-before"
    script = _TORN_SCRIPT.format(path=str(path), before=str(before))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    wal = bytearray(Path(f"{path}-wal").read_bytes())
    stale = before.read_bytes()
    page_size, salts = struct.unpack(">I", wal[8:12])[0], wal[16:24]
    frame = 24 + page_size
    commits = [
        at
        for at in range(32, len(wal) - frame + 1, frame)
        if wal[at + 8 : at + 16] == salts and struct.unpack(">I", wal[at + 4 : at + 8])[0]
    ]
    assert len(commits) == 1, commits  # the WAL started again: the in-flight commit alone
    at = commits[0]
    assert len(stale) >= at + frame  # reused space: a stale frame lay there
    wal[at + 24 : at + frame] = stale[at + 24 : at + frame]  # its page never written
    Path(f"{path}-wal").write_bytes(bytes(wal))
    store = Store.open(path)
    try:
        assert store.problems == []
        assert not store.damaged
        assert len(store.known_workers()) == 200  # the in-flight commit never was
        # Though a cut through a commit that did return looks the same: recovery then
        # takes the journals' endings (`test_a_wal_cut_short_through_an_ending_...`).
        assert store.tail_unsure
    finally:
        store.close()


async def test_a_wal_cut_short_through_an_ending_gives_that_ending_back(
    daemon: DaemonProcess,
) -> None:
    """A WAL cut in the middle of its last commit, the ending of a finished worker whose
    registration commit came before: that worker's journal says how it ended."""
    with trio.fail_after(90):
        await trio.to_thread.run_sync(daemon.terminate)  # the schema into state.db
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh('echo done > "$SUBAGENTD_RESULT"'))
            await client.wait(worker.id)
        await trio.to_thread.run_sync(daemon.kill)
        wal = daemon.state_dir / f"{STORE_NAME}-wal"
        frame = 24 + struct.unpack(">I", wal.read_bytes()[8:12])[0]
        os.truncate(wal, wal.stat().st_size - frame // 2)  # through the last commit frame
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            view = await client.status(worker.id)
            assert (view.state, view.exit_code) == ("finished", 0), view


async def test_a_lost_row_of_a_result_still_held_is_rebuilt_not_pruned(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    """A finished worker's handle is held, uncollected, for finished_ttl; a pruning never
    deletes a held worker's archive, even past the keep period. Its row lost, recovery
    must not take its archive for a pruning's leftover and delete its result: it is
    rebuilt, collectable as before."""
    async with in_process(short_tmp, keep_archives_days=1, finished_ttl=3 * 86400) as d:
        async with d.client() as client:
            with held(autojump_clock):
                worker = await client.spawn(sh('echo kept > "$SUBAGENTD_RESULT"'))
                await client.wait(worker.id)
        await trio.sleep(1.5 * 86400)  # past the keep period, within its handle's TTL
        await d.daemon.retention.prune_archives_once()
        assert await trio.Path(worker.archive).exists()  # held: not pruned
        d.daemon.store.forget([worker.id])  # as damage would lose its row
        await d.crash_and_restart()
        async with d.client() as client:
            assert (await client.collect(worker.id)).result == "kept\n"


async def test_a_wal_cut_short_through_a_wake_gives_no_seq_twice(
    daemon: DaemonProcess,
) -> None:
    """The README: no seq is given twice whatever was damaged. A wake posted and handed
    out (seq N), then its commit cut from the WAL: the wake recovery posts in its place
    must not be given seq N again."""
    with trio.fail_after(90):
        await trio.to_thread.run_sync(daemon.terminate)  # the schema into state.db
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh("exit 0"), run=run)
            await client.wait(worker.id)
        (given,) = [w.seq for w in await pending_wakes(daemon, run) if w.id == worker.id]
        await trio.to_thread.run_sync(daemon.kill)
        wal = daemon.state_dir / f"{STORE_NAME}-wal"
        frame = 24 + struct.unpack(">I", wal.read_bytes()[8:12])[0]
        os.truncate(wal, wal.stat().st_size - frame // 2)  # through the last commit frame
        await trio.to_thread.run_sync(daemon.start)
        again = [w.seq for w in await pending_wakes(daemon, run) if w.id == worker.id]
        assert again, "its parent is woken again"
        assert given not in again, (given, again)


_COMMITS_LEFT_IN_THE_WAL = """
import os, pathlib
from subagentd.daemon.store._store import Change, Store
from subagentd.daemon.core._registry import WorkerRecord
def record(i):
    return WorkerRecord(id=f"w-{{i}}", run="r-1", parent=None, name="", state="running",
        argv=["x" * 10], cwd="/", agent=None, grace=1.0, timeout=None, token=f"t-{{i}}",
        archive=f"/a/w-{{i}}", started_at=1.0)
path = pathlib.Path({path!r})
Store.open(path).close()  # the schema, checkpointed into the database
store = Store.open(path)
for i in range(50):
    store.commit(Change(workers=[record(i)]), "left in the WAL")
os._exit(0)
"""


def test_a_wal_whose_header_is_damaged_has_its_dropped_commits_counted(tmp_path: Path) -> None:
    """A byte of the WAL's header damaged (here its salt): sqlite then takes no frame of
    it, dropping every commit, silently. The salts to count the dropped commits by are
    the first frame's, not the damaged header's: the damage is named, and the store is
    taken as damaged (recovery then trusts the journals' endings)."""
    path = tmp_path / STORE_NAME
    script = _COMMITS_LEFT_IN_THE_WAL.format(path=str(path))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    fd = os.open(f"{path}-wal", os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5", 17)  # inside the header's first salt
    finally:
        os.close(fd)
    store = Store.open(path)
    try:
        assert store.known_workers() == set()  # sqlite took none of it
        assert any("cut short or corrupted" in p for p in store.problems), store.problems
        assert store.damaged
    finally:
        store.close()


async def test_reloads_then_a_kill_9_are_no_damage(daemon: DaemonProcess) -> None:
    """What a daemon does to its own store is never damage: reloads (each exec leaves the
    WAL), a kill -9, a clean restart: problems stay empty, seqs stay the store's own."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            live = await client.spawn(sh("echo up; exec sleep 600"), run=run)
            await wait_output(client, live.id, b"up")
            for _ in range(3):
                done = await client.spawn(sh('echo x > "$SUBAGENTD_RESULT"'), run=run)
                await client.wait(done.id)
                await client.reload()
                assert (await client.info()).problems == []
            assert (await client.status(live.id)).state == "running"
        await trio.to_thread.run_sync(daemon.kill)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.info()).problems == []
        await trio.to_thread.run_sync(daemon.terminate)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.info()).problems == []
        assert all(w.seq < 2**32 for w in await pending_wakes(daemon, run))


async def test_a_store_put_back_beside_a_planted_journal_name_still_serves(
    daemon: DaemonProcess,
) -> None:
    """state.db unlinked and a directory planted at state.db-journal (a name a WAL-mode
    store never uses): the copy put back must open without it, so the daemon goes on with
    a database (not a closed one whose every read fails), and a restart finds every row."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            (daemon.state_dir / STORE_NAME).unlink()
            (daemon.state_dir / f"{STORE_NAME}-journal").mkdir()
            worker = await client.spawn(sh('echo done > "$SUBAGENTD_RESULT"'), run=run)
            await client.wait(worker.id)
            problems = (await client.info()).problems
            assert any("put back" in p and "nothing written is lost" in p for p in problems), (
                problems
            )
            later = await client.spawn(["true"], run=run)
            await client.wait(later.id)
        await trio.to_thread.run_sync(daemon.kill)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.info()).problems == []
            assert (await client.collect(worker.id)).result == "done\n"
            assert (await client.status(later.id)).state == "finished"


@pytest.mark.parametrize("planted", ["fifo", "directory"])
async def test_a_journal_name_not_the_daemons_costs_only_itself(
    daemon: DaemonProcess, planted: str
) -> None:
    """A FIFO or a directory at state.db-journal: sqlite opens a journal it finds at every
    open to see whether it is hot (a FIFO blocks that for good, a directory fails it), so
    it is set aside alone, as one at -shm is, and the store kept with every worker."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh('echo done > "$SUBAGENTD_RESULT"'))
            await client.wait(worker.id)
        await trio.to_thread.run_sync(daemon.kill)
        journal = daemon.state_dir / f"{STORE_NAME}-journal"
        if planted == "fifo":
            os.mkfifo(journal)
        else:
            journal.mkdir()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
            assert (await client.collect(worker.id)).result == "done\n"
        assert any(f"{STORE_NAME}-journal is" in p and "alone" in p for p in problems), problems
        assert not any("had no row" in p for p in problems), problems
