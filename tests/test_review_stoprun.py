"""Review of i24-stoprun (a stop of many made cheaper): what a fresh look broke, and what
held when tried.

Found: an ended worker's cgroup was still removed on the event loop, in the step after
each answer (`Daemon.do_after_answers_now`, meant for the image's last moments, was also
the loop's own step), so `Launcher.remove_released`'s thread never had one to remove. A
worker that leaves its cgroup full of nested ones (its own to make: the cgroup is
delegated) held every client for their removal: 3,000 nested, ~0.3 s here. Once in the
thread, the removal held the fork lock through that walk, and a spawn (its fork takes
the lock on the event loop) held every client as long.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, reload_on_own_connection, sh
from .test_crash import _worker_processes

#: The worker makes N cgroups inside its own (a delegated cgroup is its to subdivide)
#: and leaves them there, empty, when it exits: its cgroup's removal removes each.
NEST = (
    "import os\n"
    "rel = [l for l in open('/proc/self/cgroup').read().splitlines() if l.startswith('0::')]\n"
    "mounts = [l.split()[4] for l in open('/proc/self/mountinfo') if ' - cgroup2 ' in l]\n"
    "base = mounts[0] + rel[0][3:]\n"
    "for i in range(int(os.environ['N'])):\n"
    "    os.mkdir(f'{base}/n{i}')\n"
    "print(base, flush=True)\n"
)
TREE_MODES = [pytest.param([], id="cgroups"), pytest.param(["--cgroups", "off"], id="scan")]
#: A worker that ignores its TERM: its stop takes the grace, then a KILL.
STUBBORN = sh("trap '' TERM; echo up; while :; do sleep 1; done")


def _logged(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in daemon.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


def _placed(pid: int) -> str:
    """Where the process at `pid` is, as /proc/PID/cgroup says."""
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_an_ended_workers_cgroup_is_removed_off_the_event_loop(
    daemon: DaemonProcess,
) -> None:
    """A worker leaves 3,000 empty cgroups inside its own and exits. Their removal (an
    rmdir each, ~0.1 ms) is the thread's (`remove_released`): another client's `info`
    answers meanwhile within 0.15 s (0.3 s and more when the loop removed them), and the
    cgroup is gone after."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as other:
            worker = (await client.spawn(["python3", "-c", NEST], env={"N": "3000"})).id
            found = await client.wait_for(worker, "^/", timeout=60)
            assert found.line is not None, found
            base = found.line.strip()
            assert Path(base).name == worker
            assert _is_dir(f"{base}/n2999")
            worst = 0.0
            ended = trio.Event()

            async def probe() -> None:
                nonlocal worst
                while not ended.is_set() or _is_dir(base):
                    asked = trio.current_time()
                    await other.info()
                    worst = max(worst, trio.current_time() - asked)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe)
                await client.wait(worker)
                ended.set()
            assert not _is_dir(base)
            assert worst < 0.15, worst


async def test_memory_stays_flat_while_a_stop_of_many_pauses_collection(
    daemon: DaemonProcess,
) -> None:
    """100 workers ignoring their TERM (grace 15 s) keep collection paused for its bound
    (10.3 s) while a flooding worker's output streams to a follower: the daemon's RSS
    grows by no more than 16 MiB over hundreds of MiB relayed (what the pause keeps is
    only cyclic garbage, and the relay's path makes next to none)."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with trio.fail_after(150):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(STUBBORN, run=run, grace=15)).id for _ in range(100)]
            for worker_id in ids:
                await client.wait_for(worker_id, "^up$", timeout=60)
            flood = (await client.spawn(sh("yes $(seq 100) | head -c 3000000000"))).id
            follower = await RawConnection.open(daemon.socket)
            stopper = await RawConnection.open(daemon.socket)
            async with follower.stream, stopper.stream:
                await follower.send(p.Watch(id=2, worker=flood, follow=True))
                await trio.lowlevel.wait_readable(follower.stream.socket)
                before = _rss(pid)
                await stopper.send(p.StopRun(id=3, run=run))
                relayed, most = 0, before
                with trio.move_on_after(9):  # inside the pause's bound
                    while True:
                        relayed += len(await follower.stream.receive_some(1 << 20))
                        most = max(most, _rss(pid))
                assert relayed > 50 << 20, relayed
                assert most - before < 16 << 20, (before, most, relayed)
                assert _logged(daemon, "stop.many_ended") == []  # still paused throughout
                await client.stop(flood)
                stopped = await stopper.receive()
                assert isinstance(stopped, p.Stopped), stopped
    (still,) = _logged(daemon, "stop.many_still_ending")
    assert still["workers"] == 100
    assert _worker_processes(set(ids)) == []


async def test_many_resumes_right_after_a_stop_run_each_run_in_their_own_cgroup(
    daemon: DaemonProcess,
) -> None:
    """200 workers stopped by one stop_run, then each resumed at once, while the thread
    removes the stopped attempts' cgroups (`remove_unless` skipping a resumed one's, a
    fork making its cgroup again if the removal came first): every resume starts, each
    new attempt's process is in its worker's cgroup, none is logged busy or not removed,
    and after a second stop_run every cgroup is gone."""
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            ids = [
                (await client.spawn(sh("echo up; exec sleep 3600"), run=run)).id for _ in range(200)
            ]
            for worker_id in ids:
                await client.wait_for(worker_id, "^up$", timeout=60)
            pids = {i: (await client.status(i)).pid for i in ids}
            assert f"/{ids[0]}\n" in _placed(pids[ids[0]] or 0)
            assert sorted(await client.stop_run(run)) == sorted(ids)
            for worker_id in ids:
                await client.resume(worker_id)
            for worker_id in ids:
                view = await client.status(worker_id)
                assert view.state == "running", view
                assert view.pid is not None
                assert view.pid != pids[worker_id]
                place = _placed(view.pid)
                assert f"/{worker_id}\n" in place, (worker_id, place)
            assert sorted(await client.stop_run(run)) == sorted(ids)
            await client.info()
    assert _logged(daemon, "cgroup.busy") == []
    assert _logged(daemon, "cgroup.not_removed") == []
    assert _worker_processes(set(ids)) == []
    assert all(not alive(pid) for pid in pids.values() if pid is not None)


async def test_a_spawn_while_a_full_cgroup_is_removed_holds_no_client(
    daemon: DaemonProcess,
) -> None:
    """The thread removes a cgroup holding 3,000 empty nested ones while spawns go on:
    a fork into a cgroup takes the lock the removal takes (`born_in`, on the event
    loop), so the removal holds that lock only for each rmdir, not for the walk. No
    spawn and no other client's `info` waits 0.15 s."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as other:
            worker = (await client.spawn(["python3", "-c", NEST], env={"N": "3000"})).id
            found = await client.wait_for(worker, "^/", timeout=60)
            assert found.line is not None, found
            base = found.line.strip()
            worst = {"info": 0.0, "spawn": 0.0}
            ended = trio.Event()

            async def probe(what: str, call: Callable[[], Awaitable[object]]) -> None:
                while not ended.is_set() or _is_dir(base):
                    asked = trio.current_time()
                    await call()
                    worst[what] = max(worst[what], trio.current_time() - asked)

            async with AsyncClient(daemon.socket) as spawner:
                run = await spawner.new_run()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(probe, "info", other.info)
                    nursery.start_soon(probe, "spawn", lambda: spawner.spawn(["true"], run=run))
                    await client.wait(worker)
                    ended.set()
                await spawner.stop_run(run)
            assert not _is_dir(base)
            assert max(worst.values()) < 0.15, worst


#: A worker whose tree outlives its leader's TERM: a setsid child and a double-forked
#: one, each ignoring TERM (KILLed after the grace), the leader exiting at its TERM.
ESCAPING = sh(
    "(setsid sh -c \"trap '' TERM; while :; do sleep 1; done\" &); "
    "(sh -c \"trap '' TERM; while :; do sleep 1; done\" &) & "
    "echo up; exec sleep 3600"
)


@pytest.mark.parametrize("tree_args", TREE_MODES)
async def test_a_stop_run_ends_trees_whose_leader_left_first_whole(
    daemon_dirs: DaemonProcess, tree_args: list[str]
) -> None:
    """150 workers, each with a setsid child and a double-forked one ignoring TERM: the
    leaders exit at their TERM, before any stop's task reads its cgroup, so the first
    read (`cgroup.events`, not the member list) finds it still populated by what they
    left, and the KILL after the 1 s grace ends it: no process carrying a worker's id
    is left once stop_run answers."""
    daemon_dirs.start(*tree_args)
    with trio.fail_after(240):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(ESCAPING, run=run, grace=1)).id for _ in range(150)]
            for worker_id in ids:
                await client.wait_for(worker_id, "^up$", timeout=60)
            assert len(_worker_processes(set(ids))) >= 3 * 150
            assert sorted(await client.stop_run(run)) == sorted(ids)
            assert _worker_processes(set(ids)) == []
            states = {(await client.status(i)).state for i in ids}
            assert states == {"stopped"}, states


async def test_a_reload_right_after_a_stop_run_of_many_leaves_no_cgroup(
    daemon: DaemonProcess,
) -> None:
    """A stop_run of 200 and a reload asked at once after its answer, while the thread
    removes the stopped workers' cgroups: the exec waits for the batch under way and
    removes what is left on its way out; the new image serves, each worker `stopped`,
    and not one worker's cgroup is left."""
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            ids = [
                (
                    await client.spawn(
                        ["python3", "-c", NEST + "import time; time.sleep(3600)\n"],
                        run=run,
                        env={"N": "0"},
                    )
                ).id
                for _ in range(200)
            ]
            bases = []
            for worker_id in ids:
                found = await client.wait_for(worker_id, "^/", timeout=60)
                assert found.line is not None, found
                bases.append(found.line.strip())
            assert all(_is_dir(base) for base in bases)
            assert sorted(await client.stop_run(run)) == sorted(ids)
        reply = await reload_on_own_connection(daemon)
        assert isinstance(reply, p.ReloadReply), reply
        async with AsyncClient(daemon.socket) as client:
            states = {(await client.status(i)).state for i in ids}
        assert states == {"stopped"}, states
        assert [base for base in bases if _is_dir(base)] == []


async def _stubborn_run(client: AsyncClient, count: int, grace: float) -> tuple[str, list[str]]:
    run = await client.new_run()
    ids = [(await client.spawn(STUBBORN, run=run, grace=grace)).id for _ in range(count)]
    for worker_id in ids:
        await client.wait_for(worker_id, "^up$", timeout=60)
    return run, ids


async def test_a_reload_during_a_stop_of_many_ends_every_worker_stopped(
    daemon: DaemonProcess,
) -> None:
    """120 workers ignoring TERM (grace 3 s) stopped by one stop_run, collection paused,
    and a reload asked meanwhile: the new image carries the stops on (each worker ends
    `stopped`, KILLed after its grace), and nothing of any tree is left."""
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            run, ids = await _stubborn_run(client, 120, 3)
            stopper = await RawConnection.open(daemon.socket)
            async with stopper.stream:
                await stopper.send(p.StopRun(id=3, run=run))
                async with AsyncClient(daemon.socket) as other:
                    await other.wait_for(ids[-1], "^up$", timeout=60)  # a round trip: asked
                reply = await reload_on_own_connection(daemon)
                assert isinstance(reply, p.ReloadReply), reply
        async with AsyncClient(daemon.socket) as client:
            await client.wait_run_stopped(run)
            for worker_id in ids:
                await client.wait(worker_id)
            states = {(await client.status(i)).state for i in ids}
        assert states == {"stopped"}, states
        assert _worker_processes(set(ids)) == []


async def test_a_shutdown_during_a_stop_of_many_ends_every_tree(
    daemon: DaemonProcess,
) -> None:
    """The daemon told to stop (SIGTERM) while a stop_run of 120 TERM-ignoring workers
    holds collection paused: it exits 0 once every tree is ended, none left."""
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            run, ids = await _stubborn_run(client, 120, 3)
            stopper = await RawConnection.open(daemon.socket)
            async with stopper.stream:
                await stopper.send(p.StopRun(id=3, run=run))
                async with AsyncClient(daemon.socket) as other:
                    await other.info()
                code = await trio.to_thread.run_sync(daemon.terminate, 60.0)
        assert code == 0, daemon.log()[-3000:]
        assert _worker_processes(set(ids)) == []


async def test_overlapping_stops_of_many_and_a_fault_in_one_ending_each_end_paused(
    daemon_dirs: DaemonProcess,
) -> None:
    """Two stop_runs of 119 and 120 at once (two holds of the pause, overlapping), one of their
    workers' ending raising (`SUBAGENTD_FAULT=ending:boom`: that worker ends `failed`):
    each stop logs `stop.many_ended` for its workers, with no collection made meanwhile, and
    none is cut short by its bound."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "ending:boom"})
    with trio.fail_after(240):
        async with AsyncClient(daemon_dirs.socket) as client:
            runs = [await client.new_run() for _ in range(2)]
            ids = [
                (await client.spawn(["sleep", "3600"], run=run)).id
                for run in runs
                for _ in range(119)
            ]
            boom = (await client.spawn(["sleep", "3600"], run=runs[1], name="boom")).id
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(client.stop_run, run)
            assert (await client.status(boom)).state == "failed"
            assert {(await client.status(i)).state for i in ids} == {"stopped"}
            await client.info()
    ended = _logged(daemon_dirs, "stop.many_ended")
    assert sorted((e["workers"], e["collections"]) for e in ended) == [(119, 0), (120, 0)]
    assert _logged(daemon_dirs, "stop.many_still_ending") == []
    assert _worker_processes({*ids, boom}) == []
