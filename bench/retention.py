"""Memory per retained finished worker: daemon RSS with N finished, uncollected workers.

.venv/bin/python bench/retention.py [--workers N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _harness import machine, running_daemon

from subagentd.client import Client


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=10_000)
    args = parser.parse_args()
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        for _ in range(50):  # warm up the daemon's allocations before the baseline
            client.wait(client.spawn(["true"]).id)
        base = rss(daemon.proc.pid)
        start = time.perf_counter()
        ids = [client.spawn(["true"], name="retained").id for _ in range(args.workers)]
        for worker_id in ids:
            client.wait(worker_id)
        elapsed = time.perf_counter() - start
        retained = client.info().workers.get("finished", 0)
        grown = rss(daemon.proc.pid) - base
    print(f"machine: {machine()}")
    print(
        f"{retained} retained finished workers: daemon RSS +{grown / 2**20:.1f} MiB, "
        f"{grown / args.workers / 1024:.2f} KiB per worker "
        f"(spawned and ended in {elapsed:.1f} s, {args.workers / elapsed:.0f} workers/s)"
    )


if __name__ == "__main__":
    main()
