"""Stop latency: request to "every process reaped", for workers that exit on TERM.

    .venv/bin/python bench/stop.py [--stops N] [--run-size N] [--rounds N]

One at a time: `--stops` workers `sleep 600` are started and exec'd, then
each is stopped and timed alone: subagentd `stop(id)` (waits until the whole
tree is reaped) vs supervisord `stopProcess(name, wait=True)` (answers once
the process is STOPPED, i.e. reaped).

A run at once: `--run-size` workers stopped by one request, `--rounds` times:
subagentd `stop_run(run)` vs supervisord `stopProcessGroup(group, wait=True)`.

Both daemons run side by side and stop in turns (one of each, a run of each),
so that other work on the machine weighs on both alike. Every process is
checked to be gone after each stop.

The floor, in the same turns (see floors.py): TERM to an exec'd `sleep`, a
child of the bench, until reaped through a pidfd. Target (issue 15) for one
stop: at least 2x faster than stopProcess, and within 5x of that floor.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _harness import (
    Figure,
    alive,
    process_count,
    report,
    running_daemon,
    running_supervisord,
    wait_exec,
)
from floors import sleeping, stop_once

from subagentd.client import Client

COMMAND = ["sleep", "600"]


def start_group(rpc: Any, group: str) -> list[dict[str, Any]]:
    """Start supervisord's `group`; its processes, once each has exec'd."""
    rpc.supervisor.startProcessGroup(group, True)
    processes = [p for p in rpc.supervisor.getAllProcessInfo() if p["group"] == group]
    wait_exec(p["pid"] for p in processes)
    return processes


def measure(stops: int = 100, run_size: int = 100, rounds: int = 10) -> list[Figure]:
    ours, ours_run, theirs, theirs_run, floor = [], [], [], [], []
    with (
        running_daemon() as daemon,
        Client(daemon.socket, timeout=60) as client,
        running_supervisord({"one": stops, "run": run_size}, command=" ".join(COMMAND)) as sup,
        sleeping(stops) as bare,
    ):
        rpc = sup.rpc()
        workers = [client.spawn(COMMAND) for _ in range(stops)]
        wait_exec(w.pid for w in workers if w.pid)
        processes = start_group(rpc, "one")
        wait_exec(bare)
        machine_processes = process_count()
        tracking = client.info().tree_tracking
        for worker, process, pid in zip(workers, processes, bare, strict=True):
            start = time.perf_counter()
            client.stop(worker.id)
            ours.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            rpc.supervisor.stopProcess(f"{process['group']}:{process['name']}", True)
            theirs.append((time.perf_counter() - start) * 1000)
            floor.append(stop_once(pid))
            assert worker.pid, worker
            assert not alive(worker.pid), worker
            assert not alive(process["pid"]), process

        for _ in range(rounds):
            run = client.new_run()
            workers = [client.spawn(COMMAND, run=run) for _ in range(run_size)]
            wait_exec(w.pid for w in workers if w.pid)
            start = time.perf_counter()
            stopped = client.stop_run(run)
            ours_run.append((time.perf_counter() - start) * 1000)
            assert len(stopped) == run_size, stopped
            assert not any(w.pid and alive(w.pid) for w in workers)

            processes = start_group(rpc, "run")
            start = time.perf_counter()
            stopped = rpc.supervisor.stopProcessGroup("run", True)
            theirs_run.append((time.perf_counter() - start) * 1000)
            assert len(stopped) == run_size, stopped
            assert not any(alive(p["pid"]) for p in processes)

    bare_figure = Figure.of(
        "stop.floor", "stop floor: TERM -> reaped through a pidfd (Python, no daemon)", "ms",
        "lower", floor,
        note="an exec'd `sleep` child: pidfd_send_signal(TERM), poll the pidfd, waitpid",
    )  # fmt: skip
    one = Figure.of(
        "stop.one", "stop one: stop -> reaped vs stopProcess", "ms", "lower", ours, theirs,
        target=">= 2x faster, <= 5x floor", floor=bare_figure.subagentd,
        note=f"{stops} stops of `sleep 600` each, in turns with the floor; subagentd tracked "
        "trees by "
        f"{tracking}; {machine_processes} processes on the machine at the start (a /proc scan's "
        "cost grows with them, a cgroup's does not)",
    )  # fmt: skip
    whole = Figure.of(
        "stop.run", f"stop {run_size} at once: stop_run vs stopProcessGroup", "ms", "lower",
        ours_run, theirs_run, target=">= 2x faster",
        note=f"{rounds} rounds of {run_size} workers each, in turns",
    )  # fmt: skip
    for figure in (one, whole):
        figure.met = (figure.ratio or 0) >= 2
    one.met = one.met and (one.floor_ratio or 99) <= 5
    return [one, bare_figure, whole]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stops", type=int, default=100)
    parser.add_argument("--run-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    report(measure(args.stops, args.run_size, args.rounds))


if __name__ == "__main__":
    main()
