"""A failure inside one worker's supervision ends that worker, never the daemon.

Faults are injected with SUBAGENTD_FAULT (read once by the daemon at start), or
given to an in-process daemon (tests/inprocess.py) where the TTL must pass: the
named worker's supervision raises at that point, as an unexpected bug would. A
bystander worker shows that everyone else is still supervised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, pids_in, sh
from .inprocess import held, in_process


@pytest.mark.parametrize("point", ["ending", "pump", "record"])
async def test_a_fault_in_one_workers_supervision_fails_only_that_worker(
    daemon_dirs: DaemonProcess, point: str
) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT": f"{point}:faulty"})
    child_pid = daemon_dirs.root / "child.pid"
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            bystander = await client.spawn(["sleep", "600"], run=run, name="bystander")
            # A tree: the leader prints (the pump's fault) and exits (the ending's and the
            # record's), leaving a child that only the end of its tree stops.
            faulty = await client.spawn(
                sh(f"sleep 600 & echo $! > {child_pid}; echo hello; sleep 0.2"),
                run=run,
                name="faulty",
            )
            ended = await client.wait(faulty.id)
            assert ended.state == "failed"
            info = await client.info()  # the daemon serves on
            assert info.workers.get("running") == 1
            assert faulty.pid is not None
            assert not alive(faulty.pid)
            assert [pid for pid in pids_in(child_pid) if alive(pid)] == []
            watched = await trio.to_thread.run_sync(lambda: daemon_dirs.ctl("watch", faulty.id))
            journal = watched.stdout + watched.stderr  # notes and states go to stderr
            assert "supervision failed" in journal, watched
            assert f"injected fault at {point}:faulty" in journal, watched
        conn = await RawConnection.open(daemon_dirs.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=run))
            page = await conn.receive()
            assert isinstance(page, p.Wakes)
            assert [(w.id, w.state) for w in page.wakes] == [(faulty.id, "failed")]
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(bystander.id)).state == "running"
            await client.stop(bystander.id)
            assert (await client.status(bystander.id)).state == "stopped"
            assert bystander.pid is not None
            assert not alive(bystander.pid)
    assert daemon_dirs.proc is not None
    assert daemon_dirs.proc.poll() is None


async def test_a_fault_expiring_one_handle_leaves_the_others_expiring_and_the_daemon_serving(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    ttl = 3600.0
    faults = frozenset({("expire", "doomed")})
    async with in_process(short_tmp, finished_ttl=ttl, faults=faults) as d, d.client() as client:
        with held(autojump_clock):  # the workers' real runs must not run the TTL
            bystander = await client.spawn(["sleep", "100000"], name="bystander")
            doomed = await client.spawn(["true"], name="doomed")
            await client.wait(doomed.id)
            fine = await client.spawn(["true"], name="fine")
            await client.wait(fine.id)
        await trio.sleep_until(d.ended(fine.id) + ttl + 1)
        held_ids = {w.id for w in await client.ls(all=True)}
        assert held_ids == {bystander.id, doomed.id}  # the faulted handle stays, still readable
        assert (await client.status(doomed.id)).state == "finished"
        await client.stop(bystander.id)
        assert (await client.status(bystander.id)).state == "stopped"
