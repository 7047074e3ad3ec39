"""Well-typed but hostile requests against one live daemon: every answer is a reply or
an error with a stable code (never `internal`), and after each example the daemon
still answers `info` on a fresh connection and still supervises a bystander worker.

tests/test_fuzz.py throws bytes at the framing and the decoder; this one builds
messages of the right shapes with values at and beyond their bounds (nan, inf,
-0.0, huge floats; ids 0, negative and past 2^63; strings and lists one past
their limit) and real ids of what it made, so that requests reach the daemon's
logic. Spawns run `true` or are refused; what an example makes it stops and
collects before the next one.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subagentd import protocol as p

from .conftest import DaemonProcess
from .helpers import alive

#: Examples per run: each is a few requests and a check of the daemon afterwards.
CASES = 200
#: Seconds any one read from the daemon may take before the test fails.
READ_TIMEOUT = 20.0
#: An id no example draws, for the request that ends a conversation.
SENTINEL_ID = p.MAX_INT - 7
CODES = {c.value for c in p.errors.ErrorCode}
#: Requests whose answer may wait on something that never happens (a running bystander,
#: a run nobody stops): not waited for; closing the connection cancels them.
MAY_WAIT = {"watch", "subscribe", "wait", "collect", "stop", "stop_run", "wait_run_stopped"}

# -- values ---------------------------------------------------------------------

floats = st.floats() | st.sampled_from(
    [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308, -1.0,
     p.MAX_GRACE, math.nextafter(p.MAX_GRACE, math.inf), p.MAX_TIMEOUT,
     math.nextafter(p.MAX_TIMEOUT, math.inf), 0.01]
)  # fmt: skip
ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from(
    [0, -1, 1, 2, p.MAX_INT, p.MAX_INT + 1, 2**64 - 1, -(2**63)]
)
request_ids = st.integers(1, 40) | ints


def sized(bound: int) -> st.SearchStrategy[str]:
    """A string well within `bound`, at it, or one past it."""
    return st.text(max_size=12) | st.sampled_from([0, 1, bound, bound + 1]).map(lambda n: "x" * n)


def lists_of(bound: int, item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A short list of `item`, or one of `bound` or `bound + 1` small items."""
    return st.lists(item, max_size=4) | st.sampled_from([bound, bound + 1]).map(lambda n: ["a"] * n)


#: Placeholders for ids this example made, resolved when the request is sent.
MINE, RUN, BYSTANDER = "$mine", "$run", "$bystander"
#: A worker or run that may be stopped: never the bystander.
stoppable = st.sampled_from([MINE, RUN]) | sized(p.MAX_ID_LENGTH)
#: One that may only be looked at: the bystander too.
observed = st.sampled_from([MINE, RUN, BYSTANDER]) | sized(p.MAX_ID_LENGTH)
programs = st.sampled_from(["true", "", "no-such-program-xyz", "/", "./nope", "true\x00"])
argvs = st.one_of(
    st.builds(
        lambda prog, rest: [prog, *rest], programs, st.lists(st.text(max_size=8), max_size=3)
    ),
    st.just([]),
    st.sampled_from([p.MAX_ARGS, p.MAX_ARGS + 1]).map(lambda n: ["true"] * n),
    st.sampled_from([p.MAX_ARG_BYTES - 1, p.MAX_ARG_BYTES, p.MAX_ARG_BYTES + 1]).map(
        lambda n: ["true", "x" * n]
    ),
    st.just(["true", *["x" * 100_000] * 22]),  # each fine, together over 2 MiB
)
envs = st.one_of(
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    st.sampled_from([p.MAX_ARG_BYTES, p.MAX_ARG_BYTES + 1]).map(lambda n: {"A": "v" * n}),
    st.just({f"V{i}": "" for i in range(p.MAX_ARGS + 1)}),
)
inputs = (
    st.none()
    | st.binary(max_size=16)
    | st.sampled_from([p.MAX_INPUT_BYTES, p.MAX_INPUT_BYTES + 1]).map(lambda n: b"i" * n)
)
scopes = st.sampled_from(
    ["worker:" + MINE, "run:" + RUN, "worker:" + BYSTANDER + "x", "turn:7", "turn:-1",
     "turn:x", "run:", "worker:", "", "nonsense"]
) | sized(p.MAX_NAME_LENGTH).filter(lambda s: s != "all")  # fmt: skip
maybe_none = st.none
WAIT = {"wait": st.booleans()}

# Every request type but reload with a usable id: a reload is obeyed (an exec of the
# daemon, tested in test_reload.py) and has no field to fuzz but its id.
requests = st.one_of(
    st.fixed_dictionaries(
        {"op": st.just("hello")},
        optional={"version": ints, "token": maybe_none() | sized(p.MAX_ID_LENGTH),
                  "client": sized(p.MAX_NAME_LENGTH)},
    ),
    st.fixed_dictionaries(
        {"op": st.just("spawn"), "cwd": st.sampled_from(["/", "/no/such/dir"]) | sized(4096)},
        optional={"argv": argvs, "agent": maybe_none() | sized(p.MAX_NAME_LENGTH),
                  "name": sized(p.MAX_NAME_LENGTH), "run": maybe_none() | stoppable,
                  "parent": maybe_none() | stoppable, "input": inputs, "env": envs,
                  "timeout": maybe_none() | floats, "grace": maybe_none() | floats},
    ),
    st.fixed_dictionaries({"op": st.just("new_run")}, optional={"outer": maybe_none() | stoppable}),
    st.fixed_dictionaries(
        {"op": st.just("list_workers")}, optional={"all": st.booleans(), "run": observed}
    ),
    st.fixed_dictionaries({"op": st.just("status"), "worker": observed}),
    st.fixed_dictionaries({"op": st.just("stop"), "worker": stoppable}, optional=WAIT),
    st.fixed_dictionaries({"op": st.just("stop_run"), "run": stoppable}, optional=WAIT),
    st.fixed_dictionaries(
        {"op": st.just("watch"), "worker": observed},
        optional={"since": ints, "limit": ints, "follow": st.booleans()},
    ),
    st.fixed_dictionaries({"op": st.just("collect"), "worker": observed}, optional=WAIT),
    st.fixed_dictionaries({"op": st.just("wait"), "worker": observed}),
    st.fixed_dictionaries({"op": st.just("info")}),
    st.fixed_dictionaries({"op": st.just("begin_turn")}),
    st.fixed_dictionaries({"op": st.just("cancel"), "scope": scopes}),
    st.fixed_dictionaries({"op": st.just("set_fence")}),
    st.fixed_dictionaries({"op": st.just("cancel_fence"), "epoch": ints}),
    st.fixed_dictionaries({"op": st.just("clear_fence")}),
    st.fixed_dictionaries({"op": st.just("wait_run_stopped"), "run": observed}),
    st.fixed_dictionaries(
        {"op": st.just("subscribe")},
        optional={"run": maybe_none() | observed, "worker": maybe_none() | observed,
                  "follow": st.booleans()},
    ),
    st.fixed_dictionaries({"op": st.just("ack"), "wakes": lists_of(p.MAX_ACK_WAKES, ints)}),
    st.fixed_dictionaries(
        {"op": st.just("resume"), "worker": observed},
        optional={"timeout": maybe_none() | floats, "input": inputs,
                  "argv": maybe_none() | argvs, "model": maybe_none() | sized(p.MAX_NAME_LENGTH)},
    ),
    st.fixed_dictionaries({"op": st.just("resume_run"), "run": observed}),
    st.fixed_dictionaries({"op": st.just("latest_resumable"), "cwd": st.just("/") | sized(4096)}),
    st.fixed_dictionaries({"op": st.just("abort"), "request": request_ids}),
    st.fixed_dictionaries({"op": st.just("reload"), "id": st.integers(-(2**63), 0)}),
)  # fmt: skip


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A few requests, each with an id (usable or not) unless it brought its own."""
    messages = draw(st.lists(requests, min_size=1, max_size=5))
    for message in messages:
        message.setdefault("id", draw(request_ids))
    return messages


# -- the wire ---------------------------------------------------------------------


class Wire:
    """One blocking connection after its hello; every read is bounded by READ_TIMEOUT."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(READ_TIMEOUT)
        self.sock.connect(path)
        self.frames = p.FrameDecoder()
        self.send({"op": "hello", "id": 1})
        assert isinstance(self.receive(), p.Welcome)

    def close(self) -> None:
        self.sock.close()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(p.frame(msgspec.msgpack.encode(message)))

    def receive(self) -> p.DaemonMessage:
        while (body := self.frames.next_frame()) is None:
            data = self.sock.recv(1 << 20)
            assert data, "the daemon closed the connection"
            self.frames.feed(data)
        return p.daemon_decoder.decode(body)

    def answer(self, message: dict[str, Any]) -> p.DaemonMessage:
        """Send `message` and read until a reply with its id (other replies are skipped)."""
        self.send(message)
        while (reply := self.receive()).id != message["id"]:
            pass
        return reply


@dataclass
class Made:
    """What this example made, to resolve placeholders and to clean up."""

    bystander: str
    workers: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, str):
            mine = self.workers[-1] if self.workers else "w-none"
            run = self.runs[-1] if self.runs else "r-none"
            return value.replace(MINE, mine).replace(RUN, run).replace(BYSTANDER, self.bystander)
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        return value


@dataclass
class Bystander:
    id: str
    pid: int


@pytest.fixture
def bystander(daemon: DaemonProcess) -> Iterator[Bystander]:
    """A worker that runs through every example and must still be running after each."""
    wire = Wire(str(daemon.socket))
    try:
        reply = wire.answer({"op": "spawn", "id": 2, "argv": ["sleep", "600"], "cwd": "/"})
        assert isinstance(reply, p.WorkerReply), reply
        assert reply.worker.pid is not None
        yield Bystander(reply.worker.id, reply.worker.pid)
    finally:
        wire.close()


def _converse(daemon: DaemonProcess, messages: list[dict[str, Any]], made: Made) -> None:
    wire = Wire(str(daemon.socket))
    try:
        for message in messages:
            message = made.resolve(message)
            if message["op"] in MAY_WAIT:
                wire.send(message)
                continue
            reply = wire.answer(message)
            if isinstance(reply, p.Error):
                assert reply.code in CODES, reply
                assert reply.code != "internal", (message, reply, daemon.log()[-3000:])
                assert reply.message
            elif isinstance(reply, p.WorkerReply):
                made.workers.append(reply.worker.id)
                made.runs.append(reply.worker.run)
            elif isinstance(reply, p.RunReply):
                made.runs.append(reply.run)
        # Everything asked so far was read (the decoder answers in order), and it still answers.
        assert isinstance(wire.answer({"op": "info", "id": SENTINEL_ID}), p.InfoReply)
    finally:
        wire.close()


def _still_serves(daemon: DaemonProcess, bystander: Bystander) -> None:
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, daemon.log()[-3000:]
    wire = Wire(str(daemon.socket))
    try:
        assert isinstance(wire.answer({"op": "info", "id": 2}), p.InfoReply)
        status = wire.answer({"op": "status", "id": 3, "worker": bystander.id})
        assert isinstance(status, p.WorkerReply), status
        assert (status.worker.state, status.worker.pid) == ("running", bystander.pid)
        assert alive(bystander.pid)
    finally:
        wire.close()


def _clean_up(daemon: DaemonProcess, bystander: Bystander) -> None:
    """Stop and collect every worker but the bystander, and lift any fence."""
    wire = Wire(str(daemon.socket))
    try:
        assert isinstance(wire.answer({"op": "clear_fence", "id": 2}), p.Done)
        listing = wire.answer({"op": "list_workers", "id": 3, "all": True})
        assert isinstance(listing, p.WorkerList), listing
        for n, worker in enumerate(listing.workers, start=10):
            if worker.id == bystander.id:
                continue
            stopped = wire.answer({"op": "stop", "id": 2 * n, "worker": worker.id})
            assert isinstance(stopped, p.Stopped), stopped
            collected = wire.answer({"op": "collect", "id": 2 * n + 1, "worker": worker.id})
            assert isinstance(collected, p.ResultReply), collected
    finally:
        wire.close()


@settings(
    max_examples=CASES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(messages=conversations())
def test_random_requests_never_take_the_daemon_or_a_bystander_down(
    daemon: DaemonProcess, bystander: Bystander, messages: list[dict[str, Any]]
) -> None:
    # One daemon and one bystander for every example (function-scoped fixtures are set
    # up once per test, not per example).
    made = Made(bystander=bystander.id)
    _converse(daemon, messages, made)
    _still_serves(daemon, bystander)
    _clean_up(daemon, bystander)
