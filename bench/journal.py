"""Journal capture throughput: one worker writing to stdout as fast as it can.

    .venv/bin/python bench/journal.py [--mib N] [--runs N]

The worker is `head -c N /dev/zero`. subagentd: spawn, then `wait` until it
ended (everything it wrote is in its journal); MB/s = bytes / that time.
supervisord: the same command as a program whose stdout goes to its default
AUTO log file; startProcess, then getProcessInfo polled every 5 ms until the
process is EXITED. The ceiling: the same bytes through a pipe into `cat` to
/dev/null, no supervisor at all; and, for what a journal cannot avoid (a second
copy into the page cache, the filesystem's block allocation), into `cat` writing a
file in /tmp, where the bench's state dir is. Each measured `--runs` times. Target (issue
15): at least supervisord's rate, and at least half the pipe ceiling (its "x
floor": the ceiling's rate over ours, at most 2).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _harness import Figure, report, running_daemon, running_supervisord

from subagentd.client import Client


def measure(mib: int = 256, runs: int = 5) -> list[Figure]:
    size = mib * 1024 * 1024
    command = ["head", "-c", str(size), "/dev/zero"]
    ours = []
    with running_daemon() as daemon, Client(daemon.socket, timeout=600) as client:
        for _ in range(runs):
            start = time.perf_counter()
            worker = client.spawn(command)
            client.wait(worker.id)
            ours.append(size / (time.perf_counter() - start) / 1e6)
    theirs = []
    with running_supervisord({"journal": 1}, command=" ".join(command)) as sup:
        rpc = sup.rpc()
        for _ in range(runs):
            start = time.perf_counter()
            rpc.supervisor.startProcess("journal:journal_0000", True)
            while rpc.supervisor.getProcessInfo("journal:journal_0000")["statename"] != "EXITED":
                time.sleep(0.005)
            theirs.append(size / (time.perf_counter() - start) / 1e6)
    ceiling = []
    for _ in range(runs):
        start = time.perf_counter()
        with subprocess.Popen(command, stdout=subprocess.PIPE) as producer:
            subprocess.run(["cat"], stdin=producer.stdout, stdout=subprocess.DEVNULL, check=True)
        ceiling.append(size / (time.perf_counter() - start) / 1e6)
    # The same into a file on the state dir's filesystem: a journal's floor, which also
    # pays the page cache (a second copy, and the filesystem's block allocation).
    into_file = []
    scratch = Path(tempfile.mkdtemp(prefix="sab-file-", dir="/tmp"))
    try:
        for _ in range(runs):
            start = time.perf_counter()
            with (
                subprocess.Popen(command, stdout=subprocess.PIPE) as producer,
                open(scratch / "out", "wb") as out,
            ):
                subprocess.run(["cat"], stdin=producer.stdout, stdout=out, check=True)
            into_file.append(size / (time.perf_counter() - start) / 1e6)
            (scratch / "out").unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    top = statistics.median(ceiling)
    pipe = Figure.of(
        "journal.ceiling", "pipe ceiling, no supervisor (`cat` to /dev/null)", "MB/s", "higher",
        ceiling, note="the same bytes through a pipe: the most a capture could reach",
    )  # fmt: skip
    capture = Figure.of(
        "journal.capture", f"journal capture ({mib} MiB to stdout)", "MB/s", "higher",
        ours, theirs, target=">= supervisord, >= half the ceiling (<= 2x)", floor=pipe.subagentd,
        note=f"{runs} runs; supervisord writes its AUTO stdout log; of the pipe ceiling: "
        f"subagentd {statistics.median(ours) / top:.0%}, "
        f"supervisord {statistics.median(theirs) / top:.0%}",
    )  # fmt: skip
    file_floor = Figure.of(
        "journal.file_ceiling", "file ceiling, no supervisor (`cat` into a file in /tmp)",
        "MB/s", "higher", into_file,
        note="the same bytes through a pipe into a file on the state dir's filesystem: "
        f"subagentd reaches {statistics.median(ours) / statistics.median(into_file):.0%} of it",
    )  # fmt: skip
    capture.met = (capture.ratio or 0) >= 1 and (capture.floor_ratio or 99) <= 2
    return [capture, pipe, file_floor]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    report(measure(args.mib, args.runs))


if __name__ == "__main__":
    main()
