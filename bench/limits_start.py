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
import statistics
import time

from _harness import Figure, report, run_seconds, running_daemon, summary, thread_named

from subagentd.client import Client
from subagentd.protocol import LIMIT_KINDS, Limits

LIMITS = Limits(memory=1 << 30, cpus=1.5, pids=100)


def measure(starts: int = 100) -> list[Figure]:
    limited: list[float] = []
    plain: list[float] = []
    #: The daemon's own CPU (all its threads, from schedstat) over each spawn, in ms.
    limited_cpu: list[float] = []
    plain_cpu: list[float] = []
    with running_daemon() as daemon, Client(daemon.socket, timeout=60) as client:
        pid = daemon.proc.pid
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
        # The forker's thread (limited spawns' alone), whole.
        tid = thread_named(pid, "sa-forker")  # None: an image that forks on its event loop
        others = run_seconds(pid, tid) if tid else 0.0
        for i in range(starts):
            # In turns, the order alternating: neither always comes first after a pause.
            for with_limits in (i % 2 == 0, i % 2 == 1):
                start, cpu = time.perf_counter(), run_seconds(pid, pid)
                client.spawn(["sleep", "3600"], run=run, limits=LIMITS if with_limits else None)
                (limited if with_limits else plain).append((time.perf_counter() - start) * 1000)
                (limited_cpu if with_limits else plain_cpu).append(
                    (run_seconds(pid, pid) - cpu) * 1000
                )
        others = run_seconds(pid, tid) - others if tid else 0.0
        client.stop_run(run)
    forker = others * 1000 / starts
    figure = Figure.of(
        "limits.start", "start: spawn with memory, cpus and pids limits vs without", "ms",
        "lower", limited, target="<= 1.10x the unlimited spawn", floor=summary(plain),
        note=f"{starts} starts of `sleep 3600` each way, in turns, one run; the floor "
        "column is the spawn without limits (cgroup v1 nodes: docs/design.md, Limits)",
    )  # fmt: skip
    figure.met = (figure.floor_ratio or 99) <= 1.10
    # Means, the forker's whole share on the limited side (its work after an answer, its
    # way out of the nodes and the spares it makes, falls in no one spawn's window).
    with_cpu = [statistics.fmean(limited_cpu) + forker]
    cpu = Figure.of(
        "limits.start_cpu", "start: the daemon's CPU a spawn (mean), with the three limits "
        "vs without", "ms", "lower", with_cpu, target="<= 1.10x the unlimited spawn",
        floor=summary([statistics.fmean(plain_cpu)]),
        note=f"the same spawns: the event loop thread's run time over each "
        f"(/proc/PID/task/PID/schedstat, ns), the forker thread's whole run time over the "
        f"{starts} limited ones ({forker:.3f} ms each) added to theirs; the event loop's "
        f"over the limited ones alone {statistics.fmean(limited_cpu):.3f} ms",
    )  # fmt: skip
    cpu.met = (cpu.floor_ratio or 99) <= 1.10
    return [figure, cpu]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=100)
    args = parser.parse_args()
    report(measure(args.starts))


if __name__ == "__main__":
    main()
