"""Spawn -> wake -> collect throughput for short workers.

    .venv/bin/python bench/collect.py [--workers N] [--rounds N]

`--workers` workers `true` are spawned into one run, one after another, then
each result is collected with `collect(id, wait=True)` (which waits for the
worker's end) in spawn order; workers/s = N / (first spawn to last collect),
`--rounds` times, each round on a fresh run of the same daemon. supervisord
has no results to collect: subagentd only.
"""

from __future__ import annotations

import argparse
import time

from _harness import Figure, report, running_daemon

from subagentd.client import Client


def spawn_collect(client: Client, workers: int) -> float:
    """Spawn `workers` workers `true` into a new run, collect each; workers/s."""
    run = client.new_run()
    start = time.perf_counter()
    ids = [client.spawn(["true"], run=run).id for _ in range(workers)]
    results = [client.collect(worker_id, wait=True) for worker_id in ids]
    rate = workers / (time.perf_counter() - start)
    assert all(r.state == "finished" and r.exit_code == 0 for r in results), results
    return rate


def measure(workers: int = 1000, rounds: int = 3) -> list[Figure]:
    with running_daemon() as daemon, Client(daemon.socket, timeout=120) as client:
        rates = [spawn_collect(client, workers) for _ in range(rounds)]
    return [
        Figure.of(
            "collect.rate", f"spawn -> wake -> collect, {workers:,} `true`", "workers/s",
            "higher", rates, note=f"{rounds} rounds; one client, one request at a time",
        )
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report(measure(args.workers, args.rounds))


if __name__ == "__main__":
    main()
