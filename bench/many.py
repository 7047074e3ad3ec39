"""Many live workers in one daemon: start, memory, ls, reload and stop_run at 10,000.

    .venv/bin/python bench/many.py [--workers N] [--collect N] [--lists N] [--reloads N]

subagentd only (supervisord's group of 10,000 would need minfds and a config of
10,000 programs; its 1,000 are in scale.py). On one private daemon:

- start: `--workers` workers `sleep 3600` spawned into one run, one spawn after
  another, timed until every one has exec'd (`wait_exec`); workers/s.
- RSS: the daemon's resident memory once they run, read each second for 5 s.
- ls: the blocking client's `ls()` (every live worker, page by page), timed
  alone, `--lists` times.
- reload: `Reload` with all of them live, `--reloads` times, as in reload.py:
  time until the new image answers (it has adopted them all and serves), the
  longest wait of a client connecting every 2 ms meanwhile, its connects
  refused, and the workers lost (not running with the same pid after).
- stop_run: one `stop_run` of the run, timed until its answer (every tree
  reaped); each pid checked gone after.
- spawn -> wake -> collect: `--collect` workers `true` into a new run on the
  same daemon, then each collected with `collect(id, wait=True)`, as in
  collect.py; workers/s, once.

Each live worker holds 4 descriptors in the daemon (its stdout and stderr
pipes, its pidfd, its journal), and one more while it is stopped (a pidfd per
process of its tree): the bench raises its own soft RLIMIT_NOFILE to
the hard limit first, and the hard one to what `--workers` need where it may
(root with CAP_SYS_RESOURCE); the daemon, its child, inherits them (and raises
its own soft limit to its hard one at start anyway). Where the hard limit
cannot hold `--workers`, the bench runs as many as it can hold and says so in
the notes (at 20,000: 3,900), with the limits the daemon ran with.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from _harness import Figure, alive, raise_fd_limit, report, rss, running_daemon, wait_exec
from collect import spawn_collect
from reload import Runs, reload_once

from subagentd.client import Client

COMMAND = ["sleep", "3600"]
#: What a live `sleep` worker holds in the daemon: its stdout and stderr pipes, its
#: pidfd, its journal (measured: 4,875 live held 19,514); and one more while it is
#: stopped (the stop pins each process of its tree with a pidfd of its own). With only
#: 4, a stop_run of them all found no descriptor for most of those pidfds, and ended
#: them with cgroup.kill after their grace instead of TERM.
DESCRIPTORS_PER_WORKER = 5
#: Descriptors the daemon holds besides its workers' (its store, logs, sockets, the
#: bench's connections and the reload prober's), with room to spare.
DAEMON_DESCRIPTORS = 500


def live_size(wanted: int) -> tuple[int, str]:
    """How many live workers the daemon can hold here, at most `wanted`, and why fewer.

    The bench first raises its soft RLIMIT_NOFILE to the hard limit, and the hard
    one where it may (root with CAP_SYS_RESOURCE); the daemon inherits both."""
    _, hard = raise_fd_limit(DESCRIPTORS_PER_WORKER * wanted + DAEMON_DESCRIPTORS)
    fits = (hard - DAEMON_DESCRIPTORS) // DESCRIPTORS_PER_WORKER
    if fits >= wanted:
        return wanted, ""
    return fits, (
        f"{fits:,} live, not {wanted:,}: the descriptor limit here is {hard:,} (hard, and "
        f"this process may not raise it) and a live worker needs {DESCRIPTORS_PER_WORKER} "
        "in the daemon (4, and 1 while it is stopped); "
    )


def fd_limits(pid: int) -> str:
    """`pid`'s soft / hard RLIMIT_NOFILE and how many descriptors it holds now."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    return f"descriptor limit {soft:,} / {hard:,}, {len(os.listdir(f'/proc/{pid}/fd')):,} open"


def measure(
    workers: int = 10_000, collect: int = 10_000, lists: int = 5, reloads: int = 3
) -> list[Figure]:
    workers, fewer = live_size(workers)
    size = f"{workers:,}"
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        run = client.new_run()
        began = time.perf_counter()
        spawned = [client.spawn(COMMAND, run=run) for _ in range(workers)]
        wait_exec(w.pid for w in spawned if w.pid)
        start_s = time.perf_counter() - began
        assert client.info().workers.get("running") == workers
        limits = fd_limits(daemon.proc.pid)

        time.sleep(1)  # let the starts settle
        memory = []
        for _ in range(5):
            memory.append(rss(daemon.proc.pid) / 2**20)
            time.sleep(1)

        listing = []
        for _ in range(lists):
            began = time.perf_counter()
            listed = client.ls()
            listing.append((time.perf_counter() - began) * 1000)
            assert len(listed) == workers, len(listed)

        reloaded = Runs()
        for _ in range(reloads):
            reload_once(daemon, spawned, reloaded)
        client.close()  # a reload closed it: connect again
        client.connect()

        began = time.perf_counter()
        stopped = client.stop_run(run)
        stop_ms = (time.perf_counter() - began) * 1000
        assert len(stopped) == workers, len(stopped)
        assert not any(w.pid and alive(w.pid) for w in spawned)

        rate = [spawn_collect(client, collect)] if collect else []
        after = fd_limits(daemon.proc.pid)

    return figures(
        size, start_s, memory, listing, reloaded, stop_ms, rate, collect, fewer + limits, after
    )


def figures(
    size: str,
    start_s: float,
    memory: list[float],
    listing: list[float],
    reloaded: Runs,
    stop_ms: float,
    rate: list[float],
    collect: int,
    limits: str,
    after: str,
) -> list[Figure]:
    steps = "".join(
        f"; {name} {statistics.median(ms):.0f} ms" for name, ms in reloaded.phases.items()
    )
    out = [
        Figure.of(
            "many.start", f"start {size} `sleep` (one spawn after another)", "workers/s",
            "higher", [int(size.replace(",", "")) / start_s],
            note=f"{start_s:.1f} s until every one had exec'd; {limits} with all running",
        ),
        Figure.of(
            "many.rss", f"daemon RSS with {size} running", "MiB", "lower", memory,
            note="read each second for 5 s",
        ),
        Figure.of(
            "many.ls", f"ls of {size} live (blocking client, every page)", "ms", "lower",
            listing, note=f"{len(listing)} times",
        ),
        Figure.of(
            "many.reload.time", f"reload, {size} live: time until serving", "ms", "lower",
            reloaded.times, note=f"{len(reloaded.times)} reloads{steps}",
        ),
        Figure.of(
            "many.reload.connect_wait", f"reload, {size} live: longest connect wait", "ms",
            "lower", reloaded.longest,
        ),
        Figure.of(
            "many.reload.refused", f"reload, {size} live: connects refused", "connects",
            "lower", reloaded.refused, target="0", met=max(reloaded.refused) == 0,
        ),
        Figure.of(
            "many.reload.lost", f"reload, {size} live: workers lost", "workers", "lower",
            reloaded.lost or [0], target="0", met=max(reloaded.lost) == 0,
        ),
        Figure.of(
            "many.stop_run", f"stop_run of {size} live, until every tree reaped", "ms",
            "lower", [stop_ms],
        ),
    ]  # fmt: skip
    if rate:
        out.append(
            Figure.of(
                "many.collect", f"spawn -> wake -> collect, {collect:,} `true`", "workers/s",
                "higher", rate, note=f"once, on the same daemon; at the end: {after}",
            )
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--collect", type=int, default=10_000, help="0: skip the collect")
    parser.add_argument("--lists", type=int, default=5)
    parser.add_argument("--reloads", type=int, default=3)
    args = parser.parse_args()
    report(measure(args.workers, args.collect, args.lists, args.reloads))


if __name__ == "__main__":
    main()
