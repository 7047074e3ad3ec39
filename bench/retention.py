"""Memory per retained finished worker: daemon RSS with N finished, uncollected workers.

    .venv/bin/python bench/retention.py [--workers N]

After a warm-up of 50 workers (the daemon's first allocations), RSS is read,
N workers `true` are spawned and waited for but never collected, and RSS is
read again: the growth over N is the cost of one retained handle (record,
journal kept open for paging, wake). subagentd only.
"""

from __future__ import annotations

import argparse
import time

from _harness import Figure, report, rss, running_daemon

from subagentd.client import Client


def measure(workers: int = 10_000) -> list[Figure]:
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        for _ in range(50):
            client.wait(client.spawn(["true"]).id)
        base = rss(daemon.proc.pid)
        start = time.perf_counter()
        ids = [client.spawn(["true"], name="retained").id for _ in range(workers)]
        for worker_id in ids:
            client.wait(worker_id)
        elapsed = time.perf_counter() - start
        retained = client.info().workers.get("finished", 0)
        grown = rss(daemon.proc.pid) - base
    return [
        Figure.of(
            "retention.per_worker", f"memory per retained finished worker ({workers:,})",
            "KiB", "lower", [grown / workers / 1024],
            note=f"{retained} retained: RSS +{grown / 2**20:.1f} MiB; spawned and ended in "
            f"{elapsed:.1f} s ({workers / elapsed:.0f} workers/s)",
        )
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=10_000)
    args = parser.parse_args()
    report(measure(args.workers))


if __name__ == "__main__":
    main()
