"""A trio consumer of wakes cancelled while the daemon is gone leaves at once.

Leaving a wake stream with a wake in hand acknowledges it (shielded, so that a cancel
does not lose the acknowledgement of a wake the caller got). With the daemon gone
(kill -9, nothing serving), that acknowledgement cannot be made: the caller leaves
anyway, at once, and the wake stays pending for the next subscriber (at least once),
unless the client gets back to a daemon while it is open: the acknowledgement, left to
its connection, then goes out.
"""

from __future__ import annotations

import contextlib

import trio

from subagentd.client import AsyncClient, _core

from .conftest import DaemonProcess
from .test_client_acks import Daemon
from .test_wakes_reload_storm import ended_run, nothing_left, reload_from_elsewhere

#: Far below the client's reconnect window (30 s), far above a cancel's own time.
LEAVE_WITHIN = 5.0


async def test_an_async_consumer_cancelled_with_the_daemon_gone_leaves_at_once(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)
        async with AsyncClient(daemon.socket) as client:
            with trio.CancelScope() as scope:
                async with contextlib.aclosing(client.events(run=run, follow=True)) as wakes:
                    async for _wake in wakes:
                        daemon.kill()
                        scope.cancel()
                        cancelled_at = trio.current_time()
                        await trio.sleep_forever()
            left_after = trio.current_time() - cancelled_at
        assert left_after < LEAVE_WITHIN


async def test_a_consumer_cancelled_across_a_reload_still_has_its_wake_acknowledged(
    daemon: DaemonProcess,
) -> None:
    """A reload is no daemon gone: the acknowledgement of the wake in hand, made while the
    client reconnects to the new image, is answered within the leaving bound, and no
    subscriber gets that wake again."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)
        async with AsyncClient(daemon.socket) as client:
            with trio.CancelScope() as scope:
                async with contextlib.aclosing(client.events(run=run, follow=True)) as wakes:
                    async for _wake in wakes:
                        await reload_from_elsewhere(daemon)  # this connection goes with it
                        scope.cancel()
                        cancelled_at = trio.current_time()
                        await trio.sleep_forever()
            assert trio.current_time() - cancelled_at < LEAVE_WITHIN
        assert await nothing_left(daemon, run) == []


def test_an_ack_left_to_the_connection_goes_out_once_it_is_back() -> None:
    """The core's side of leaving at once: an acknowledgement made while reconnecting and
    detached by its caller still goes out on the next connection (after the recall that
    delivers its wake there again), and its answer is taken in, with nobody to read it;
    if the conversation never comes back, it is simply gone (the wake stays pending)."""
    for back in (True, False):
        daemon = Daemon()
        conn = _core.Connection(reconnect=True)
        subscription = _core.WakeSubscription(run="r-1", follow=True)
        stream, frame = conn.send(subscription.request(), again=subscription.request)
        daemon.take_frames(frame)
        daemon.read_one()
        daemon.post()
        conn.receive_data(b"".join(daemon.replies))
        daemon.replies.clear()
        got = []
        while (reply := conn.next_reply(stream)) is not None:
            got += subscription.take(reply)
        (wake,) = got
        conn.connection_lost(ConnectionResetError())  # the daemon gone under it
        assert conn.reconnecting
        ack, frame = conn.send(_core.ack([wake.seq]).request)
        assert frame is None  # nothing goes out before a new connection
        conn.detach(ack)
        assert conn.abort(stream) is None
        daemon.reload()
        if not back:
            conn.reconnect_failed(ConnectionRefusedError())
            assert wake.seq in daemon.queue.pending  # at least once: for the next subscriber
            continue
        daemon.take_frames(conn.reconnected())
        while daemon.unread or daemon.replies:
            while daemon.unread:
                daemon.read_one()
            conn.receive_data(b"".join(daemon.replies))
            daemon.replies.clear()
            daemon.take_frames(conn.outgoing())
        assert daemon.refused == []
        assert daemon.queue.pending == {}  # acknowledged, by nobody waiting
        assert not conn.reconnecting
        assert not conn.closed
