"""Another process reading state.db never stops the daemon: its lock on the store is
carried across a reload's exec (no window for a reader to get in), and a lock another
process already holds at a start is waited for, and said, never a reason to exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME, Store
from subagentd.daemon.store._store_lock import StoreLock, StoreLocked
from subagentd.protocol.errors import Busy

from .conftest import BIN, DaemonProcess
from .helpers import alive, descriptors, sh, wait_output
from .helpers import reload_on_own_connection as reload

TICKING = "echo up; while :; do echo tick; sleep 0.05; done"

#: A reader of state.db as a poller or a person's sqlite3 shell is: it opens the database
#: and reads (a WAL reader then keeps its shared lock while it stays open), trying again
#: at once while the daemon holds it out; once in, it says so and holds on for `hold`
#: seconds (-1: until killed). `ready` is printed once it has begun trying.
READER = """
import sqlite3, sys, time
path, hold, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
while True:
    if how == "read-only":  # no transaction left open: the connection alone holds on
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0)
    else:
        db = sqlite3.connect(path, timeout=0)
    try:
        if how != "read-only":
            db.execute("BEGIN")
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.OperationalError:
        db.close()
        continue
    print("in", flush=True)
    time.sleep(hold if hold >= 0 else 10**6)
    db.close()
    print("out", flush=True)
    break
"""


#: One read of state.db by another process: what it read, or why it could not.
READER_ONCE = """
import sqlite3, sys
try:
    db = sqlite3.connect(sys.argv[1], timeout=0)
    print(db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])
except sqlite3.OperationalError as exc:
    print(exc)
"""


def start_reader(state_db: Path, hold: float, how: str = "transaction") -> subprocess.Popen[str]:
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(state_db), str(hold), how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    assert reader.stdout.readline() == "ready\n"
    return reader


def start_sqlite3_shell(state_db: Path) -> subprocess.Popen[str]:
    """A person's `sqlite3 state.db`, one query asked and answered, left open."""
    shell = subprocess.Popen(
        ["sqlite3", str(state_db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert shell.stdin is not None
    assert shell.stdout is not None
    shell.stdin.write("SELECT count(*) > 0 FROM sqlite_master;\n")
    shell.stdin.flush()
    assert shell.stdout.readline() == "1\n"
    return shell


def start_waiting(daemon: DaemonProcess) -> subprocess.Popen[bytes]:
    """Start the daemon as `DaemonProcess.start` does, without waiting for its READY=1."""
    with open(daemon.root / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "subagentd"),
                "--socket", str(daemon.socket),
                "--state-dir", str(daemon.state_dir),
                "--config", str(daemon.config),
                "--log-format", "json",
            ],
            env=daemon.env | {"NOTIFY_SOCKET": str(daemon.notify_path)},
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    daemon.proc, daemon.log_path = proc, daemon.root / "daemon.log"
    return proc


def log_events(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in daemon.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


@pytest.mark.parametrize("hold", [1.0, -1.0], ids=["lets-go", "never-lets-go"])
async def test_a_reader_trying_state_db_through_reloads_never_stops_the_daemon(
    daemon: DaemonProcess, hold: float
) -> None:
    # Today's exec let go of the store's lock: a reader got in in the window, and the new
    # image gave up after its busy timeout with every worker running on unsupervised.
    assert daemon.proc is not None
    reader = start_reader(daemon.state_dir / "state.db", hold)
    try:
        with trio.fail_after(90):
            async with AsyncClient(daemon.socket) as client:
                workers = [await client.spawn(sh(TICKING)) for _ in range(3)]
                for worker in workers:
                    await wait_output(client, worker.id, b"tick")
            for generation in (2, 3, 4):
                reply = await reload(daemon)
                assert isinstance(reply, p.ReloadReply), (reply, daemon.log()[-3000:])
                assert (reply.image_generation, reply.carried_live) == (generation, 3)
            async with AsyncClient(daemon.socket) as client:
                info = await client.info()
                assert (info.pid, info.workers) == (daemon.proc.pid, {"running": 3})
                for worker in workers:
                    view = await client.status(worker.id)
                    assert (view.state, view.pid) == ("running", worker.pid)
                    before = len(await wait_output(client, worker.id, b"tick"))
                    await wait_output(client, worker.id, b"tick\n" * (before // 5 + 2))
        assert reader.poll() is None  # still knocking: never let in
    finally:
        reader.kill()
        out, _ = reader.communicate()
    assert "in" not in out.split()


@pytest.mark.parametrize("how", ["transaction", "read-only", "sqlite3-shell"])
async def test_a_start_with_a_reader_holding_state_db_waits_for_it_and_says_so(
    daemon_dirs: DaemonProcess, how: str
) -> None:
    # Today: "cannot open the store ...: database is locked; free space or fix the
    # state dir's permissions", exit 1.
    if how == "sqlite3-shell" and shutil.which("sqlite3") is None:
        pytest.skip("no sqlite3 shell here")
    daemon_dirs.start()
    assert daemon_dirs.terminate() == 0
    state_db = daemon_dirs.state_dir / "state.db"
    if how == "sqlite3-shell":
        reader = start_sqlite3_shell(state_db)
    else:
        reader = start_reader(state_db, -1.0, how)
        assert reader.stdout is not None
        assert reader.stdout.readline() == "in\n"
    try:
        proc = start_waiting(daemon_dirs)
        with trio.fail_after(60):
            while not log_events(daemon_dirs, "store.waiting"):
                assert proc.poll() is None, daemon_dirs.log()
                await trio.sleep(0.05)
        (waiting,) = log_events(daemon_dirs, "store.waiting")
        assert f"pid {reader.pid}" in str(waiting["why"]), waiting
        with trio.fail_after(30):
            async with AsyncClient(daemon_dirs.socket) as client:
                info = await client.info()  # the wait is told, to whoever asks
                assert info.pid == proc.pid
                assert info.store_wait is not None
                assert f"locked by pid {reader.pid}" in info.store_wait, info
                assert info.problems == [info.store_wait]
    finally:
        reader.kill()
        reader.communicate()
    # The reader gone, the daemon takes its store and serves.
    await trio.to_thread.run_sync(lambda: daemon_dirs.wait_notify("READY=1", mainpid=proc.pid))
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(["true"])
            assert (await client.wait(worker.id)).state == "finished"
            assert (await client.info()).problems == []
    assert log_events(daemon_dirs, "store.wait_over")
    assert daemon_dirs.terminate() == 0
    assert alive(proc.pid) is False


async def test_a_reader_that_never_lets_go_keeps_the_daemon_waiting_and_saying_why(
    daemon_dirs: DaemonProcess,
) -> None:
    # Today the start gave up at once. Now it waits, for good: `info` says what for and
    # since when, every other request is answered busy (saying why, when to try again),
    # and it stops when told to.
    daemon_dirs.start()
    assert daemon_dirs.terminate() == 0
    reader = start_reader(daemon_dirs.state_dir / "state.db", -1.0)
    try:
        assert reader.stdout is not None
        assert reader.stdout.readline() == "in\n"
        proc = start_waiting(daemon_dirs)
        with trio.fail_after(60):
            while not log_events(daemon_dirs, "store.waiting"):
                assert proc.poll() is None, daemon_dirs.log()
                await trio.sleep(0.05)
            for _ in range(2):  # a second connection, later: the same wait, the same since
                async with AsyncClient(daemon_dirs.socket) as client:
                    info = await client.info()
                    assert info.store_wait is not None
                    assert "waiting since" in info.store_wait
                    assert f"pid {reader.pid}" in info.store_wait
                    with pytest.raises(Busy, match=r"cannot answer this yet.*locked by") as busy:
                        await client.spawn(["true"])
                    assert busy.value.retry_after == 1.0
                    with pytest.raises(Busy):
                        await client.ls()
            waits = {str(line["since"]) for line in log_events(daemon_dirs, "store.waiting")}
            assert len(waits) == 1
            assert proc.poll() is None
        assert daemon_dirs.terminate() == 0  # told to stop while it waits: it stops
        assert not daemon_dirs.socket.exists()
    finally:
        reader.kill()
        reader.communicate()


def test_the_open_store_keeps_every_other_processs_sqlite_out(tmp_path: Path) -> None:
    store = Store.open(tmp_path / STORE_NAME)
    try:
        ran = subprocess.run(
            [sys.executable, "-c", READER_ONCE, str(tmp_path / STORE_NAME)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "database is locked" in ran.stdout, ran
        assert not (tmp_path / f"{STORE_NAME}-shm").exists()
    finally:
        store.close()
    ran = subprocess.run(
        [sys.executable, "-c", READER_ONCE, str(tmp_path / STORE_NAME)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.stdout.strip().isdigit(), ran  # closed: its lock is let go


@pytest.mark.parametrize("what", ["another file", "a directory", "a closed descriptor"])
def test_an_inherited_lock_that_is_not_the_store_is_not_taken_for_it(
    tmp_path: Path, what: str
) -> None:
    # A descriptor a checkpoint names as the store's lock is believed only if it is the
    # store file: else it is closed, and the file there locked afresh.
    path = tmp_path / STORE_NAME
    if what == "another file":
        fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    elif what == "a directory":
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
    lock = StoreLock.take(path, fd)
    try:
        assert lock.holds(path)
        held = {target for target, _ in descriptors(os.getpid()).values()}
        assert str(tmp_path / "other") not in held  # closed, not kept as the lock
        assert str(tmp_path) not in held
        with pytest.raises(StoreLocked, match=f"the store {path} is locked"):
            StoreLock.take(path)  # another open file description: held out, as any other
    finally:
        lock.release()
    StoreLock.take(path).release()  # let go of: free again
