"""Wakes: every ending wakes its parent exactly once, across reconnects and crashes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, sh


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def _pending(
    daemon: DaemonProcess, run: str | None = None, worker: str | None = None
) -> list[p.Wake]:
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Subscribe(id=2, run=run, worker=worker))
        reply = await conn.receive()
        assert isinstance(reply, p.Wakes)
        assert reply.complete
        return reply.wakes


async def test_every_ending_wakes_its_parent_once(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run = await client.new_run()
        gate = daemon.root / "gate"  # `ok` lives until its child is registered
        ok = await client.spawn(
            sh(f"while [ ! -e {gate} ]; do sleep 0.02; done; echo all good"), run=run
        )
        bad = await client.spawn(sh("echo broken; exit 4"), run=run)
        child = await client.spawn(["true"], parent=ok.id)
        gate.touch()
        for w in (ok, bad, child):
            await client.wait(w.id)
        wakes = await _pending(daemon, run=run)
        assert {(w.id, w.state, w.exit_code, w.preview) for w in wakes} == {
            (ok.id, "finished", 0, "all good\n"),
            (bad.id, "failed", 4, "broken\n"),
        }
        assert all(w.run == run and w.parent is None for w in wakes)
        (delegated,) = await _pending(daemon, worker=ok.id)
        assert (delegated.id, delegated.parent, delegated.state) == (child.id, ok.id, "finished")
        # Delivered but not acknowledged: still there for the next subscriber.
        assert [w.seq for w in await _pending(daemon, run=run)] == [w.seq for w in wakes]


async def test_fifty_endings_give_fifty_wakes_each_once_across_a_reconnect(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        first = await RawConnection.open(daemon.socket)
        await first.send(p.Subscribe(id=2, run=run, follow=True))
        opening = await first.receive()
        assert isinstance(opening, p.Wakes)
        assert opening.wakes == []
        gate = daemon.root / "gate"
        workers = [
            await client.spawn(sh(f"while [ ! -e {gate} ]; do sleep 0.05; done; echo {i}"), run=run)
            for i in range(50)
        ]
        gate.touch()  # all fifty end at about the same moment
        received: list[p.Wake] = []
        while len(received) < 20:
            reply = await first.receive()
            assert isinstance(reply, p.Wakes)
            received += reply.wakes
        acked = [w.seq for w in received[:10]]
        await first.send(p.Ack(id=3, wakes=acked))
        while not isinstance(reply := await first.receive(), p.Done):  # acknowledged for sure
            assert isinstance(reply, p.Wakes)
            received += reply.wakes
        await first.stream.aclose()  # drops off with ten delivered and not acknowledged

        for w in workers:
            await client.wait(w.id)
        second = await RawConnection.open(daemon.socket)
        async with second.stream:
            await second.send(p.Subscribe(id=2, run=run))
            reply = await second.receive()
            assert isinstance(reply, p.Wakes)
            rest = reply.wakes
            assert {w.seq for w in rest}.isdisjoint(acked)
            assert len(rest) == 40
            await second.send(p.Ack(id=3, wakes=[w.seq for w in rest]))
            assert isinstance(await second.receive(), p.Done)
        ids = [w.id for w in received[:10] + rest]
        assert sorted(ids) == sorted(w.id for w in workers)
        assert await _pending(daemon, run=run) == []


async def test_acknowledging_a_wake_never_received_is_invalid(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(["true"])
        await client.wait(worker.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Ack(id=2, wakes=[1]))
            reply = await conn.receive()
            assert isinstance(reply, p.Error)
            assert reply.code == "invalid"
            await conn.send(p.Subscribe(id=3))
            reply = await conn.receive()
            assert isinstance(reply, p.Error)
            assert reply.code == "invalid"
            await conn.send(p.Subscribe(id=4, run="r-unknown"))
            reply = await conn.receive()
            assert isinstance(reply, p.Error)
            assert reply.code == "not_found"
        assert len(await _pending(daemon, run=worker.run)) == 1


async def test_unacknowledged_wakes_survive_a_crash(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            workers = [await client.spawn(["true"], run=run) for _ in range(3)]
            for w in workers:
                await client.wait(w.id)
        (first, *rest) = await _pending(daemon, run=run)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=run))
            await conn.receive()
            await conn.send(p.Ack(id=3, wakes=[first.seq]))
            assert isinstance(await conn.receive(), p.Done)
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        assert [w.seq for w in await _pending(daemon, run=run)] == [w.seq for w in rest]


async def test_more_wakes_than_a_page_holds_come_in_pages_none_lost(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    # However many wakes a parent left unacknowledged, no page is over the frame limit:
    # WAKES_PER_PAGE a page, `complete` on the last, and a client reads them all.
    from subagentd.daemon.workers._mailbox import WAKES_PER_PAGE

    with trio.fail_after(120):
        run = await client.new_run()
        workers = [await client.spawn(["true"], run=run) for _ in range(WAKES_PER_PAGE + 5)]
        for worker in workers:
            await client.wait(worker.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=run))
            pages: list[p.Wakes] = []
            while not pages or not pages[-1].complete:
                reply = await conn.receive()
                assert isinstance(reply, p.Wakes)
                pages.append(reply)
        assert [len(page.wakes) for page in pages] == [WAKES_PER_PAGE, 5]
        ids = [wake.id for page in pages for wake in page.wakes]
        assert sorted(ids) == sorted(w.id for w in workers)
        seen = [wake.id async for wake in client.events(run=run)]  # and acknowledged
        assert sorted(seen) == sorted(ids)
        assert await _pending(daemon, run=run) == []
