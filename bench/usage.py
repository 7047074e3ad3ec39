"""Usage: what reading 1,000 workers' usage costs the daemon while `top` is open, and
what it costs while nobody asks (issue 26, item 3).

    .venv/bin/python bench/usage.py [--workers N] [--seconds S] [--rounds R] [--cgroups off]

`--workers` workers `sleep 3600` are spawned. Then, for `--seconds`, a top-like client
asks once a second for the whole listing with usage (`Client.ls(usage=True)`: every page,
each live worker's CPU, memory and processes read from its cgroup's counters and /proc),
and the daemon's CPU over the window is read from /proc/<daemon pid>/stat (utime + stime,
10 ms ticks) as a share of one core. The same window with no client asking is the
baseline: nothing is read then, so it is the idle daemon's cost. The client runs in this
process, so its own CPU is not counted. Each window is made `--rounds` times, alternating.

The same listings without usage are a window of their own, so the reading's own cost is
the difference. Also how long one listing with usage takes against one without, on the
client's clock (ms for all the workers): what a refresh of `top` waits for.
"""

from __future__ import annotations

import argparse
import time

from _harness import Figure, cpu_seconds, raise_fd_limit, report, running_daemon

from subagentd.client import Client

#: Reading every worker's usage once a second may cost the daemon at most this much of
#: one core (in %): "a few %".
TARGET = 5.0


def window(
    pid: int, seconds: float, ask: Client | None, workers: int, *, usage: bool = True
) -> tuple[float, list[float]]:
    """The daemon's CPU as % of one core over `seconds`, `ask` listing (with `usage`) once
    a second meanwhile (None: nobody asks); and the ms each listing took."""
    took: list[float] = []
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    for tick in range(round(seconds)):
        if ask is not None:
            began = time.perf_counter()
            listed = ask.ls(usage=usage)
            took.append((time.perf_counter() - began) * 1000)
            assert len(listed) == workers, len(listed)
            assert all((view.usage is not None) == usage for view in listed)
        next_tick = wall0 + tick + 1
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    return (cpu_seconds(pid) - cpu0) / (time.perf_counter() - wall0) * 100, took


def measure(
    workers: int = 1000, seconds: float = 10, rounds: int = 3, cgroups: str = "auto"
) -> list[Figure]:
    raise_fd_limit(4 * workers + 1024)
    asking: list[float] = []
    listing: list[float] = []
    idle: list[float] = []
    with_usage: list[float] = []
    without: list[float] = []
    with (
        running_daemon("--cgroups", cgroups) as daemon,
        Client(daemon.socket, timeout=120) as client,
    ):
        for _ in range(workers):
            client.spawn(["sleep", "3600"])
        info = client.info(usage=True)
        assert info.workers.get("running") == workers, info.workers
        assert info.usage is not None
        assert info.usage.processes == workers, info.usage
        tracking = info.tree_tracking
        time.sleep(2)  # the starts settled: logs flushed, pipes quiet
        for _ in range(rounds):
            cpu, took = window(daemon.proc.pid, seconds, client, workers)
            asking.append(cpu)
            with_usage += took
            cpu, took = window(daemon.proc.pid, seconds, client, workers, usage=False)
            listing.append(cpu)
            without += took
            idle.append(window(daemon.proc.pid, seconds, None, workers)[0])
    where = f"tree tracking: {tracking}"
    return [
        Figure.of(
            "usage.top_cpu", f"daemon CPU, {workers:,} live, all usage read 1/s", "% of a core",
            "lower", asking, target=f"a few % (< {TARGET:g} %)",
            met=sorted(asking)[len(asking) // 2] < TARGET,
            note=f"{rounds} windows of {seconds:g} s, a listing of every page with usage each "
            f"second; {where}; the machine is shared with other work",
        ),
        Figure.of(
            "usage.list_cpu", f"daemon CPU, {workers:,} live, listed 1/s without usage",
            "% of a core", "lower", listing,
            note="the same listings, no usage read: what a refresh costs without it (the "
            "difference from the figure above is the reading's own cost)",
        ),
        Figure.of(
            "usage.idle_cpu", f"daemon CPU, {workers:,} live, nobody asking", "% of a core",
            "lower", idle, target="near 0: nothing read", met=max(idle) < 0.5,
            note="the windows between those above: no request at all",
        ),
        Figure.of(
            "usage.list_with", f"ls of {workers:,} with usage", "ms", "lower", with_usage,
            note="on the client's clock: what a refresh of top waits for",
        ),
        Figure.of("usage.list_without", f"ls of {workers:,} without usage", "ms", "lower", without),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cgroups", choices=["auto", "off"], default="auto")
    args = parser.parse_args()
    report(measure(args.workers, args.seconds, args.rounds, args.cgroups))


if __name__ == "__main__":
    main()
