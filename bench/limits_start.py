"""The cost of limits on start: spawn -> running with all three limits, against without.

    .venv/bin/python bench/limits_start.py [--starts N]

One daemon, one run: `spawn(["sleep", "3600"])` with `limits=Limits(memory=1G,
cpus=1.5, pids=100)` and without, in turns (one of each, the order alternating), so
that other work on the machine weighs on both alike; each timed from request to answer
(the worker runs, born in its limit nodes: see docs/design.md, "Limits"). What a
limited spawn adds: its nodes made and their limits written (a node per run, one per
worker, in each of the memory, cpu and pids hierarchies), the forking thread's step into
them and back. Target (issue 26): the median at most 10% above the unlimited one.
Where this daemon cannot enforce limits (its `info.controls`), nothing is measured.
"""

from __future__ import annotations

import argparse
import time

from _harness import Figure, report, running_daemon, summary

from subagentd.client import Client
from subagentd.protocol import LIMIT_KINDS, Limits

LIMITS = Limits(memory=1 << 30, cpus=1.5, pids=100)


def measure(starts: int = 100) -> list[Figure]:
    limited: list[float] = []
    plain: list[float] = []
    with running_daemon() as daemon, Client(daemon.socket, timeout=60) as client:
        controls = {k: c for k, c in client.info().controls.items() if k in LIMIT_KINDS}
        if not all(c.enforced for c in controls.values()) or not controls:
            why = "; ".join(f"{k}: {c.how}" for k, c in controls.items()) or "no controls"
            return [
                Figure.of(
                    "limits.start", "start with limits: not measured", "ms", "lower", None,
                    note=f"this daemon cannot enforce every limit ({why})",
                )
            ]  # fmt: skip
        warm = client.new_run()
        for _ in range(5):  # the daemon's first allocations, the first nodes' making
            client.spawn(["sleep", "3600"], run=warm)
            client.spawn(["sleep", "3600"], run=warm, limits=LIMITS)
        client.stop_run(warm)
        run = client.new_run()
        for i in range(starts):
            # In turns, the order alternating: neither always comes first after a pause.
            for with_limits in (i % 2 == 0, i % 2 == 1):
                start = time.perf_counter()
                client.spawn(["sleep", "3600"], run=run, limits=LIMITS if with_limits else None)
                (limited if with_limits else plain).append((time.perf_counter() - start) * 1000)
        client.stop_run(run)
    figure = Figure.of(
        "limits.start", "start: spawn with memory, cpus and pids limits vs without", "ms",
        "lower", limited, target="<= 1.10x the unlimited spawn", floor=summary(plain),
        note=f"{starts} starts of `sleep 3600` each way, in turns, one run; the floor "
        "column is the spawn without limits (cgroup v1 nodes: docs/design.md, Limits)",
    )  # fmt: skip
    figure.met = (figure.floor_ratio or 99) <= 1.10
    return [figure]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=100)
    args = parser.parse_args()
    report(measure(args.starts))


if __name__ == "__main__":
    main()
