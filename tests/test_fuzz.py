"""Protocol fuzzing against a live daemon: any bytes a peer sends get an error or a
clean close, never a crash, and never touch another connection."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subagentd import protocol as p

from .conftest import DaemonProcess

#: Cases run per test; the note on the issue reports the total.
CASES = 1000

HELLO = p.encode(p.Hello(id=1))
# Every op but reload: a well-formed reload is obeyed, and ends the bystander's connection.
OPS = ["hello", "spawn", "stop", "watch", "collect", "wait", "info", "ack", "subscribe",
       "resume", "cancel", "set_fence", "abort", "nonsense"]  # fmt: skip

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)  # fmt: skip


@st.composite
def hostile_frames(draw: st.DrawFn) -> bytes:
    """Bytes a broken or hostile client might send after its hello."""
    kind = draw(st.sampled_from(["random", "truncated", "wrong_types", "huge", "deep"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        body = msgspec.msgpack.encode({"op": draw(st.sampled_from(OPS)), "id": 5})
        whole = p.frame(body)
        return whole[: draw(st.integers(0, len(whole) - 1))]
    if kind == "wrong_types":
        message = draw(st.dictionaries(st.text(max_size=8), msgpack_values, max_size=6))
        message["op"] = draw(st.sampled_from(OPS) | msgpack_values)
        message["id"] = draw(st.integers(0, 2**31) | msgpack_values)
        return p.frame(msgspec.msgpack.encode(message))
    if kind == "huge":
        return struct.pack(">I", draw(st.integers(p.DEFAULT_FRAME_LIMIT + 1, 2**32 - 1)))
    depth = draw(st.integers(100, 5000))
    return p.frame(b"\x91" * depth + b"\xc0")  # arrays nested `depth` deep


def _exchange(path: str, payload: bytes) -> list[p.DaemonMessage]:
    """Send hello + payload, half-close, read everything the daemon says until it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(HELLO + payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    decoder = p.FrameDecoder()
    decoder.feed(data)
    return [p.daemon_decoder.decode(body) for body in decoder.frames()]


@pytest.fixture
def bystander(daemon: DaemonProcess) -> Iterator[socket.socket]:
    """A well-behaved client that stays connected throughout."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(daemon.socket))
        s.sendall(HELLO)
        s.recv(4096)
        yield s


def _still_answers(s: socket.socket, request_id: int) -> None:
    s.sendall(p.encode(p.Info(id=request_id)))
    decoder = p.FrameDecoder()
    while not (frames := decoder.frames()):
        decoder.feed(s.recv(65536))
    reply = p.daemon_decoder.decode(frames[0])
    assert isinstance(reply, p.InfoReply)
    assert reply.id == request_id


@settings(
    max_examples=CASES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=hostile_frames())
def test_hostile_frames_get_an_error_or_a_clean_close(
    daemon: DaemonProcess, bystander: socket.socket, payload: bytes
) -> None:
    replies = _exchange(str(daemon.socket), payload)
    assert isinstance(replies[0], p.Welcome)
    for reply in replies[1:]:
        # Whatever it was, the answer is an error with a stable code (or, for a
        # frame that happened to be a valid request, its ordinary answer).
        if isinstance(reply, p.Error):
            assert reply.code in {c.value for c in p.errors.ErrorCode}, reply
            assert reply.message
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, daemon.log()
    _still_answers(bystander, 100 + len(payload) % 1000)


def test_a_thousand_connections_dropped_mid_frame(
    daemon: DaemonProcess, bystander: socket.socket
) -> None:
    frame = p.encode(p.Spawn(id=2, argv=["true"], cwd="/"))
    for i in range(1000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(daemon.socket))
            s.sendall(HELLO + frame[: 1 + i % (len(frame) - 1)])
    _still_answers(bystander, 7)
    assert daemon.proc is not None
    assert daemon.proc.poll() is None
    # No half-received spawn ever ran.
    ran = [e.name for e in os.scandir(daemon.state_dir / "archives")]
    assert [name for name in ran if not name.startswith(".spare-")] == []
