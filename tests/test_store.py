"""The store (`<state>/state.db`): damage costs only itself and is reported, a planted
symlink is never followed, the wake log of an image before the store is imported once,
and `--check` and a reload agree on the schema versions an image reads."""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
import subprocess
import time
import zlib
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.core._registry import LaunchFence, RunRecord, WorkerRecord
from subagentd.daemon.core._wakes import WakeQueue
from subagentd.daemon.lifecycle._checkpoint import read_checkpoint
from subagentd.daemon.lifecycle._reload import image_refusal
from subagentd.daemon.store._journal import Journal
from subagentd.daemon.store._legacy import import_checkpoint_v1
from subagentd.daemon.store._store import (
    READS_VERSIONS,
    SCHEMA_VERSION,
    STORE_NAME,
    WAL_SIZE_LIMIT,
    Change,
    Store,
)
from subagentd.daemon.store._wake_log import open_wakes

from .conftest import BIN, DaemonProcess
from .helpers import pending_wakes as _pending_wakes
from .helpers import sh, write_old_record

PREVIEW = "x" * 200  # as long as a wake's preview gets: a few wakes fill a page


def _wake(seq: int, run: str = "r-1") -> p.Wake:
    return p.Wake(seq=seq, id=f"w-{seq}", run=run, state="finished", preview=PREVIEW)


def _open(state: Path) -> tuple[Store, WakeQueue]:
    store = Store.open(state / STORE_NAME)
    return store, open_wakes(store, state / "wakes.log")


def _page_size(db: Path) -> int:
    size = int.from_bytes(db.read_bytes()[16:18], "big")
    return 65536 if size == 1 else size


def _overwrite_page(db: Path, page: int) -> None:
    """Garbage over one page of the database file (pages count from 1)."""
    size = _page_size(db)
    with open(db, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(bytes([0xA5]) * size)


def _query(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


# -- damage, called directly ---------------------------------------------------


def test_a_damaged_page_of_wakes_costs_only_the_wakes_on_it(tmp_path: Path) -> None:
    store, _ = _open(tmp_path)
    for seq in range(1, 301):
        store.post_wake(_wake(seq))
    store.close()  # checkpointed into state.db: the damage below hits committed rows
    db = tmp_path / STORE_NAME
    leaves = [
        row[0]
        for row in _query(
            db,
            "SELECT pageno FROM dbstat WHERE name = 'wakes' AND pagetype = 'leaf' ORDER BY pageno",
        )
    ]
    assert len(leaves) > 10
    _overwrite_page(db, int(leaves[len(leaves) // 2]))  # type: ignore[call-overload]

    store, queue = _open(tmp_path)
    kept = sorted(queue.pending)
    lost = sorted(set(range(1, 301)) - set(kept))
    assert 0 < len(lost) < 30, lost  # one page's rows, no more
    assert lost == list(range(lost[0], lost[-1] + 1))  # they sat together, on that page
    assert all(queue.pending[seq] == _wake(seq) for seq in kept)
    (problem,) = store.problems
    assert "damaged" in problem
    assert "kept as" in problem
    assert "lost" in problem
    assert list(tmp_path.glob(f"{STORE_NAME}.damaged-*"))
    assert queue.last_seq >= 300  # the floor was read back: no seq is given again


def test_a_damaged_seq_floor_never_lets_a_seq_be_given_again(tmp_path: Path) -> None:
    store, queue = _open(tmp_path)
    for seq in range(1, 7):
        store.post_wake(_wake(seq))
    store.ack_wakes([2, 3, 4, 5, 6])  # only the floor says 2-6 were given
    store.close()
    db = tmp_path / STORE_NAME
    ((counters,),) = _query(db, "SELECT rootpage FROM sqlite_master WHERE name = 'counters'")
    _overwrite_page(db, int(counters))  # type: ignore[call-overload]

    store, queue = _open(tmp_path)
    assert sorted(queue.pending) == [1]  # the wakes' own page was whole
    assert queue.last_seq > 2**32  # which seqs the floor covered is unknown: skip far
    assert store.problems


def test_a_wake_row_that_does_not_read_is_removed_alone(tmp_path: Path) -> None:
    store, _ = _open(tmp_path)
    for seq in (1, 2, 3):
        store.post_wake(_wake(seq))
    store.close()
    conn = sqlite3.connect(tmp_path / STORE_NAME)
    conn.execute("UPDATE wakes SET state = 'no such state' WHERE seq = 2")
    conn.commit()
    conn.close()

    store, queue = _open(tmp_path)
    assert sorted(queue.pending) == [1, 3]
    assert any("wake 2" in problem for problem in store.problems)
    store.close()
    store, queue = _open(tmp_path)
    assert (sorted(queue.pending), store.problems) == ([1, 3], [])  # reported once


def test_the_store_is_write_ahead_logged_and_held_by_the_daemon_alone(tmp_path: Path) -> None:
    """WAL with synchronous=NORMAL: each commit is in the WAL when it returns (kill -9
    loses none), fsynced at checkpoints (see the module docstring for why); exclusive
    locking: the WAL index is in the daemon's memory, and nobody else writes meanwhile."""
    store, _ = _open(tmp_path)
    store.post_wake(_wake(1))
    assert store._db.execute("PRAGMA journal_mode").fetchall() == [("wal",)]
    assert store._db.execute("PRAGMA synchronous").fetchall() == [(1,)]  # NORMAL
    assert (tmp_path / f"{STORE_NAME}-wal").stat().st_size > 0
    assert not (tmp_path / f"{STORE_NAME}-shm").exists()
    assert store.version == SCHEMA_VERSION
    other = sqlite3.connect(tmp_path / STORE_NAME, timeout=0)
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("SELECT count(*) FROM wakes").fetchall()
    finally:
        other.close()
    store.close()
    assert _query(tmp_path / STORE_NAME, "SELECT seq FROM wakes") == [(1,)]


def test_a_symlink_at_the_old_wake_log_is_set_aside_unread(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious, outside the state dir\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "wakes.log").symlink_to(victim)
    store, queue = _open(state)
    assert queue.pending == {}
    assert (state / "wakes.log.not-ours").is_symlink()
    assert victim.read_bytes() == b"precious, outside the state dir\n"
    assert any("not a regular file" in problem for problem in store.problems)


# -- the daemon, end to end ----------------------------------------------------


async def _problems(daemon: DaemonProcess) -> list[str]:
    async with AsyncClient(daemon.socket) as client:
        return (await client.info()).problems


async def test_a_corrupt_state_db_is_reported_and_the_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    """A page overwritten in the middle of the database (here the one holding the seq
    floor): the daemon starts, says so, keeps every wake it can read, gives no seq twice."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            kept_run, acked_run = await client.new_run(), await client.new_run()
            for _ in range(3):
                await client.wait((await client.spawn(["true"], run=kept_run)).id)
            for _ in range(3):
                await client.wait((await client.spawn(["true"], run=acked_run)).id)
            seen = [w.seq async for w in client.events(run=acked_run)]  # delivered and acked
        pending = await _pending_wakes(daemon, kept_run)
        assert len(pending) == 3
        await trio.to_thread.run_sync(daemon.terminate)
        db = daemon.state_dir / STORE_NAME
        ((counters,),) = _query(db, "SELECT rootpage FROM sqlite_master WHERE name = 'counters'")
        _overwrite_page(db, int(counters))  # type: ignore[call-overload]

        await trio.to_thread.run_sync(daemon.start)
        problems = await _problems(daemon)
        assert any("store" in problem and "damaged" in problem for problem in problems), problems
        assert list(daemon.state_dir.glob(f"{STORE_NAME}.damaged-*"))
        assert await _pending_wakes(daemon, kept_run) == pending  # only the floor's page lost
        async with AsyncClient(daemon.socket) as client:
            await client.wait((await client.spawn(["true"], run=acked_run)).id)
            (fresh,) = [w async for w in client.events(run=acked_run)]
        assert fresh.seq > max(seen + [w.seq for w in pending])


async def test_a_symlink_at_state_db_is_set_aside_not_followed(
    daemon_dirs: DaemonProcess,
) -> None:
    victims = {}
    for name in ("victim-db", "victim-wal"):
        victims[name] = daemon_dirs.root / name
        victims[name].write_bytes(b"precious, outside the state dir\n")
    daemon_dirs.state_dir.mkdir(mode=0o700)
    (daemon_dirs.state_dir / STORE_NAME).symlink_to(victims["victim-db"])
    (daemon_dirs.state_dir / f"{STORE_NAME}-wal").symlink_to(victims["victim-wal"])
    with trio.fail_after(60):
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            await client.wait((await client.spawn(["true"], run=run)).id)
        assert [w.state for w in await _pending_wakes(daemon_dirs, run)] == ["finished"]
        problems = await _problems(daemon_dirs)
    assert any("not the daemon's own" in problem for problem in problems), problems
    for victim in victims.values():
        assert victim.read_bytes() == b"precious, outside the state dir\n"
    assert stat.S_ISREG(os.lstat(daemon_dirs.state_dir / STORE_NAME).st_mode)
    (aside,) = daemon_dirs.state_dir.glob(f"{STORE_NAME}.not-ours-*[0-9]")
    assert aside.is_symlink()  # moved itself, as it was


def _frame(record: dict[str, object]) -> bytes:
    """One entry of the wake log of an image before the store: u32 length, u32 crc32, body."""
    body = msgspec.msgpack.encode(record)
    return struct.pack(">II", len(body), zlib.crc32(body)) + body


async def test_the_wake_log_of_an_image_before_the_store_is_imported(
    daemon_dirs: DaemonProcess,
) -> None:
    """Upgraded in place over an old state dir, the daemon loses no wake: each keeps its
    seq, numbering goes on above the old floor, and the old log is set aside."""
    old = [_wake(3, run="r-old"), _wake(7, run="r-old")]
    daemon_dirs.state_dir.mkdir(mode=0o700)
    (daemon_dirs.state_dir / "wakes.log").write_bytes(
        _frame({"type": "floor", "last_seq": 41})
        + b"".join(_frame({"type": "post", "wake": msgspec.to_builtins(w)}) for w in old)
        + _frame({"type": "floor", "last_seq": 41})
        + _frame({"type": "post", "wake": msgspec.to_builtins(_wake(42, run="r-old"))})
        + _frame({"type": "ack", "seqs": [7]})
    )
    with trio.fail_after(60):
        await trio.to_thread.run_sync(daemon_dirs.start)
        assert [w.seq for w in await _pending_wakes(daemon_dirs, "r-old")] == [3, 42]
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            await client.wait((await client.spawn(["true"], run=run)).id)
        (fresh,) = await _pending_wakes(daemon_dirs, run)
        assert fresh.seq == 43
        assert not (daemon_dirs.state_dir / "wakes.log").exists()
        assert (daemon_dirs.state_dir / "wakes.log.imported").exists()
        await trio.to_thread.run_sync(daemon_dirs.terminate)
        await trio.to_thread.run_sync(daemon_dirs.start)  # imported once: nothing doubled
        assert [w.seq for w in await _pending_wakes(daemon_dirs, "r-old")] == [3, 42]


# -- schema versions -----------------------------------------------------------


def test_check_says_which_store_schema_versions_it_reads(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "subagentd"), "--check", "--state-dir", str(tmp_path / "state"),
         "--config", str(tmp_path / "agents.toml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "reads store schema versions: " + ", ".join(map(str, READS_VERSIONS)) in result.stdout
    assert image_refusal(result.stdout, SCHEMA_VERSION) is None  # this image takes over


def test_a_reload_into_an_image_that_cannot_read_the_schema_in_use_is_refused() -> None:
    before_the_store = "subagentd 0.1\nreads checkpoint versions: 1, 2\n"
    refusal = image_refusal(before_the_store, SCHEMA_VERSION)
    assert refusal is not None
    assert "store schema versions []" in refusal
    older = before_the_store + "reads store schema versions: 1\n"
    assert image_refusal(older, 2) is not None  # this image migrated the store past it
    assert image_refusal(older, 1) is None
    # An image of checkpoint version 1 cannot take this one's (v2) checkpoint.
    assert image_refusal("reads checkpoint versions: 1\nreads store schema versions: 1, 2\n", 2)


# -- schema version 2: what the daemon knows ------------------------------------

#: The schema as the image of schema version 1 wrote it, verbatim.
_V1_SCHEMA = """
CREATE TABLE schema_version
    (version INTEGER PRIMARY KEY, migrated_at REAL NOT NULL, by TEXT NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO counters VALUES ('wake_seq', 0);
CREATE TABLE wakes (
    seq INTEGER PRIMARY KEY, worker TEXT NOT NULL, attempt INTEGER NOT NULL,
    run TEXT NOT NULL, parent TEXT, state TEXT NOT NULL, exit_code INTEGER,
    preview TEXT NOT NULL, posted_at REAL NOT NULL, UNIQUE (worker, attempt));
CREATE TRIGGER wake_seq_rises AFTER INSERT ON wakes BEGIN
    UPDATE counters SET value = max(value, NEW.seq) WHERE name = 'wake_seq';
END;
INSERT INTO schema_version VALUES (1, 0.0, 'subagentd pid 1');
INSERT INTO wakes VALUES (5, 'w-5', 1, 'r-1', NULL, 'finished', 0, 'five', 0.0);
UPDATE counters SET value = 9 WHERE name = 'wake_seq';
"""


def _record(worker_id: str, **fields: object) -> WorkerRecord:
    defaults: dict[str, object] = {
        "id": worker_id, "run": "r-1", "parent": None, "name": "", "state": "running",
        "argv": ["true"], "cwd": "/", "agent": None, "grace": 1.0, "timeout": None,
        "token": f"t-{worker_id}", "archive": f"/a/{worker_id}", "started_at": 1.0,
    }  # fmt: skip
    return WorkerRecord(**(defaults | fields))  # type: ignore[arg-type]


def test_a_v1_store_is_migrated_to_v2_with_its_wakes_and_seq_floor(tmp_path: Path) -> None:
    path = tmp_path / STORE_NAME
    db = sqlite3.connect(path)
    db.executescript(_V1_SCHEMA)
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    store = Store.open(path)
    try:
        assert store.version == SCHEMA_VERSION == 3
        wakes, floor = store.wakes()
        assert [(w.seq, w.id, w.preview) for w in wakes] == [(5, "w-5", "five")]
        assert floor == 9
        store.commit(Change(workers=[_record("w-new")]), "a test")
        assert store.worker("w-new") == _record("w-new")
        assert store.launch().turn == 0
    finally:
        store.close()
    versions = [row[0] for row in _query(path, "SELECT version FROM schema_version")]
    assert versions == [1, 2, 3]


def test_an_ending_is_one_transaction_and_a_row_that_does_not_decode_costs_only_itself(
    tmp_path: Path,
) -> None:
    path = tmp_path / STORE_NAME
    store = Store.open(path)
    ended = _record("w-a", state="finished", ended_at=2.0, exit_code=0)
    store.commit(Change(workers=[ended], wakes=[_wake(1)]), "an ending")
    store.commit(Change(workers=[_record("w-b", cwd="/src", spawned_at=3.0)]), "a spawn")

    def crash() -> None:
        raise RuntimeError("the daemon dies here")

    with pytest.raises(RuntimeError):  # rolled back whole: neither the record nor the wake
        store.commit(
            Change(workers=[_record("w-b", state="failed", ended_at=4.0)], wakes=[_wake(2)]),
            "an ending",
            before_commit=crash,
        )
    assert store.worker("w-b") == _record("w-b", cwd="/src", spawned_at=3.0)
    assert [w.seq for w in store.wakes()[0]] == [1]
    store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE workers SET record = x'c1' WHERE id = 'w-a'")
    db.commit()
    db.close()
    store = Store.open(path)
    try:
        held, damaged = store.held_workers()
        assert ([r.id for r in held], damaged) == (["w-b"], ["w-a"])
        assert any("w-a" in problem for problem in store.problems), store.problems
        assert store.runs_started_in("/src") == {"r-1": 3.0}
    finally:
        store.close()


def test_the_workers_taken_back_include_every_one_above_a_held_handle(tmp_path: Path) -> None:
    # A collected parent stays while a worker it delegated is held (Registry.release):
    # a reload or a restart takes it back too, or stopping it would miss its live child.
    store = Store.open(tmp_path / STORE_NAME)
    try:
        done = {"state": "finished", "ended_at": 2.0, "exit_code": 0, "collected": True}
        store.commit(
            Change(
                workers=[
                    _record("w-top", **done),
                    _record("w-mid", parent="w-top", **done),
                    _record("w-live", parent="w-mid"),
                    _record("w-gone", **done),  # collected, nothing below it: released
                    # Parents that loop (damaged rows): the walk still ends.
                    _record("w-x", parent="w-y", **done),
                    _record("w-y", parent="w-x", state="failed", ended_at=2.0),
                ]
            ),
            "a test",
        )
        held, damaged = store.held_workers()
        assert (sorted(r.id for r in held), damaged) == (
            ["w-live", "w-mid", "w-top", "w-x", "w-y"],
            [],
        )
    finally:
        store.close()


def _old_journal(archive: Path, output: bytes) -> None:
    journal = Journal.create(archive / "journal")
    journal.append("stdout", output, 1.0)
    journal.close()


async def test_an_older_state_dir_is_imported_once_and_hostile_files_are_skipped(
    daemon_dirs: DaemonProcess,
) -> None:
    """Upgraded over an image before schema v2, the daemon loses no record or run: each
    record.json and run file is taken into the store once; a symlink, a FIFO or a huge
    file in their place is skipped and reported, never followed nor waited on."""
    state = daemon_dirs.state_dir
    archives = state / "archives"
    victim = daemon_dirs.root / "victim"
    victim.write_bytes(b"precious, outside the state dir\n")
    for name in ("w-good", "w-link", "w-fifo", "w-huge"):
        (archives / name).mkdir(parents=True)
    old_view = {
        "id": "w-good", "run": "r-named", "parent": None, "name": "", "state": "finished",
        "cwd": "/", "archive": "/elsewhere/archives/w-good", "exit_code": 0,
        "started_at": time.time() - 2, "ended_at": time.time() - 1,  # not yet pruned
    }  # fmt: skip
    write_old_record(archives / "w-good", old_view)
    (archives / "w-good" / "stdout.tail").write_bytes(b"the end of its stdout\n")
    _old_journal(archives / "w-good", b"the start\n")
    (archives / "w-link" / "record.json").symlink_to(victim)
    os.mkfifo(archives / "w-fifo" / "record.json")
    (archives / "w-huge" / "record.json").write_bytes(b"")
    os.truncate(archives / "w-huge" / "record.json", 64 << 20)  # sparse: costs no disk
    (state / "runs").mkdir()
    (state / "runs" / "r-named.json").write_bytes(b'{"id":"r-named","outer":null,"created_at":1}')
    (state / "runs" / "r-evil.json").symlink_to(victim)
    with trio.fail_after(60):
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            good = await client.status("w-good")
            assert (good.state, good.archive) == ("finished", str(archives / "w-good"))
            problems = (await client.info()).problems
            for name in ("w-link", "w-fifo", "w-huge", "r-evil"):
                assert any(name in p and "older image" in p for p in problems), (name, problems)
            assert (await client.collect("w-good")).result == "the end of its stdout\n"
            await client.collect((await client.spawn(["true"], run="r-named")).id, wait=True)
        assert not (archives / "w-good" / "record.json").exists()
        assert not (archives / "w-good" / "stdout.tail").exists()
        assert (archives / "w-link" / "record.json").is_symlink()  # left as it was
        await trio.to_thread.run_sync(daemon_dirs.kill)
        await trio.to_thread.run_sync(daemon_dirs.start)  # imported once: nothing again
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status("w-good")).state == "finished"
            assert "w-good" not in {w.id for w in await client.ls(all=True)}  # collected
            assert (await client.collect("w-good")).result == "the end of its stdout\n"
    assert victim.read_bytes() == b"precious, outside the state dir\n"


async def test_an_archive_holds_only_what_a_person_reads_and_the_store_answers_the_rest(
    daemon: DaemonProcess,
) -> None:
    """No record.json, stdout.tail or run file: after a kill -9 a released worker's status,
    collect's tail (its stdout ending before its stderr: kept in the store) and
    latest_resumable still answer, from the store."""
    cwd = daemon.root / "project"
    cwd.mkdir()
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            released = await client.spawn(["sh", "-c", "echo first; exit 3"], run=run, cwd=cwd)
            await client.collect(released.id, wait=True)
            loud = await client.spawn(
                sh("echo the stdout; head -c 70000 /dev/zero | tr '\\0' e >&2"), run=run
            )
            await client.wait(loud.id)
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(released.id)).state == "failed"
            assert (await client.collect(loud.id)).result == "the stdout\n"
            latest = await client.latest_resumable(cwd)
            assert (latest.run, latest.resumable) == (run, True)
    for worker in (released, loud):
        assert sorted(os.listdir(worker.archive)) == ["journal", "snapshot.json"]
    assert not (daemon.state_dir / "runs").exists()


def test_what_a_version_1_checkpoint_carried_is_taken_into_the_store(tmp_path: Path) -> None:
    """An older image reloading into this one hands over a version 1 checkpoint, which
    carried the whole registry: read, and taken into the store, nothing lost."""
    ended = _record("w-old", state="finished", ended_at=2.0, exit_code=0)
    live = _record("w-live", pid=123, pid_start=456)
    v1 = {
        "version": 1, "image_generation": 3, "reloads": 2, "listen_fd": 5, "lock_fd": 6,
        "runs": [RunRecord(id="r-1", outer=None, created_at=1.0, stopped=True)],
        "ended": [msgspec.msgpack.encode(ended)],
        "tombstones": [],
        "live": [{"id": "w-live", "pid": 123, "pid_start": 456, "stdout": 7, "stderr": 8,
                  "archive": "/a/w-live", "record": msgspec.msgpack.encode(live)}],
        "turn": 4, "fence": {"epoch": 2, "cancelled": True}, "fence_epochs": 2,
    }  # fmt: skip
    path = tmp_path / "checkpoint"
    path.write_bytes(msgspec.msgpack.encode(v1))
    checkpoint = read_checkpoint(path)
    assert [(c.id, c.pid, c.stdout) for c in checkpoint.live] == [("w-live", 123, 7)]
    assert checkpoint.v1_state is not None
    store = Store.open(tmp_path / STORE_NAME)
    try:
        import_checkpoint_v1(store, checkpoint.v1_state, tmp_path / "archives")
        old, carried = store.worker("w-old"), store.worker("w-live")
        assert old is not None
        assert (old.state, old.archive) == (
            "finished",
            str(tmp_path / "archives" / "w-old"),
        )
        assert carried is not None
        assert (carried.pid, carried.pid_start) == (123, 456)
        assert [(r.id, r.stopped) for r in store.runs()] == [("r-1", True)]
        launch = store.launch()
        assert (launch.turn, launch.fence, launch.fence_epochs) == (
            4, LaunchFence(epoch=2, cancelled=True), 2,
        )  # fmt: skip
    finally:
        store.close()


def test_the_wal_is_cut_back_after_a_transaction_larger_than_its_limit(tmp_path: Path) -> None:
    store = Store.open(tmp_path / STORE_NAME)
    try:
        big = [_record(f"w-{i}", argv=["x" * 4096]) for i in range(3000)]  # ~12 MiB at once
        store.commit(Change(workers=big), "a test")
        for i in range(3):  # the WAL is reset, and cut, by the writes after a checkpoint
            store.commit(Change(workers=[_record(f"w-small-{i}")]), "a test")
        wal = tmp_path / f"{STORE_NAME}-wal"
        assert wal.stat().st_size <= WAL_SIZE_LIMIT, wal.stat().st_size
    finally:
        store.close()


def _ended_worker(worker_id: str, run: str) -> WorkerRecord:
    return WorkerRecord(
        id=worker_id,
        run=run,
        parent=None,
        name="",
        state="failed",
        argv=["false"],
        cwd="/",
        agent=None,
        grace=1.0,
        timeout=None,
        token=f"t-{worker_id}",
        archive=f"/a/{worker_id}",
        started_at=1.0,
        ended_at=2.0,
        collected=True,
    )


def test_a_stopped_runs_row_goes_with_its_last_workers_when_they_are_pruned(
    tmp_path: Path,
) -> None:
    """The row of an implicit run is kept for its stop while a worker of it could be
    resumed, so no further: a prune of its last worker's row takes it; a named run's stays,
    and so does an implicit one's while a worker of it is left."""
    store = Store.open(tmp_path / STORE_NAME)
    try:
        implicit = RunRecord(id="r-i", outer=None, created_at=0.0, stopped=True, implicit=True)
        kept = RunRecord(id="r-k", outer=None, created_at=0.0, stopped=True, implicit=True)
        named = RunRecord(id="r-n", outer=None, created_at=0.0, stopped=True)
        workers = [
            _ended_worker("w-1", "r-i"),
            _ended_worker("w-2", "r-i"),
            _ended_worker("w-3", "r-k"),
            _ended_worker("w-4", "r-k"),
            _ended_worker("w-5", "r-n"),
        ]
        store.commit(Change(workers=workers, runs=[implicit, kept, named]), "test")
        store.forget(["w-1"])
        assert store.run("r-i") == implicit  # w-2 could still be resumed into it
        store.forget(["w-2", "w-3", "w-5"])
        assert store.run("r-i") is None
        assert store.run("r-k") == kept
        assert store.run("r-n") == named
        assert store.run("r-nope") is None
    finally:
        store.close()
