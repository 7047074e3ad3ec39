"""Where a private daemon spends its time under one workload, sampled with py-spy.

    .venv/bin/python -m pip install py-spy      # once; not a dependency of the project
    .venv/bin/python bench/profile.py WORKLOAD [--seconds S] [--rate HZ] [--svg FILE]

WORKLOAD is what the client does in a loop while py-spy samples the daemon:
`info` (control round trips), `spawn` (`sleep` workers into one run), `stop`
(spawn a `sleep`, then stop it) or `collect` (spawn `true`, collect it with
wait). Prints the functions with the largest share of samples: "self" (the
function was running) and "inclusive" (it was on the stack), every thread of
the daemon counted, shares of the busy samples: those of a thread waiting
for work (trio in epoll, an idle worker thread) are left out. Samples are
wall-clock, not CPU: a thread blocked in a system call (say, a send that
wakes the client) counts where it blocks. --svg also writes a flame graph.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from _harness import BIN, running_daemon

from subagentd.client import Client


def workload(client: Client, name: str) -> Callable[[], None]:
    run = client.new_run()

    def info() -> None:
        client.info()

    def spawn() -> None:
        client.spawn(["sleep", "3600"], run=run)

    def stop() -> None:
        client.stop(client.spawn(["sleep", "3600"], run=run).id)

    def collect() -> None:
        client.collect(client.spawn(["true"], run=run).id, wait=True)

    return {"info": info, "spawn": spawn, "stop": stop, "collect": collect}[name]


PREFIXES = [re.compile(rf"\(/\S*/{d}/") for d in ("site-packages", "subagentd", r"python3\.\d+")]


def short(frame: str) -> str:
    """`function (path:line)` with the venv, editable-install and stdlib prefixes cut."""
    for prefix in PREFIXES:
        frame = prefix.sub("(", frame, count=1)
    return frame


#: Where a thread waits for work: samples ending here are idle, and left out.
IDLE = re.compile(
    r"^(EpollIOManager\.get_events \(trio/_core/_io_epoll\.py"
    r"|WorkerThread\._work \(trio/_core/_thread_cache\.py:211\)"
    r"|thread \()"
)


def shares(raw: Path) -> tuple[int, int, collections.Counter[str], collections.Counter[str]]:
    """Busy and idle samples, and per frame (busy only): as the running one (self), and
    anywhere on the stack (inclusive)."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [short(f) for f in stack.split(";") if f]
        n = int(count)
        if not frames or IDLE.match(frames[-1]):
            idle += n
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    return total, idle, own, anywhere


def record(
    spy: Path, pid: int, out: Path, fmt: str, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for --seconds into `out`, in format `fmt` (raw or flamegraph)."""
    return subprocess.Popen(
        [str(spy), "record", "--pid", str(pid), "--format", fmt, "--output", str(out),
         "--rate", str(args.rate), "--nonblocking", "--threads", "--duration", str(args.seconds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=["info", "spawn", "stop", "collect"])
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--svg", type=Path, help="also write a flame graph here")
    args = parser.parse_args()
    spy = BIN / "py-spy"
    if not spy.exists():
        sys.exit(f"no {spy}: {BIN / 'python'} -m pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        with running_daemon() as daemon, Client(daemon.socket, timeout=60) as client:
            step = workload(client, args.workload)
            for _ in range(20):  # warm up
                step()
            steps = 0
            recorders = [(raw, "raw")] + ([(args.svg, "flamegraph")] if args.svg else [])
            spies = [record(spy, daemon.proc.pid, out, fmt, args) for out, fmt in recorders]
            while any(s.poll() is None for s in spies):
                step()
                steps += 1
        total, idle, own, anywhere = shares(raw)
    print(
        f"{args.workload}: {steps} steps in {args.seconds} s; {total} busy samples at "
        f"{args.rate} Hz, and {idle} idle ones (waiting in epoll or for a job) left out"
    )
    print("-- self (running)")
    for frame, n in own.most_common(args.top):
        print(f"{n / total:6.1%}  {frame}")
    print("-- inclusive (on the stack)")
    for frame, n in anywhere.most_common(args.top * 2):
        print(f"{n / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
