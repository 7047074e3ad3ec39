"""A real daemon per test: its own short socket path, state dir and config,
started as a user would start it, ready when it says READY=1 over sd_notify."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .helpers import Connect, RawConnection
from .inprocess import short_root

BIN = Path(sys.executable).parent
START_TIMEOUT = 20.0
_Socket = socket.socket  # DaemonProcess has a field named `socket`


#: SUBAGENTD_TEST_RELAYED=1: every test daemon relays every worker's output (an output
#: relay holds its pipes: `--relay-above 0`), to run whole-behaviour tests that way.
RELAYED = ["--relay-above", "0"] if os.environ.get("SUBAGENTD_TEST_RELAYED") == "1" else []


@dataclass
class DaemonProcess:
    """A subagentd run by the test, and the datagram socket it notifies."""

    root: Path
    socket: Path
    state_dir: Path
    config: Path
    notify_path: Path
    #: No rate limit on reloads: a test reloads as often as it needs without waiting
    #: on the real clock (the limit itself is tested in-process, on the mock clock).
    extra_args: list[str] = field(default_factory=lambda: ["--reload-interval", "0", *RELAYED])
    proc: subprocess.Popen[bytes] | None = None
    _notify: _Socket | None = None
    log_path: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment a client of this daemon runs with."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUBAGENTD_")}
        env["SUBAGENTD_SOCKET"] = str(self.socket)
        return env

    def start(self, *args: str, env: dict[str, str] | None = None, ready: str = "READY=1") -> None:
        """Start the daemon (`env`: variables for it alone) and wait for its READY=1 (or
        `ready`: say, STATUS=recovering, told before a restart's recovery)."""
        if self._notify is None:
            self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._notify.bind(str(self.notify_path))
        # What an earlier daemon said is not what this one will say.
        self._notify.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self._notify.recv(4096)
        self._notify.setblocking(True)
        self.log_path = self.root / "daemon.log"
        env = self.env | {"NOTIFY_SOCKET": str(self.notify_path)} | (env or {})
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(BIN / "subagentd"),
                    "--socket", str(self.socket),
                    "--state-dir", str(self.state_dir),
                    "--config", str(self.config),
                    "--log-format", "json",
                    *self.extra_args,
                    *args,
                ],
                env=env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.wait_notify(ready, mainpid=self.proc.pid)

    def wait_notify(
        self, wanted: str, timeout: float = START_TIMEOUT, mainpid: int | None = None
    ) -> list[str]:
        """Block until a notification containing `wanted` (from `mainpid`, if given)
        arrives; all lines seen."""
        assert self._notify is not None
        self._notify.settimeout(timeout)
        seen: list[str] = []
        while True:
            try:
                datagram = self._notify.recv(4096).decode()
            except TimeoutError:
                raise AssertionError(
                    f"daemon did not notify {wanted!r} within {timeout}s; saw {seen}; "
                    f"log:\n{self.log()}"
                ) from None
            lines = datagram.splitlines()
            seen.extend(lines)
            if wanted in lines and (mainpid is None or f"MAINPID={mainpid}" in lines):
                return seen

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def ctl(
        self,
        *args: str,
        input: str | None = None,
        timeout: float = 30.0,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run subagentctl against this daemon, as a person at a shell would (in `cwd`)."""
        return subprocess.run(
            [str(BIN / "subagentctl"), *args],
            env=self.env,
            cwd=cwd,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture
def daemon_dirs() -> Iterator[DaemonProcess]:
    # Unix socket paths are limited to 108 bytes: keep the root short.
    root = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    d = DaemonProcess(
        root=root,
        socket=root / "run" / "s.sock",
        state_dir=root / "state",
        config=root / "agents.toml",
        notify_path=root / "notify",
    )
    try:
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            # Gracefully, so the daemon stops its workers rather than orphaning them.
            try:
                d.terminate(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
        if d._notify is not None:
            d._notify.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon(daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A serving daemon, stopped and cleaned up after the test."""
    daemon_dirs.start()
    return daemon_dirs


@pytest.fixture(params=["cgroup", "scan"])
def tracking(request: pytest.FixtureRequest, daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A serving daemon each way of tracking trees: in cgroups (skipped where this machine
    gives the daemon none), and by scanning /proc (``--cgroups off``)."""
    from subagentd.client import Client

    daemon_dirs.start(*(["--cgroups", "off"] if request.param == "scan" else []))
    with Client(daemon_dirs.socket) as sync:
        info = sync.info()
    if request.param == "cgroup" and not info.tree_tracking.startswith("cgroup "):
        pytest.skip(f"this machine gives the daemon no cgroup: {info.tree_tracking}")
    if request.param == "scan":
        assert info.tree_tracking == "/proc scan (cgroups turned off: --cgroups off)"
    assert info.controls["freeze"].how == (
        "cgroup v2 cgroup.freeze"
        if request.param == "cgroup"
        else "SIGSTOP/SIGCONT over the process tree (scan)"
    )
    return daemon_dirs


@pytest.fixture
async def connect(daemon: DaemonProcess) -> AsyncIterator[Connect]:
    """Open raw connections to the daemon; all are closed after the test."""
    opened: list[RawConnection] = []

    async def open_connection(hello: bool = True) -> RawConnection:
        conn = await RawConnection.open(daemon.socket, hello)
        opened.append(conn)
        return conn

    yield open_connection
    for conn in opened:
        await conn.stream.aclose()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir short enough for a Unix socket path (an in-process daemon's)."""
    with short_root() as root:
        yield root


@contextlib.contextmanager
def tmpfs_state_dir(daemon_dirs: DaemonProcess, options: str) -> Iterator[Path]:
    """Mount a tmpfs (`options`, e.g. "size=2m") over the daemon's state dir; on the
    way out the daemon is stopped and the tmpfs unmounted."""
    assert os.geteuid() == 0, "the full-disk tests mount a tmpfs: run them as root"
    daemon_dirs.state_dir.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs",
         str(daemon_dirs.state_dir)],
        check=True, timeout=30,
    )  # fmt: skip
    try:
        yield daemon_dirs.state_dir
    finally:
        if daemon_dirs.proc is not None and daemon_dirs.proc.poll() is None:
            daemon_dirs.terminate()
        subprocess.run(["umount", "-l", str(daemon_dirs.state_dir)], check=False, timeout=30)


@pytest.fixture
def small_disk(daemon_dirs: DaemonProcess) -> Iterator[Path]:
    """A 2 MiB tmpfs over the daemon's state dir."""
    with tmpfs_state_dir(daemon_dirs, "size=2m") as state_dir:
        yield state_dir
