"""A pause and a reload together: an unpause or a pause that a reload cuts short (its
request answered `reloading`) leaves the tree as its record says, all held or none.
Without cgroups: SIGSTOP and SIGCONT over a scanned tree, the way that takes scans."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import ConnectionLost, RemoteError

from .conftest import DaemonProcess
from .helpers import sh, wait_output

#: A tree of many processes: scans to take time, children to be left behind.
SLEEPERS = 40
FORKER = f"for i in $(seq {SLEEPERS}); do sleep 600 & done; echo forked; wait"


@pytest.fixture
async def client(daemon_dirs: DaemonProcess) -> AsyncIterator[AsyncClient]:
    daemon_dirs.start("--cgroups", "off")
    async with AsyncClient(daemon_dirs.socket) as client:
        yield client


def _group_states(pgid: int) -> list[str]:
    """The states of the processes in process group `pgid` (the worker's tree)."""
    states = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
            fields = raw[raw.rindex(b")") + 2 :].split()
            if int(fields[2]) == pgid:
                states.append(fields[0].decode())
    return states


async def _quietly(request: Callable[[], Awaitable[object]]) -> None:
    """A request the reload may cut short (answered `reloading`, or its connection lost)."""
    with contextlib.suppress(RemoteError, ConnectionLost):
        await request()


async def test_an_unpause_cut_short_by_a_reload_leaves_the_tree_as_its_record_says(
    client: AsyncClient, daemon_dirs: DaemonProcess
) -> None:
    with trio.fail_after(120):
        worker = await client.spawn(sh(FORKER))
        await wait_output(client, worker.id, b"forked\n")
        assert worker.pid is not None
        for _ in range(8):
            await client.pause(worker=worker.id)
            async with AsyncClient(daemon_dirs.socket) as other, trio.open_nursery() as nursery:
                nursery.start_soon(_quietly, functools.partial(other.unpause, worker=worker.id))
                nursery.start_soon(_quietly, client.reload)
            paused = (await client.status(worker.id)).paused
            states = _group_states(worker.pid)
            assert len(states) == SLEEPERS + 1
            stopped = [s for s in states if s in ("T", "t")]
            assert len(stopped) == (len(states) if paused else 0), (paused, states)
            if paused:
                await client.unpause(worker=worker.id)


async def _paused_whole(client: AsyncClient) -> tuple[str, int]:
    """A worker of SLEEPERS children, paused: every process of it stopped."""
    worker = await client.spawn(sh(FORKER))
    await wait_output(client, worker.id, b"forked\n")
    await client.pause(worker=worker.id)
    assert worker.pid is not None
    assert set(_group_states(worker.pid)) == {"T"}
    return worker.id, worker.pid


async def test_a_reload_finding_the_leader_let_go_lets_the_whole_tree_go(
    client: AsyncClient,
) -> None:
    # As an unpause the reload cut short after the leader leaves it (or someone else's
    # SIGCONT to it alone): the new image says not paused, so nothing may stay stopped,
    # since no unpause would reach it (`already_unpaused`).
    with trio.fail_after(60):
        worker_id, pid = await _paused_whole(client)
        os.kill(pid, signal.SIGCONT)
        await client.reload()
        assert not (await client.status(worker_id)).paused
        states = _group_states(pid)
        assert len(states) == SLEEPERS + 1
        assert "T" not in states, states


async def test_a_reload_finding_the_leader_held_holds_the_whole_tree(
    client: AsyncClient,
) -> None:
    # As a pause the reload cut short before its last scan: the new image says paused,
    # so all of it is held.
    with trio.fail_after(60):
        worker_id, pid = await _paused_whole(client)
        child = next(
            int(name)
            for name in os.listdir("/proc")
            if name.isdigit() and int(name) != pid and _pgid(int(name)) == pid
        )
        os.kill(child, signal.SIGCONT)
        await client.reload()
        assert (await client.status(worker_id)).paused
        assert set(_group_states(pid)) == {"T"}


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2 :].split()[2])
