"""A reviewer's attacks on the store's own lock (issue 24, items 1 and 3): where another
process could still get a lock on the store file the daemon has open."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME

from .conftest import DaemonProcess
from .helpers import RawConnection, pending_wakes, sh, wait_output
from .helpers import reload_on_own_connection as reload

TICKING = "echo up; while :; do echo tick; sleep 0.05; done"

#: A same-user process that takes a reader's shared lock (a POSIX read lock on sqlite's
#: shared bytes, as any sqlite reader's) on the copy a put-back makes of the store, once
#: sqlite has written it (its second close for writing: the first is its creation) and
#: before the daemon renames it over state.db. It says `locked` (or `refused`: the daemon
#: held it first), then holds on until its stdin closes.
LOCKER = r"""
import ctypes, fcntl, os, struct, sys
directory = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
notify = libc.inotify_init1(os.O_CLOEXEC)
assert notify >= 0 and libc.inotify_add_watch(notify, directory.encode(), 0x8) >= 0
print("ready", flush=True)
closes = {}
said = None
while said is None:
    events = os.read(notify, 65536)
    offset = 0
    while offset < len(events) and said is None:
        _, _, _, length = struct.unpack_from("iIII", events, offset)
        name = events[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
        offset += 16 + length
        if ".put-back-" not in name or name.endswith("-journal"):
            continue
        closes[name] = closes.get(name, 0) + 1
        if closes[name] < 2:
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        shared = struct.pack("hhqqi", fcntl.F_RDLCK, os.SEEK_SET, 0x40000002, 510, 0)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLK, shared)
            said = "locked"
        except OSError:
            said = "refused"
print(said, flush=True)
sys.stdin.read()
"""

READER_ONCE = """
import sqlite3, sys
try:
    db = sqlite3.connect(sys.argv[1], timeout=0)
    print(db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])
except sqlite3.OperationalError as exc:
    print(exc)
"""


def _start_locker(daemon: DaemonProcess) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(daemon.state_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def test_a_lock_taken_on_the_put_back_copy_costs_the_daemon_nothing(
    daemon: DaemonProcess,
) -> None:
    """state.db unlinked under the daemon: its next change puts a whole copy back. A
    reader that locks that copy before the daemon holds it (it is in the state dir, under
    a name inotify tells) must not end the daemon, nor leave its store closed: the daemon
    keeps the store it has until it holds a copy, and puts one back once it can."""
    # Before: the daemon locked the copy only after renaming it over state.db, and the
    # StoreLocked that raised there escaped the put-back with the old connection closed
    # and no new one.
    assert daemon.proc is not None
    locker = _start_locker(daemon)
    assert locker.stdin is not None
    assert locker.stdout is not None
    try:
        with trio.fail_after(90):
            assert await trio.to_thread.run_sync(locker.stdout.readline) == "ready\n"
            async with AsyncClient(daemon.socket) as client:
                run = await client.new_run()
                (daemon.state_dir / STORE_NAME).unlink()
                first = await client.spawn(sh("echo first"), run=run)  # its commit notices
                said = await trio.to_thread.run_sync(locker.stdout.readline)
                assert said in ("locked\n", "refused\n"), said
                await client.wait(first.id)
            locker.stdin.close()
            await trio.to_thread.run_sync(locker.wait)
            async with AsyncClient(daemon.socket) as client:
                second = await client.spawn(sh("echo second"), run=run)
                await client.wait(second.id)
                info = await client.info()
                assert info.pid == daemon.proc.pid
                assert any("put back" in p for p in info.problems), info.problems
            # The daemon holds the file at state.db again: a reader is told it is locked.
            reader = await trio.run_process(
                [sys.executable, "-c", READER_ONCE, str(daemon.state_dir / STORE_NAME)],
                capture_stdout=True,
            )
            assert reader.stdout.decode().strip() == "database is locked", reader.stdout
            await trio.to_thread.run_sync(daemon.kill)
            db = sqlite3.connect(daemon.state_dir / STORE_NAME)
            try:
                rows = {str(row[0]) for row in db.execute("SELECT id FROM workers")}
            finally:
                db.close()
            assert {first.id, second.id} <= rows, rows
    finally:
        if locker.poll() is None:
            locker.kill()
            locker.wait()
        locker.stdout.close()


async def test_a_rebuilt_handoff_gives_no_worker_the_pipe_of_another(
    daemon_dirs: DaemonProcess,
) -> None:
    """A checkpoint handed over unreadable: the new image finds each live worker's pipes
    by what its fd 0, 1 and 2 are now. A worker that opened another worker's stdout pipe
    (/proc/<pid>/fd/1, the same user's) and made it its own fd 1 must not take that pipe
    from its owner: the owner's output still goes to the owner's journal."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "handoff:garbage"})
    told = daemon_dirs.root / "told"
    told.mkdir()
    # Each worker waits to be told its part: the thief must be the one the store lists
    # first (by id), so that it is looked at before the worker whose pipe it holds.
    either = (
        f'f="{told}/$SUBAGENTD_WORKER_ID"; while [ ! -p "$f" ]; do sleep 0.01; done; '
        'read part victim < "$f"; if [ "$part" = thief ]; then '
        "echo stolen; exec >/proc/$victim/fd/1; exec sleep 600; "
        "else while :; do echo tick; sleep 0.05; done; fi"
    )
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            thief, victim = sorted(
                [await client.spawn(sh(either)) for _ in range(2)], key=lambda w: w.id
            )
            for worker in (thief, victim):
                os.mkfifo(told / worker.id)
            await trio.to_thread.run_sync((told / victim.id).write_text, "victim 0\n")
            await wait_output(client, victim.id, b"tick")
            await trio.to_thread.run_sync((told / thief.id).write_text, f"thief {victim.pid}\n")
            await wait_output(client, thief.id, b"stolen")
        conn = await RawConnection.open(daemon_dirs.socket)
        async with conn.stream:
            await conn.send(p.Reload(id=2))
            assert await conn.receive() is None  # its answer is lost with the checkpoint
        async with AsyncClient(daemon_dirs.socket) as client:
            first: list[str] = []

            async def victim_ticks(cancel: trio.CancelScope) -> None:
                seen = await wait_output(client, victim.id, b"tick")
                await wait_output(client, victim.id, b"tick\n" * (seen.count(b"tick") + 3))
                first.append("victim")
                cancel.cancel()

            async def thief_ticks(cancel: trio.CancelScope) -> None:
                await wait_output(client, thief.id, b"tick")
                first.append("thief")
                cancel.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim_ticks, nursery.cancel_scope)
                nursery.start_soon(thief_ticks, nursery.cancel_scope)
            assert first == ["victim"], "the victim's ticks went into the thief's journal"
            for worker in (thief, victim):
                await client.stop(worker.id)
    assert daemon_dirs.terminate() == 0


async def test_a_store_file_replaced_just_before_a_reload_is_not_taken_as_the_store(
    daemon: DaemonProcess,
) -> None:
    """Another process renames its own database over state.db and the daemon reloads at
    once (before a change or its idle check notices): the new image must not serve from
    that file, losing the store the old image had open; the store comes through whole."""
    assert daemon.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            done = await client.spawn(sh("echo done"), run=run)
            await client.wait(done.id)
        # A stop closes the store: its WAL checkpointed into state.db and removed.
        assert await trio.to_thread.run_sync(daemon.terminate) == 0
        await trio.to_thread.run_sync(daemon.start)
        assert daemon.proc is not None
        async with AsyncClient(daemon.socket) as client:
            live = await client.spawn(sh(TICKING), run=run)
            await wait_output(client, live.id, b"tick")
        foreign = daemon.root / "foreign.db"
        conn = sqlite3.connect(foreign)
        try:
            conn.execute("CREATE TABLE theirs (a)")
            conn.commit()
        finally:
            conn.close()
        os.replace(foreign, daemon.state_dir / STORE_NAME)
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply), (reply, daemon.log()[-3000:])
        async with AsyncClient(daemon.socket) as client:
            info = await client.info()
            assert info.pid == daemon.proc.pid
            assert (await client.status(done.id)).state == "finished", info.problems
            view = await client.status(live.id)
            assert (view.state, view.pid) == ("running", live.pid), info.problems
            # Said by the old image's last look at its files before the exec (the store
            # put back whole), or else by the new image finding the carried lock's file
            # no longer at the name.
            assert any(
                "replaced by another file during a reload" in x
                or "no longer linked in the state dir" in x
                for x in info.problems
            ), info.problems
        (theirs,) = daemon.state_dir.glob(f"{STORE_NAME}.not-ours-*")
        conn = sqlite3.connect(theirs)
        try:
            assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("theirs",)]
        finally:
            conn.close()
        async with AsyncClient(daemon.socket) as client:
            await client.stop(live.id)


async def test_a_wal_replaced_just_before_a_reload_is_not_replayed_into_the_store(
    daemon: DaemonProcess,
) -> None:
    """Another process (one reading state.db as a plain file: the lock keeps out sqlite,
    not read(2)) makes a WAL of its own for a copy of the store and renames it over
    state.db-wal just before a reload: the new image must not replay it in place of the
    old image's, whose commits (here: a live worker's row) would be lost."""
    assert daemon.proc is not None
    with trio.fail_after(90):
        # A stop closes the store: its WAL checkpointed into state.db and removed.
        assert await trio.to_thread.run_sync(daemon.terminate) == 0
        await trio.to_thread.run_sync(daemon.start)
        assert daemon.proc is not None
        store = daemon.state_dir / STORE_NAME
        foreign = daemon.root / "copy.db"
        shutil.copyfile(store, foreign)
        async with AsyncClient(daemon.socket) as client:
            live = await client.spawn(sh(TICKING))  # its row only in the daemon's WAL
            await wait_output(client, live.id, b"tick")
        conn = sqlite3.connect(foreign, isolation_level=None)
        try:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            conn.execute("CREATE TABLE theirs (a)")
            staged = daemon.root / "theirs-wal"
            shutil.copyfile(f"{foreign}-wal", staged)
            os.replace(staged, f"{store}-wal")
        finally:
            conn.close()
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply), (reply, daemon.log()[-3000:])
        async with AsyncClient(daemon.socket) as client:
            info = await client.info()
            view = await client.status(live.id)
            assert (view.state, view.pid) == ("running", live.pid), info.problems
            await client.stop(live.id)


#: A poller of state.db as a monitoring script might be written: it leaves the file it
#: found there alone (the daemon's), and opens whatever file is at the name once that
#: changes, holding on to it for a second once in, then ending.
POLLER = r"""
import os, sqlite3, sys, time
path = sys.argv[1]
first = os.stat(path).st_ino
print("ready", flush=True)
while True:
    try:
        if os.stat(path).st_ino == first:
            continue
    except FileNotFoundError:
        pass
    db = sqlite3.connect(path, timeout=0)
    try:
        db.execute("BEGIN")
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.OperationalError:
        db.close()
        continue
    print("in", flush=True)
    time.sleep(1)
    db.close()
    break
"""

#: What makes a salvage take a while: a WAL of this many bytes to read again.
BIG_WAL = 48 * 1024 * 1024


def _damage_with_a_big_wal(store: Path) -> None:
    """Overwrite the page of `counters` in the (closed) store at `store`, and leave beside
    it a WAL of BIG_WAL bytes of frames that do not touch that page."""
    conn = sqlite3.connect(store, isolation_level=None)
    try:
        ((counters,),) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'counters'"
        ).fetchall()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("CREATE TABLE bulk (a)")
        for _ in range(BIG_WAL // (1024 * 1024)):
            conn.execute("INSERT INTO bulk VALUES (zeroblob(1024 * 1024))")
        shutil.copyfile(f"{store}-wal", f"{store}.wal-kept")
    finally:
        conn.close()
    os.rename(f"{store}.wal-kept", f"{store}-wal")
    fd = os.open(store, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * int(page_size), (int(counters) - 1) * int(page_size))
    finally:
        os.close(fd)


def _start_poller(store: Path) -> subprocess.Popen[str]:
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, str(store)], stdout=subprocess.PIPE, text=True
    )
    assert poller.stdout is not None
    assert poller.stdout.readline() == "ready\n"
    return poller


async def test_a_damaged_store_set_aside_gives_no_reader_its_name_in_between(
    daemon: DaemonProcess,
) -> None:
    """A damaged state.db at a start is set aside and a fresh one, with what it still
    gives, takes its place. A reader that opens the name in between (sqlite makes the file
    if there is none) must not leave the daemon with an empty store that says nothing."""
    # Before: the lock was let go for the whole salvage; the reader got in, the open gave
    # up with StoreLocked, and the next attempt took the reader's empty file as the store:
    # every wake the damaged one held gone, and no problem said.
    store = daemon.state_dir / STORE_NAME
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            for _ in range(3):
                await client.wait((await client.spawn(["true"], run=run)).id)
        pending = await pending_wakes(daemon, run)
        assert len(pending) == 3
        assert await trio.to_thread.run_sync(daemon.terminate) == 0
        await trio.to_thread.run_sync(_damage_with_a_big_wal, store)
        poller = _start_poller(store)
        try:
            await trio.to_thread.run_sync(daemon.start)
            async with AsyncClient(daemon.socket) as client:
                problems = (await client.info()).problems
            assert any("was damaged" in problem for problem in problems), problems
            assert await pending_wakes(daemon, run) == pending
        finally:
            poller.kill()
            poller.wait()
            assert poller.stdout is not None
            poller.stdout.close()
