"""The systemd units: they verify, and socket activation serves as a user would run it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import trio

from subagentd.client import AsyncClient

from .conftest import BIN

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


async def test_socket_activation_serves_and_hides_listen_vars_from_workers() -> None:
    root = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    sock = root / "s.sock"
    activator = await trio.lowlevel.open_process(
        ["systemd-socket-activate", "-l", str(sock), str(BIN / "subagentd"),
         "--socket", str(sock), "--state-dir", str(root / "state"),
         "--config", str(root / "agents.toml")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        with trio.fail_after(30):
            assert activator.stderr is not None
            said = b""
            while b"Listening on" not in said:  # the socket exists before the daemon
                said += await activator.stderr.receive_some()
            async with AsyncClient(sock) as client:
                worker = await client.spawn(["env"])
                env = (await client.collect(worker.id, wait=True)).result
                assert "LISTEN_FDS" not in env
                assert "LISTEN_PID" not in env
                assert (await client.info()).pid == activator.pid  # it exec'd the daemon in place
            activator.terminate()
            await activator.wait()
        assert sock.exists()  # the activator made the socket file; the daemon leaves it
    finally:
        if activator.returncode is None:
            activator.kill()
            await activator.wait()
        shutil.rmtree(root, ignore_errors=True)
