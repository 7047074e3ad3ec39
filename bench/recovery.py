"""A restart after kill -9: how soon the new daemon answers, while it recovers.

    .venv/bin/python bench/recovery.py [--finished N] [--live M]

subagentd only. On one private daemon: `--finished` workers `true` spawned and ended
(kept: a day's finished TTL), then `--live` workers `sleep 3600`; the daemon is killed
with SIGKILL and started again on the same state dir, while a client connects every
10 ms and asks `info`. Printed: when the first `info` was answered (from the start of
the new process), the longest an `info` waited, when the daemon said READY=1 (every
worker taken back: the finished ones as they were, the live ones `interrupted`), and
the workers lost (ids known before and not after, or finished ones changed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _harness import daemon_command, raise_fd_limit, stop_daemon, wait_ready

from subagentd.client import Client, SubagentdError


def start(root: Path, notify: socket.socket) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBAGENTD_")}
    env["NOTIFY_SOCKET"] = str(root / "notify")
    with open(root / "daemon.log", "ab") as log:
        return subprocess.Popen(
            [*daemon_command(), "--socket", str(root / "s.sock"), "--state-dir",
             str(root / "state"), "--config", str(root / "agents.toml"),
             "--finished-ttl", "86400"],
            env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=10_000)
    parser.add_argument("--live", type=int, default=2_000)
    args = parser.parse_args()
    raise_fd_limit(5 * args.live + 500)
    root = Path(tempfile.mkdtemp(prefix="sar-", dir="/tmp"))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(root / "notify"))
    notify.settimeout(0.05)
    proc = start(root, notify)
    try:
        wait_ready(notify, proc, root / "daemon.log")
        with Client(root / "s.sock") as client:
            run = client.new_run()
            for _ in range(args.finished):
                client.spawn(["true"], run=run)
            for _ in range(args.live):
                client.spawn(["sleep", "3600"], run=run)
            while client.info().workers.get("running", 0) > args.live:
                time.sleep(0.2)
            before = {w.id: w.state for w in client.ls(all=True)}
        proc.kill()
        proc.wait()
        began = time.monotonic()
        proc = start(root, notify)
        waits: list[float] = []
        first: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                asked = time.monotonic()
                try:
                    with Client(root / "s.sock", timeout=60) as client:
                        client.info()
                    first.append(time.monotonic() - began)
                except (OSError, SubagentdError):
                    pass  # not listening yet
                waits.append(time.monotonic() - asked)
                time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        wait_ready(notify, proc, root / "daemon.log", deadline=600)
        ready = time.monotonic() - began
        done.set()
        prober.join()
        with Client(root / "s.sock") as client:
            after = {w.id: w.state for w in client.ls(all=True)}
        lost = [i for i, s in before.items() if after.get(i) not in (s, "interrupted")]
        print(f"restart after kill -9, {args.finished:,} finished + {args.live:,} live:")
        print(f"- first info answered after {first[0] * 1000:,.0f} ms (from the new process)")
        print(f"- longest info wait {max(waits) * 1000:,.0f} ms")
        print(f"- recovered (READY=1) after {ready * 1000:,.0f} ms")
        print(f"- workers lost: {len(lost)}")
    finally:
        stop_daemon(proc)
        notify.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
