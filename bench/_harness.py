"""What every benchmark shares: a private daemon to measure, and summary statistics.

The daemon runs from this checkout's venv in a fresh temporary state dir, and
is ready when it says READY=1 over sd_notify, as under systemd.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass
class BenchDaemon:
    root: Path
    socket: Path
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def running_daemon(*args: str) -> Iterator[BenchDaemon]:
    root = Path(tempfile.mkdtemp(prefix="sab-", dir="/tmp"))
    notify_path = root / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    sock = root / "s.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBAGENTD_")}
    env["NOTIFY_SOCKET"] = str(notify_path)
    log = open(root / "daemon.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(BIN / "subagentd"), "--socket", str(sock), "--state-dir", str(root / "state"),
         "--config", str(root / "agents.toml"), *args],
        env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while b"READY=1" not in notify.recv(4096).split(b"\n"):
            pass
        yield BenchDaemon(root=root, socket=sock, proc=proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        notify.close()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p99, min, max and the spread (p90 - p10) of `samples` in seconds."""
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p99": pct(99),
        "min": ordered[0],
        "max": ordered[-1],
        "spread": pct(90) - pct(10),
    }


def machine() -> str:
    return f"{os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"
