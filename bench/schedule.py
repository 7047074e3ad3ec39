"""A run that schedules: N `true` workers through a run capped at 16, against no cap,
GNU parallel -j 16 and xargs -P 16 (the floor), in one run; and the schedule's own cost
per start.

    .venv/bin/python bench/schedule.py [--workers N]

Each way runs N `true` to their ends and counts workers a second, from the first spawn
(or the tool's start) until the last has ended: subagentd's through one `Client`, every
spawn sent at once (over the cap each is answered at once, queued), then a `wait` of
each (the last to end is known only once all have); `parallel -j 16 true ::: 1..N`
(Debian's `parallel`, where installed) and `xargs -P 16 -n 1 true` over the same list.
The daemon's own CPU time over the run is given with each subagentd figure: on a busy
machine it says more than the wall clock. The schedule's cost per start is the pure core
(`core/_schedule.Schedule`) alone, by calling it: N workers admitted into a run capped
at 16, then each ending and the next start decided, in a loop; target (issue 27) under
1 ms a start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time

from _harness import Figure, cpu_seconds, report, running_daemon

from subagentd.client import Client
from subagentd.daemon.core._schedule import Schedule

CAP = 16


def through_daemon(workers: int, cap: int | None) -> tuple[float, float]:
    """Workers a second through a run (capped at `cap`, or not), and the daemon's CPU
    seconds a worker, spawn to every ending."""
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        run = client.new_run(max_running=cap)
        cpu = cpu_seconds(daemon.proc.pid)
        start = time.perf_counter()
        ids = [client.spawn(["true"], run=run).id for _ in range(workers)]
        for worker_id in ids:
            client.wait(worker_id)
        elapsed = time.perf_counter() - start
        used = cpu_seconds(daemon.proc.pid) - cpu
    return workers / elapsed, used / workers * 1000


def through_tool(command: list[str], workers: int) -> float:
    """Workers a second through a command line that runs `true` once per input line."""
    lines = "".join(f"{n}\n" for n in range(workers)).encode()
    start = time.perf_counter()
    subprocess.run(command, input=lines, check=True, stdout=subprocess.DEVNULL)
    return workers / (time.perf_counter() - start)


def schedule_cost(workers: int) -> float:
    """Microseconds of the pure schedule a start: admit them all, then end and start."""
    caps = {"r": CAP}
    schedule = Schedule(run_cap=caps.get)
    start = time.perf_counter()
    running = [f"w{n}" for n in range(workers) if schedule.admit(f"w{n}", "r", None) is None]
    while running:
        schedule.ended(running.pop())
        running += schedule.to_start()
    return (time.perf_counter() - start) / workers * 1e6


def measure(workers: int = 10_000) -> list[Figure]:
    load = os.getloadavg()[0]
    capped, capped_cpu = through_daemon(workers, CAP)
    uncapped, uncapped_cpu = through_daemon(workers, None)
    xargs = through_tool(["xargs", "-P", str(CAP), "-n", "1", "true"], workers)
    parallel = None
    if shutil.which("parallel"):
        parallel = through_tool(["parallel", "-j", str(CAP), "true"], workers)
    cost = schedule_cost(workers)
    said = f"{workers} `true` workers; load average {load:.1f} at the start"
    figures = [
        Figure.of(
            "queue.capped", f"run capped at {CAP}: workers through", "workers/s", "higher",
            [capped],
            note=f"{said}; the daemon's CPU {capped_cpu:.2f} ms a worker; one Client, every "
            "spawn answered at once (queued past the cap), then a wait of each",
        ),
        Figure.of(
            "queue.uncapped", "the same run without a cap", "workers/s", "higher",
            [uncapped], note=f"the daemon's CPU {uncapped_cpu:.2f} ms a worker",
        ),
        Figure.of(
            "queue.parallel", f"GNU parallel -j {CAP}", "workers/s", "higher",
            [parallel] if parallel is not None else None,
            note="" if parallel is not None else "not measured: GNU parallel is not installed",
        ),
        Figure.of(
            "queue.xargs", f"xargs -P {CAP} -n 1 (the floor)", "workers/s", "higher", [xargs],
        ),
        Figure.of(
            "queue.schedule", "the schedule's decision a start (pure core)", "µs", "lower",
            [cost], target="< 1,000 µs (1 ms)",
            note=f"admit {workers} into a run capped at {CAP}, then end and start each",
        ),
    ]  # fmt: skip
    figures[-1].met = cost < 1000
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=10_000)
    args = parser.parse_args()
    report(measure(args.workers))


if __name__ == "__main__":
    main()
