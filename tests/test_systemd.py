"""The systemd units: `subagentctl install-units` writes them for this install, they
verify, and socket activation serves as a user would run it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import BIN
from .helpers import RawConnection, command_line, descriptors

CTL = str(BIN / "subagentctl")


def install_units(*args: str, ctl: str = CTL, home: Path | None = None) -> CompletedProcess[str]:
    """`subagentctl install-units ARGS` as a user runs it (HOME: `home`, if given)."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run(
        [ctl, "install-units", *args], env=env, capture_output=True, text=True, timeout=60
    )


def verify(*units: Path) -> CompletedProcess[str]:
    """systemd-analyze verify: the units parse, and ExecStart names an executable."""
    return subprocess.run(
        ["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60
    )


def test_installed_units_pass_systemd_analyze_verify_and_run_this_install(tmp_path: Path) -> None:
    done = install_units("--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    service, socket_unit = tmp_path / "subagentd.service", tmp_path / "subagentd.socket"
    assert done.stdout.splitlines()[:3] == [
        f"wrote {service}",
        f"wrote {socket_unit}",
        f"ExecStart: {BIN / 'subagentd'} --log-format json",
    ]
    assert "systemctl --user daemon-reload" in done.stdout
    assert f"systemctl --user link {service} {socket_unit}" in done.stdout  # not systemd's dir
    text = service.read_text()
    assert f'ExecStart="{BIN}/subagentd" --log-format json' in text
    assert f'ExecReload="{BIN}/subagentctl" reload' in text
    for line in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "Delegate=yes"):
        assert line in text.splitlines()
    assert "ListenStream=%t/subagentd/subagentd.sock" in socket_unit.read_text()
    checked = verify(service, socket_unit)
    assert checked.returncode == 0, checked.stderr
    assert "subagentd" not in checked.stderr, checked.stderr  # no warning about our units


def test_install_units_goes_to_systemds_user_dir_by_default(tmp_path: Path) -> None:
    done = install_units(home=tmp_path)
    assert done.returncode == 0, done.stderr
    unit_dir = tmp_path / ".config" / "systemd" / "user"
    assert (unit_dir / "subagentd.service").is_file()
    assert (unit_dir / "subagentd.socket").is_file()
    assert "systemctl --user link" not in done.stdout  # systemd looks there itself
    assert "  systemctl --user enable --now subagentd.socket" in done.stdout


def test_installing_again_changes_nothing(tmp_path: Path) -> None:
    assert install_units("--dir", str(tmp_path)).returncode == 0
    before = (tmp_path / "subagentd.service").stat()
    again = install_units("--dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"unchanged {tmp_path / 'subagentd.service'}\n")
    assert (tmp_path / "subagentd.service").stat().st_ino == before.st_ino  # not rewritten


def test_an_edited_unit_is_replaced_only_with_force_and_nothing_is_written_before(
    tmp_path: Path,
) -> None:
    service = tmp_path / "subagentd.service"
    service.write_text("[Service]\nExecStart=/opt/mine/subagentd\n")
    refused = install_units("--dir", str(tmp_path))
    assert refused.returncode == 1
    assert f"{service} differs" in refused.stderr
    assert "--force" in refused.stderr
    assert service.read_text() == "[Service]\nExecStart=/opt/mine/subagentd\n"
    assert not (tmp_path / "subagentd.socket").exists()  # refused before writing either
    forced = install_units("--dir", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"replaced {service}" in forced.stdout
    assert f"{BIN}/subagentd" in service.read_text()


def test_a_symlink_where_a_unit_goes_is_replaced_with_force_never_written_through(
    tmp_path: Path,
) -> None:
    # As `systemctl --user link` leaves it, pointing into an old checkout.
    elsewhere = tmp_path / "checkout-unit"
    elsewhere.write_text("old\n")
    units = tmp_path / "units"
    units.mkdir()
    (units / "subagentd.service").symlink_to(elsewhere)
    refused = install_units("--dir", str(units))
    assert refused.returncode == 1
    assert f"is a symlink (to {elsewhere})" in refused.stderr
    forced = install_units("--dir", str(units), "--force")
    assert forced.returncode == 0, forced.stderr
    assert not (units / "subagentd.service").is_symlink()
    assert f"{BIN}/subagentd" in (units / "subagentd.service").read_text()
    assert elsewhere.read_text() == "old\n"


def test_a_fifo_where_a_unit_goes_is_refused_without_a_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "subagentd.socket")
    for args in ((), ("--force",)):
        refused = install_units("--dir", str(tmp_path), *args)  # a read would block: timeout
        assert refused.returncode == 1
        assert "subagentd.socket is a FIFO, not a unit file" in refused.stderr
        assert not (tmp_path / "subagentd.service").exists()
    (tmp_path / "subagentd.socket").unlink()
    (tmp_path / "subagentd.socket").mkdir()
    refused = install_units("--dir", str(tmp_path), "--force")
    assert refused.returncode == 1
    assert "is a directory, not a unit file" in refused.stderr


def test_an_unwritable_dir_is_refused_with_the_reason(tmp_path: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    if os.geteuid() == 0:  # root writes through any mode: a read-only mount stops it
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(units)], check=True)
    else:
        units.chmod(0o500)
    try:
        refused = install_units("--dir", str(units))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(units)], check=True)
        units.chmod(0o700)
    assert refused.returncode == 1
    assert f"cannot write {units}/.subagentd.service." in refused.stderr
    assert "Read-only file system" in refused.stderr or "Permission denied" in refused.stderr
    assert "Traceback" not in refused.stderr
    (tmp_path / "file").write_text("")
    refused = install_units("--dir", str(tmp_path / "file" / "units"))
    assert refused.returncode == 1
    assert f"{tmp_path / 'file'} is not a directory" in refused.stderr


def test_an_empty_or_overlong_dir_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    empty = subprocess.run(
        [CTL, "install-units", "--dir", ""], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert empty.returncode == 2
    assert "--dir: give a directory" in empty.stderr
    long = install_units("--dir", str(tmp_path / ("d" * 300)))
    assert long.returncode == 1
    assert "File name too long" in long.stderr
    assert list(tmp_path.iterdir()) == []


def _install_named(tmp_path: Path, name: str) -> Path:
    """This install's two commands, linked into a directory named `name`."""
    bin_dir = tmp_path / name
    bin_dir.mkdir()
    for command in ("subagentd", "subagentctl"):
        (bin_dir / command).symlink_to(BIN / command)
    return bin_dir


def test_an_install_whose_path_systemd_would_expand_is_named_as_it_is(tmp_path: Path) -> None:
    # %h is a specifier and a space a word break to systemd; $HOME is left as it is there.
    bin_dir = _install_named(tmp_path, "my %h $HOME dir")
    done = install_units("--dir", str(tmp_path / "units"), ctl=str(bin_dir / "subagentctl"))
    assert done.returncode == 0, done.stderr
    assert f"ExecStart: {bin_dir / 'subagentd'}" in done.stdout
    service = tmp_path / "units" / "subagentd.service"
    assert 'my %%h $HOME dir/subagentd" --log-format json' in service.read_text()
    checked = verify(service, tmp_path / "units" / "subagentd.socket")
    assert checked.returncode == 0, checked.stderr  # it found the executable by that name
    os.unlink(bin_dir / "subagentd")  # and, without it there, would not
    assert verify(service).returncode != 0


@pytest.mark.parametrize(
    ("name", "why"),
    [("line\nbreak", "holds a control character"), ("it's", "holds a quote or a backslash")],
)
def test_an_install_whose_path_systemd_cannot_start_is_refused(
    tmp_path: Path, name: str, why: str
) -> None:
    bin_dir = _install_named(tmp_path, name)
    refused = install_units("--dir", str(tmp_path / "units"), ctl=str(bin_dir / "subagentctl"))
    assert refused.returncode == 1
    assert why in refused.stderr
    assert not (tmp_path / "units").exists()


def test_install_units_says_it_as_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [CTL, "--json", "install-units", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["bin_dir"] == str(BIN)
    assert [u["action"] for u in said["units"]] == ["wrote", "wrote"]
    assert said["then"][0] == "systemctl --user daemon-reload"


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
            # every descriptor it was carried, and was told the checkpoint's memfd and the
            # settings, not LISTEN_FDS again.
            held = descriptors(activator.pid)
            assert held[3][0].startswith("socket:"), held
            assert [fd for fd, (_, inheritable) in held.items() if inheritable] == [0, 1, 2]
            argv = command_line(activator.pid)
            assert "--handoff-fd" in argv
            assert f"--state-dir={root / 'state'}" in argv
            async with AsyncClient(sock) as client:
                assert (await client.status(worker.id)).state == "running"
            activator.terminate()
            await activator.wait()
            assert os.stat(sock).st_ino == made  # never unlinked, by either image
