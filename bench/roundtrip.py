"""Control round trip: subagentd `info` vs supervisord `supervisor.getState`.

    .venv/bin/python bench/roundtrip.py [--calls N] [--clients N] [--seconds S] [--rounds N]

Both daemons run side by side and are measured in turns, so that other work
on the machine weighs on both alike.

Latency: one client, one connection per daemon, `--calls` calls after a
warm-up, in 10 blocks taking turns; each call is timed alone (median and
p99, in ms). subagentd is asked with the blocking Client, supervisord with
xmlrpc.client over its Unix socket on a kept-alive HTTP/1.1 connection.

The floor, the third party in those turns (see floors.py): a bare trio +
msgspec echo server on a Unix socket, in its own process, called the same way
(one blocking connection, the daemon's frame codec, a small Struct each way).
Target (issue 15): at least 4x faster than getState, within 1.5x of the echo.

Throughput: `--clients` threads, each with its own connection, call as fast
as they can for `--seconds`; calls/s over all of them, `--rounds` times for
each daemon in turns. The clients share this process's GIL, alike for both.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

from _harness import Figure, report, running_daemon, running_supervisord
from floors import EchoClient, running_echo

from subagentd.client import Client

#: Calls before measuring: imports, caches, the daemon's first allocations.
WARM_UP = 200
#: The calls are made in this many blocks, taking turns between the two daemons.
BLOCKS = 10


def timed(call: Callable[[], object], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def throughput(
    connect: Callable[[], tuple[Callable[[], object], Callable[[], None]]],
    clients: int,
    seconds: float,
) -> float:
    """Calls/s of `clients` threads; `connect()` gives one a (call, close) pair."""
    counts = [0] * clients
    ready = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(i: int) -> None:
        call, close = connect()
        try:
            call()
            ready.wait()
            n = 0
            while not stop.is_set():
                call()
                n += 1
            counts[i] = n
        finally:
            close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def measure(
    calls: int = 10_000, clients: int = 8, seconds: float = 3.0, rounds: int = 3
) -> list[Figure]:
    ours: list[float] = []
    theirs: list[float] = []
    echo: list[float] = []
    ours_rate, theirs_rate = [], []
    with (
        running_daemon() as daemon,
        running_supervisord({"idle": 1}) as sup,
        running_echo() as echo_path,
    ):

        def connect_ours() -> tuple[Callable[[], object], Callable[[], None]]:
            client = Client(daemon.socket, timeout=30)
            client.connect()
            return client.info, client.close

        def connect_theirs() -> tuple[Callable[[], object], Callable[[], None]]:
            rpc = sup.rpc(timeout=30)
            return rpc.supervisor.getState, rpc("close")

        (ours_call, ours_close), (theirs_call, theirs_close) = connect_ours(), connect_theirs()
        bare = EchoClient(echo_path)
        timed(ours_call, WARM_UP)
        timed(theirs_call, WARM_UP)
        timed(bare.call, WARM_UP)
        for _ in range(BLOCKS):  # in turns, so that other work on the machine hits all alike
            ours += timed(ours_call, calls // BLOCKS)
            theirs += timed(theirs_call, calls // BLOCKS)
            echo += timed(bare.call, calls // BLOCKS)
        ours_close()
        theirs_close()
        bare.close()
        for _ in range(rounds):
            ours_rate.append(throughput(connect_ours, clients, seconds))
            theirs_rate.append(throughput(connect_theirs, clients, seconds))

    floor = Figure.of(
        "roundtrip.floor", "round-trip floor: bare trio + msgspec echo (no daemon)", "ms",
        "lower", echo,
        note="a framed msgpack request decoded into a Struct, an answer encoded, one "
        "blocking connection with the same frame codec; the third party in the turns",
    )  # fmt: skip
    latency_figure = Figure.of(
        "roundtrip.latency", "control round trip (info vs getState)", "ms", "lower",
        ours, theirs, target=">= 4x faster, <= 1.5x echo", floor=floor.subagentd,
        note=f"{calls} calls on one connection, each timed; in {BLOCKS} blocks, in turns "
        "with the echo",
    )  # fmt: skip
    latency_figure.met = (latency_figure.ratio or 0) >= 4 and (
        latency_figure.floor_ratio or 99
    ) <= 1.5
    rate = Figure.of(
        "roundtrip.throughput", f"control throughput, {clients} clients", "calls/s", "higher",
        ours_rate, theirs_rate,
        note=f"{clients} threads, each its own connection, {seconds:g} s, {rounds} rounds",
    )  # fmt: skip
    return [latency_figure, floor, rate]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report(measure(args.calls, args.clients, args.seconds, args.rounds))


if __name__ == "__main__":
    main()
