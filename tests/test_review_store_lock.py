"""A reviewer's attacks on the store's own lock (issue 24, items 1 and 3): where another
process could still get a lock on the store file the daemon has open."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import trio

from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME

from .conftest import DaemonProcess
from .helpers import sh

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
