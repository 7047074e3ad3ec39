"""A stop_run of hundreds, as its cost per worker is cut: what grew with the number of
workers is gone (no garbage collection during a stop of many, so none walks every
worker's objects: counted by the daemon, not timed), and every promise holds under the
batching (each nested tree ended whole, nothing alive after, each worker woken once,
each ending in the store before its wake, a kill -9 mid-stop losing none)."""

from __future__ import annotations

import json

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.processes._tree import read_stat

from .conftest import DaemonProcess
from .helpers import RawConnection, pending_wakes
from .test_crash import _worker_processes

#: Past the supervisor's UNSEEN_STOP_FROM (100), few enough for a loaded 2-core machine.
MANY = 300
#: Each worker a tree: a shell and two children, which its stop finds and ends too.
NESTED = ["sh", "-c", "sleep 3600 & sleep 3600 & echo up; wait"]

TREE_MODES = [pytest.param([], id="cgroups"), pytest.param(["--cgroups", "off"], id="scan")]


async def _spawn(daemon: DaemonProcess, count: int, argv: list[str]) -> tuple[str, list[str]]:
    async with AsyncClient(daemon.socket) as client:
        run = await client.new_run()
        ids = [(await client.spawn(argv, run=run)).id for _ in range(count)]
        if argv == NESTED:  # each shell has forked both children: the stop finds them
            for worker_id in ids:
                found = await client.wait_for(worker_id, "^up$", timeout=60)
                assert found.outcome == "matched", found
        return run, ids


def _logged(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in daemon.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def _started(pid: int) -> int | None:
    """When the process at `pid` started (clock ticks after boot); None if there is none:
    with the start, a pid names one process, not whichever the machine gave it to since."""
    stat = read_stat(pid)
    return None if stat is None else stat.starttime


async def test_a_stop_of_many_makes_no_garbage_collection_while_its_workers_end(
    daemon: DaemonProcess,
) -> None:
    """The step that grew with the number of workers: a stop of thousands makes objects
    (a task, a cancel scope, events a worker) that live until each ending, and every
    quarter of the heap they made brought a full collection walking every worker's
    objects (three in a stop_run of 5,000: 1.7 s of its 4.7 s). Counted by the daemon
    itself (`stop.many_ended`: collections of any generation from the stop to its last
    ending): none, at 300 as at 10,000. A stop of a few pauses nothing."""
    with trio.fail_after(180):
        run, ids = await _spawn(daemon, MANY, ["sleep", "3600"])
        few_run, few = await _spawn(daemon, 3, ["sleep", "3600"])
        async with AsyncClient(daemon.socket) as client:
            assert sorted(await client.stop_run(run)) == sorted(ids)
            assert sorted(await client.stop_run(few_run)) == sorted(few)
            await client.info()  # a round trip after the last ending: its line is out
    (ended,) = _logged(daemon, "stop.many_ended")
    assert ended["workers"] == MANY
    assert ended["collections"] == 0
    assert _logged(daemon, "stop.many_still_ending") == []


@pytest.mark.parametrize("tree_args", TREE_MODES)
async def test_a_stop_run_of_nested_trees_wakes_each_once_after_its_ending_is_written(
    daemon_dirs: DaemonProcess, tree_args: list[str]
) -> None:
    """300 trees of three processes, stopped by one stop_run while a follower takes the
    run's wakes as they are posted: each worker's wake comes once, and the daemon is
    killed -9 the moment the first wakes arrive, so every wake seen must already have
    its ending in the store (`stopped` after the restart, never `interrupted`), and the
    restart's wakes are the same ones again (unacknowledged), each worker's one seq."""
    daemon_dirs.start(*tree_args)
    with trio.fail_after(300):
        run, ids = await _spawn(daemon_dirs, MANY, NESTED)
        async with AsyncClient(daemon_dirs.socket) as client:
            pids = {i: (await client.status(i)).pid for i in ids}
            started = {pid: _started(pid) for pid in pids.values() if pid is not None}
        follower = await RawConnection.open(daemon_dirs.socket)
        seen: dict[str, list[int]] = {}
        async with follower.stream:
            await follower.send(p.Subscribe(id=2, run=run, follow=True))
            first = await follower.receive()
            assert isinstance(first, p.Wakes), first
            assert first.wakes == [], first
            stopper = await RawConnection.open(daemon_dirs.socket)
            async with stopper.stream:
                await stopper.send(p.StopRun(id=3, run=run))
                page = await follower.receive()
                daemon_dirs.kill()  # as the first wakes come: the rest, mid-stop
                while page is not None:
                    assert isinstance(page, p.Wakes), page
                    for wake in page.wakes:
                        seen.setdefault(wake.id, []).append(wake.seq)
                    page = await follower.receive()
        assert seen, "no wake came before the kill"
        assert all(len(seqs) == 1 for seqs in seen.values()), seen
        await trio.to_thread.run_sync(daemon_dirs.start, *tree_args)
        async with AsyncClient(daemon_dirs.socket) as client:
            states = {i: (await client.status(i)).state for i in ids}
        for worker_id in seen:  # woken before the kill: its ending was in the store first
            assert states[worker_id] == "stopped", (worker_id, states[worker_id])
        assert set(states.values()) <= {"stopped", "interrupted"}, states
        again = await pending_wakes(daemon_dirs, run)
        by_worker: dict[str, list[int]] = {}
        for wake in again:
            by_worker.setdefault(wake.id, []).append(wake.seq)
        assert sorted(by_worker) == sorted(ids)  # every worker woken, each once
        assert all(len(seqs) == 1 for seqs in by_worker.values()), by_worker
        assert all(by_worker[i] == seqs for i, seqs in seen.items())  # the same wake
        assert [pid for pid, at in started.items() if _started(pid) == at] == []
        assert _worker_processes(set(ids)) == []  # every tree ended whole


@pytest.mark.parametrize("tree_args", TREE_MODES)
async def test_a_stop_run_of_nested_trees_answers_with_every_tree_gone(
    daemon_dirs: DaemonProcess, tree_args: list[str]
) -> None:
    """The same 300 trees under one stop_run left to finish: its answer comes once every
    process of every tree is gone and every ending is written; each worker's journal
    ends `stopped` once, and the run's wakes are one a worker."""
    daemon_dirs.start(*tree_args)
    with trio.fail_after(300):
        run, ids = await _spawn(daemon_dirs, MANY, NESTED)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert sorted(await client.stop_run(run)) == sorted(ids)
            assert _worker_processes(set(ids)) == []
            states = {i: (await client.status(i)).state for i in ids}
            assert set(states.values()) == {"stopped"}
            for worker_id in ids[:: MANY // 30]:
                page = await client.watch_page(worker_id)
                endings = [e.data for e in page.entries if e.kind == "state"]
                assert sum(e.startswith(b"stopped ") for e in endings) == 1, endings
        woken = sorted((w.id, w.state) for w in await pending_wakes(daemon_dirs, run))
        assert woken == sorted((i, "stopped") for i in ids)
