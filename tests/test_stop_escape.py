"""A process that moves itself out of its worker's cgroup does not escape a stop.

Where workers have cgroups, any of them may write `cgroup.procs` where it can (a delegated
user service anywhere in its subtree, root anywhere): into the daemon's own cgroup, a
sibling worker's, or one it makes beside its own. It keeps the worker id it inherited in
its environment, and by that a stop, a stop_run and the daemon's shutdown still end it.

Real daemon, real cgroups: each worker forks a child that moves itself, prints its pid and
where it went; the test checks in /proc that nothing of it is left once the stop answers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient, Client

from .conftest import DaemonProcess
from .helpers import alive, sh, wait_output

PYTHON = sys.executable

#: A child that writes its own pid into the cgroup named first (making it if it is not
#: there), prints "escaped <pid>", and sleeps on; the worker itself waits.
ESCAPE = r"""
dest=$1
mkdir -p "$dest"
sh -c 'echo $$ > "$1/cgroup.procs" && echo escaped $$ && exec sleep 60' sh "$dest" &
exec sleep 60
"""


@pytest.fixture
def cgrouped(daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A daemon whose workers have cgroups (skipped where this machine gives it none)."""
    daemon_dirs.start()
    with Client(daemon_dirs.socket, timeout=30) as client:
        how = client.info().tree_tracking
    if not how.startswith("cgroup "):
        pytest.skip(f"this machine gives the daemon no cgroup: {how}")
    return daemon_dirs


@pytest.fixture
async def user(cgrouped: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cgrouped.socket) as client:
        yield client


@contextlib.contextmanager
def reaped_after(made: list[Path], pids: list[int]) -> Iterator[None]:
    """Kill what a failed test left alive, and remove the cgroups it made."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for path in reversed(made):
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    trio_free_sleep()


def trio_free_sleep() -> None:
    """A moment for a killed process to leave its cgroup (cleanup only, outside trio)."""
    subprocess.run(["sleep", "0.01"], check=False)


def base_of(client_info_tracking: str) -> Path:
    return Path(client_info_tracking.removeprefix("cgroup "))


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"process {pid} names no cgroup v2")


async def _escaped_pid(client: AsyncClient, worker_id: str) -> int:
    out = await wait_output(client, worker_id, b"\n")
    return int(out.split()[1])


async def _escaping_worker(
    client: AsyncClient, move: str, *, run: str | None = None
) -> tuple[str, int, Path, list[Path]]:
    """A worker whose child moved itself `move`: ("daemon": into the daemon's own cgroup,
    "sibling": into another worker's, "new": into one it made beside its own); its id,
    the child's pid, where it went, and the cgroups made for it (to clean up)."""
    base = base_of((await client.info()).tree_tracking)
    made: list[Path] = []
    if move == "daemon":
        dest = base.parent
    elif move == "sibling":
        sibling = await client.spawn(["sleep", "60"], grace=0)
        dest = base / sibling.id
    else:
        dest = base / f"escape-{secrets.token_hex(4)}"
        made.append(dest)
    worker = await client.spawn([*sh(ESCAPE), "sh", str(dest)], run=run, grace=0.5)
    pid = await _escaped_pid(client, worker.id)
    assert alive(pid)
    assert str(pid) in (dest / "cgroup.procs").read_text().split(), (
        f"the child did not move into {dest}: it is in {cgroup_of(pid)}"
    )
    return worker.id, pid, dest, made


MOVES = ["daemon", "sibling", "new"]


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_its_stop(
    user: AsyncClient, move: str
) -> None:
    with trio.fail_after(30):
        worker_id, pid, _, made = await _escaping_worker(user, move)
        with reaped_after(made, [pid]):
            assert await user.stop(worker_id)
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"
            assert (await user.status(worker_id)).state == "stopped"
            # A sibling whose cgroup it moved into runs on: only what carries the
            # stopped worker's id was ended.
            live = [w for w in await user.ls() if w.state == "running"]
            assert len(live) == (1 if move == "sibling" else 0)


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_its_run(
    user: AsyncClient, move: str
) -> None:
    with trio.fail_after(30):
        run = await user.new_run()
        worker_id, pid, _, made = await _escaping_worker(user, move, run=run)
        with reaped_after(made, [pid]):
            assert await user.stop_run(run) == [worker_id]
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_the_daemon(
    cgrouped: DaemonProcess, move: str
) -> None:
    with trio.fail_after(30):
        async with AsyncClient(cgrouped.socket) as client:
            _, pid, _, made = await _escaping_worker(client, move)
        with reaped_after(made, [pid]):
            assert cgrouped.terminate() == 0
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"
