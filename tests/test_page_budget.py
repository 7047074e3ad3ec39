"""The page budget followed pages share (serving/_outgoing.py): first come, first served,
never more than its total out, and nothing of it lost to a cancel."""

from __future__ import annotations

import socket

import msgspec
import pytest
import trio
import trio.testing

from subagentd import protocol as p
from subagentd.daemon.core._session import Session
from subagentd.daemon.serving._outgoing import (
    MIN_PAGE_BYTES,
    PageBudget,
    Reservation,
    room,
)
from subagentd.daemon.serving._server import HOLD_SECONDS, Connection
from subagentd.daemon.workers._reader import PageInHand


async def test_waiters_are_served_in_the_order_they_asked() -> None:
    budget = PageBudget(100)
    order: list[str] = []
    assert await budget.reserve(90) == 90

    async def ask(name: str, size: int) -> None:
        order.append(name + " asks")
        await budget.reserve(size)
        order.append(name + " has")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "big", 60)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask, "small", 5)  # would fit now, but waits its turn
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["big asks", "small asks"]
        budget.release(50)  # 60 free: big's turn, and then none left for small
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["big asks", "small asks", "big has"]
        budget.release(5)
    assert order == ["big asks", "small asks", "big has", "small has"]
    assert budget.free == 0


async def test_a_cancelled_waiter_lets_those_after_it_through_and_keeps_nothing() -> None:
    budget = PageBudget(100)
    await budget.reserve(50)
    got: list[int] = []
    first = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_reserve_in, first, budget, 80, got)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_reserve_in, trio.CancelScope(), budget, 40, got)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # 40 would fit, but waits behind 80
        first.cancel()
    assert got == [40]
    assert budget.free == 10
    budget.release(50)
    budget.release(40)
    assert budget.free == 100


async def _reserve_in(
    scope: trio.CancelScope, budget: PageBudget, size: int, got: list[int]
) -> None:
    with scope:
        got.append(await budget.reserve(size))


async def test_a_cancel_at_once_takes_nothing() -> None:
    budget = PageBudget(100)
    with trio.CancelScope() as scope:
        scope.cancel()
        await budget.reserve(10)
    assert budget.free == 100


@pytest.mark.parametrize("size", [0, 1, 100, 10**12])
async def test_a_reservation_is_at_most_the_whole_budget(size: int) -> None:
    budget = PageBudget(100)
    held = Reservation(budget)
    await held.take(size)
    assert held.size == min(size, 100)
    assert held.grow_nowait(10**12)  # the whole budget, no more
    assert held.size == 100
    held.release()
    held.release()  # once only
    assert budget.free == 100


def test_a_reservation_grows_only_into_what_is_free_and_nobody_waits_for() -> None:
    budget = PageBudget(100)
    assert budget.reserve_nowait(70)
    held = Reservation(budget)
    assert held.grow_nowait(30)
    assert not held.grow_nowait(31)
    assert held.size == 30


@pytest.mark.parametrize(
    ("buffer", "in_use", "expected"),
    [(212992, 0, 212992 - 64), (212992, 212992, MIN_PAGE_BYTES), (4096, 0, MIN_PAGE_BYTES)],
)
def test_the_room_of_a_socket_is_what_its_buffer_has_free(
    buffer: int, in_use: int, expected: int
) -> None:
    assert room(buffer, in_use) == expected


def _connection(sock: trio.socket.SocketType) -> Connection:
    session = Session(lambda token: None, pid=1, daemon_version="test", frame_limit=1 << 24)
    return Connection(stream=trio.SocketStream(sock), conn_id=1, session=session)


def _page(size: int) -> p.Page:
    entry = p.Entry(seq=1, kind="stdout", data=b"z" * size, at=1.5)
    return p.Page(id=0, entries=[entry], next=1, next_offset=0, complete=True)


async def test_a_page_its_socket_stops_taking_is_let_go_then_read_again_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The rest of a page the socket took part of is kept HOLD_SECONDS (its bytes in the
    budget), then let go (the budget back); once its client reads, it is read again and
    the rest sent: the client gets the one frame, whole."""
    daemon_end, client_end = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = _connection(daemon_end)
    budget = PageBudget(16 * 1024 * 1024)
    held = Reservation(budget)
    reads_again = 0

    async def again() -> p.Page:
        nonlocal reads_again
        reads_again += 1
        return _page(600_000)

    expected = p.encode(msgspec.structs.replace(_page(600_000), id=7))
    with daemon_end, client_end:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.send_page, PageInHand(_page(600_000), again), 7, held)
            await trio.sleep(HOLD_SECONDS / 2)
            assert budget.free < budget.total  # the rest kept, and counted
            await trio.sleep(HOLD_SECONDS)
            assert budget.free == budget.total  # let go
            assert reads_again == 0
            received = b""
            while len(received) < len(expected):
                received += await client_end.recv(1 << 20)
    assert reads_again == 1
    assert received == expected
