"""The client core's acknowledgements across reconnects, against the daemon's rule: an
`ack` names only wakes delivered on its own connection.

A hypothesis state machine runs the sans-I/O `Connection` and a followed
`WakeSubscription` against the daemon's real `WakeQueue` and its per-connection rule
(as `Session.check_ack` has it), with reloads at any moment: between a page and its
reading, between an ack's sending and the daemon's reading of it, and between the
daemon's `done` and the client's. Whatever the order, no ack is refused, no wake is
handed over twice, and once all is read every wake was handed over and acknowledged.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from subagentd.client import _acks, _core
from subagentd.daemon.core._wakes import WakeQueue
from subagentd.protocol import (
    Ack,
    Done,
    Error,
    FrameDecoder,
    Reply,
    Subscribe,
    Wake,
    Wakes,
    client_decoder,
    encode,
)

RELOADING = encode(Error(id=0, code="reloading", message="reloading; reconnect", retry_after=0.2))
PAGE = 2  # the daemon's wakes per page, small: recalls of several pages


class Daemon:
    """The daemon's side of one connection at a time: wakes kept in its `WakeQueue`, pages
    sent for subscriptions, and acks taken only for wakes delivered on this connection."""

    def __init__(self) -> None:
        self.queue = WakeQueue()
        self.delivered: set[int] = set()
        self.followers: list[int] = []  # followed subscriptions on this connection
        self.incoming = FrameDecoder()
        self.unread: deque[bytes] = deque()  # the client's frames not yet read
        self.replies: deque[bytes] = deque()  # answers not yet read by the client
        self.refused: list[Error] = []
        self.workers = 0

    def post(self) -> None:
        self.workers += 1
        wake = self.queue.post(
            worker=f"w-{self.workers}",
            run="r-1",
            parent=None,
            state="finished",
            exit_code=0,
            preview="",
            attempt=1,
        )
        assert wake is not None
        for rid in self.followers:
            self._send(Wakes(id=rid, wakes=[wake]))

    def take_frames(self, data: bytes | list[bytes] | None) -> None:
        self.incoming.feed(b"".join(data) if isinstance(data, list) else (data or b""))
        self.unread.extend(self.incoming.frames())

    def read_one(self) -> None:
        match client_decoder.decode(self.unread.popleft()):
            case Subscribe(id=rid, run=run, follow=follow):
                pending = self.queue.pending_for(("run", run or ""))
                pages = [pending[i : i + PAGE] for i in range(0, len(pending), PAGE)] or [[]]
                for i, wakes in enumerate(pages):
                    last = i == len(pages) - 1
                    self._send(Wakes(id=rid, wakes=wakes, complete=last and not follow))
                if follow:
                    self.followers.append(rid)
            case Ack(id=rid, wakes=seqs):
                never = sorted(set(seqs) - self.delivered)
                if never:
                    self.refused.append(Error(id=rid, code="invalid", message=f"{never}"))
                    self._send(self.refused[-1])
                    return
                self.queue.ack(seqs)
                self.delivered.difference_update(seqs)
                self._send(Done(id=rid))
            case other:
                raise AssertionError(f"not in this model: {other!r}")

    def reload(self) -> None:
        """The connection goes: what was not read of it is lost, its deliveries with it."""
        self.delivered.clear()
        self.followers.clear()
        self.incoming = FrameDecoder()
        self.unread.clear()
        self.replies.clear()

    def _send(self, reply: Reply) -> None:
        if isinstance(reply, Wakes):
            self.delivered.update(wake.seq for wake in reply.wakes)
        self.replies.append(encode(reply))


class AcksAcrossReloads(RuleBasedStateMachine):
    #: Wakes the client's ack ledger keeps each by its seq (the rest by ranges).
    KEPT = _acks.KEPT

    def __init__(self) -> None:
        super().__init__()
        self.daemon = Daemon()
        self.conn = _core.Connection(reconnect=True, acks_kept=self.KEPT)
        self.subscription = _core.WakeSubscription(run="r-1", follow=True)
        self.stream, frame = self.conn.send(
            self.subscription.request(), again=self.subscription.request
        )
        self.daemon.take_frames(frame)
        self.handed: list[Wake] = []
        self.in_hand: deque[Wake] = deque()
        self.acks: dict[int, int] = {}  # ack request id -> the seq it acknowledges
        self.acknowledged: set[int] = set()

    # -- the daemon ---------------------------------------------------------------

    @rule()
    def a_worker_ends(self) -> None:
        self.daemon.post()

    @precondition(lambda self: self._handed_pending())
    @rule(data=st.data())
    def another_client_acknowledges_one(self, data: st.DataObject) -> None:
        """A wake this client was handed, acknowledged on another connection: this one
        never hears of it, and its own ack of it later must still be taken (done)."""
        self.daemon.queue.ack([data.draw(st.sampled_from(self._handed_pending()))])

    def _handed_pending(self) -> list[int]:
        return sorted(w.seq for w in self.handed if w.seq in self.daemon.queue.pending)

    @precondition(lambda self: self.daemon.unread)
    @rule()
    def the_daemon_reads(self) -> None:
        self.daemon.read_one()

    @precondition(lambda self: not self.conn.reconnecting)
    @rule()
    def a_reload(self) -> None:
        self.daemon.reload()
        self.conn.receive_data(RELOADING)

    # -- the client ---------------------------------------------------------------

    @precondition(lambda self: self.daemon.replies and not self.conn.reconnecting)
    @rule()
    def the_client_reads(self) -> None:
        self.conn.receive_data(self.daemon.replies.popleft())
        self.daemon.take_frames(self.conn.outgoing())

    @precondition(lambda self: self.conn.reconnecting)
    @rule()
    def the_client_reconnects(self) -> None:
        self.daemon.take_frames(self.conn.reconnected())

    @rule()
    def the_caller_asks_for_the_next_wake(self) -> None:
        self._next_page()

    def _next_page(self) -> bool:
        reply = self.conn.next_reply(self.stream)
        if reply is None:
            return False
        fresh = self.subscription.take(reply)
        self.handed += fresh
        self.in_hand += fresh
        return True

    @precondition(lambda self: self.in_hand)
    @rule()
    def the_caller_acknowledges_one(self) -> None:
        seq = self.in_hand.popleft().seq
        rid, frame = self.conn.send(_core.ack([seq]).request)
        self.acks[rid] = seq
        self.daemon.take_frames(frame)

    @rule()
    def the_caller_hears_of_its_acks(self) -> None:
        for rid, seq in list(self.acks.items()):
            reply = self.conn.next_reply(rid)
            if reply is not None:
                assert reply == Done(id=rid)
                self.conn.finish(rid)
                del self.acks[rid]
                self.acknowledged.add(seq)

    # -- what holds ---------------------------------------------------------------

    @invariant()
    def no_ack_is_refused(self) -> None:
        assert self.daemon.refused == []

    @invariant()
    def no_wake_is_handed_over_twice(self) -> None:
        seqs = [wake.seq for wake in self.handed]
        assert len(seqs) == len(set(seqs))

    @invariant()
    def an_acknowledged_wake_is_never_delivered_again(self) -> None:
        assert not self.acknowledged & set(self.daemon.queue.pending)

    def teardown(self) -> None:
        """Everything read, every wake acknowledged: none lost, none left pending."""
        for _ in range(10_000):
            if self.conn.reconnecting:
                self.the_client_reconnects()
            elif self.daemon.unread:
                self.the_daemon_reads()
            elif self.daemon.replies:
                self.the_client_reads()
            else:
                answered = len(self.acks)
                paged = self._next_page()
                self.the_caller_hears_of_its_acks()
                if self.in_hand:
                    self.the_caller_acknowledges_one()
                elif not paged and len(self.acks) == answered:
                    break  # nothing more can come
        self.no_ack_is_refused()
        assert self.acks == {}, f"acks never answered: {self.acks}"
        assert sorted(w.seq for w in self.handed) == list(range(1, self.daemon.workers + 1))
        assert self.daemon.queue.pending == {}


AcksAcrossReloads.TestCase.settings = settings(max_examples=300, stateful_step_count=40)
test_acks_across_reloads = AcksAcrossReloads.TestCase


class AcksAcrossReloadsKeepingTwo(AcksAcrossReloads):
    """The same, the ledger keeping two wakes by seq: the older known only by a range of
    seqs for their parent, an acknowledgement of one from an earlier connection (or
    acknowledged elsewhere) resolved by recalls."""

    KEPT = 2


AcksAcrossReloadsKeepingTwo.TestCase.settings = settings(max_examples=300, stateful_step_count=40)
test_acks_across_reloads_keeping_two = AcksAcrossReloadsKeepingTwo.TestCase
