"""A pause's journal: every `paused` entry is followed by its `unpaused`, whatever ends
the pause (an unpause, a stop, the worker's own ending, a reload that finds it let go, a
crash's recovery). Real processes, each way of tracking trees."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol.errors import Refused

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .pausing import COUNTER, cgroup_of


@pytest.fixture
async def client(tracking: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(tracking.socket) as client:
        yield client


async def _states(client: AsyncClient, worker_id: str) -> list[bytes]:
    """The `state` entries of its journal, each's first word."""
    entries: list[p.Entry] = []
    since = 0
    while True:
        page = await client.watch_page(worker_id, since=since)
        entries += page.entries
        if page.complete or page.next == since:
            break
        since = page.next
    return [e.data.split()[0] for e in entries if e.kind == "state"]


def _pause_entries(states: list[bytes]) -> list[bytes]:
    return [s for s in states if s in (b"paused", b"unpaused")]


async def test_a_paused_worker_ending_by_itself_journals_its_pause_ended(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(sh(COUNTER))
        await wait_output(client, worker.id, b"2\n")
        await client.pause(worker=worker.id)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)  # a fatal signal ends even a held process
        ended = await client.wait(worker.id)
        assert (ended.state, ended.paused) == ("failed", False)
        states = await _states(client, worker.id)
        assert _pause_entries(states) == [b"paused", b"unpaused"], states
        assert states.index(b"unpaused") < len(states) - 1  # before its ending's entry


async def test_a_stopped_paused_worker_journals_its_pause_ended(client: AsyncClient) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(sh(f"trap 'exit 0' TERM; {COUNTER}"))
        await wait_output(client, worker.id, b"2\n")
        await client.pause(worker=worker.id)
        assert await client.stop(worker.id)
        states = await _states(client, worker.id)
        assert _pause_entries(states) == [b"paused", b"unpaused"], states


async def test_a_pause_let_go_behind_the_daemons_back_is_journaled_ended_at_a_reload(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        worker = await client.spawn(sh(COUNTER))
        await wait_output(client, worker.id, b"2\n")
        await client.pause(worker=worker.id)
        # Let go by someone else (the user, root): the cgroup thawed, the tree continued.
        group = cgroup_of(info, worker.id)
        if group is not None:
            (group / "cgroup.freeze").write_bytes(b"0")
        assert worker.pid is not None
        os.killpg(worker.pid, signal.SIGCONT)
        await client.reload()
        assert not (await client.status(worker.id)).paused
        states = await _states(client, worker.id)
        assert _pause_entries(states) == [b"paused", b"unpaused"], states


async def test_a_crash_with_a_paused_worker_journals_its_pause_ended(
    tracking: DaemonProcess,
) -> None:
    with trio.fail_after(40):
        async with AsyncClient(tracking.socket) as client:
            worker = await client.spawn(sh(COUNTER))
            await wait_output(client, worker.id, b"2\n")
            await client.pause(worker=worker.id)
        await trio.to_thread.run_sync(tracking.kill)
        await trio.to_thread.run_sync(tracking.start)
        async with AsyncClient(tracking.socket) as client:
            ended = await client.status(worker.id)
            assert (ended.state, ended.paused) == ("interrupted", False)
            states = await _states(client, worker.id)
        assert _pause_entries(states) == [b"paused", b"unpaused"], states


async def test_a_worker_whose_tree_is_being_ended_is_not_paused(client: AsyncClient) -> None:
    # Its own process exited; what is left of its tree takes its TERM (and says so) and
    # runs on through the grace. A pause now would be journaled with no end before the
    # worker's ending: it is refused, as for a worker being stopped.
    stubborn = "trap 'echo got TERM' TERM; echo child; while :; do sleep 0.05; done"
    with trio.fail_after(30):
        worker = await client.spawn(sh(f"({stubborn}) & exec sleep 0.2"), grace=2)
        await wait_output(client, worker.id, b"got TERM\n")
        with pytest.raises(Refused, match="nothing running"):
            await client.pause(worker=worker.id)
        ended = await client.wait(worker.id)
        assert not ended.paused
        states = await _states(client, worker.id)
        assert _pause_entries(states) == [], states
