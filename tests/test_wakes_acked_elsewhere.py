"""Wakes of one parent acknowledged by another client while this one reconnected.

A client that got wakes before a reload has an `ack` of them wait for their
redelivery (a recall of their parent, protocol/README.md "Acknowledging across a
reconnect"). A wake the recall did not bring again was acknowledged by someone
else: this client's later `ack` of it is done, in either client, whether it comes
in the same call as the one that made the recall or in a later one.
"""

from __future__ import annotations

import trio

from subagentd.client import AsyncClient, Client, Wake

from .conftest import DaemonProcess
from .test_wakes_reload_storm import ended_run, nothing_left, reload_from_elsewhere


async def acknowledged_by_another(daemon: DaemonProcess, run: str, seq: int) -> None:
    """Another client, on a connection of its own, takes wake `seq` of `run` and acks it."""
    async with AsyncClient(daemon.socket) as other:
        got = [wake async for wake in other.events(run=run, ack=False)]
        assert seq in {wake.seq for wake in got}
        await other.ack([seq])


def by_seq(wakes: list[Wake]) -> list[Wake]:
    return sorted(wakes, key=lambda wake: wake.seq)


async def test_an_async_ack_of_a_wake_another_client_took_during_a_reload_is_done(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 2)
        async with AsyncClient(daemon.socket) as client:
            first, second = by_seq([wake async for wake in client.events(run=run, ack=False)])
            await reload_from_elsewhere(daemon)  # the client's connection goes with it
            await acknowledged_by_another(daemon, run, second.seq)
            await client.ack([first.seq])  # its recall finds `second` acknowledged already
            await client.ack([second.seq])  # so this one is done, not refused
        assert await nothing_left(daemon, run) == []


async def test_a_blocking_ack_of_a_wake_another_client_took_during_a_reload_is_done(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 2)
        with Client(daemon.socket, timeout=30) as client:
            got = await trio.to_thread.run_sync(lambda: list(client.events(run=run, ack=False)))
            first, second = by_seq(got)
            await reload_from_elsewhere(daemon)
            await acknowledged_by_another(daemon, run, second.seq)
            await trio.to_thread.run_sync(client.ack, [first.seq])
            await trio.to_thread.run_sync(client.ack, [second.seq])
        assert await nothing_left(daemon, run) == []
