"""One control connection's side of the conversation, sans I/O: bytes in, what to do out.

A `Session` takes the bytes a client sends and answers, frame by frame, what the server
is to do: send a reply it decided itself (the welcome, a refusal), run a request, or
close with a last word. It owns what the protocol says about one connection: the hello
and the version check, the ids in flight and their limit, aborts of requests not in
flight, the wakes delivered and not yet acknowledged, the large frame's share of the
frame budget, and what is owed when a reload keeps the connection (protocol/README.md,
A conversation). No trio, no socket, no clock (deadlines take `now`); the server's trio
shell (`_server.py`) moves the bytes and runs the requests.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from subagentd.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClientMessage,
    Done,
    Error,
    FrameDecoder,
    Hello,
    Reply,
    Welcome,
    client_decoder,
    op,
)
from subagentd.protocol.errors import ErrorCode, Forbidden, FrameTooLarge, Invalid, Recovering

from ._authority import WorkerForToken, caller_at_hello

#: Requests one connection may have in flight; more are answered `busy`. Aborts have
#: as many again of their own, so that a connection at the limit can still abort.
MAX_IN_FLIGHT = 256
#: A frame longer than this is read only once its length is reserved in the server's
#: frame budget; until then its connection is not read (its client's sends block).
BUDGETED_FROM = 64 * 1024
#: A budgeted frame must then arrive whole within FRAME_SECONDS plus a second per
#: FRAME_MIN_RATE bytes, or its connection is closed: a client that sends the header
#: of a large frame and stalls must not hold the budget (and every large request) for good.
FRAME_SECONDS = 5.0
FRAME_MIN_RATE = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Close:
    """Send `error` as the last word and close: the stream cannot go on."""

    error: Error


@dataclass(frozen=True, slots=True)
class Release:
    """Give `size` bytes back to the frame budget: the frame they were reserved for is whole."""

    size: int


#: What `Session.next_event` answers. A request (a `ClientMessage`) is admitted and in flight
#: until `finished`: run it, inline if its class says `at_once`, else in a task of its own.
#: A `Reply` is the session's own answer (the welcome, a refusal); the connection goes on.
Event: typing.TypeAlias = "ClientMessage | Reply | Close | Release"


class Session:
    """One connection, from its first byte to its close or its keeping by a reload.

    Feed what arrives with `receive`; take `next_event` until it answers None; tell it
    when a request is `finished`. Nothing it is fed makes it raise: a bad frame is an
    event (a refusal, or a `Close`); only `check_ack` raises, `Invalid`, for its request.
    """

    def __init__(
        self,
        worker_for_token: WorkerForToken,
        *,
        pid: int,
        daemon_version: str,
        frame_limit: int,
        welcomed: bool = False,
        caller: str | None = None,
        unread: bytes = b"",
        delivered: Iterable[int] = (),
    ) -> None:
        self._worker_for_token = worker_for_token
        self._pid = pid
        self._daemon_version = daemon_version
        self._decoder = FrameDecoder(frame_limit)
        self._decoder.feed(unread)  # what the image before this one read of it (a reload's)
        self.welcomed = welcomed  # past its hello (one a reload handed over is)
        #: The worker whose cgroup the peer is in, as the server's admission found it (None:
        #: no worker's, or no cgroups to tell); read once, at the hello.
        self.within: str | None = None
        #: The worker this connection acts as (None: the user), settled at the hello; one a
        #: reload handed over keeps what the image before settled.
        self.caller = caller
        self.in_flight: dict[int, None] = {}  # ids, in the order they came
        self.delivered: set[int] = set(delivered)  # wake seqs sent here, not yet acked
        self.reserved = 0  # of the server's frame budget, for the large frame arriving here
        self._budgeted_length = 0
        self._due = math.inf
        #: A reload keeps this connection: nothing more is taken of it here.
        self.kept = False
        self._closed = False
        self._unsent: dict[int, Reply] = {}  # answers the keeping cut off
        self._body: bytes | None = None  # a whole frame, waiting behind its `Release`

    # -- bytes in, events out ---------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Take bytes the client sent, split anywhere."""
        if not self._closed:
            self._decoder.feed(data)

    def next_event(self) -> Event | None:
        """What to do next, or None until more bytes arrive (never again once closed or kept).

        Frame by frame: what came before a bad frame is answered first.
        """
        if self._closed or self.kept:
            return None
        body, self._body = self._body, None
        if body is None:
            try:
                body = self._decoder.next_frame()
            except FrameTooLarge as exc:
                # The stream cannot be resynchronised: this connection ends here.
                return self._close(Error(id=0, code=ErrorCode.TOO_LARGE, message=str(exc)))
            if body is None:
                return None
            if self.reserved:  # what it held is a whole frame now
                self._body = body
                return Release(self.give_back())
        message = _decode(body)
        if not self.welcomed:
            return self._hello(message)
        if isinstance(message, Error):
            return message  # the connection carries on
        return self._admit(message)

    def _close(self, error: Error) -> Close:
        self._closed = True
        return Close(error)

    def _hello(self, message: ClientMessage | Error) -> Reply | Close:
        if isinstance(message, Error):  # a first message that does not decode: no hello
            return self._close(message)
        if not isinstance(message, Hello):
            return self._close(
                Error(
                    id=message.id,
                    code=ErrorCode.INVALID,
                    message=f"a connection opens with {op(Hello)}",
                )
            )
        if message.version != PROTOCOL_VERSION:
            return self._close(
                Error(
                    id=message.id,
                    code=ErrorCode.UNSUPPORTED_VERSION,
                    message=f"this daemon speaks protocol {PROTOCOL_VERSION}, "
                    f"not {message.version}; upgrade the client or the daemon",
                )
            )
        try:
            self.caller = caller_at_hello(message.token, self.within, self._worker_for_token)
        except Recovering as exc:
            # No token is known until a restart's recovery is over: not welcomed yet, the
            # connection stays open for the hello to be said again after `retry_after`.
            return Error(
                id=message.id, code=exc.code, message=exc.message, retry_after=exc.retry_after
            )
        except Forbidden as exc:
            return self._close(Error(id=message.id, code=exc.code, message=exc.message))
        self.welcomed = True
        return Welcome(
            id=message.id,
            version=PROTOCOL_VERSION,
            daemon_version=self._daemon_version,
            pid=self._pid,
            worker=self.caller,
        )

    def _admit(self, message: ClientMessage) -> ClientMessage | Reply:
        """`message`, now in flight; or why it cannot be taken on this connection now."""
        rid = message.id
        if rid in self.in_flight:
            return Error(
                id=rid, code=ErrorCode.INVALID, message=f"request id {rid} is already in flight"
            )
        limit = 2 * MAX_IN_FLIGHT if isinstance(message, Abort) else MAX_IN_FLIGHT
        if len(self.in_flight) >= limit:
            return Error(
                id=rid,
                code=ErrorCode.BUSY,
                message=f"more than {MAX_IN_FLIGHT} requests in flight on one "
                "connection; wait for answers or open another connection",
            )
        if isinstance(message, Hello):
            return Error(
                id=rid,
                code=ErrorCode.INVALID,
                message=f"{op(Hello)} was already exchanged on this connection",
            )
        if isinstance(message, Abort) and message.request not in self.in_flight:
            return Done(id=rid)  # nothing to end: not an error (protocol/README.md, Abort)
        self.in_flight[rid] = None
        return message

    def finished(self, request_id: int, unsent: Reply | None = None) -> None:
        """Request `request_id` is over: answered, or ended without an answer; `unsent`, the
        answer it had when the keeping cut its sending off (the seal sends it)."""
        del self.in_flight[request_id]
        if unsent is not None:
            self.answer_if_kept(unsent)

    def answer_if_kept(self, reply: Reply) -> None:
        """Its request, cut short by the keeping, is owed `reply` rather than `reloading`."""
        if self.kept:
            self._unsent[reply.id] = reply

    # -- the frame budget ---------------------------------------------------------

    def wanted_reservation(self) -> int | None:
        """The length of the large frame arriving, if it needs a reservation before reading on."""
        length = self._decoder.incomplete_length
        if length is not None and length > BUDGETED_FROM and not self.reserved:
            return length
        return None

    def reserve(self, size: int, now: float) -> None:
        """`size` bytes were reserved for the frame arriving at `now`: it is due whole by
        `deadline`."""
        length = self._decoder.incomplete_length or 0
        self.reserved = size
        self._budgeted_length = length
        self._due = now + self._allowed(length)

    @property
    def deadline(self) -> float:
        """When the budgeted frame arriving is overdue (inf: none is)."""
        return self._due if self.reserved else math.inf

    def overdue(self) -> Close:
        """The last word for a connection whose budgeted frame missed its `deadline`."""
        length = self._budgeted_length
        return self._close(
            Error(
                id=0,
                code=ErrorCode.INVALID,
                message=f"a frame of {length} bytes did not arrive whole within "
                f"{self._allowed(length):.0f} s; send each frame at once",
            )
        )

    @staticmethod
    def _allowed(length: int) -> float:
        return FRAME_SECONDS + length / FRAME_MIN_RATE

    def give_back(self) -> int:
        """The reservation held (to release), held no more."""
        size, self.reserved = self.reserved, 0
        return size

    # -- wakes ----------------------------------------------------------------------

    def delivered_wakes(self, seqs: Iterable[int]) -> None:
        """Wakes sent on this connection: acknowledgeable here (and on the connection a
        reload keeps) until acknowledged."""
        self.delivered.update(seqs)

    def check_ack(self, seqs: Iterable[int]) -> None:
        """Raise Invalid unless every wake in `seqs` was delivered here."""
        never = sorted(set(seqs) - self.delivered)
        if never:
            raise Invalid(
                f"wakes {never} were never delivered on this connection; "
                "acknowledge only wakes you received"
            )

    def acked(self, seqs: Iterable[int]) -> None:
        self.delivered.difference_update(seqs)

    # -- kept by a reload ---------------------------------------------------------------

    def keep(self) -> None:
        """A reload keeps this connection: nothing more is taken of it here."""
        self.kept = True

    def unread(self) -> bytes:
        """What arrived and was not taken as requests (a frame half arrived): for the image
        that serves the connection next, to be read first."""
        return self._decoder.unread()

    def cut_off(self, reloads: Iterable[int]) -> list[int]:
        """The requests in flight the keeping ends here: all but the `reloads` it serves."""
        spared = set(reloads)
        return [rid for rid in self.in_flight if rid not in spared]

    def owed(self, cut: Iterable[int], retry_after: float) -> list[Reply]:
        """What each request `cut_off` (and since `finished`) is answered: its answer if it
        had one, else `reloading` under its own id: its client sends it again, and the image
        that reads on answers it."""
        return [
            self._unsent.pop(
                rid,
                Error(
                    id=rid,
                    code=ErrorCode.RELOADING,
                    message="the daemon is reloading; send this request again (this "
                    "connection is kept: the new image answers it)",
                    retry_after=retry_after,
                ),
            )
            for rid in cut
        ]


def _decode(body: bytes) -> ClientMessage | Error:
    try:
        return client_decoder.decode(body)
    except msgspec.ValidationError as exc:
        # msgpack, but a field missing, of the wrong type or out of range: msgspec
        # names it ("... - at `$.grace`").
        return Error(id=salvage_id(body), code=ErrorCode.INVALID, message=f"invalid request: {exc}")
    except msgspec.DecodeError as exc:
        return Error(
            id=salvage_id(body), code=ErrorCode.INVALID, message=f"malformed message: {exc}"
        )


def salvage_id(body: bytes) -> int:
    """The id of a message that failed to decode, if it has a readable one, so the
    client can match the error to its request. An id of 0 or less is answered as
    given: 0 is also what a message without a readable id gets."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return 0
    if isinstance(raw, dict) and isinstance(raw.get("id"), int):
        return int(raw["id"])
    return 0
