"""Start latency: subagentd spawn -> running vs supervisord startProcess(name, wait=True).

    .venv/bin/python bench/start.py [--starts N]

subagentd: `spawn(["sleep", "3600"])` answers once the worker runs (its pid
known, its journal open); timed from request to answer, `--starts` times.
supervisord: `--starts` predefined programs `sleep 3600` (autostart=false,
startsecs=0), each started once with startProcess(name, wait=True), timed
from request to answer. With startsecs=0 supervisord answers RUNNING as soon
as it forked, possibly before the exec: the comparison favours it.

Both daemons run side by side and start in turns, one of each, so that other
work on the machine weighs on both alike; after each pair, the floors (see
floors.py): `os.posix_spawn` of `sleep 3600` until it has exec'd, and
`subprocess.Popen` of it with stdout and stderr piped. Target (issue 15): at
least 2x faster than startProcess, and within 5x of the posix_spawn floor.
"""

from __future__ import annotations

import argparse
import time

from _harness import Figure, report, running_daemon, running_supervisord, wait_exec
from floors import popen_once, posix_spawn_once

from subagentd.client import Client


def measure(starts: int = 100) -> list[Figure]:
    ours, theirs, spawn_floor, popen_floor = [], [], [], []
    with (
        running_daemon() as daemon,
        Client(daemon.socket, timeout=60) as client,
        running_supervisord({"start": starts}) as sup,
    ):
        rpc = sup.rpc()
        warm = client.new_run()
        for _ in range(5):  # the daemon's first allocations
            client.spawn(["sleep", "3600"], run=warm)
        client.stop_run(warm)
        run = client.new_run()
        for i in range(starts):
            start = time.perf_counter()
            client.spawn(["sleep", "3600"], run=run)
            ours.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            rpc.supervisor.startProcess(f"start:start_{i:04d}", True)
            theirs.append((time.perf_counter() - start) * 1000)
            spawn_floor.append(posix_spawn_once())
            popen_floor.append(popen_once())
        client.stop_run(run)
        wait_exec(p["pid"] for p in rpc.supervisor.getAllProcessInfo())
        rpc.supervisor.stopProcessGroup("start", True)

    floor = Figure.of(
        "start.floor", "start floor: `os.posix_spawn` + pidfd (Python, no daemon)", "ms",
        "lower", spawn_floor,
        note="until the call returns: glibc's posix_spawn returns once the child exec'd "
        "(checked after: its comm is `sleep`)",
    )  # fmt: skip
    popen = Figure.of(
        "start.popen", "start reference: `subprocess.Popen`, stdout and stderr piped", "ms",
        "lower", popen_floor, note="returns once the child exec'd, as the daemon's spawn does",
    )  # fmt: skip
    figure = Figure.of(
        "start.one", "start: spawn -> running vs startProcess", "ms", "lower", ours, theirs,
        target=">= 2x faster, <= 5x floor", floor=floor.subagentd,
        note=f"{starts} starts of `sleep 3600` each, in turns with the floor and Popen",
    )  # fmt: skip
    figure.met = (figure.ratio or 0) >= 2 and (figure.floor_ratio or 99) <= 5
    return [figure, floor, popen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=100)
    args = parser.parse_args()
    report(measure(args.starts))


if __name__ == "__main__":
    main()
