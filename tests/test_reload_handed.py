"""The checkpoint a reload hands over cannot be replaced by another process: it travels
in a sealed memfd named on the new image's command line, with the settings, which the
new image serves with. A file in the state dir rewritten during the reload changes
nothing; a checkpoint whose settings differ is reported, not taken; one that cannot be
read costs no worker (the handoff is rebuilt from what the kernel shows)."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon._settings import Settings
from subagentd.daemon.serving._listener import bind_control_socket

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, alive, command_line, sh, wait_output
from .helpers import reload_on_own_connection as reload
from .test_store_lock import start_reader

TICKING = "echo up; while :; do echo tick; sleep 0.05; done"

#: A process of the user's rewriting the state dir's checkpoint file whenever a new one
#: appears, for as long as it runs: to settings that lose work (`settings`), or to
#: garbage. It says `ready` once it watches, and `rewrote` each time it did.
REWRITER = """
import msgspec, os, sys, time
path, how = sys.argv[1], sys.argv[2]
print("ready", flush=True)
mine = None
while True:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        time.sleep(0.0005)
        continue
    if st.st_ino == mine:
        time.sleep(0.0005)
        continue
    try:
        raw = open(path, "rb").read()
        if how == "settings":
            checkpoint = msgspec.msgpack.decode(raw)
            checkpoint["settings"].update(cgroups="off", finished_ttl=0, keep_archives_days=0)
            raw = msgspec.msgpack.encode(checkpoint)
        else:
            raw = b"\\x85garbage" + raw[: len(raw) // 3]
        with open(path + ".mine", "wb") as file:
            file.write(raw)
        os.rename(path + ".mine", path)
        mine = os.stat(path).st_ino
        print("rewrote", flush=True)
    except (OSError, ValueError, msgspec.DecodeError):
        pass
"""


def start_rewriter(daemon: DaemonProcess, how: str) -> subprocess.Popen[str]:
    rewriter = subprocess.Popen(
        [sys.executable, "-c", REWRITER, str(daemon.state_dir / "checkpoint"), how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rewriter.stdout is not None
    assert rewriter.stdout.readline() == "ready\n"
    return rewriter


async def spawn_ticking(daemon: DaemonProcess, count: int) -> list[p.WorkerView]:
    async with AsyncClient(daemon.socket) as client:
        workers = [await client.spawn(sh(TICKING)) for _ in range(count)]
        for worker in workers:
            await wait_output(client, worker.id, b"tick")
    return workers


async def assert_supervised(daemon: DaemonProcess, workers: list[p.WorkerView]) -> p.DaemonInfo:
    """Every worker running as it was, its output still journaled; the daemon's info."""
    assert daemon.proc is not None
    async with AsyncClient(daemon.socket) as client:
        info = await client.info()
        assert (info.pid, info.workers.get("running")) == (daemon.proc.pid, len(workers))
        for worker in workers:
            view = await client.status(worker.id)
            assert (view.state, view.pid) == ("running", worker.pid)
            seen = await wait_output(client, worker.id, b"tick")
            await wait_output(client, worker.id, b"tick\n" * (seen.count(b"tick") + 3))
        return info


@pytest.mark.parametrize("how", ["settings", "garbage"])
async def test_the_checkpoint_file_rewritten_during_a_reload_changes_nothing(
    daemon: DaemonProcess, how: str
) -> None:
    # Today the new image read the checkpoint from the state dir: rewritten in the exec's
    # window, its settings were taken (cgroups off, nothing kept), or its garbage ended
    # the daemon with every live worker orphaned.
    rewriter = start_rewriter(daemon, how)
    try:
        with trio.fail_after(90):
            workers = await spawn_ticking(daemon, 3)
            async with AsyncClient(daemon.socket) as client:
                done = await client.spawn(["echo", "kept"])
                assert (await client.wait(done.id)).state == "finished"
            for generation in (2, 3):
                reply = await reload(daemon)
                assert isinstance(reply, p.ReloadReply), (reply, daemon.log()[-3000:])
                assert (reply.image_generation, reply.carried_live) == (generation, 3)
            info = await assert_supervised(daemon, workers)
            assert "--cgroups off" not in info.tree_tracking
            assert info.problems == []
            async with AsyncClient(daemon.socket) as client:
                # A finished handle outlives the reloads (finished_ttl=0 would have let it go).
                assert (await client.collect(done.id)).result == "kept\n"
    finally:
        rewriter.kill()
        rewriter.communicate()
    assert daemon.proc is not None
    assert "--cgroups=auto" in command_line(daemon.proc.pid)


def sealed(raw: bytes) -> int:
    """A memfd holding `raw`, sealed, as a reload hands its checkpoint over."""
    fd = os.memfd_create("checkpoint", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, raw)
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def start_handed_differing(daemon_dirs: DaemonProcess) -> None:
    """Start an image as a reload's exec does (a listening socket, the locked state dir, a
    sealed checkpoint), its checkpoint's settings not its command line's."""
    daemon_dirs.state_dir.mkdir(parents=True)
    control = bind_control_socket(daemon_dirs.socket)
    lock_fd = os.open(daemon_dirs.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    listen_fd = control.sock.fileno()
    given = Settings(
        socket=daemon_dirs.socket, state_dir=daemon_dirs.state_dir, config=daemon_dirs.config
    )
    said = {
        "socket": str(given.socket), "state_dir": str(given.state_dir),
        "config": str(given.config), "cgroups": "off", "finished_ttl": 0.0,
        "keep_archives_days": 0.0,
    }  # fmt: skip
    handed = sealed(
        msgspec.msgpack.encode(
            {"version": 4, "image_generation": 4, "reloads": 3, "listen_fd": listen_fd,
             "lock_fd": lock_fd, "live": [], "settings": said}
        )
    )  # fmt: skip
    daemon_dirs.log_path = daemon_dirs.root / "daemon.log"
    with open(daemon_dirs.log_path, "ab") as log:
        daemon_dirs.proc = subprocess.Popen(
            [str(BIN / "subagentd"), "--handoff-fd", str(handed), *given.command_line()],
            env=daemon_dirs.env,
            pass_fds=(listen_fd, lock_fd, handed),
            stdout=log,
            stderr=log,
        )
    control.sock.close()
    os.close(lock_fd)
    os.close(handed)


async def test_checkpoint_settings_that_differ_from_the_command_line_are_reported_not_taken(
    daemon_dirs: DaemonProcess,
) -> None:
    # An image started as a reload starts one, its checkpoint (an image's bug) saying
    # other settings than its command line: the command line's are served with.
    start_handed_differing(daemon_dirs)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:  # waits in the backlog
            info = await client.info()
            assert info.image_generation == 5
            assert "--cgroups off" not in info.tree_tracking
            for name, value in [("cgroups", "off"), ("finished_ttl", 0), ("keep_archives_days", 0)]:
                assert any(f"says {name}={value}" in problem for problem in info.problems), info
            done = await client.spawn(["echo", "kept"])
            assert (await client.wait(done.id)).state == "finished"
            assert (await client.collect(done.id)).result == "kept\n"
    assert "reload.setting_differs" in daemon_dirs.log()
    assert daemon_dirs.terminate() == 0


@pytest.mark.parametrize("fault", ["garbage", "truncated"])
async def test_a_checkpoint_handed_over_unreadable_leaves_every_worker_supervised(
    daemon_dirs: DaemonProcess, fault: str
) -> None:
    # The old image hands over bytes that do not decode (a test's fault standing in for
    # an image's bug): the new image rebuilds the handoff from what the kernel shows.
    daemon_dirs.start(env={"SUBAGENTD_FAULT": f"handoff:{fault}"})
    with trio.fail_after(90):
        workers = await spawn_ticking(daemon_dirs, 3)
        conn = await RawConnection.open(daemon_dirs.socket)
        async with conn.stream:
            await conn.send(p.Reload(id=2))
            assert await conn.receive() is None  # its answer is lost with the checkpoint
        info = await assert_supervised(daemon_dirs, workers)
        (problem,) = info.problems
        assert "the checkpoint handed over as descriptor" in problem, problem
        assert "took over from what the kernel shows" in problem
        async with AsyncClient(daemon_dirs.socket) as client:
            for worker in workers:
                await client.stop(worker.id)
                assert (await client.status(worker.id)).state == "stopped"
    assert daemon_dirs.terminate() == 0


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\x93" * 1000, msgspec.msgpack.encode({"version": 4, "listen_fd": "x"})],
    ids=["empty", "not-msgpack", "nested", "wrong-type"],
)
def test_a_handed_checkpoint_of_hostile_bytes_is_unreadable(raw: bytes) -> None:
    from subagentd.daemon.lifecycle._checkpoint import CheckpointUnreadable, read_handed

    with pytest.raises(CheckpointUnreadable, match="the checkpoint handed over"):
        read_handed(sealed(raw))


def test_a_handed_checkpoint_not_sealed_is_unreadable() -> None:
    from subagentd.daemon.lifecycle._checkpoint import CheckpointUnreadable, read_handed

    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
    os.write(fd, b"anything")
    with pytest.raises(CheckpointUnreadable, match="is not sealed"):
        read_handed(fd)


def test_a_handed_checkpoint_is_sealed_against_every_writer() -> None:
    from subagentd.daemon.lifecycle._checkpoint import sealed_checkpoint

    fd = sealed_checkpoint(b"what the old image wrote")
    try:
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # as another process would
        try:
            with pytest.raises(PermissionError):
                os.write(again, b"something else")
        finally:
            os.close(again)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


@pytest.fixture
def touched() -> Iterator[Path]:
    """A module file of the image, for a test to touch so that a reload runs its `--check`
    child (its mtime put back after the test)."""
    spec = importlib.util.find_spec("subagentd.daemon.lifecycle._rebuilt")
    assert spec is not None
    assert spec.origin is not None
    path = Path(spec.origin)
    before = path.stat()
    try:
        yield path
    finally:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


async def test_a_reload_into_an_image_that_reads_only_a_checkpoint_file_still_works(
    daemon_dirs: DaemonProcess, touched: Path
) -> None:
    # The image on disk says (its --check) it reads checkpoint versions up to 3: it is
    # handed a version 3 checkpoint in the state dir's file, named by --handoff, as
    # images before the memfd were, and the settings in it.
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "check:reads-before-4,handoff:keep"})
    assert daemon_dirs.proc is not None
    with trio.fail_after(90):
        workers = await spawn_ticking(daemon_dirs, 2)
        os.utime(touched)  # the image on disk changed: its --check child says what it reads
        reply = await reload(daemon_dirs)
        assert isinstance(reply, p.ReloadReply), (reply, daemon_dirs.log()[-3000:])
        assert (reply.image_generation, reply.carried_live) == (2, 2)
        argv = command_line(daemon_dirs.proc.pid)
        assert argv[-2:] == ["--handoff", str(daemon_dirs.state_dir / "checkpoint")]
        kept = msgspec.msgpack.decode((daemon_dirs.state_dir / "checkpoint.kept").read_bytes())
        assert kept["version"] == 3
        assert kept.get("store_lock_fd") is None
        assert not (daemon_dirs.state_dir / "checkpoint").exists()  # spent
        await assert_supervised(daemon_dirs, workers)


async def test_a_new_image_waiting_for_its_store_stops_at_sigterm_and_its_workers_with_it(
    daemon_dirs: DaemonProcess, touched: Path
) -> None:
    """SIGTERM while a handoff waits for a store another process holds: the exec left it
    blocked (it waited for the store to open, for good here); it ends the wait, the
    carried workers with it (as any stop ends them), and exits 0. The next start has
    them `interrupted`, none running."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "check:reads-before-4"})
    assert daemon_dirs.proc is not None
    reader = start_reader(daemon_dirs.state_dir / "state.db", -1.0)
    try:
        with trio.fail_after(90):
            workers = await spawn_ticking(daemon_dirs, 2)
            os.utime(touched)
            conn = await RawConnection.open(daemon_dirs.socket)
            async with conn.stream:
                await conn.send(p.Reload(id=2))
                assert reader.stdout is not None
                assert await trio.to_thread.run_sync(reader.stdout.readline) == "in\n"
                async with AsyncClient(daemon_dirs.socket) as client:
                    assert (await client.info()).store_wait is not None  # the new image
                daemon_dirs.proc.terminate()
                assert await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30) == 0
            assert not any(w.pid is not None and alive(w.pid) for w in workers)
    finally:
        reader.kill()
        reader.communicate()
    with trio.fail_after(90):
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            for worker in workers:
                assert (await client.status(worker.id)).state == "interrupted"
            assert (await client.info()).workers.get("running", 0) == 0


@pytest.mark.parametrize("hold", [2.0, -1.0], ids=["lets-go", "never-lets-go"])
async def test_a_new_image_that_cannot_have_its_store_yet_waits_holding_every_worker(
    daemon_dirs: DaemonProcess, touched: Path, hold: float
) -> None:
    # Into an image that reads only a checkpoint file, the store's lock is not carried: a
    # reader gets in between the images. Today the new image gave up and exited, every
    # worker running on unsupervised; now it waits, says why, and holds them all.
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "check:reads-before-4"})
    assert daemon_dirs.proc is not None
    reader = start_reader(daemon_dirs.state_dir / "state.db", hold)
    try:
        with trio.fail_after(90):
            workers = await spawn_ticking(daemon_dirs, 2)
            os.utime(touched)
            conn = await RawConnection.open(daemon_dirs.socket)
            async with conn.stream:
                await conn.send(p.Reload(id=2))
                assert reader.stdout is not None
                assert await trio.to_thread.run_sync(reader.stdout.readline) == "in\n"
                async with AsyncClient(daemon_dirs.socket) as client:
                    info = await client.info()  # the new image, waiting
                    assert info.pid == daemon_dirs.proc.pid
                    assert info.store_wait is not None
                    assert f"locked by pid {reader.pid}" in info.store_wait, info
                assert all(w.pid is not None and alive(w.pid) for w in workers)
                if hold < 0:
                    return  # it waits for good, holding them (the fixture stops it)
                reply = await conn.receive()  # once the reader let go
                assert isinstance(reply, p.ReloadReply), reply
                assert (reply.image_generation, reply.carried_live) == (2, 2)
            await assert_supervised(daemon_dirs, workers)
            async with AsyncClient(daemon_dirs.socket) as client:
                assert (await client.info()).store_wait is None
    finally:
        reader.kill()
        reader.communicate()
