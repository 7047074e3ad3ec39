"""Scale: 1,000 concurrently running workers; the daemon's memory and its CPU while idle.

    .venv/bin/python bench/scale.py [--workers N] [--seconds S]

subagentd: `--workers` workers `sleep 3600` are spawned; supervisord: a group
of as many processes `sleep 3600`, started with startProcessGroup. Once every
process has exec'd and 2 s have passed, nothing is asked of either daemon for
`--seconds`: its RSS is read every second (/proc/PID/status), and its CPU time
over the whole window from /proc/PID/stat (utime + stime, in clock ticks of
10 ms), as a share of one core. Idle should cost next to nothing: no polling.
The time to start them all is reported too (workers/s).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from _harness import (
    Figure,
    cpu_seconds,
    report,
    rss,
    running_daemon,
    running_pids,
    running_supervisord,
    wait_exec,
)

from subagentd.client import Client

#: An idle daemon may spend at most this share of one core (in %).
IDLE_TARGET = 0.5


def idle(pid: int, seconds: float) -> tuple[list[float], float]:
    """RSS in MiB each second, and CPU as % of one core, over `seconds` of idling."""
    time.sleep(2)  # let the starts settle: logs flushed, pipes quiet
    memory = []
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    for _ in range(round(seconds)):
        time.sleep(1)
        memory.append(rss(pid) / 2**20)
    cpu = (cpu_seconds(pid) - cpu0) / (time.perf_counter() - wall0) * 100
    return memory, cpu


def timed(start: Callable[[], list[int]], count: int) -> tuple[list[int], float]:
    began = time.perf_counter()
    pids = start()
    wait_exec(pids)
    return pids, count / (time.perf_counter() - began)


def measure(workers: int = 1000, seconds: float = 10) -> list[Figure]:
    with running_daemon() as daemon, Client(daemon.socket, timeout=120) as client:

        def spawn_all() -> list[int]:
            return [client.spawn(["sleep", "3600"]).pid or 0 for _ in range(workers)]

        _, ours_rate = timed(spawn_all, workers)
        assert client.info().workers.get("running") == workers
        ours_rss, ours_cpu = idle(daemon.proc.pid, seconds)

    with running_supervisord({"w": workers}) as sup:
        rpc = sup.rpc()

        def start_all() -> list[int]:
            rpc.supervisor.startProcessGroup("w", True)
            return list(running_pids(rpc).values())

        pids, theirs_rate = timed(start_all, workers)
        assert len(pids) == workers
        theirs_rss, theirs_cpu = idle(sup.proc.pid, seconds)
        rpc.supervisor.stopProcessGroup("w", True)

    cpu = Figure.of(
        "scale.idle_cpu", f"idle CPU with {workers:,} running", "% of a core", "lower",
        [ours_cpu], [theirs_cpu], target=f"near 0 (< {IDLE_TARGET} %)",
        met=ours_cpu < IDLE_TARGET, note=f"over {seconds:g} s; /proc/PID/stat has 10 ms ticks",
    )  # fmt: skip
    return [
        Figure.of(
            "scale.rss", f"daemon RSS with {workers:,} running", "MiB", "lower",
            ours_rss, theirs_rss, note=f"read each second for {seconds:g} s",
        ),
        cpu,
        Figure.of(
            "scale.start_rate", f"start {workers:,} (spawns vs startProcessGroup)", "workers/s",
            "higher", [ours_rate], [theirs_rate],
            note="until every process has exec'd; subagentd: one spawn after another",
        ),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    report(measure(args.workers, args.seconds))


if __name__ == "__main__":
    main()
