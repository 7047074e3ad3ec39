"""Control round trip: `info` from the blocking client, median and p99.

.venv/bin/python bench/roundtrip.py [--calls N]
"""

from __future__ import annotations

import argparse
import time

from _harness import machine, ms, running_daemon, summary

from subagentd.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    with running_daemon() as daemon, Client(daemon.socket, timeout=30) as client:
        for _ in range(200):  # warm up: imports, caches, the daemon's first allocations
            client.info()
        samples = []
        for _ in range(args.calls):
            start = time.perf_counter()
            client.info()
            samples.append(time.perf_counter() - start)
    s = summary(samples)
    print(f"machine: {machine()}")
    print(
        f"info round trip over {s['n']} calls: median {ms(s['median'])}, p99 {ms(s['p99'])}, "
        f"min {ms(s['min'])}, max {ms(s['max'])}"
    )


if __name__ == "__main__":
    main()
