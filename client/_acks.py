"""Where each wake was delivered, and the acknowledgements that wait for its redelivery.

The daemon takes an `ack` only for wakes delivered on the same connection. A
client that reconnects (a reload) may still hold wakes of a page from the
connection before, and an acknowledgement of one of them, sent as it is on the
new connection, is refused. `AckLedger` keeps, sans I/O, on which connection of
the conversation each wake came, holds such an acknowledgement, and asks for
the wake to be delivered again on the new connection (an unfollowed subscribe
to its parent, a *recall*); the held acknowledgement then goes out for the wakes
that came again and is done for those that did not (someone acknowledged them).

What it keeps is bounded (`KEPT` wakes each by its seq): a follower whose wakes
others acknowledge never hears of it. Past the bound the oldest are let go into
one range of seqs for their parent. An acknowledgement naming a seq known only by
such ranges is held and resolved by recalls made after it, of every parent whose
range holds the seq (it may be any of theirs; on which connection it came is
lost with it): it goes out if its wake came again, and is done if it did not.
Nothing acknowledged is lost, nor a wake handed over twice; given up is only the
daemon's `invalid` for a seq never delivered that falls in such a range (done
instead), and a recall (a round trip, a page of that parent's pending wakes) for
each acknowledgement of a wake that old.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from subagentd.protocol import Subscribe, Wake, Wakes

#: The parent a wake is for, as a subscription names it: ("run", id) or ("worker", id).
Parent = tuple[str, str]

#: The generation of a wake that a recall found acknowledged already (by whoever).
_GONE = -1
#: Wakes kept each by its seq (about 240 bytes each); past it the oldest are let go
#: into their parents' ranges, down to half of it at once.
KEPT = 10_000


def parent_of(wake: Wake) -> Parent:
    """Whose wakes `wake` is among: its delegating worker's, else its run's (top-level)."""
    return ("worker", wake.parent) if wake.parent is not None else ("run", wake.run)


def recall(parent: Parent) -> Subscribe:
    """The unfollowed subscribe that delivers `parent`'s unacknowledged wakes here, all of
    them and then a complete page: what came again, and by its absence what did not."""
    kind, name = parent
    return Subscribe(
        id=0, run=name if kind == "run" else None, worker=name if kind == "worker" else None
    )


@dataclass(slots=True)
class _Delivery:
    generation: int  # the connection it came on last (`_GONE`: acknowledged meanwhile)
    parent: Parent


@dataclass(frozen=True, slots=True)
class Release:
    """A held acknowledgement let go: `seqs` to send under its id (empty: nothing is left
    to acknowledge, answer it done)."""

    request_id: int
    seqs: list[int]


class AckLedger:
    """The wakes delivered in one conversation, by connection, and the held acknowledgements.

    ``generation`` counts the conversation's connections (`new_connection` at each
    reconnect). A connection a reload keeps is the same connection: its generation
    does not change, and its wakes stay acknowledgeable on it.
    """

    def __init__(self, kept: int = KEPT) -> None:
        self.generation = 0
        self._kept = kept
        self._where: dict[int, _Delivery] = {}  # in the order they first came
        self._held: dict[int, list[int]] = {}  # ack request id -> the seqs it names
        self._recalls: dict[int, Parent] = {}  # recall request id -> its parent
        self._last_recall = 0  # the id of the newest recall sent
        # The seqs let go of (`_let_go`), by parent: the lowest and the highest.
        self._let_go_seqs: dict[Parent, tuple[int, int]] = {}
        # Held seqs known only by those ranges: the newest recall sent before they were
        # held and the parents whose later recall is awaited; once none is, whether the
        # wake came again here (True) or not (False: someone acknowledged it).
        self._resolving: dict[int, tuple[int, set[Parent]]] = {}
        self._resolved: dict[int, bool] = {}

    @property
    def holding(self) -> bool:
        """Whether an acknowledgement waits for a redelivery, or a recall for its answer."""
        return bool(self._held or self._recalls)

    def delivered(self, wakes: Iterable[Wake]) -> None:
        """Wakes that came on the current connection (any subscription's page)."""
        for wake in wakes:
            self._where[wake.seq] = _Delivery(self.generation, parent_of(wake))
            if self._resolving and self._resolving.pop(wake.seq, None) is not None:
                self._resolved[wake.seq] = True  # came again here, while held
        if len(self._where) > self._kept:
            self._let_go()

    def acknowledged(self, seqs: Iterable[int]) -> None:
        """Wakes the daemon answered an acknowledgement of: nothing more to keep of them."""
        for seq in seqs:
            self._where.pop(seq, None)

    def stale(self, seqs: Iterable[int]) -> bool:
        """Whether any of `seqs` came on an earlier connection and not again on this one:
        an acknowledgement of them must wait (`hold`)."""
        return any(self._stale(seq) for seq in seqs)

    def settle(self, seqs: Iterable[int]) -> list[int]:
        """`seqs` but those a recall found acknowledged already (by whoever, for another
        acknowledgement's sake): nothing is sent for them, and nothing more kept of them."""
        seqs = list(seqs)
        gone = {seq for seq in seqs if self._generation_of(seq) == _GONE}
        for seq in gone:
            self._where.pop(seq, None)
        return [seq for seq in seqs if seq not in gone]

    def hold(self, request_id: int, seqs: Iterable[int]) -> list[Parent]:
        """Hold acknowledgement `request_id` until its wakes came again here; answers the
        parents to recall now (none while one is out for them already)."""
        self._held[request_id] = list(seqs)
        self._await_recalls()
        return self._to_recall()

    def drop(self, request_id: int) -> None:
        """The caller gave up on acknowledgement `request_id` (finished, aborted)."""
        self._forget(self._held.pop(request_id, ()))

    def new_connection(self) -> tuple[list[Parent], list[Release]]:
        """A new connection said welcome: whatever came before is stale, recalls out on the
        old one are lost. Answers the parents to recall on it, and the acknowledgements
        that need none (naming no wake delivered before: the daemon judges them)."""
        self.generation += 1
        self._recalls.clear()
        # A wake that came again came on the connection before: its entry is stale now.
        self._resolved = {seq: again for seq, again in self._resolved.items() if not again}
        return self._to_recall(), self._release()

    def recall_sent(self, request_id: int, parent: Parent) -> None:
        self._recalls[request_id] = parent
        self._last_recall = max(self._last_recall, request_id)

    def is_recall(self, request_id: int) -> bool:
        return request_id in self._recalls

    def recalled_parent(self, request_id: int) -> Parent:
        """The parent recall `request_id` asks for (to ask again under the same id)."""
        return self._recalls[request_id]

    def recalled(self, request_id: int, page: Wakes | None) -> list[Release]:
        """A page of recall `request_id` (None: its parent is unknown to the daemon and has
        nothing pending). Once complete, what did not come again was acknowledged by
        someone: answers the acknowledgements that can go now."""
        if page is not None:
            self.delivered(page.wakes)
            if not page.complete:
                return []
        parent = self._recalls.pop(request_id)
        for delivery in self._where.values():
            if delivery.parent == parent and 0 <= delivery.generation < self.generation:
                delivery.generation = _GONE
        for seq, (before, awaited) in list(self._resolving.items()):
            if request_id > before:
                awaited.discard(parent)
                if not awaited:  # every parent it could be of recalled, and it came not
                    del self._resolving[seq]
                    self._resolved[seq] = False
        return self._release()

    def recall_refused(self, request_id: int) -> list[int]:
        """Recall `request_id` was refused (forbidden, ...): the acknowledgements waiting on
        it cannot be made; answers their ids, now dropped, for the caller to fail."""
        parent = self._recalls.pop(request_id)
        failed = [
            rid
            for rid, seqs in self._held.items()
            if any(parent in self._awaited(seq) for seq in seqs)
        ]
        for rid in failed:
            self.drop(rid)
        return failed

    def _stale(self, seq: int) -> bool:
        if seq in self._resolved:
            return False
        delivery = self._where.get(seq)
        if delivery is not None:
            return 0 <= delivery.generation < self.generation
        return seq in self._resolving or bool(self._ranges_holding(seq))

    def _awaited(self, seq: int) -> set[Parent]:
        """The parents whose recall a held `seq` waits for (none: it can go)."""
        if (resolving := self._resolving.get(seq)) is not None:
            return resolving[1]
        if seq not in self._resolved and seq in self._where and self._stale(seq):
            return {self._where[seq].parent}
        return set()

    def _to_recall(self) -> list[Parent]:
        """The parents to recall now: of a stale wake's, unless a recall of it is out; of
        a seq known only by ranges, unless one is out that was sent after it was held."""
        newest: dict[Parent, int] = {}
        for rid, parent in self._recalls.items():
            newest[parent] = max(newest.get(parent, 0), rid)
        wanted = set()
        for seqs in self._held.values():
            for seq in seqs:
                before = self._resolving[seq][0] if seq in self._resolving else -1
                wanted |= {p for p in self._awaited(seq) if newest.get(p, -1) <= before}
        return sorted(wanted)

    def _ranges_holding(self, seq: int) -> set[Parent]:
        return {parent for parent, (low, high) in self._let_go_seqs.items() if low <= seq <= high}

    def _await_recalls(self) -> None:
        """Every held seq known only by ranges waits for recalls sent from now on, of each
        parent whose range holds it (once held, or once another acknowledgement of it
        went: see `_forget`)."""
        for seqs in self._held.values():
            for seq in seqs:
                if seq in self._where or seq in self._resolved or seq in self._resolving:
                    continue
                if parents := self._ranges_holding(seq):
                    self._resolving[seq] = (self._last_recall, parents)

    def _forget(self, seqs: Iterable[int]) -> None:
        """What was resolved of `seqs`, no acknowledgement holding them any more."""
        for seq in seqs:
            self._resolving.pop(seq, None)
            self._resolved.pop(seq, None)
        self._await_recalls()  # for another held acknowledgement naming one of them

    def _let_go(self) -> None:
        """Keep the newest half of `KEPT` by seq; the older go into their parents'
        ranges, never one a held acknowledgement names (it waits on its entry)."""
        held = {seq for seqs in self._held.values() for seq in seqs}
        older = islice(self._where, len(self._where) - self._kept // 2)
        for seq in [seq for seq in older if seq not in held]:
            parent = self._where.pop(seq).parent
            low, high = self._let_go_seqs.get(parent, (seq, seq))
            self._let_go_seqs[parent] = (min(low, seq), max(high, seq))

    def _release(self) -> list[Release]:
        released = []
        for rid, seqs in list(self._held.items()):
            if any(self._stale(seq) for seq in seqs):
                continue
            del self._held[rid]
            left = [
                seq
                for seq in seqs
                if self._generation_of(seq) != _GONE and self._resolved.get(seq, True)
            ]
            self.acknowledged(seq for seq in seqs if seq not in left)
            self._forget(seqs)
            released.append(Release(rid, left))
        return released

    def _generation_of(self, seq: int) -> int | None:
        delivery = self._where.get(seq)
        return None if delivery is None else delivery.generation
