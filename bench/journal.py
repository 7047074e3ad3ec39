"""Journal capture throughput: one worker writing to stdout as fast as it can.

    .venv/bin/python bench/journal.py [--mib N] [--runs N]

Reports MB/s (median of --runs) next to the ceiling: `cat` of the same bytes
into /dev/null through a pipe.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from _harness import machine, running_daemon

from subagentd.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    size = args.mib * 1024 * 1024
    command = ["head", "-c", str(size), "/dev/zero"]
    captured = []
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        for _ in range(args.runs):
            start = time.perf_counter()
            worker = client.spawn(command)
            client.wait(worker.id)
            captured.append(size / (time.perf_counter() - start) / 1e6)
    ceiling = []
    for _ in range(args.runs):
        start = time.perf_counter()
        with subprocess.Popen(command, stdout=subprocess.PIPE) as producer:
            subprocess.run(["cat"], stdin=producer.stdout, stdout=subprocess.DEVNULL, check=True)
        ceiling.append(size / (time.perf_counter() - start) / 1e6)
    print(f"machine: {machine()}")
    print(
        f"journal capture of {args.mib} MiB: median {statistics.median(captured):.0f} MB/s "
        f"(runs: {', '.join(f'{x:.0f}' for x in captured)})"
    )
    print(f"pipe ceiling (cat to /dev/null): median {statistics.median(ceiling):.0f} MB/s")


if __name__ == "__main__":
    main()
