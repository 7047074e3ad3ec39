"""Pause and unpause latency of a worker holding a 100-process tree (issue 26, item 5).

    .venv/bin/python bench/pause.py [--sleepers N] [--rounds N]

A worker forks `--sleepers` sleepers (`sleep 600 &`, then `wait`): with itself, a tree of
N + 1 processes. Each round times `pause(worker=W)`, request to answer (the daemon
answers once the kernel says the tree is held), then checks every process is held
(frozen 1 in its cgroup's cgroup.events, or state T in /proc), then times
`unpause(worker=W)` and checks every process runs again. Twice: with cgroups (cgroup v2
cgroup.freeze) and with `--cgroups off` (SIGSTOP/SIGCONT over the tree found by scanning
/proc). No supervisord side: it has no pause.

The floor, with cgroups, in the same rounds: the bench itself writes the worker's
cgroup.freeze and waits for cgroup.events to say frozen (then thawed), as the daemon does,
from Python with no daemon in between.
"""

from __future__ import annotations

import argparse
import os
import select
import time
from pathlib import Path

from _harness import Figure, process_count, report, running_daemon

from subagentd.client import Client

#: Medians of pause and unpause for a 100-process tree, as the issue asks them measured.
TARGET_MS = 50.0


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return "gone"
    return raw[raw.rindex(b")") + 2 :].split()[0].decode()


def _tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(name))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, ()))
    return found


def _wait_tree(root: int, size: int, deadline: float = 60) -> list[int]:
    """The tree once it holds `size` processes, each exec'd into `sleep` but the root."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        tree = _tree(root)
        if len(tree) >= size:
            return tree
        time.sleep(0.05)
    raise AssertionError(f"the worker's tree did not reach {size} processes")


def _kernel_wait(group: Path, frozen: bool) -> float:
    """The floor: freeze (or thaw) the cgroup from here, until cgroup.events says so; ms."""
    want = b"frozen 1" if frozen else b"frozen 0"
    fd = os.open(group / "cgroup.events", os.O_RDONLY)
    try:
        poll = select.poll()
        poll.register(fd, select.POLLPRI)
        start = time.perf_counter()
        (group / "cgroup.freeze").write_bytes(b"1" if frozen else b"0")
        while want not in os.pread(fd, 4096, 0):
            poll.poll(5000)
        return (time.perf_counter() - start) * 1000
    finally:
        os.close(fd)


def _one_mode(
    cgroups: bool, sleepers: int, rounds: int
) -> tuple[list[float], list[float], list[float], list[float], str, int]:
    """(pause ms, unpause ms, floor freeze ms, floor thaw ms, how, processes on the
    machine) for one way of pausing."""
    paused, unpaused, floor_freeze, floor_thaw = [], [], [], []
    script = f"for i in $(seq {sleepers}); do sleep 600 & done; echo up; wait"
    with (
        running_daemon(*([] if cgroups else ["--cgroups", "off"])) as daemon,
        Client(daemon.socket, timeout=60) as client,
    ):
        info = client.info()
        worker = client.spawn(["sh", "-c", script])
        assert worker.pid is not None
        tree = _wait_tree(worker.pid, sleepers + 1)
        group = (
            Path(info.tree_tracking.removeprefix("cgroup ")) / worker.id
            if info.tree_tracking.startswith("cgroup ")
            else None
        )
        assert (group is not None) == cgroups, info.tree_tracking
        machine_processes = process_count()
        for _ in range(rounds):
            start = time.perf_counter()
            answer = client.pause(worker=worker.id)
            paused.append((time.perf_counter() - start) * 1000)
            assert answer.paused == [worker.id], answer
            if group is not None:
                assert "frozen 1" in (group / "cgroup.events").read_text()
            states = {_state(pid) for pid in tree}
            assert states <= {"T", "t"} or group is not None, states
            start = time.perf_counter()
            answer_un = client.unpause(worker=worker.id)
            unpaused.append((time.perf_counter() - start) * 1000)
            assert answer_un.unpaused == [worker.id], answer_un
            assert not {_state(pid) for pid in tree} & {"T", "t"}
            if group is not None:
                assert "frozen 0" in (group / "cgroup.events").read_text()
                floor_freeze.append(_kernel_wait(group, True))
                floor_thaw.append(_kernel_wait(group, False))
        client.stop(worker.id)
    return (
        paused,
        unpaused,
        floor_freeze,
        floor_thaw,
        info.controls["freeze"].how,
        machine_processes,
    )


def measure(sleepers: int = 100, rounds: int = 20) -> list[Figure]:
    figures = []
    for cgroups in (True, False):
        paused, unpaused, floor_freeze, floor_thaw, how, machine_processes = _one_mode(
            cgroups, sleepers, rounds
        )
        mode = "cgroup" if cgroups else "scan"
        floors = []
        if floor_freeze:
            floors = [
                Figure.of(
                    f"pause.{mode}.floor_freeze",
                    f"floor: cgroup.freeze 1 -> frozen 1, {sleepers + 1} processes (no daemon)",
                    "ms", "lower", floor_freeze,
                ),
                Figure.of(
                    f"pause.{mode}.floor_thaw",
                    f"floor: cgroup.freeze 0 -> frozen 0, {sleepers + 1} processes (no daemon)",
                    "ms", "lower", floor_thaw,
                ),
            ]  # fmt: skip
        note = (
            f"{rounds} rounds; a tree of {sleepers} sleepers and their shell; {how}; "
            f"{machine_processes} processes on the machine (a scan's cost grows with them)"
        )
        pause = Figure.of(
            f"pause.{mode}.pause", f"pause a {sleepers + 1}-process tree ({mode}): request -> held",
            "ms", "lower", paused, target=f"<= {TARGET_MS:g} ms", note=note,
            floor=floors[0].subagentd if floors else None,
        )  # fmt: skip
        unpause = Figure.of(
            f"pause.{mode}.unpause", f"unpause it ({mode}): request -> running again",
            "ms", "lower", unpaused, target=f"<= {TARGET_MS:g} ms", note=note,
            floor=floors[1].subagentd if floors else None,
        )  # fmt: skip
        for figure in (pause, unpause):
            assert figure.subagentd is not None
            figure.met = figure.subagentd["median"] <= TARGET_MS
        figures += [pause, unpause, *floors]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sleepers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    report(measure(args.sleepers, args.rounds))


if __name__ == "__main__":
    main()
