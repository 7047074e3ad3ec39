"""Wakes under a storm of reloads: a slow consumer of a followed wake stream, in either
client, gets every wake exactly once, and what it acknowledged no later subscriber gets.

The consumer holds each wake 50 ms while a reload lands every 0.2 s, so a wake handed
over from a page of one connection is acknowledged after the client has moved to the
next: that acknowledgement waits for the wake's redelivery there (protocol/README.md,
"Reload"). So does a caller's own `ack` of wakes it got before a reload.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from subagentd.client import AsyncClient, Client, Wake
from subagentd.protocol.errors import Busy

from .conftest import DaemonProcess
from .helpers import sh

#: Workers whose wakes the consumer takes: some ended before it subscribes, the rest in
#: batches, each let go by one reload of the storm, so every batch's wakes are posted
#: between reloads and taken, slowly, across the next.
ENDED_BEFORE = 12
BATCHES = 6
PER_BATCH = 5
HOLD = 0.05  # what the consumer spends on each wake
STORM_PAUSE = 0.2  # between one reload's answer and the next reload


def gate(daemon: DaemonProcess, batch: int) -> Path:
    return daemon.root / f"gate-{batch}"


async def reload_storm(daemon: DaemonProcess, reloads: list[int]) -> None:
    """Reload, by the real request on a connection of its own, every `STORM_PAUSE` s until
    cancelled; after each of the first `BATCHES`, let the next batch of workers end."""
    async with AsyncClient(daemon.socket) as reloader:
        while True:
            try:
                reloads.append((await reloader.reload()).image_generation)
            except Busy as exc:  # another reload just ended
                await trio.sleep(exc.retry_after or STORM_PAUSE)
                continue
            if len(reloads) <= BATCHES:
                gate(daemon, len(reloads)).touch()
            await trio.sleep(STORM_PAUSE)


async def spawn_wakers(daemon: DaemonProcess) -> tuple[str, set[str]]:
    """A run with `ENDED_BEFORE` workers ended and `BATCHES` batches waiting for their gate."""
    async with AsyncClient(daemon.socket) as spawner:
        run = await spawner.new_run()
        ids = set()
        for _ in range(ENDED_BEFORE):
            ids.add((await spawner.spawn(["true"], run=run)).id)
        for batch in range(1, BATCHES + 1):
            wait = f"while [ ! -e {gate(daemon, batch)} ]; do sleep 0.02; done"
            for _ in range(PER_BATCH):
                ids.add((await spawner.spawn(sh(wait), run=run)).id)
        return run, ids


async def storm_while(
    daemon: DaemonProcess, consume: Callable[[], Awaitable[list[Wake]]]
) -> tuple[list[Wake], list[int]]:
    """What `consume` got, and the generations the storm reloaded to while it ran."""
    reloads: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reload_storm, daemon, reloads)
        got = await consume()
        nursery.cancel_scope.cancel()
    return got, reloads


async def nothing_left(daemon: DaemonProcess, run: str) -> list[Wake]:
    """What a second subscriber, after the first stopped, gets of the run's wakes."""
    async with AsyncClient(daemon.socket) as second:
        return [wake async for wake in second.events(run=run)]


def assert_each_once(got: list[Wake], ids: set[str], reloads: list[int]) -> None:
    assert len(reloads) >= BATCHES  # each batch's wakes came after a reload of its own
    seqs = [wake.seq for wake in got]
    assert len(seqs) == len(set(seqs)), f"a wake handed over twice: {sorted(seqs)}"
    assert sorted(wake.id for wake in got) == sorted(ids)


async def test_a_slow_async_consumer_gets_each_wake_once_through_a_reload_storm(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--reload-interval", "0")
    daemon = daemon_dirs
    with trio.fail_after(120):
        run, ids = await spawn_wakers(daemon)

        async def consume() -> list[Wake]:
            got: list[Wake] = []
            async with (
                AsyncClient(daemon.socket) as client,
                contextlib.aclosing(client.events(run=run, follow=True)) as wakes,
            ):
                async for wake in wakes:
                    got.append(wake)
                    await trio.sleep(HOLD)
                    if len(got) == len(ids):
                        break
            return got

        got, reloads = await storm_while(daemon, consume)
        assert_each_once(got, ids, reloads)
        assert await nothing_left(daemon, run) == []


async def test_a_slow_blocking_consumer_gets_each_wake_once_through_a_reload_storm(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--reload-interval", "0")
    daemon = daemon_dirs
    with trio.fail_after(120):
        run, ids = await spawn_wakers(daemon)

        def consume_blocking() -> list[Wake]:
            got: list[Wake] = []
            with Client(daemon.socket, timeout=60) as client:
                wakes = client.events(run=run, follow=True)
                with contextlib.closing(wakes):
                    for wake in wakes:
                        got.append(wake)
                        time.sleep(HOLD)
                        if len(got) == len(ids):
                            break
            return got

        async def consume() -> list[Wake]:
            return await trio.to_thread.run_sync(consume_blocking, abandon_on_cancel=True)

        got, reloads = await storm_while(daemon, consume)
        assert_each_once(got, ids, reloads)
        assert await nothing_left(daemon, run) == []


async def ended_run(daemon: DaemonProcess, workers: int) -> tuple[str, set[str]]:
    """A run of `workers` workers, every one ended: its wakes all posted."""
    async with AsyncClient(daemon.socket) as spawner:
        run = await spawner.new_run()
        ids = {(await spawner.spawn(["true"], run=run)).id for _ in range(workers)}
        for worker in ids:
            await spawner.wait(worker)
    return run, ids


async def reload_from_elsewhere(daemon: DaemonProcess) -> None:
    async with AsyncClient(daemon.socket) as reloader:
        assert (await reloader.reload()).image_generation >= 2


async def test_an_async_ack_of_wakes_got_before_a_reload_is_taken_after_it(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        run, ids = await ended_run(daemon, 3)
        async with AsyncClient(daemon.socket) as client:
            got = [wake async for wake in client.events(run=run, ack=False)]
            assert {wake.id for wake in got} == ids
            await reload_from_elsewhere(daemon)  # the client's connection goes with it
            await client.ack([wake.seq for wake in got])
        assert await nothing_left(daemon, run) == []


async def test_a_blocking_ack_of_wakes_got_before_a_reload_is_taken_after_it(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        run, ids = await ended_run(daemon, 3)
        with Client(daemon.socket, timeout=30) as client:
            got = await trio.to_thread.run_sync(lambda: list(client.events(run=run, ack=False)))
            assert {wake.id for wake in got} == ids
            await reload_from_elsewhere(daemon)
            await trio.to_thread.run_sync(client.ack, [wake.seq for wake in got])
        assert await nothing_left(daemon, run) == []
