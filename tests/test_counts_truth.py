"""`info`'s counts, kept as workers change state (issue 24, item 8), against the truth: a
walk of every worker through `ls --all`, after ends, stops, a resume, a collect, a reload
and a restart after kill -9; and an `ls` cursor given before a reload, used after."""

from __future__ import annotations

import collections
import json

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, reload_on_own_connection


async def _truth(client: AsyncClient) -> dict[str, int]:
    return dict(collections.Counter(w.state for w in await client.ls(all=True)))


async def _agree(daemon: DaemonProcess, client: AsyncClient) -> dict[str, int]:
    counted = (await client.info()).workers
    walked = await _truth(client)
    assert counted == walked, (counted, walked)
    shown = daemon.ctl("ls", "--all", "--json")
    assert shown.returncode == 0, shown.stderr
    listed = [json.loads(line) for line in shown.stdout.splitlines()]
    assert dict(collections.Counter(w["state"] for w in listed)) == walked, listed
    return walked


async def test_info_counts_agree_with_a_walk_through_every_change(daemon: DaemonProcess) -> None:
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            done = [(await client.spawn(["true"], run=run)).id for _ in range(3)]
            failed = [(await client.spawn(["false"], run=run)).id for _ in range(2)]
            sleepers = [(await client.spawn(["sleep", "600"], run=run)).id for _ in range(4)]
            for worker in done + failed:
                await client.wait(worker)
            await _agree(daemon, client)
            await client.stop(sleepers[0])
            await client.stop(sleepers[1])
            await client.collect(done[0])
            await _agree(daemon, client)
            await client.resume(sleepers[0])
            await client.resume(failed[0])
            await client.wait(failed[0])
            await _agree(daemon, client)
        await reload_on_own_connection(daemon)
        async with AsyncClient(daemon.socket) as client:
            await _agree(daemon, client)
            await client.stop(sleepers[2])
            await _agree(daemon, client)
        daemon.kill()
        daemon.start()
        async with AsyncClient(daemon.socket) as client:
            await _agree(daemon, client)
            await client.stop_run(run)
            await _agree(daemon, client)


async def test_an_ls_cursor_from_before_a_reload_pages_on_after_it(daemon: DaemonProcess) -> None:
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            for _ in range(7):
                await client.wait((await client.spawn(["true"], run=run)).id)
            whole = [w.id for w in await client.ls(all=True)]
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.ListWorkers(id=2, all=True, limit=3))
            first = await conn.receive()
        assert isinstance(first, p.WorkerList), first
        assert first.next is not None
        await reload_on_own_connection(daemon)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.ListWorkers(id=2, all=True, after=first.next))
            rest = await conn.receive()
        assert isinstance(rest, p.WorkerList), rest
        assert [w.id for w in first.workers + rest.workers] == whole
