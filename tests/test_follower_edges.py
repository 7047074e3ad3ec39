"""Followers at the edges of the page budget's design (issue 24, item 6, reviewed): a
follower stalled mid-page whose worker is collected meanwhile, and a reload while an
idle follower's socket is more than half full."""

from __future__ import annotations

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, reload_on_own_connection
from .test_follower_memory import FLOOD, MIB, _in_order, _read_all, _stalled


async def test_a_follower_stalled_mid_page_of_a_worker_collected_meanwhile_gets_the_rest(
    daemon: DaemonProcess,
) -> None:
    """The page let go while its client did not read is read again to send its rest: a
    collect meanwhile must not cost the follower the bytes it was already being sent
    (the daemon had them; before the page budget it held them and sent them)."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
            async with _stalled(daemon, worker.id, 1) as (follower,):
                follower.decoder.feed(await follower.stream.receive_some(100_000))
                # The stall is the point: past HOLD_SECONDS (the daemon's real clock) the
                # page is let go.
                await trio.sleep(1.5)
                await client.collect(worker.id)
                stdout, pieces = await _read_all(follower, chunk=8192)
            assert len(stdout) == 24 * MIB
            _in_order(pieces)


async def test_a_reload_keeps_an_idle_follower_whose_socket_is_half_full(
    daemon: DaemonProcess,
) -> None:
    """A follower that read nothing of a page its socket took whole, its worker quiet: no
    frame is half sent, so the reload keeps its connection and tells it `reloading` (as
    before the page budget), rather than holding the reload KEEP_SECONDS and closing it;
    asked again from its cursor, it gets the rest, every byte once."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            script = "head -c 150000 /dev/zero; read line; head -c 1000 /dev/zero"
            worker = await client.spawn(["sh", "-c", script], stdin_open=True)
            follower = await RawConnection.open(daemon.socket)
            async with follower.stream:
                await follower.send(p.Watch(id=2, worker=worker.id, follow=True))
                await trio.lowlevel.wait_readable(follower.stream.socket)
                got = 0
                while got < 150000:  # every byte in its journal, and so sent or on its way
                    got = sum(
                        len(e.data)
                        for e in (await client.watch_page(worker.id)).entries
                        if e.kind == "stdout"
                    )
                await reload_on_own_connection(daemon)
                stdout, cursor = b"", (0, 0)
                while isinstance(reply := await follower.receive(), p.Page):
                    stdout += b"".join(e.data for e in reply.entries if e.kind == "stdout")
                    cursor = reply.next, reply.next_offset
                assert reply is not None, "the reload closed an idle follower's connection"
                assert isinstance(reply, p.Error), reply
                assert reply.code == "reloading", reply
            await client.send(worker.id, b"go\n", eof=True)
            await client.wait(worker.id)
            again = await RawConnection.open(daemon.socket)
            async with again.stream:
                since, offset = cursor
                await again.send(
                    p.Watch(id=2, worker=worker.id, since=since, offset=offset, follow=True)
                )
                rest, _ = await _read_all(again)
            assert len(stdout + rest) == 151000
            assert (stdout + rest).count(0) == 151000


async def test_followers_gone_mid_page_give_back_their_budget(daemon: DaemonProcess) -> None:
    """Followers by the hundred that read part of a page, then abort or just close (more
    than the 16 MiB budget's worth of pages begun): none keeps its share; a follower
    after them gets the whole flood."""
    with trio.fail_after(180):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
            for round_ in range(3):
                async with _stalled(daemon, worker.id, 60) as followers:
                    for n, follower in enumerate(followers):
                        follower.decoder.feed(await follower.stream.receive_some(100_000))
                        if (n + round_) % 2:
                            await follower.send(p.Abort(id=3, request=2))
            reader = await RawConnection.open(daemon.socket)
            async with reader.stream:
                await reader.send(p.Watch(id=2, worker=worker.id, follow=True))
                stdout, pieces = await _read_all(reader)
            assert len(stdout) == 24 * MIB
            _in_order(pieces)


async def test_a_reload_while_a_follower_is_stalled_mid_page_loses_it_no_byte(
    daemon: DaemonProcess,
) -> None:
    """Half a frame sent and its client not reading: the reload goes ahead (the connection
    cannot be kept mid-frame, so it is closed); asked again from its last whole page,
    the follower gets the rest, every byte once, from the next image."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
        async with _stalled(daemon, worker.id, 1) as (follower,):
            stdout, cursor = b"", (0, 0)
            decoder = follower.decoder
            while (decoder.incomplete_length or 0) < 256 * 1024:  # into a page, not through
                decoder.feed(await follower.stream.receive_some(4096))
                while (body := decoder.next_frame()) is not None:
                    page = p.daemon_decoder.decode(body)
                    assert isinstance(page, p.Page), page
                    stdout += b"".join(e.data for e in page.entries if e.kind == "stdout")
                    cursor = page.next, page.next_offset
            reply = await reload_on_own_connection(daemon)
            assert isinstance(reply, p.ReloadReply), reply
            while data := await follower.stream.receive_some(65536):
                decoder.feed(data)
                while (body := decoder.next_frame()) is not None:
                    page = p.daemon_decoder.decode(body)
                    if not isinstance(page, p.Page):
                        break
                    stdout += b"".join(e.data for e in page.entries if e.kind == "stdout")
                    cursor = page.next, page.next_offset
        again = await RawConnection.open(daemon.socket)
        async with again.stream:
            since, offset = cursor
            await again.send(
                p.Watch(id=2, worker=worker.id, since=since, offset=offset, follow=True)
            )
            rest, _ = await _read_all(again)
        assert len(stdout) + len(rest) == 24 * MIB
        assert (stdout + rest).count(0) == 24 * MIB
