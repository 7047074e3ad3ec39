"""The server's connection core (`daemon/_session.py`), tested by calling it: no socket, no trio.

Each test feeds a `Session` bytes as a client would send them and checks what it says
to do; the hypothesis test feeds it anything, split anywhere.
"""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from subagentd import protocol as p
from subagentd.daemon.core._session import (
    BUDGETED_FROM,
    FRAME_MIN_RATE,
    FRAME_SECONDS,
    MAX_IN_FLIGHT,
    Close,
    Event,
    Release,
    Session,
    salvage_id,
)
from subagentd.protocol.errors import ErrorCode, FrameTooLarge, Invalid

TOKENS = {"tok-w1": "w1"}


def session(*, welcomed: bool = False, frame_limit: int = p.DEFAULT_FRAME_LIMIT) -> Session:
    return Session(
        TOKENS.get, pid=4242, daemon_version="9.9", frame_limit=frame_limit, welcomed=welcomed
    )


def events(s: Session, *messages: p.Request[p.Reply] | bytes) -> list[Event]:
    """Feed `messages` (bytes as they are) and take every event they make."""
    for message in messages:
        s.receive(message if isinstance(message, bytes) else p.encode(message))
    out: list[Event] = []
    while (event := s.next_event()) is not None:
        out.append(event)
    return out


def welcomed() -> Session:
    s = session()
    [welcome] = events(s, p.Hello(id=1))
    assert isinstance(welcome, p.Welcome)
    return s


def test_hello_is_welcomed_with_the_daemon_and_the_worker_it_acts_as() -> None:
    s = session()
    [welcome] = events(s, p.Hello(id=1, token="tok-w1"))
    assert welcome == p.Welcome(
        id=1, version=p.PROTOCOL_VERSION, daemon_version="9.9", pid=4242, worker="w1"
    )
    assert s.caller == "w1"


def test_hello_of_another_version_is_refused_and_closes() -> None:
    s = session()
    [close] = events(s, p.Hello(id=1, version=p.PROTOCOL_VERSION + 1), p.Info(id=2))
    assert isinstance(close, Close)
    assert close.error.id == 1
    assert close.error.code == ErrorCode.UNSUPPORTED_VERSION
    assert events(s, p.Info(id=3)) == []  # nothing after the last word


def test_hello_with_an_unknown_token_is_forbidden() -> None:
    [close] = events(session(), p.Hello(id=1, token="tok-gone"))
    assert isinstance(close, Close)
    assert close.error.code == ErrorCode.FORBIDDEN


def test_request_before_hello_is_refused_and_closes() -> None:
    [close] = events(session(), p.Info(id=5))
    assert isinstance(close, Close)
    assert (close.error.id, close.error.code) == (5, ErrorCode.INVALID)
    assert "opens with hello" in close.error.message


def test_first_message_that_does_not_decode_closes_with_the_id_it_could_read() -> None:
    body = msgspec.msgpack.encode({"op": "nonsense", "id": 9})
    [close] = events(session(), p.frame(body))
    assert isinstance(close, Close)
    assert (close.error.id, close.error.code) == (9, ErrorCode.INVALID)


def test_a_second_hello_is_invalid_and_the_connection_goes_on() -> None:
    s = welcomed()
    [error, info] = events(s, p.Hello(id=2), p.Info(id=3))
    assert isinstance(error, p.Error)
    assert (error.id, error.code) == (2, ErrorCode.INVALID)
    assert info == p.Info(id=3)


def test_malformed_message_after_hello_is_answered_and_the_connection_goes_on() -> None:
    s = welcomed()
    [error, info] = events(s, p.frame(b"\xc1"), p.Info(id=3))
    assert isinstance(error, p.Error)
    assert (error.id, error.code) == (0, ErrorCode.INVALID)
    assert info == p.Info(id=3)


def test_duplicate_id_in_flight_is_invalid_and_the_first_stays_in_flight() -> None:
    s = welcomed()
    assert events(s, p.Wait(id=7, worker="w")) == [p.Wait(id=7, worker="w")]
    [error] = events(s, p.Status(id=7, worker="w"))
    assert isinstance(error, p.Error)
    assert (error.id, error.code) == (7, ErrorCode.INVALID)
    assert list(s.in_flight) == [7]
    s.finished(7)
    assert events(s, p.Status(id=7, worker="w")) == [p.Status(id=7, worker="w")]  # free again


def test_the_257th_request_in_flight_is_busy_and_an_abort_still_gets_in() -> None:
    s = welcomed()
    admitted = events(s, *(p.Wait(id=i, worker="w") for i in range(2, 2 + MAX_IN_FLIGHT)))
    assert len(admitted) == MAX_IN_FLIGHT
    [busy] = events(s, p.Wait(id=1000, worker="w"))
    assert isinstance(busy, p.Error)
    assert (busy.id, busy.code) == (1000, ErrorCode.BUSY)
    abort = p.Abort(id=1001, request=2)
    assert events(s, abort) == [abort]
    s.finished(2)  # aborted
    s.finished(1001)  # and its abort answered: a place came free
    assert events(s, p.Wait(id=1000, worker="w")) == [p.Wait(id=1000, worker="w")]


def test_abort_of_an_id_not_in_flight_is_done_at_once() -> None:
    s = welcomed()
    assert events(s, p.Abort(id=3, request=99)) == [p.Done(id=3)]
    assert events(s, p.Abort(id=4, request=4)) == [p.Done(id=4)]  # itself: not in flight before
    assert not s.in_flight


def test_ack_of_a_wake_not_delivered_here_is_invalid() -> None:
    s = welcomed()
    s.delivered_wakes([10, 11])
    with pytest.raises(Invalid, match=r"\[12\]"):
        s.check_ack([10, 12])
    s.check_ack([10, 11])
    s.acked([10])
    assert s.delivered == {11}
    with pytest.raises(Invalid):
        s.check_ack([10])  # acknowledged once: no more


def test_a_large_frame_waits_for_its_reservation_and_gives_it_back_whole() -> None:
    s = welcomed()
    frame = p.encode(p.Spawn(id=2, argv=["x"], input=b"a" * (2 * BUDGETED_FROM)))
    length = len(frame) - p.HEADER.size
    assert events(s, frame[:100]) == []
    assert s.wanted_reservation() == length
    s.reserve(length, now=50.0)
    assert s.deadline == 50.0 + FRAME_SECONDS + length / FRAME_MIN_RATE
    assert s.wanted_reservation() is None  # held: not asked twice
    release, spawn = events(s, frame[100:])
    assert release == Release(length)
    assert isinstance(spawn, p.Spawn)
    assert (s.reserved, s.deadline) == (0, math.inf)


def test_a_large_frame_overdue_closes_with_what_was_allowed() -> None:
    s = welcomed()
    s.receive(p.HEADER.pack(10 * FRAME_MIN_RATE))
    s.reserve(s.wanted_reservation() or 0, now=0.0)
    close = s.overdue()
    assert close.error.code == ErrorCode.INVALID
    assert f"within {FRAME_SECONDS + 10:.0f} s" in close.error.message
    assert s.next_event() is None
    assert s.give_back() == 10 * FRAME_MIN_RATE  # the shell releases what it held


def test_a_frame_over_the_limit_closes_too_large() -> None:
    s = session(frame_limit=1000)
    [_welcome, close] = events(s, p.Hello(id=1), p.HEADER.pack(1001))
    assert isinstance(close, Close)
    assert (close.error.id, close.error.code) == (0, ErrorCode.TOO_LARGE)


def test_kept_by_a_reload_salvages_a_half_frame_and_owes_each_request_in_flight() -> None:
    s = welcomed()
    info = p.encode(p.Info(id=9))
    events(s, p.Wait(id=2, worker="w"), p.Reload(id=3), p.Stop(id=4, worker="w"))
    s.receive(info[:5])  # a frame half arrived
    s.keep()
    s.receive(info[5:])
    assert s.next_event() is None  # kept: nothing more is taken here
    assert s.unread() == info  # the next image reads it whole
    cut = s.cut_off(reloads=[3])
    assert cut == [2, 4]
    s.finished(2)  # ended by the seal, with no answer
    s.finished(4, unsent=p.Stopped(id=4, found=True, stopped=["w"]))  # cut off with one
    owed = s.owed(cut, retry_after=0.2)
    again = owed[0]
    assert isinstance(again, p.Error)
    assert (again.id, again.code, again.retry_after) == (2, ErrorCode.RELOADING, 0.2)
    assert owed[1] == p.Stopped(id=4, found=True, stopped=["w"])
    assert list(s.in_flight) == [3]


def test_a_session_handed_over_by_a_reload_reads_its_unread_bytes_first() -> None:
    info = p.encode(p.Info(id=9))
    s = Session(
        TOKENS.get,
        pid=1,
        daemon_version="9.9",
        frame_limit=p.DEFAULT_FRAME_LIMIT,
        welcomed=True,
        unread=info[:5],
        delivered=[3],
    )
    assert events(s, info[5:]) == [p.Info(id=9)]
    s.check_ack([3])  # delivered by the image before: still acknowledgeable here


def test_salvage_id_reads_what_it_can() -> None:
    assert salvage_id(msgspec.msgpack.encode({"op": "x", "id": 12})) == 12
    assert salvage_id(msgspec.msgpack.encode({"id": "12"})) == 0
    assert salvage_id(msgspec.msgpack.encode([1, 2])) == 0
    assert salvage_id(b"\xc1") == 0


# -- anything, split anywhere ---------------------------------------------------------

_REQUESTS = st.one_of(
    st.builds(p.Hello, id=st.integers(1, 6)),
    st.builds(p.Info, id=st.integers(1, 6)),
    st.builds(p.Wait, id=st.integers(1, 6), worker=st.just("w")),
    st.builds(p.Abort, id=st.integers(1, 6), request=st.integers(1, 6)),
    st.builds(p.Ack, id=st.integers(1, 6), wakes=st.lists(st.integers(0, 3), max_size=3)),
)
_PIECES = st.one_of(
    _REQUESTS.map(p.encode),
    st.binary(max_size=40),  # garbage, framed or not
    st.binary(max_size=40).map(p.frame),
    st.dictionaries(st.sampled_from(["op", "id", "x"]), st.integers(-2, 3), max_size=3).map(
        lambda d: p.frame(msgspec.msgpack.encode(d))
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    hello_first=st.booleans(),
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    finish=st.lists(st.booleans(), max_size=40),
    reloads=st.lists(st.integers(1, 6), max_size=2),
)
def test_any_bytes_split_anywhere_get_one_answer_per_frame_and_never_raise(
    hello_first: bool,
    pieces: list[bytes],
    cuts: list[int],
    finish: list[bool],
    reloads: list[int],
) -> None:
    """Whatever arrives, the session never raises; each whole frame gets exactly one
    event until a `Close` (after which nothing), no id is admitted while in flight, the
    limit holds, and a keeping owes each request still in flight one answer."""
    stream = (p.encode(p.Hello(id=1)) if hello_first else b"") + b"".join(pieces)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    s = session(frame_limit=64)
    answers = 0  # events that answer a frame: all but a Release
    closed = False
    in_flight: set[int] = set()
    finishing = iter(finish)
    for start, end in itertools.pairwise(bounds):
        s.receive(stream[start:end])
        while (event := s.next_event()) is not None:
            assert not closed, "an event after the last word"
            if isinstance(event, Release):
                continue
            answers += 1
            if isinstance(event, Close):
                closed = True
            elif isinstance(event, p.Reply):
                assert event.id not in in_flight or isinstance(event, p.Error)
            else:
                assert event.id not in in_flight, "admitted twice while in flight"
                in_flight.add(event.id)
                assert len(in_flight) <= 2 * MAX_IN_FLIGHT
                if next(finishing, True):
                    s.finished(event.id)
                    in_flight.discard(event.id)
            assert set(s.in_flight) == in_flight
    # Every whole frame (up to one over the limit) was answered once, unless a failed
    # hello closed the connection at its first.
    reference = p.FrameDecoder(64)
    reference.feed(stream)
    frames = 0
    try:
        while reference.next_frame() is not None:
            frames += 1
    except FrameTooLarge:
        frames += 1
    assert answers == frames or (closed and answers == 1)
    # A reload keeps it: each request in flight but the reloads is owed one answer.
    s.keep()
    assert s.next_event() is None
    cut = s.cut_off(reloads)
    assert set(cut) == in_flight - set(reloads)
    for rid in cut:
        s.finished(rid)
    owed = s.owed(cut, retry_after=0.2)
    assert sorted(reply.id for reply in owed) == sorted(cut)
    if not closed:
        assert s.unread() == reference.unread()
