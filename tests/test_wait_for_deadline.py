"""A pattern wait keeps one deadline across reloads: the client fixes it when it first
sends the wait-for and, sending it again after a reload, asks for the time left, never
the whole time a second time. The arithmetic is the sans-I/O core's (its shells pass
their clock as ``now``); end to end, a wait that never matches returns at its timeout,
through the trio client and through subagentctl, however many reloads came meanwhile.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import trio

from subagentd.client import AsyncClient, _core
from subagentd.protocol import (
    HEADER,
    Error,
    Reply,
    Request,
    WaitFor,
    WaitForReply,
    WaitForResult,
    WorkerView,
    client_decoder,
    encode,
)

from .conftest import DaemonProcess

RELOADING = encode(Error(id=0, code="reloading", message="reloading; reconnect", retry_after=0.2))
WORKER = WorkerView(id="w-1", run="r-1", state="running", started_at=0.0)


def sent(frames: list[bytes]) -> list[Request[Reply]]:
    return [client_decoder.decode(data[HEADER.size :]) for data in frames]


def test_the_time_left_counts_down_to_the_deadline_and_stops_at_zero() -> None:
    assert _core.time_left(110.0, 100.0) == 10.0
    assert _core.time_left(110.0, 110.0) == 0.0
    assert _core.time_left(110.0, 150.0) == 0.0  # past it: 0, a wait-for that looks once


def test_a_wait_for_sent_again_after_each_reload_asks_for_the_time_left() -> None:
    conn = _core.Connection(reconnect=True)
    asked, frame = conn.send(WaitFor(id=0, worker="w-1", pattern="x", timeout=10.0), now=100.0)
    assert frame is not None
    assert sent([frame]) == [WaitFor(id=asked, worker="w-1", pattern="x", timeout=10.0)]
    times = []
    for told, reconnected in ((103.0, 104.5), (108.0, 109.0), (111.0, 112.0)):
        conn.receive_data(RELOADING, now=told)
        assert conn.reconnecting
        [again] = sent(conn.reconnected(now=reconnected))
        assert isinstance(again, WaitFor)
        assert (again.id, again.pattern) == (asked, "x")
        times.append(again.timeout)
    assert times == [5.5, 1.0, 0.0]  # the deadline stays at 110, whatever the reloads
    conn.receive_data(encode(WaitForReply(id=asked, result=_timed_out())), now=112.0)
    assert conn.next_reply(asked) == WaitForReply(id=asked, result=_timed_out())


def test_a_wait_for_answered_reloading_under_its_own_id_asks_for_the_time_left() -> None:
    conn = _core.Connection(reconnect=True)
    asked, _ = conn.send(WaitFor(id=0, worker="w-1", pattern="x", timeout=30.0), now=50.0)
    refusal = Error(id=asked, code="reloading", message="send it again", retry_after=0.2)
    conn.receive_data(encode(refusal), now=62.5)
    assert conn.next_reply(asked) is None
    assert sent(conn.outgoing()) == [WaitFor(id=asked, worker="w-1", pattern="x", timeout=17.5)]


def test_a_wait_for_made_while_reconnecting_counts_its_time_from_when_it_was_made() -> None:
    conn = _core.Connection(reconnect=True)
    conn.send(WaitFor(id=0, worker="w-1", pattern="x", timeout=5.0), now=0.0)
    conn.receive_data(RELOADING, now=1.0)
    made, frame = conn.send(WaitFor(id=0, worker="w-2", pattern="y", timeout=8.0), now=2.0)
    assert frame is None  # goes out on the new connection
    by_worker = {r.worker: r for r in sent(conn.reconnected(now=4.0)) if isinstance(r, WaitFor)}
    assert (by_worker["w-1"].timeout, by_worker["w-2"].timeout) == (1.0, 6.0)
    assert by_worker["w-2"].id == made


def test_a_wait_for_needs_the_shells_clock_and_one_that_looks_once_does_not() -> None:
    conn = _core.Connection(reconnect=True)
    with pytest.raises(TypeError, match="now="):
        conn.send(WaitFor(id=0, worker="w-1", pattern="x", timeout=5.0))
    looked, _ = conn.send(WaitFor(id=0, worker="w-1", pattern="x", timeout=0.0))
    conn.receive_data(RELOADING)
    assert sent(conn.reconnected()) == [WaitFor(id=looked, worker="w-1", pattern="x", timeout=0)]


def _timed_out() -> WaitForResult:
    return WaitForResult(outcome="timed_out", worker=WORKER)


# -- end to end: a real daemon, real reloads --------------------------------------------

TIMEOUT = 6.0
#: The reloads come this far apart, from the wait's start: a client that asked for the
#: whole time again after the last would return this much late, at least.
SPACING = 1.0
#: What a wait may take past its deadline here (a loaded machine, the last reload's
#: pause): well below what starting the timeout over would cost.
SLACK = 1.5


async def reload_twice_while_waiting(daemon: DaemonProcess) -> float:
    """Two reloads, each on a connection of its own, SPACING apart (the spacing is the
    scenario: time passing in a wait); answers when the last one served, on trio's clock."""
    for _ in range(2):
        await trio.sleep(SPACING)
        async with AsyncClient(daemon.socket) as other:
            await other.reload()
    return trio.current_time()


async def test_a_pattern_wait_keeps_its_deadline_across_two_reloads(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "1000"])
            start = trio.current_time()
            results: list[WaitForResult] = []
            ended: list[float] = []
            async with trio.open_nursery() as nursery:

                async def wait_for() -> None:
                    results.append(await client.wait_for(worker.id, "never", timeout=TIMEOUT))
                    ended.append(trio.current_time())

                nursery.start_soon(wait_for)
                reloaded = await reload_twice_while_waiting(daemon)
            assert (await client.info()).image_generation == 3
            await client.stop(worker.id)
    [result] = results
    assert result.outcome == "timed_out"
    took, last_reload = ended[0] - start, reloaded - start
    assert took >= TIMEOUT - 0.5
    # Starting over after the last reload would take at least last_reload + TIMEOUT.
    assert took < max(TIMEOUT, last_reload) + SLACK < last_reload + TIMEOUT


async def test_subagentctl_wait_for_keeps_its_deadline_across_two_reloads(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "1000"])
            async with trio.open_nursery() as nursery:
                start = time.monotonic()
                done: list[tuple[subprocess.CompletedProcess[str], float]] = []

                async def wait() -> None:
                    waited = await trio.to_thread.run_sync(
                        lambda: daemon.ctl(
                            "wait", worker.id, "--for", "never", "--timeout", str(TIMEOUT)
                        )
                    )
                    done.append((waited, time.monotonic()))

                nursery.start_soon(wait)
                await reload_twice_while_waiting(daemon)
                last_reload = time.monotonic() - start
            await client.stop(worker.id)
    [(waited, finished)] = done
    assert waited.returncode == 5, waited.stderr  # timed out
    assert "timed out" in waited.stderr
    took = finished - start
    assert took >= TIMEOUT - 0.5
    assert took < max(TIMEOUT, last_reload) + SLACK < last_reload + TIMEOUT
