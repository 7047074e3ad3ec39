"""Reload with N live workers: subagentd's reload in place vs supervisord's restart.

    .venv/bin/python bench/reload.py [--workers 0 100 1000] [--runs N]

subagentd: N workers `sleep 3600` run; `Reload` is sent on a fresh connection
and timed until its answer, which the new image gives once every worker is
adopted and it serves. Reloads are rate-limited to one a second: a `busy`
answer is waited out (its retry_after) and not timed.

supervisord: N processes `sleep 3600` of one group run; `supervisor.restart()`
is sent and timed until getState answers RUNNING again (while it restarts, it
answers SHUTDOWN_STATE or refuses connections). This is how supervisord
reloads its code or its config wholesale (`supervisorctl reload`).

Meanwhile a prober thread connects every 2 ms (blocking connect: a connect
waits in the listen backlog) and records how long each connect took until the
daemon answered its hello (subagentd), and how many connects were refused
(both; supervisord's socket is gone while it restarts). The time's note splits subagentd's reload
into its steps (medians), from the timestamps of its log events.

Floors (see floors.py), measured after each worker count's reloads: a fresh
interpreter of the venv's python, `-c pass` and `-c "import trio, msgspec"`,
until it exits: what any exec'd new image pays before it can serve. Targets
(issue 15): with 1,000 live, time until serving and the longest connect wait
under 300 ms, none lost, none refused; with 0 live, under 150 ms.

Lost: the workers that were running before and are not running with the
same pid after (supervisord: its processes killed by the restart; with
autostart=false it does not start them again, and with autostart=true it
would start new ones, which is a loss all the same).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from _harness import (
    BenchDaemon,
    Figure,
    alive,
    report,
    running_daemon,
    running_pids,
    running_supervisord,
    wait_exec,
)
from floors import INTERPRETER, interpreter_once

from subagentd import protocol as p
from subagentd.client import Client
from subagentd.protocol.errors import Busy

#: Between two connects of the prober: fine enough to see a wait, and it leaves
#: the daemon the CPU (on 2 cores, a prober in a tight loop slows the reload).
PROBE_PAUSE = 0.002


@dataclass
class Probe:
    """Connects to `path` in a loop until stopped: each wait, and the refusals."""

    path: str
    greet: bool
    waits: list[float] = field(default_factory=list)
    refused: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._loop)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _loop(self) -> None:
        hello = p.encode(p.Hello(id=1))
        while not self._stop.is_set():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                start = time.perf_counter()
                try:
                    s.connect(self.path)  # blocking: waits in the backlog, if there is one
                    s.settimeout(60)
                    if self.greet:
                        s.sendall(hello)
                        s.recv(4096)  # the welcome (or the reloading notice)
                except OSError:  # no socket file, refused, reset, backlog full
                    self.refused += 1
                else:
                    self.waits.append((time.perf_counter() - start) * 1000)
            time.sleep(PROBE_PAUSE)


@dataclass
class Runs:
    """One system's samples at one worker count."""

    times: list[float] = field(default_factory=list)
    longest: list[float] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add(self, elapsed: float, probe: Probe, lost: int) -> None:
        self.times.append(elapsed * 1000)
        self.longest.append(max(probe.waits, default=0.0))
        self.lost.append(lost)
        self.refused.append(probe.refused)


#: The daemon's log events that mark a reload's steps, and what lies between them.
PHASES = [
    ("reload.checking", "reload.checked", "check"),
    ("reload.checked", "reload.frozen", "pause+freeze"),
    ("reload.frozen", "reload.exec", "checkpoint"),
    ("reload.exec", "reload.adopted", "exec+imports+adopt"),
    ("reload.adopted", "daemon.serving", "serve"),
]


def phases(log: Path, offset: int) -> dict[str, float]:
    """Milliseconds between the reload's log events written after `offset` of `log`."""
    at: dict[str, float] = {}
    with log.open("rb") as f:
        f.seek(offset)
        for line in f:
            try:
                event = json.loads(line)
                stamp = datetime.fromisoformat(event["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            at.setdefault(event.get("event", ""), stamp)
    return {name: (at[b] - at[a]) * 1000 for a, b, name in PHASES if a in at and b in at}


def reload_once(daemon: BenchDaemon, workers: list[p.WorkerView], out: Runs) -> None:
    """Reload `daemon` once, with `workers` live: add its time, longest connect wait,
    refusals, losses and steps to `out`."""
    while True:
        offset = (daemon.root / "daemon.log").stat().st_size
        with Probe(str(daemon.socket), greet=True) as probe:
            start = time.perf_counter()
            try:
                with Client(daemon.socket, timeout=120) as requester:
                    reply = requester.request(p.Reload(id=0))
            except Busy as busy:  # rate-limited: wait it out, untimed
                time.sleep(busy.retry_after or 1.0)
                continue
            elapsed = time.perf_counter() - start
        break
    assert isinstance(reply, p.ReloadReply), reply
    with Client(daemon.socket, timeout=120) as after:  # a reload closes connections
        views = {v.id: v for v in after.ls()}
    lost = sum(1 for w in workers if w.id not in views or views[w.id].pid != w.pid)
    out.add(elapsed, probe, lost)
    for name, ms in phases(daemon.root / "daemon.log", offset).items():
        out.phases.setdefault(name, []).append(ms)


def reload_subagentd(count: int, runs: int) -> Runs:
    out = Runs()
    with running_daemon() as daemon:
        with Client(daemon.socket, timeout=120) as client:
            workers = [client.spawn(["sleep", "3600"]) for _ in range(count)]
        wait_exec(w.pid for w in workers if w.pid)
        for _ in range(runs):
            reload_once(daemon, workers, out)
    return out


def serving_again(connect: Callable[[], object]) -> None:
    """Poll supervisord until it answers RUNNING; a new connection after each failure."""
    rpc: object = connect()
    while True:
        try:
            if rpc.supervisor.getState()["statecode"] == 1:  # type: ignore[attr-defined]
                return
        except Exception:
            rpc = connect()
            time.sleep(0.0005)


def reload_supervisord(count: int, runs: int) -> Runs:
    out = Runs()
    with running_supervisord({"w": count} if count else {}) as sup:
        for _ in range(runs):
            rpc = sup.rpc()
            if count:
                rpc.supervisor.startProcessGroup("w", True)
            before = running_pids(rpc)
            assert len(before) == count, before
            wait_exec(before.values())
            with Probe(str(sup.socket), greet=False) as probe:
                start = time.perf_counter()
                rpc.supervisor.restart()
                serving_again(sup.rpc)
                elapsed = time.perf_counter() - start
            after = running_pids(sup.rpc())
            lost = sum(
                1 for name, pid in before.items() if after.get(name) != pid or not alive(pid)
            )
            out.add(elapsed, probe, lost)
    return out


#: Targets of issue 15 by live workers: time until serving (ms), and with them the
#: longest connect wait (ms), none lost and none refused.
TARGETS = {0: 150, 1000: 300}
#: Each interpreter floor is measured this many times after each worker count's reloads.
FLOOR_RUNS = 5


def interpreter_floors(samples: dict[str, list[float]]) -> None:
    """Add FLOOR_RUNS of each interpreter floor to `samples`, in turns."""
    for _ in range(FLOOR_RUNS):
        for name, code in INTERPRETER.items():
            samples.setdefault(name, []).append(interpreter_once(code))


def measure(workers: tuple[int, ...] = (0, 100, 1000), runs: int = 3) -> list[Figure]:
    figures = []
    floors: dict[str, list[float]] = {}
    for code in INTERPRETER.values():  # untimed: writes the bytecode if it is missing
        interpreter_once(code)
    counted = []
    for count in workers:
        ours = reload_subagentd(count, runs)
        interpreter_floors(floors)
        theirs = reload_supervisord(count, runs)
        counted.append((count, ours, theirs))
    bare = Figure.of(
        "reload.floor.pass", "reload floor: a fresh interpreter, `python -c pass`", "ms",
        "lower", floors["pass"],
        note="the venv's python with its site, bytecode written; until it exits",
    )  # fmt: skip
    imports = Figure.of(
        "reload.floor.imports", 'reload floor: `python -c "import trio, msgspec"`', "ms",
        "lower", floors["imports"],
        note="what any exec'd new image pays before it can serve; until it exits",
    )  # fmt: skip
    figures += [bare, imports]
    for count, ours, theirs in counted:
        what = f"reload, {count:,} live"
        time_figure = Figure.of(
            f"reload.{count}.time", f"{what}: time until serving", "ms", "lower",
            ours.times, theirs.times, floor=imports.subagentd, note=f"{runs} reloads" + "".join(
                f"; {name} {statistics.median(ms):.0f} ms" for name, ms in ours.phases.items()
            ),
        )  # fmt: skip
        wait = Figure.of(
            f"reload.{count}.connect_wait", f"{what}: longest connect wait", "ms", "lower",
            ours.longest,
            note="a client connecting every 2 ms meanwhile, until its hello is answered "
            "(supervisord refuses connects while it restarts: see the next row)",
        )  # fmt: skip
        lost = Figure.of(
            f"reload.{count}.lost", f"{what}: workers lost", "workers", "lower",
            ours.lost or [0], theirs.lost or [0], target="0",
        )  # fmt: skip
        lost.met = max(ours.lost, default=0) == 0
        none_refused = max(ours.refused, default=0) == 0
        if count in TARGETS:
            bound = TARGETS[count]
            time_figure.target = f"< {bound} ms" + (", none lost, none refused" if count else "")
            time_figure.met = statistics.median(ours.times) < bound and (
                not count or (lost.met and none_refused)
            )
            if count:
                wait.target = f"< {bound} ms"
                wait.met = statistics.median(ours.longest) < bound
        figures += [
            time_figure,
            wait,
            Figure.of(
                f"reload.{count}.refused", f"{what}: connects refused", "connects", "lower",
                ours.refused, theirs.refused, target="0", met=none_refused,
            ),
            lost,
        ]  # fmt: skip
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 100, 1000])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    report(measure(tuple(args.workers), args.runs))


if __name__ == "__main__":
    main()
