"""kill -9 of the daemon at random points while it spawns, stops, journals and
reloads, or posts and acknowledges wakes by the hundred (mid-transaction in the
store); after each restart: journals whole up to a torn tail, every result kept,
every unacknowledged wake there once and no acknowledged one back, no seq given
twice, and no process of any worker left."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.processes._tree import scan
from subagentd.daemon.store._journal import Journal
from subagentd.protocol.errors import TransportError

from .conftest import DaemonProcess
from .helpers import RawConnection, sh
from .helpers import pending_wakes as _pending_wakes

ROUNDS = 4


def _worker_processes(ids: set[str]) -> list[int]:
    """Live processes that carry one of these workers' ids in their environment."""
    found = []
    for stat in scan().values():
        if stat.state == "Z":
            continue
        try:
            environ = Path(f"/proc/{stat.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(f"SUBAGENTD_WORKER_ID={i}".encode() in environ for i in ids):
            found.append(stat.pid)
    return found


async def _activity(daemon: DaemonProcess, rng: random.Random, ids: set[str]) -> None:
    """Spawn, write, stop and reload until the daemon is killed under it."""
    try:
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            ids.add(run)
            while True:
                action = rng.choice(["spawn", "spawn", "writer", "stop", "reload"])
                if action == "spawn":
                    ids.add((await client.spawn(sh(f"echo {rng.random()}"), run=run)).id)
                elif action == "writer":
                    ids.add((await client.spawn(["seq", "1", "2000000"], run=run)).id)
                elif action == "stop" and len(ids) > 1:
                    await client.stop(rng.choice(sorted(ids - {run})), wait=False)
                elif action == "reload":
                    conn = await RawConnection.open(daemon.socket)
                    async with conn.stream:
                        await conn.send(p.Reload(id=2))
                        await conn.receive()
    except (OSError, p.errors.SubagentdError, trio.BrokenResourceError):
        return  # the daemon died under us, as intended


async def test_kill_9_at_random_points_loses_nothing_and_leaves_no_orphan(
    daemon: DaemonProcess,
) -> None:
    rng = random.Random(20261130)
    ids: set[str] = set()
    for _ in range(ROUNDS):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_activity, daemon, rng, ids)
                await trio.sleep(rng.uniform(0.2, 1.0))
                daemon.kill()
            await trio.to_thread.run_sync(daemon.start)
        workers = {i for i in ids if i.startswith("w-")}
        assert _worker_processes(workers) == []  # recovery ended every orphan
        async with AsyncClient(daemon.socket) as client:
            for worker_id in workers:
                view = await client.status(worker_id)
                assert view.state in p.TERMINAL_STATES | {"running"}, view
                archive = Path(view.archive)
                Journal.open(archive / "journal", writable=False)  # no damage before a torn tail
                if view.state == "finished":
                    result = await client.collect(worker_id)
                    assert result.result, worker_id  # every finished worker printed something
                if view.state == "running":
                    await client.stop(worker_id)  # carried by a reload that completed
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            for n, run in enumerate(sorted(i for i in ids if i.startswith("r-")), start=2):
                await conn.send(p.Subscribe(id=n, run=run))
                page = await conn.receive()
                assert isinstance(page, p.Wakes)
                woken = [w.id for w in page.wakes]
                assert len(woken) == len(set(woken))  # never posted twice


# -- wakes, posted and acknowledged by the hundred -----------------------------


@dataclass
class _Wakes:
    """What the test saw of one run's wakes, across every kill."""

    spawned: list[str] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # seq -> worker: one wake per seq
    acked: set[int] = field(default_factory=set)  # the daemon answered `done` to their ack
    unsure: set[int] = field(default_factory=set)  # ack sent, answer lost with the daemon


async def _spawn_endings(daemon: DaemonProcess, run: str, wakes: _Wakes) -> None:
    try:
        async with AsyncClient(daemon.socket) as client:
            while True:
                wakes.spawned.append((await client.spawn(["true"], run=run)).id)
    except (OSError, p.errors.SubagentdError, trio.BrokenResourceError):
        return


async def _ack_as_delivered(daemon: DaemonProcess, run: str, wakes: _Wakes) -> None:
    try:
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=run, follow=True))
            asked: dict[int, list[int]] = {}
            while (reply := await conn.receive()) is not None:
                if isinstance(reply, p.Done):
                    done = asked.pop(reply.id)
                    wakes.acked.update(done)
                    wakes.unsure.difference_update(done)
                    continue
                assert isinstance(reply, p.Wakes), reply
                for wake in reply.wakes:
                    assert wakes.seen.setdefault(wake.seq, wake.id) == wake.id, "seq given twice"
                if reply.wakes:
                    rid = 3 + len(asked) + len(wakes.acked)
                    asked[rid] = [w.seq for w in reply.wakes]
                    wakes.unsure.update(asked[rid])
                    await conn.send(p.Ack(id=rid, wakes=asked[rid]))
    except (OSError, trio.BrokenResourceError, AssertionError) as exc:
        if isinstance(exc, AssertionError):
            raise
        return


async def test_kill_9_amid_many_wake_posts_and_acks_loses_none_and_resurrects_none(
    daemon: DaemonProcess,
) -> None:
    rng = random.Random(20261201)
    async with AsyncClient(daemon.socket) as client:
        run = await client.new_run()
    wakes = _Wakes()
    for _ in range(ROUNDS):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_spawn_endings, daemon, run, wakes)
                nursery.start_soon(_ack_as_delivered, daemon, run, wakes)
                await trio.sleep(rng.uniform(0.3, 1.5))
                daemon.kill()
                nursery.cancel_scope.cancel()  # a client would wait out its retries
            await trio.to_thread.run_sync(daemon.start)
            pending = {w.seq: w.id for w in await _pending_wakes(daemon, run)}
        assert not pending.keys() & wakes.acked, "an acknowledged wake came back"
        assert len(set(pending.values())) == len(pending), "a worker woke its run twice"
        for seq, worker in pending.items():
            assert wakes.seen.get(seq, worker) == worker, f"seq {seq} given twice"
        async with AsyncClient(daemon.socket) as client:
            for worker in wakes.spawned:
                if (await client.status(worker)).state not in p.TERMINAL_STATES:
                    continue
                delivered = {s for s, w in wakes.seen.items() if w == worker}
                assert worker in pending.values() or delivered & (wakes.acked | wakes.unsure), (
                    f"the wake of {worker} was lost"
                )
    assert len(wakes.acked) > 50, "too few wakes acknowledged to have tested much"


# -- kill -9 inside an ending's transaction ------------------------------------


async def test_kill_9_inside_an_endings_transaction_leaves_neither_half(
    daemon_dirs: DaemonProcess,
) -> None:
    """The daemon dies (SIGKILL, from inside: `die-in-ending`) after an ending's record
    and wake are written in its transaction but before the commit. Neither half is in
    the store: the next start finds the worker not ended, recovers it `interrupted`
    with one wake; the endings before it keep theirs, once each."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "die-in-ending:3"})
    ids: list[str] = []
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            for _ in range(2):
                worker = await client.spawn(sh("echo ok"), run=run)
                ids.append(worker.id)
                await client.wait(worker.id)
            ids.append((await client.spawn(sh("echo last"), run=run)).id)
        assert daemon_dirs.proc is not None
        await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30)  # it killed itself
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            states = [(await client.status(i)).state for i in ids]
            assert states == ["finished", "finished", "interrupted"]
            for worker_id in ids:
                archive = Path((await client.status(worker_id)).archive)
                Journal.open(archive / "journal", writable=False)  # whole
        woken = [(w.id, w.state) for w in await _pending_wakes(daemon_dirs, run)]
        assert sorted(woken) == sorted(zip(ids, states, strict=True)), woken
        await trio.to_thread.run_sync(daemon_dirs.kill)  # and again: nothing doubled
        await trio.to_thread.run_sync(daemon_dirs.start)
        again = [(w.id, w.state) for w in await _pending_wakes(daemon_dirs, run)]
        assert again == woken


# -- kill -9 after a spawn's answer, before its start is written ----------------


async def test_kill_9_before_a_started_worker_is_written_down_leaves_no_orphan(
    daemon_dirs: DaemonProcess,
) -> None:
    """A spawn is answered once its worker runs; its pid and its journal's `running`
    entry are written just after (`die-before-start-written` kills the daemon between
    the two). The next start knows the worker, registered before its fork, finds it
    `interrupted`, and has ended its tree, although the store named no pid for it."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "die-before-start-written:sleeper"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            with contextlib.suppress(TransportError):  # answered, or not, as it died
                await client.spawn(["sleep", "600"], run=run, name="sleeper")
        assert daemon_dirs.proc is not None
        await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30)  # it killed itself
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            (worker,) = await client.ls(all=True, run=run)
            assert (worker.name, worker.state) == ("sleeper", "interrupted")
            assert (await client.status(worker.id)).state == "interrupted"
        assert _worker_processes({worker.id}) == []


# -- a run's endings, written together ------------------------------------------


async def test_a_runs_stop_is_not_answered_before_its_last_ending_is_written(
    daemon_dirs: DaemonProcess,
) -> None:
    """A run's stopped workers end within a few scheduling batches, each batch's endings
    in one transaction (`GroupCommit`): the stop's answer still waits for every one of
    them to be in the store. The daemon dies inside the last ending's transaction
    (`die-in-ending:30`): no answer has gone out, and the next start finds the endings
    written before `stopped`, that batch's `interrupted`, each with one wake."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "die-in-ending:30"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(["sleep", "60"], run=run)).id for _ in range(30)]
        conn = await RawConnection.open(daemon_dirs.socket)
        async with conn.stream:
            await conn.send(p.StopRun(id=2, run=run))
            assert await conn.receive() is None  # it died before answering
        assert daemon_dirs.proc is not None
        await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30)
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            states = {i: (await client.status(i)).state for i in ids}
        # That transaction held its whole batch (perhaps all 30): found `interrupted`.
        assert "interrupted" in states.values(), states
        assert set(states.values()) <= {"stopped", "interrupted"}, states
        woken = sorted((w.id, w.state) for w in await _pending_wakes(daemon_dirs, run))
        assert woken == sorted(states.items())


async def test_a_fault_in_one_ending_of_a_batch_costs_the_others_nothing(
    daemon_dirs: DaemonProcess,
) -> None:
    """One ending's fault (injected inside the transaction) rolls back the batch it was
    written with; the others are then written alone, and only the faulty worker ends
    `failed`. Every worker wakes its run once, in memory and after a restart."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "record:doomed"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            fine = [(await client.spawn(["sleep", "60"], run=run)).id for _ in range(20)]
            doomed = (await client.spawn(["sleep", "60"], run=run, name="doomed")).id
            await client.stop_run(run)
            states = {i: (await client.status(i)).state for i in [*fine, doomed]}
            assert states == {**dict.fromkeys(fine, "stopped"), doomed: "failed"}
        woken = sorted((w.id, w.state) for w in await _pending_wakes(daemon_dirs, run))
        assert woken == sorted(states.items())
        daemon_dirs.kill()
        await trio.to_thread.run_sync(daemon_dirs.start)
        again = sorted((w.id, w.state) for w in await _pending_wakes(daemon_dirs, run))
        assert again == woken
