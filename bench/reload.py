"""Reload in place with N live workers: time from request to answer, the longest
connect wait seen meanwhile by a client connecting in a loop, and workers lost.

    .venv/bin/python bench/reload.py [--workers 0 100 1000] [--runs N]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

from _harness import machine, running_daemon

from subagentd import protocol as p
from subagentd.client import Client


def connect_waits(path: str, stop: threading.Event, waits: list[float]) -> None:
    """Connect (blocking: a connect waits in the backlog), say hello, hang up; record each wait."""
    hello = p.encode(p.Hello(id=1))
    while not stop.is_set():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            start = time.perf_counter()
            s.connect(path)
            s.settimeout(60)
            s.sendall(hello)
            s.recv(4096)  # the welcome (or the reloading notice)
            waits.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 100, 1000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    for count in args.workers:
        with running_daemon() as daemon, Client(daemon.socket, timeout=120) as client:
            workers = [client.spawn(["sleep", "3600"]) for _ in range(count)]
            times, longest = [], []
            for _ in range(args.runs):
                time.sleep(1.1)  # reloads are rate-limited to one a second
                waits: list[float] = []
                stop = threading.Event()
                prober = threading.Thread(
                    target=connect_waits, args=(str(daemon.socket), stop, waits)
                )
                prober.start()
                start = time.perf_counter()
                with Client(daemon.socket, timeout=120) as requester:
                    reply = requester.request(p.Reload(id=0))
                times.append(time.perf_counter() - start)
                stop.set()
                prober.join()
                assert isinstance(reply, p.ReloadReply), reply
                longest.append(max(waits, default=0.0))
            with Client(daemon.socket, timeout=120) as after:
                views = {v.id: v for v in after.ls()}
            lost = sum(1 for w in workers if views.get(w.id) is None or views[w.id].pid != w.pid)
        print(
            f"reload with {count:>5} live workers: median {statistics.median(times) * 1000:.0f} ms "
            f"(runs {', '.join(f'{t * 1000:.0f}' for t in times)}), longest connect wait "
            f"{max(longest) * 1000:.0f} ms, workers lost: {lost}"
        )


if __name__ == "__main__":
    main()
