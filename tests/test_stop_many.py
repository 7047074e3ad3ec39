"""A stop_run of hundreds of live workers at once: every tree reaped before the answer,
every ending written once and waking its run once, nothing lost to a kill -9 right after
the answer, in both tree modes; a stop holds no pidfd for a worker's own process."""

from __future__ import annotations

import contextlib
import os

import pytest
import trio

from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import pending_wakes
from .test_crash import _worker_processes

#: Enough workers that their endings come over many scheduling steps, few enough that a
#: loaded 2-core machine spawns them in seconds.
MANY = 200

TREE_MODES = [pytest.param([], id="cgroups"), pytest.param(["--cgroups", "off"], id="scan")]


async def _spawn_sleepers(daemon: DaemonProcess, count: int) -> tuple[str, dict[str, int]]:
    """A run of `count` live `sleep` workers; their pids by id."""
    async with AsyncClient(daemon.socket) as client:
        run = await client.new_run()
        pids: dict[str, int] = {}
        for _ in range(count):
            view = await client.spawn(["sleep", "3600"], run=run)
            assert view.pid is not None
            pids[view.id] = view.pid
        return run, pids


def _gone(pid: int) -> bool:
    """Whether no process, not even a zombie, is left at `pid` (the daemon reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("tree_args", TREE_MODES)
async def test_a_stop_run_of_hundreds_ends_each_once_and_a_kill_after_its_answer_loses_none(
    daemon_dirs: DaemonProcess, tree_args: list[str]
) -> None:
    daemon_dirs.start(*tree_args)
    with trio.fail_after(240):
        run, pids = await _spawn_sleepers(daemon_dirs, MANY)
        async with AsyncClient(daemon_dirs.socket) as client:
            stopped = await client.stop_run(run)
        # The answer waited for every tree to be reaped and every ending to be written.
        daemon_dirs.kill()
        assert sorted(stopped) == sorted(pids)
        assert [pid for pid in pids.values() if not _gone(pid)] == []
        assert _worker_processes(set(pids)) == []
        await trio.to_thread.run_sync(daemon_dirs.start, *tree_args)
        async with AsyncClient(daemon_dirs.socket) as client:
            states = {i: (await client.status(i)).state for i in pids}
            assert set(states.values()) == {"stopped"}
            for worker_id in pids:
                page = await client.watch_page(worker_id)
                endings = [e.data for e in page.entries if e.kind == "state"]
                assert endings[-1].startswith(b"stopped "), endings
                assert sum(e.startswith(b"stopped ") for e in endings) == 1, endings
                assert page.complete
        woken = [(w.id, w.state) for w in await pending_wakes(daemon_dirs, run)]
        assert sorted(woken) == sorted((i, "stopped") for i in pids)  # each exactly once


def _pidfds(pid: int) -> int:
    """How many pidfds process `pid` holds (its other descriptors come and go)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]"
    return held


async def test_a_stop_in_its_grace_holds_no_descriptor_for_the_workers_own_process(
    daemon: DaemonProcess,
) -> None:
    """A lone worker that ignores TERM keeps its stop in its grace: meanwhile the stop
    holds no pidfd, as the worker held none live (its own process, our unreaped child,
    is signalled by pid and its exit awaited through its supervision's, where a pidfd
    for it cost each stopped worker one, and a stop_run of thousands under the limit
    ran out). Then the grace runs out, cgroup.kill ends it, and its ending is
    written once."""
    assert daemon.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            info = await client.info()
            if not info.tree_tracking.startswith("cgroup "):
                pytest.skip(f"this machine gives the daemon no cgroup: {info.tree_tracking}")
            run = await client.new_run()
            worker = await client.spawn(
                ["sh", "-c", "trap '' TERM; exec sleep 3600"], run=run, grace=3.0
            )
            await client.info()  # its supervision under way: its pipes open, no pidfd
            live = _pidfds(daemon.proc.pid)
            await client.stop(worker.id, wait=False)
            await client.info()  # a round trip later, the stop is waiting in its grace
            assert (await client.status(worker.id)).state == "running"
            assert _pidfds(daemon.proc.pid) == live == 0
            await client.stop(worker.id)
            ended = await client.status(worker.id)
            assert ended.state == "stopped"
            assert worker.pid is not None
            assert _gone(worker.pid)
