"""Stop latency: request to "every process reaped", for workers that exit on TERM.

    .venv/bin/python bench/stop.py [--stops N] [--run-size N]

One worker at a time (median and p99 over N stops), then a run of
--run-size workers stopped at once with `stop --run`.
"""

from __future__ import annotations

import argparse
import time

from _harness import machine, ms, running_daemon, summary

from subagentd.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stops", type=int, default=100)
    parser.add_argument("--run-size", type=int, default=100)
    args = parser.parse_args()
    with running_daemon() as daemon, Client(daemon.socket, timeout=60) as client:
        samples = []
        for _ in range(args.stops):
            worker = client.spawn(["sleep", "600"])
            start = time.perf_counter()
            client.stop(worker.id)  # waits until the whole tree is reaped
            samples.append(time.perf_counter() - start)
            assert client.status(worker.id).state == "stopped"
        run = client.new_run()
        workers = [client.spawn(["sleep", "600"], run=run) for _ in range(args.run_size)]
        start = time.perf_counter()
        stopped = client.stop_run(run)
        whole_run = time.perf_counter() - start
        assert len(stopped) == len(workers)
    s = summary(samples)
    print(f"machine: {machine()}")
    print(f"stop one worker ({s['n']} stops): median {ms(s['median'])}, p99 {ms(s['p99'])}")
    print(f"stop a run of {args.run_size} workers: {ms(whole_run)}")


if __name__ == "__main__":
    main()
