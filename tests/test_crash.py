"""kill -9 of the daemon at random points while it spawns, stops, journals and
reloads; after each restart: journals whole up to a torn tail, every result
kept, every unacknowledged wake there once, and no process of any worker left."""

from __future__ import annotations

import random
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon._journal import Journal
from subagentd.daemon._tree import scan

from .conftest import DaemonProcess
from .helpers import RawConnection, sh

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
