"""The client core's ack ledger, sans I/O: what a recall settles for later acks, and what
the ledger keeps of wakes a follower never acknowledges itself."""

from __future__ import annotations

import tracemalloc

from subagentd.client import _core
from subagentd.protocol import (
    HEADER,
    Ack,
    Done,
    Error,
    FrameDecoder,
    Reply,
    Request,
    Subscribe,
    Wake,
    Wakes,
    client_decoder,
    encode,
)

RELOADING = encode(Error(id=0, code="reloading", message="reloading; reconnect", retry_after=0.2))


def wake(seq: int) -> Wake:
    return Wake(seq=seq, id=f"w-{seq}", run="r-1", state="finished", exit_code=0, preview="ok")


def requests(data: bytes | list[bytes] | None) -> list[object]:
    decoder = FrameDecoder()
    decoder.feed(b"".join(data) if isinstance(data, list) else (data or b""))
    return [client_decoder.decode(body) for body in decoder.frames()]


def reconnect(conn: _core.Connection) -> list[Request[Reply]]:
    assert conn.reconnecting
    return [client_decoder.decode(data[HEADER.size :]) for data in conn.reconnected()]


def followed(conn: _core.Connection) -> int:
    subscription = _core.WakeSubscription(run="r-1", follow=True)
    stream, _ = conn.send(subscription.request(), again=subscription.request)
    return stream


def test_a_later_ack_of_a_wake_a_recall_found_acknowledged_is_done_without_sending() -> None:
    conn = _core.Connection(reconnect=True)
    stream = followed(conn)
    delivered = [wake(seq) for seq in (1, 2, 3, 4)]
    conn.receive_data(encode(Wakes(id=stream, wakes=delivered)) + RELOADING)
    reconnect(conn)
    first, data = conn.send(_core.ack([1]).request)
    [recall] = requests(data)
    assert isinstance(recall, Subscribe)
    # Another client acknowledged wakes 2 and 4 meanwhile: the recall brings 1 and 3 only.
    conn.receive_data(encode(Wakes(id=recall.id, wakes=[wake(1), wake(3)], complete=True)))
    assert requests(conn.outgoing()) == [Ack(id=first, wakes=[1])]
    second, data = conn.send(_core.ack([2]).request)
    assert data is None  # the new connection never had wake 2: it would refuse it
    assert conn.next_reply(second) == Done(id=second)
    third, data = conn.send(_core.ack([4, 3]).request)  # 4 settled, 3 delivered here
    assert requests(data) == [Ack(id=third, wakes=[3])]


#: Wakes a follower is handed and others acknowledge, in each half of the measure.
HALF = 50_000
PAGE = 1_000


def retained_after(conn: _core.Connection, stream: int, seqs: range) -> int:
    for at in range(seqs.start, seqs.stop, PAGE):
        page = [wake(seq) for seq in range(at, min(at + PAGE, seqs.stop))]
        conn.receive_data(encode(Wakes(id=stream, wakes=page)))
        assert conn.next_reply(stream) is not None  # the caller takes every page
    return tracemalloc.get_traced_memory()[0]


def test_a_follower_whose_wakes_others_acknowledge_keeps_bounded_memory() -> None:
    conn = _core.Connection(reconnect=True)
    stream = followed(conn)
    tracemalloc.start()
    try:
        first = retained_after(conn, stream, range(1, HALF + 1))
        second = retained_after(conn, stream, range(HALF + 1, 2 * HALF + 1))
    finally:
        tracemalloc.stop()
    # Another HALF wakes handed over and acknowledged elsewhere cost (about) nothing more.
    assert second - first < 1024 * 1024
