"""What the pause tests share: a worker to pause, and what the kernel says of it."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from subagentd import protocol as p
from subagentd.client import AsyncClient

#: Prints a counter, a line every 10 ms, forking a `sleep` for each: lines to lose, and
#: forks for a pause to catch.
COUNTER = "i=0; while :; do echo $i; i=$((i+1)); sleep 0.01; done"


def cgroup_of(info: p.DaemonInfo, worker_id: str) -> Path | None:
    """The worker's cgroup, None where trees are scanned."""
    if not info.tree_tracking.startswith("cgroup "):
        return None
    return Path(info.tree_tracking.removeprefix("cgroup ")) / worker_id


def proc_state(pid: int) -> str:
    """The process's state letter in /proc/PID/stat ("T": stopped)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rindex(b")") + 2 :].split()[0].decode()


def kernel_holds(info: p.DaemonInfo, worker_id: str, pid: int) -> bool:
    """What the kernel says: its cgroup frozen, or its leader stopped."""
    group = cgroup_of(info, worker_id)
    if group is not None:
        return "frozen 1" in (group / "cgroup.events").read_text()
    return proc_state(pid) in ("T", "t")


def frozen_left(info: p.DaemonInfo, worker_id: str) -> bool:
    """Whether the worker's cgroup is still there and frozen (never where trees are
    scanned): what a test checks once the worker has ended, as its cgroup is removed."""
    group = cgroup_of(info, worker_id)
    if group is None:
        return False
    try:
        return "frozen 1" in (group / "cgroup.events").read_text()
    except OSError as exc:  # gone, or being removed as it is read (ENODEV): nothing held
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            return False
        raise


async def wait_journaled(client: AsyncClient, worker_id: str, kind: str, data: bytes) -> None:
    """Follow the worker's journal until it holds an entry of `kind` saying `data`."""
    async with contextlib.aclosing(client.watch(worker_id, follow=True)) as entries:
        async for entry in entries:
            if (entry.kind, entry.data) == (kind, data):
                return
    raise AssertionError(f"worker {worker_id} ended with no {kind} entry {data!r}")
