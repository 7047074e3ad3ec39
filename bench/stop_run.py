"""stop_run of thousands of live workers: wall time and the daemon's CPU, a worker.

    .venv/bin/python bench/stop_run.py [--workers N ...] [--rounds N] [--py-spy FILE]

For each `--workers` size, on a fresh private daemon: that many `sleep 3600` spawned
into one run (each checked exec'd), 2 s idle, then one `stop_run` of the run timed
until its answer (every tree reaped), the daemon's CPU time (utime + stime of
/proc/PID/stat) read before and after, every pid checked gone after (still the
daemon's child: 10,000 pids freed at once are soon given to others). `--py-spy FILE`
records the daemon's samples through the stop_run (py-spy from this venv, `pip install
py-spy`) into FILE.<size>.<round>.json (speedscope); `--perf FILE` records its on-CPU
samples with their kernel stacks (`perf record -g`) into FILE.<size>.<round>.data (with
SYSCALLS=1 in the environment, `strace -c -f`'s count of its system calls instead). The
CPU is split into user and system time, and the main thread's from the threads'.

The step bench/many.py makes once at its size, alone and quicker: the figure to
profile and compare builds with (`BENCH_SUBAGENTD`, see _harness.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _harness import (
    BIN,
    CLOCK_TICKS,
    Figure,
    alive,
    cpu_seconds,
    parent_of,
    raise_fd_limit,
    report,
    running_daemon,
    wait_exec,
)

from subagentd.client import Client

COMMAND = ["sleep", "3600"]
#: The issue's target: 10,000 in 3 s, so ~0.3 ms of wall time a stopped worker.
TARGET_MS_A_WORKER = 0.3


def cpu_split(pid: int) -> tuple[float, float, float]:
    """The daemon's user and system CPU seconds so far, and its main thread's (both)."""

    def times(path: str) -> tuple[float, float]:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS

    user, system = times(f"/proc/{pid}/stat")
    return user, system, sum(times(f"/proc/{pid}/task/{pid}/stat"))


def stop_once(
    workers: int, profile: str | None, perf: str | None = None
) -> tuple[float, float, str]:
    """One daemon, `workers` live, one stop_run: (wall ms, daemon CPU ms a worker, its
    tree tracking)."""
    raise_fd_limit(2 * workers + 1000)
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        pid = daemon.proc.pid
        run = client.new_run()
        spawned = [client.spawn(COMMAND, run=run) for _ in range(workers)]
        wait_exec(w.pid for w in spawned if w.pid)
        time.sleep(2)
        tracking = client.info().tree_tracking
        spy = None
        if profile:
            spy = subprocess.Popen(
                [str(BIN / "py-spy"), "record", "--native", "-r", "200", "-f", "speedscope",
                 "-o", profile, "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1)
        recorder = None
        if perf:
            recorder = subprocess.Popen(
                # SYSCALLS=1: its system calls counted instead (strace -c), not sampled.
                ["strace", "-c", "-f", "-o", perf, "-p", str(pid)]
                if os.environ.get("SYSCALLS")
                else ["perf", "record", "-g", "-F", "499", "-o", perf, "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1)
        began, cpu, split = time.perf_counter(), cpu_seconds(pid), cpu_split(pid)
        stopped = client.stop_run(run)
        wall = (time.perf_counter() - began) * 1000
        cpu_ms = (cpu_seconds(pid) - cpu) * 1000 / workers
        user, system, main = (
            (after - before) * 1000 / workers
            for after, before in zip(cpu_split(pid), split, strict=True)
        )
        print(
            f"  daemon CPU a worker: user {user:.3f} ms, system {system:.3f} ms; main thread "
            f"{main:.3f} ms, other threads {user + system - main:.3f} ms",
            file=sys.stderr,
        )
        for tool in (spy, recorder):
            if tool is not None:
                tool.send_signal(2)
                tool.wait(60)
        assert len(stopped) == workers, len(stopped)
        survivors = [w.pid for w in spawned if w.pid and alive(w.pid) and parent_of(w.pid) == pid]
        assert not survivors, survivors
        return wall, cpu_ms, tracking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2000, 5000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--py-spy", dest="profile", default=None)
    parser.add_argument("--perf", default=None)
    args = parser.parse_args()
    figures = []
    for size in args.workers:
        walls, cpus = [], []
        for n in range(args.rounds):
            profile = f"{args.profile}.{size}.{n}.json" if args.profile else None
            perf = f"{args.perf}.{size}.{n}.data" if args.perf else None
            wall, cpu_ms, tracking = stop_once(size, profile, perf)
            walls.append(wall)
            cpus.append(cpu_ms)
            load = os.getloadavg()[0]
            print(
                f"stop_run of {size:,} ({tracking}): {wall:,.0f} ms, {wall / size:.3f} ms a "
                f"worker wall, daemon CPU {cpu_ms:.3f} ms a worker; load {load:.1f}",
                file=sys.stderr,
            )
        figures.append(
            Figure.of(
                f"stop_run.{size}",
                f"stop_run of {size:,} live, until every tree reaped",
                "ms",
                "lower",
                walls,
                target=f"under {TARGET_MS_A_WORKER * size:,.0f} ms",
                note=f"daemon CPU {min(cpus):.3f} ms a stopped worker (best of {len(cpus)})",
            )
        )
    report(figures)


if __name__ == "__main__":
    main()
