"""Wakes of one parent acknowledged by another client while this one reconnected.

A client that got wakes before a reload has an `ack` of them wait for their
redelivery (a recall of their parent, protocol/README.md "Acknowledging across a
reconnect"). A wake the recall did not bring again was acknowledged by someone
else: this client's later `ack` of it is done, in either client, whether it comes
in the same call as the one that made the recall or in a later one. Two slow consumers
following one run through a reload storm acknowledge each other's wakes so.
"""

from __future__ import annotations

import contextlib

import trio

from subagentd.client import AsyncClient, Client, Wake

from .conftest import DaemonProcess
from .test_wakes_reload_storm import (
    HOLD,
    ended_run,
    nothing_left,
    reload_from_elsewhere,
    spawn_wakers,
    storm_while,
)


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


async def test_two_slow_consumers_of_one_run_ack_each_others_wakes_through_a_reload_storm(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--reload-interval", "0")
    daemon = daemon_dirs
    with trio.fail_after(150):
        run, ids = await spawn_wakers(daemon)
        got: dict[str, list[Wake]] = {"one": [], "other": []}

        async def consume() -> list[Wake]:
            async def follow(name: str, all_handed: trio.CancelScope) -> None:
                async with (
                    AsyncClient(daemon.socket) as client,
                    contextlib.aclosing(client.events(run=run, follow=True)) as wakes,
                ):
                    async for wake in wakes:
                        got[name].append(wake)
                        await trio.sleep(HOLD)
                        if {w.id for w in got["one"] + got["other"]} == ids:
                            all_handed.cancel()

            async with trio.open_nursery() as consumers:
                for name in got:
                    consumers.start_soon(follow, name, consumers.cancel_scope)
            return got["one"] + got["other"]

        handed, reloads = await storm_while(daemon, consume)
        assert len(reloads) >= 1
        for wakes in got.values():  # each consumer was handed each wake at most once
            assert len(wakes) == len({wake.seq for wake in wakes})
        assert {wake.id for wake in handed} == ids
        assert await nothing_left(daemon, run) == []
