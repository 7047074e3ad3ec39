"""What a reload's exec carries: every descriptor once, listed in the checkpoint and
found there by the new image; the daemon's settings, not rebuilt into argv; and, if
the exec fails, exactly what it took given back."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon._settings import Settings
from subagentd.daemon.lifecycle._checkpoint import (
    Checkpoint,
    CheckpointUnreadable,
    read_checkpoint,
    write_checkpoint,
)
from subagentd.daemon.serving._listener import bind_control_socket, bound_for
from subagentd.protocol.errors import Refused

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, command_line, descriptors, sh, wait_output
from .helpers import reload_on_own_connection as reload

TICKING = "echo up; while :; do echo tick; sleep 0.05; done"


def held_for_good(found: dict[int, tuple[str, bool]]) -> dict[int, tuple[str, bool]]:
    """The descriptors the daemon holds, less those its spare-archive maker has open for
    a moment in its thread (a spare's files, as it makes them): neither taken nor given
    back by a reload, they come and go as it runs, and would make the count flaky."""
    return {fd: what for fd, what in found.items() if "/.spare-" not in what[0]}


async def test_a_failed_exec_gives_back_exactly_the_descriptors_it_took(
    daemon_dirs: DaemonProcess,
) -> None:
    # The exec's image is made a file the kernel will not run: everything is carried,
    # the checkpoint written, and execv itself fails.
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "reload:unexecutable"})
    assert daemon_dirs.proc is not None
    pid = daemon_dirs.proc.pid
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            workers = [await client.spawn(sh(TICKING)) for _ in range(3)]
            for worker in workers:
                await wait_output(client, worker.id, b"tick")
            before = held_for_good(descriptors(pid))
            with pytest.raises(Refused, match=r"exec failed.*old image serves on"):
                await client.reload()  # asked on this connection: it is kept, then resumed
            after = held_for_good(descriptors(pid))
            # The same open files, sockets, pipes and pidfds, each as (non-)inheritable as it
            # was. The requester's connection is the same socket, now under another number.
            assert Counter(after.values()) == Counter(before.values())
            assert not any(inheritable for fd, (_, inheritable) in after.items() if fd > 2)
            assert not (daemon_dirs.state_dir / "checkpoint").exists()
            info = await client.info()  # the old image serves on, with every worker
            assert (info.pid, info.image_generation, info.workers) == (pid, 1, {"running": 3})
            for worker in workers:
                seen = await wait_output(client, worker.id, b"tick\n" * 3)  # still journaled
                assert seen.startswith(b"up\ntick\n")
        reloaded = await reload(daemon_dirs)  # the fault was for once
        assert isinstance(reloaded, p.ReloadReply), reloaded
        assert (reloaded.image_generation, reloaded.carried_live) == (2, 3)


async def test_the_new_image_finds_each_carried_descriptor_once_in_the_checkpoint(
    daemon_dirs: DaemonProcess,
) -> None:
    # The new image keeps the checkpoint it adopted (written aside) for us to read.
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "handoff:keep"})
    assert daemon_dirs.proc is not None
    pid = daemon_dirs.proc.pid
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            workers = [await client.spawn(sh(TICKING)) for _ in range(3)]
            for worker in workers:
                await wait_output(client, worker.id, b"tick")
        conn = await RawConnection.open(daemon_dirs.socket)
        async with conn.stream:
            await conn.send(p.Reload(id=2))
            reply = await conn.receive()
            assert isinstance(reply, p.ReloadReply), reply
            kept = daemon_dirs.state_dir / "checkpoint.kept"
            checkpoint: dict[str, Any] = msgspec.msgpack.decode(kept.read_bytes())
            held = descriptors(pid)  # the new image's, while the requester is still connected
        lock_file_fd = checkpoint["lock_file_fd"]
        what_is_where = {
            checkpoint["listen_fd"]: "socket:",
            checkpoint["lock_fd"]: str(daemon_dirs.state_dir),
            **({lock_file_fd: str(daemon_dirs.state_dir / "lock")} if lock_file_fd else {}),
            checkpoint["store_lock_fd"]: str(daemon_dirs.state_dir / "state.db"),
            **{w[stream]: "pipe:" for w in checkpoint["live"] for stream in ("stdout", "stderr")},
            **{
                w["journal"]["fd"]: str(daemon_dirs.state_dir / "archives" / w["id"] / "journal")
                for w in checkpoint["live"]
            },
            **{c["fd"]: "socket:" for c in checkpoint["requesters"]},
        }
        listed = [
            checkpoint["listen_fd"],
            checkpoint["lock_fd"],
            *([lock_file_fd] if lock_file_fd is not None else []),
            checkpoint["store_lock_fd"],
            *(w[stream] for w in checkpoint["live"] for stream in ("stdout", "stderr")),
            *(w["journal"]["fd"] for w in checkpoint["live"]),  # each journal's, not reopened
            *(c["fd"] for c in checkpoint["requesters"]),
        ]
        assert len(listed) == len(set(listed)) == 3 + bool(lock_file_fd) + 3 * 3 + 1, checkpoint
        assert {w["pid"] for w in checkpoint["live"]} == {w.pid for w in workers}
        for fd, kind in what_is_where.items():
            target, inheritable = held[fd]
            assert target.startswith(kind), (fd, target, kind)
            assert not inheritable, (fd, target)  # taken back: no worker or next image gets it
        # Nothing but the standard streams would leak into an exec: nothing came unlisted.
        assert [fd for fd, (_, inheritable) in held.items() if inheritable] == [0, 1, 2]
        settings = checkpoint["settings"]
        assert (settings["socket"], settings["state_dir"], settings["config"]) == (
            str(daemon_dirs.socket),
            str(daemon_dirs.state_dir),
            str(daemon_dirs.config),
        )
        # The command line names the checkpoint's memfd (spent: closed once read) and
        # gives the settings, which the new image serves with.
        argv = command_line(pid)
        handed = argv.index("--handoff-fd")
        assert argv[handed + 1].isdigit()
        assert not any(target.startswith("/memfd:") for target, _ in held.values())
        assert argv[handed + 2 : handed + 5] == [
            f"--socket={daemon_dirs.socket}",
            f"--state-dir={daemon_dirs.state_dir}",
            f"--config={daemon_dirs.config}",
        ]
        assert not (daemon_dirs.state_dir / "checkpoint").exists()
        async with AsyncClient(daemon_dirs.socket) as client:
            for worker in workers:
                view = await client.status(worker.id)
                assert (view.state, view.pid) == ("running", worker.pid)


async def test_a_setting_given_at_start_survives_two_reloads(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start("--idle-exit", "0.3")
    assert daemon_dirs.proc is not None
    pid = daemon_dirs.proc.pid
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(["sleep", "60"])  # running: the daemon is not idle
        for generation in (2, 3):
            reply = await reload(daemon_dirs)
            assert isinstance(reply, p.ReloadReply), reply
            assert reply.image_generation == generation
            # Given on the command line, which no other process can rewrite.
            assert "--idle-exit=0.3" in command_line(pid)
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.stop(worker.id)
            await client.collect(worker.id)
        # Nothing running, nothing to collect, nobody connected: idle, so it exits.
        code = await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30)
        assert code == 0
        assert not daemon_dirs.socket.exists()


def test_an_image_handed_an_unreadable_checkpoint_exits_as_if_it_had_crashed(
    daemon_dirs: DaemonProcess,
) -> None:
    # It knows neither its settings nor its descriptors: it must not serve on guesses
    # (the default socket and state dir); the next start recovers, as after kill -9.
    checkpoint = msgspec.msgpack.encode({"version": 1, "listen_fd": "three"})  # this version
    daemon_dirs.root.joinpath("checkpoint").write_bytes(checkpoint)
    ran = subprocess.run(
        [str(BIN / "subagentd"), "--handoff", str(daemon_dirs.root / "checkpoint")],
        env=daemon_dirs.env | {"SUBAGENTD_STATE_DIR": str(daemon_dirs.state_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 1, ran.stderr
    assert "reload.handoff_unreadable" in ran.stderr
    assert "does not decode" in ran.stderr
    assert not daemon_dirs.state_dir.exists()  # nothing taken, nothing written
    assert not daemon_dirs.socket.exists()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("finished_ttl", float("nan")),
        ("keep_archives_days", -1.0),
        ("idle_exit", float("nan")),
        ("reload_interval", float("nan")),
        ("reload_interval", -1.0),
        ("request_key_ttl", -1.0),
    ],
)
def test_a_checkpoint_carrying_an_unusable_setting_is_unreadable(
    tmp_path: Path, setting: str, value: float
) -> None:
    # The checkpoint sits in the state dir, in a worker's reach between its write and the
    # exec: a setting in it is held to the command line's rule (zero or more, no nan).
    settings = {"socket": "/s", "state_dir": "/d", "config": "/c", setting: value}
    raw = msgspec.msgpack.encode(
        {"version": 2, "image_generation": 1, "reloads": 0, "listen_fd": 3, "lock_fd": 4,
         "live": [], "settings": settings}
    )  # fmt: skip
    (tmp_path / "checkpoint").write_bytes(raw)
    with pytest.raises(CheckpointUnreadable, match=f"does not decode.*{setting}"):
        read_checkpoint(tmp_path / "checkpoint")


def test_a_checkpoint_naming_a_state_dir_it_does_not_lie_in_is_not_followed(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    # Written into the state dir by a worker between a reload's write and its exec: it
    # would have the next image take, and write, a state dir that is not the daemon's.
    elsewhere = tmp_path / "elsewhere"
    settings = {"socket": str(daemon_dirs.socket), "state_dir": str(elsewhere), "config": "/c"}
    daemon_dirs.state_dir.mkdir(parents=True)
    checkpoint = daemon_dirs.state_dir / "checkpoint"
    raw = msgspec.msgpack.encode(
        {"version": 2, "image_generation": 1, "reloads": 0, "listen_fd": 3, "lock_fd": 4,
         "live": [], "settings": settings}
    )  # fmt: skip
    checkpoint.write_bytes(raw)
    ran = subprocess.run(
        [str(BIN / "subagentd"), "--handoff", str(checkpoint)],
        env=daemon_dirs.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 1, ran.stderr
    assert "reload.handoff_unreadable" in ran.stderr
    assert f"names the state dir {elsewhere}" in ran.stderr
    assert not elsewhere.exists()
    assert not daemon_dirs.socket.exists()


def _handed_over(daemon_dirs: DaemonProcess, named_socket: Path) -> None:
    """Start an image as a reload's exec would, handed a listening socket made for
    `daemon_dirs.socket` and the locked state dir by a checkpoint naming `named_socket`."""
    daemon_dirs.state_dir.mkdir(parents=True)
    control = bind_control_socket(daemon_dirs.socket)
    lock_fd = os.open(daemon_dirs.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    listen_fd = control.sock.fileno()
    settings = Settings(
        socket=named_socket, state_dir=daemon_dirs.state_dir, config=daemon_dirs.config
    )
    checkpoint = daemon_dirs.state_dir / "checkpoint"
    write_checkpoint(
        checkpoint,
        Checkpoint(
            image_generation=1, reloads=0, listen_fd=listen_fd, lock_fd=lock_fd, live=[],
            settings=settings,
        ),
    )  # fmt: skip
    daemon_dirs.log_path = daemon_dirs.root / "daemon.log"
    with open(daemon_dirs.log_path, "ab") as log:
        daemon_dirs.proc = subprocess.Popen(
            [str(BIN / "subagentd"), "--handoff", str(checkpoint)],
            env=daemon_dirs.env,
            pass_fds=(listen_fd, lock_fd),
            stdout=log,
            stderr=log,
        )
    control.sock.close()
    os.close(lock_fd)


async def test_a_checkpoint_naming_another_socket_file_neither_gives_it_out_nor_unlinks_it(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    # Rewritten by a worker between a reload's write and its exec to name another file:
    # the new image would tell its workers that path, and unlink that file at exit. It
    # serves the socket it was handed under the path that socket was made for.
    victim = tmp_path / "another-programs.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(victim))
        _handed_over(daemon_dirs, victim)
        with trio.fail_after(60):
            async with AsyncClient(daemon_dirs.socket) as client:  # waits in the backlog
                worker = await client.spawn(["sh", "-c", 'echo "at $SUBAGENTD_SOCKET"'])
                seen = await wait_output(client, worker.id, b"\n")
        assert seen == f"at {daemon_dirs.socket}\n".encode()
        assert daemon_dirs.terminate() == 0
        assert victim.exists()
        assert not daemon_dirs.socket.exists()  # its own, unlinked as ever
        assert "reload.socket_misnamed" in daemon_dirs.log()


def test_the_socket_says_which_path_it_was_made_for(tmp_path: Path) -> None:
    """`bound_for` reads the path back from the socket, never from a file: a socket bound
    any other way (here, straight at its path) is one whose path it cannot tell."""
    made = bind_control_socket(tmp_path / "run" / "s.sock")
    with made.sock:
        assert bound_for(made.sock.fileno()) == tmp_path / "run" / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plain:
        plain.bind(str(tmp_path / "plain.sock"))
        assert bound_for(plain.fileno()) is None
    with open(tmp_path / "file", "wb") as file, pytest.raises(OSError, match="non-socket"):
        bound_for(file.fileno())
