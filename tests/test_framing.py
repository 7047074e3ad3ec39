"""The wire format: frames survive any split of the byte stream, and every message round-trips."""

from __future__ import annotations

import importlib.metadata
import itertools
import typing

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from subagentd.protocol import (
    HEADER,
    Abort,
    Ack,
    BeginTurn,
    Cancel,
    CancelFence,
    Cancelled,
    ClearFence,
    ClientMessage,
    Collect,
    DaemonInfo,
    DaemonMessage,
    Done,
    Entry,
    Error,
    FenceReply,
    FrameDecoder,
    Grep,
    GrepMatch,
    GrepReply,
    GrepResult,
    Hello,
    Info,
    InfoReply,
    Latest,
    LatestResumable,
    ListWorkers,
    NewRun,
    Page,
    Pause,
    Paused,
    Reload,
    ReloadReply,
    ReopenRun,
    Reply,
    Request,
    ResultReply,
    Resume,
    ResumeRun,
    RunReply,
    Send,
    Sent,
    SetFence,
    Spawn,
    Status,
    Stop,
    Stopped,
    StopRun,
    Subscribe,
    TurnReply,
    Unpause,
    Unpaused,
    Wait,
    WaitFor,
    WaitForReply,
    WaitForResult,
    WaitRunStopped,
    Wake,
    Wakes,
    Watch,
    Welcome,
    WorkerList,
    WorkerReply,
    WorkerResult,
    WorkerView,
    client_decoder,
    daemon_decoder,
    encode,
    frame,
    package_version,
)
from subagentd.protocol.errors import FrameTooLarge

bodies = st.lists(st.binary(max_size=300), max_size=20)


def test_frame_is_big_endian_length_then_body() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"


def test_nothing_comes_out_until_a_frame_is_whole() -> None:
    decoder = FrameDecoder()
    wire = frame(b"hello")
    for byte in wire[:-1]:
        decoder.feed(bytes([byte]))
        assert decoder.next_frame() is None
    decoder.feed(wire[-1:])
    assert decoder.next_frame() == b"hello"
    assert decoder.next_frame() is None
    assert decoder.pending == 0


def test_a_torn_frame_stays_pending() -> None:
    decoder = FrameDecoder()
    decoder.feed(frame(b"whole") + frame(b"torn")[:-1])
    assert decoder.frames() == [b"whole"]
    assert decoder.pending == len(frame(b"torn")) - 1


@given(bodies, st.lists(st.integers(min_value=0), max_size=30))
def test_any_split_of_the_stream_gives_back_the_same_bodies(
    sent: list[bytes], cuts: list[int]
) -> None:
    wire = b"".join(frame(body) for body in sent)
    points = sorted({cut % (len(wire) + 1) for cut in cuts} | {0, len(wire)})
    decoder = FrameDecoder()
    received: list[bytes] = []
    for start, end in itertools.pairwise(points):
        decoder.feed(wire[start:end])
        received += decoder.frames()
    assert received == sent
    assert decoder.pending == 0


def test_an_oversized_length_is_refused_before_its_body_arrives() -> None:
    decoder = FrameDecoder(limit=1024)
    decoder.feed(HEADER.pack(1025))
    with pytest.raises(FrameTooLarge) as caught:
        decoder.next_frame()
    assert (caught.value.length, caught.value.limit) == (1025, 1024)


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    decoder = FrameDecoder(limit=4)
    decoder.feed(frame(b"1234"))
    assert decoder.next_frame() == b"1234"


# -- messages --------------------------------------------------------------------

WORKER = WorkerView(
    id="w-1",
    run="r-1",
    parent="w-0",
    name="tests",
    state="finished",
    pid=4242,
    exit_code=0,
    attempt=2,
    turn=3,
    started_at=1700000000.5,
    ended_at=1700000010.25,
    archive="/state/archives/w-1",
    argv=["pytest", "-x"],
    cwd="/src",
    agent="reviewer",
)

EXAMPLES: list[Request[Reply] | Reply] = [
    Hello(id=1, token="secret", client="test"),
    Spawn(
        id=2,
        argv=["sh", "-c", "cat"],
        agent=None,
        name="cat",
        run="r-1",
        parent="w-0",
        input=b"\x00\xffnot utf-8",
        cwd="/tmp",
        env={"K": "V"},
        timeout=9.5,
        grace=1.0,
    ),
    NewRun(id=3, outer="r-1"),
    ListWorkers(id=4, all=True, run="r-1"),
    Status(id=5, worker="w-1"),
    Stop(id=6, worker="w-1", wait=False),
    StopRun(id=7, run="r-1"),
    Watch(id=8, worker="w-1", since=41, follow=True, limit=10),
    Collect(id=9, worker="w-1", wait=True),
    Wait(id=10, worker="w-1"),
    Info(id=11),
    Abort(id=12, request=8),
    BeginTurn(id=14),
    Cancel(id=15, scope="turn:3"),
    SetFence(id=16),
    CancelFence(id=17, epoch=2),
    ClearFence(id=18),
    WaitRunStopped(id=19, run="r-1"),
    Subscribe(id=20, run="r-1", worker=None, follow=True),
    Ack(id=21, wakes=[7, 8]),
    Reload(id=22),
    Resume(id=23, worker="w-1", timeout=60.0, input=b"again", argv=["sh"], model="large"),
    Resume(id=23, worker="w-1", env={"A": "1"}, cwd="/src", grace=1.0, stdin_open=False),
    ResumeRun(id=24, run="r-1"),
    ReopenRun(id=24, run="r-1"),
    LatestResumable(id=25, cwd="/src"),
    Grep(id=26, worker="w-1", pattern="ERROR|warn(ing)?", before=2, after=3, limit=10),
    WaitFor(id=27, worker="w-1", pattern="listening on \\d+", timeout=30.0),
    Send(id=28, worker="w-1", data=b"\x00\xffhello\n", eof=True),
    Pause(id=29, worker="w-1"),
    Unpause(id=30, run="r-1"),
    GrepReply(
        id=26,
        result=GrepResult(
            matches=[
                GrepMatch(line_no=3, kind="stderr", line="ERROR x", before=["a"], after=["b"])
            ],
            truncated=True,
        ),
    ),
    WaitForReply(
        id=27, result=WaitForResult(outcome="matched", line="listening on 80", worker=WORKER)
    ),
    Sent(id=28, written=9),
    Paused(id=29, paused=["w-1", "w-2"], already_paused=["w-3"]),
    Unpaused(id=30, unpaused=["w-1"], already_unpaused=[]),
    Welcome(id=1, version=1, daemon_version="0.1.0", pid=99, worker="w-0"),
    WorkerReply(id=2, worker=WORKER),
    WorkerList(id=4, workers=[WORKER, WORKER]),
    RunReply(id=3, run="r-2"),
    Stopped(id=6, found=True, stopped=["w-1", "w-2"]),
    Page(
        id=8,
        entries=[
            Entry(seq=42, kind="stdout", data=b"\xff\xfe raw", at=1700000001.0),
            Entry(seq=43, kind="state", data=b"finished exit_code=0", at=1700000002.0),
        ],
        next=43,
        complete=True,
    ),
    ResultReply(id=9, result=WorkerResult(id="w-1", state="failed", exit_code=3, result="oops")),
    InfoReply(
        id=11,
        info=DaemonInfo(
            version="0.1.0",
            protocol=1,
            pid=99,
            image_generation=2,
            reloads=1,
            workers={"running": 1},
            holds_park=True,
        ),
    ),
    Done(id=12),
    Error(id=13, code="reloading", message="the daemon is reloading", retry_after=0.5),
    TurnReply(id=14, turn=4),
    Cancelled(id=15, cancelled=["w-1", "w-2"]),
    FenceReply(id=16, epoch=2),
    Wakes(
        id=20,
        wakes=[
            Wake(
                seq=7,
                id="w-1",
                run="r-1",
                parent=None,
                state="failed",
                exit_code=3,
                preview="oops",
                attempt=2,
            )
        ],
        complete=True,
    ),
    ReloadReply(id=22, image_generation=2, carried_live=3, stopped_by_reload=["w-9"]),
    Latest(id=25, run="r-1", resumable=False, reason="HEAD is on another branch"),
]


def _every(base: type[msgspec.Struct]) -> set[type[msgspec.Struct]]:
    """Every message class the protocol derives from `base`, at any depth (not a test's: a
    test may declare a later version's message to see what this one makes of it)."""
    found: set[type[msgspec.Struct]] = set()
    pending = list(base.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls.__module__.startswith("subagentd.protocol"):
            found.add(cls)
        pending += cls.__subclasses__()
    return found


def _decoder_for(message: Request[Reply] | Reply) -> msgspec.msgpack.Decoder[typing.Any]:
    return client_decoder if isinstance(message, Request) else daemon_decoder


def test_the_examples_cover_every_message_type() -> None:
    assert {type(message) for message in EXAMPLES} == _every(Request) | _every(Reply)


def test_the_decoders_know_every_message_type() -> None:
    # A type missing from its union would be answered `invalid` (or break the client's
    # connection) on the wire, however complete the rest of the code is.
    assert set(typing.get_args(ClientMessage)) == _every(Request)
    assert set(typing.get_args(DaemonMessage)) == _every(Reply)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_every_message_round_trips(message: Request[Reply] | Reply) -> None:
    wire = encode(message)
    decoder = FrameDecoder()
    decoder.feed(wire)
    (body,) = decoder.frames()
    assert len(body) == len(wire) - HEADER.size
    assert _decoder_for(message).decode(body) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_fields_from_a_newer_peer_are_ignored(message: Request[Reply] | Reply) -> None:
    fields = msgspec.to_builtins(message, builtin_types=(bytes,))
    fields["added_in_a_later_version"] = {"any": ["shape"]}
    assert _decoder_for(message).decode(msgspec.msgpack.encode(fields)) == message


@given(st.binary(max_size=2000), st.text(max_size=200))
def test_raw_bytes_and_text_survive_the_wire(data: bytes, text: str) -> None:
    page = Page(
        id=1, entries=[Entry(seq=1, kind="stderr", data=data, at=0.0)], next=1, complete=False
    )
    assert daemon_decoder.decode(encode(page)[HEADER.size :]) == page
    spawn = Spawn(id=2, argv=[text], input=data, env={text: text})
    assert client_decoder.decode(encode(spawn)[HEADER.size :]) == spawn


def test_the_version_spoken_is_the_version_installed() -> None:
    """One place holds the version (protocol/_version.py, which pyproject.toml reads):
    what the hello and --version say is what the installed distribution says."""
    assert package_version() == importlib.metadata.version("subagentd")
