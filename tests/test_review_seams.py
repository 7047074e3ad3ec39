"""Review of the seams closed in issue 24's second round: each test an attack on one."""

from __future__ import annotations

import time

import trio

from subagentd.client import Client

from .conftest import DaemonProcess
from .test_wakes_reload_storm import ended_run, nothing_left, reload_from_elsewhere

#: Far below the client's reconnect window (30 s), far above a break's own time.
LEAVE_WITHIN = 5.0


async def test_a_blocking_consumer_leaving_with_the_daemon_gone_leaves_at_once(
    daemon: DaemonProcess,
) -> None:
    """The blocking client's twin of the trio consumer's seam: a `break` out of its wake
    stream with the daemon killed acknowledges the wake in hand, and must not wait out the
    reconnect window for a daemon that refuses every connect."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> float:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    daemon.kill()
                    left = time.monotonic()
                    break
                return time.monotonic() - left

        assert await trio.to_thread.run_sync(consume) < LEAVE_WITHIN


async def test_a_blocking_consumer_leaving_across_a_reload_has_its_wake_acknowledged(
    daemon: DaemonProcess,
) -> None:
    """A reload is no daemon gone: the blocking consumer's leaving acknowledgement, made
    as its connection goes with the reload, is taken by the new image."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> float:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    trio.from_thread.run(reload_from_elsewhere, daemon)
                    left = time.monotonic()
                    break
                return time.monotonic() - left

        assert await trio.to_thread.run_sync(consume) < LEAVE_WITHIN
        assert await nothing_left(daemon, run) == []


async def test_a_blocking_consumers_leaving_ack_goes_out_at_its_next_call_after_a_restart(
    daemon: DaemonProcess,
) -> None:
    """Left to the connection with the daemon gone, the acknowledgement goes out with the
    client's next call, once a daemon serves again: the wake it had is not handed again."""
    with trio.fail_after(90):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> None:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    daemon.kill()
                    break
                daemon.start()
                client.info()  # its next call, on a new connection

        await trio.to_thread.run_sync(consume)
        assert await nothing_left(daemon, run) == []
