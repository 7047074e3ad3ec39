"""The systemd units: they verify, and socket activation serves as a user would run it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import BIN
from .helpers import RawConnection, command_line, descriptors

UNITS = Path(__file__).parent.parent / "systemd"


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # The units name ~/.local/bin; verify checks that ExecStart exists, so point
    # them at this checkout's venv, changing nothing else.
    for unit in ("subagentd.service", "subagentd.socket"):
        text = (UNITS / unit).read_text().replace("%h/.local/bin/", f"{BIN}/")
        (tmp_path / unit).write_text(text)
    service = (tmp_path / "subagentd.service").read_text()
    assert "Type=notify" in service
    assert "ExecReload=" in service
    assert "KillMode=mixed" in service
    assert "Restart=on-failure" in service
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "subagentd.service"),
         str(tmp_path / "subagentd.socket")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "subagentd" not in result.stderr, result.stderr  # no warning about our units


@contextlib.asynccontextmanager
async def _socket_activated(root: Path) -> AsyncIterator[trio.Process]:
    """A daemon started by systemd-socket-activate on `root`/s.sock, once it listens."""
    sock = root / "s.sock"
    activator = await trio.lowlevel.open_process(
        ["systemd-socket-activate", "-l", str(sock), str(BIN / "subagentd"),
         "--socket", str(sock), "--state-dir", str(root / "state"),
         "--config", str(root / "agents.toml")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert activator.stderr is not None
        said = b""
        while b"Listening on" not in said:  # the socket exists before the daemon
            said += await activator.stderr.receive_some()
        yield activator
    finally:
        if activator.returncode is None:
            activator.kill()
            await activator.wait()
        shutil.rmtree(root, ignore_errors=True)


async def test_socket_activation_serves_and_hides_listen_vars_from_workers() -> None:
    root = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    sock = root / "s.sock"
    with trio.fail_after(30):
        async with _socket_activated(root) as activator:
            async with AsyncClient(sock) as client:
                worker = await client.spawn(["env"])
                env = (await client.collect(worker.id, wait=True)).result
                assert "LISTEN_FDS" not in env
                assert "LISTEN_PID" not in env
                assert (await client.info()).pid == activator.pid  # it exec'd the daemon in place
            activator.terminate()
            await activator.wait()
            assert sock.exists()  # the activator made the socket file; the daemon leaves it


async def test_a_socket_activated_daemon_carries_its_listen_socket_across_a_reload() -> None:
    root = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    sock = root / "s.sock"
    with trio.fail_after(60):
        async with _socket_activated(root) as activator:
            made = os.stat(sock).st_ino
            async with AsyncClient(sock) as client:
                worker = await client.spawn(["sleep", "60"])
            conn = await RawConnection.open(sock)
            async with conn.stream:
                await conn.send(p.Reload(id=2))
                reply = await conn.receive()
            assert isinstance(reply, p.ReloadReply), reply
            assert (reply.image_generation, reply.carried_live) == (2, 1)
            # The new image has systemd's socket where systemd put it, close-on-exec like
            # every descriptor it was carried, and was told nothing but the checkpoint.
            held = descriptors(activator.pid)
            assert held[3][0].startswith("socket:"), held
            assert [fd for fd, (_, inheritable) in held.items() if inheritable] == [0, 1, 2]
            assert command_line(activator.pid)[-2:] == [
                "--handoff",
                str(root / "state" / "checkpoint"),
            ]
            async with AsyncClient(sock) as client:
                assert (await client.status(worker.id)).state == "running"
            activator.terminate()
            await activator.wait()
            assert os.stat(sock).st_ino == made  # never unlinked, by either image
