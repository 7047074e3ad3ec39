"""Where each wake was delivered, and the acknowledgements that wait for its redelivery.

The daemon takes an `ack` only for wakes delivered on the same connection. A
client that reconnects (a reload) may still hold wakes of a page from the
connection before, and an acknowledgement of one of them, sent as it is on the
new connection, is refused. `AckLedger` keeps, sans I/O, on which connection of
the conversation each wake came, holds such an acknowledgement, and asks for
the wake to be delivered again on the new connection (an unfollowed subscribe
to its parent, a *recall*); the held acknowledgement then goes out for the wakes
that came again and is done for those that did not (someone acknowledged them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from subagentd.protocol import Subscribe, Wake, Wakes

#: The parent a wake is for, as a subscription names it: ("run", id) or ("worker", id).
Parent = tuple[str, str]

#: The generation of a wake that a recall found acknowledged already (by whoever).
_GONE = -1


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

    def __init__(self) -> None:
        self.generation = 0
        self._where: dict[int, _Delivery] = {}
        self._held: dict[int, list[int]] = {}  # ack request id -> the seqs it names
        self._recalls: dict[int, Parent] = {}  # recall request id -> its parent

    @property
    def holding(self) -> bool:
        """Whether an acknowledgement waits for a redelivery, or a recall for its answer."""
        return bool(self._held or self._recalls)

    def delivered(self, wakes: Iterable[Wake]) -> None:
        """Wakes that came on the current connection (any subscription's page)."""
        for wake in wakes:
            self._where[wake.seq] = _Delivery(self.generation, parent_of(wake))

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
            del self._where[seq]
        return [seq for seq in seqs if seq not in gone]

    def hold(self, request_id: int, seqs: Iterable[int]) -> list[Parent]:
        """Hold acknowledgement `request_id` until its wakes came again here; answers the
        parents to recall now (none while one is out for them already)."""
        self._held[request_id] = list(seqs)
        return self._to_recall()

    def drop(self, request_id: int) -> None:
        """The caller gave up on acknowledgement `request_id` (finished, aborted)."""
        self._held.pop(request_id, None)

    def new_connection(self) -> tuple[list[Parent], list[Release]]:
        """A new connection said welcome: whatever came before is stale, recalls out on the
        old one are lost. Answers the parents to recall on it, and the acknowledgements
        that need none (naming no wake delivered before: the daemon judges them)."""
        self.generation += 1
        self._recalls.clear()
        return self._to_recall(), self._release()

    def recall_sent(self, request_id: int, parent: Parent) -> None:
        self._recalls[request_id] = parent

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
        return self._release()

    def recall_refused(self, request_id: int) -> list[int]:
        """Recall `request_id` was refused (forbidden, ...): the acknowledgements waiting on
        it cannot be made; answers their ids, now dropped, for the caller to fail."""
        parent = self._recalls.pop(request_id)
        failed = [
            rid
            for rid, seqs in self._held.items()
            if any(self._stale(seq) and self._where[seq].parent == parent for seq in seqs)
        ]
        for rid in failed:
            del self._held[rid]
        return failed

    def _stale(self, seq: int) -> bool:
        delivery = self._where.get(seq)
        return delivery is not None and 0 <= delivery.generation < self.generation

    def _to_recall(self) -> list[Parent]:
        wanted = {
            self._where[seq].parent
            for seqs in self._held.values()
            for seq in seqs
            if self._stale(seq)
        }
        out = set(self._recalls.values())
        return sorted(wanted - out)

    def _release(self) -> list[Release]:
        released = []
        for rid, seqs in list(self._held.items()):
            if any(self._stale(seq) for seq in seqs):
                continue
            del self._held[rid]
            left = [seq for seq in seqs if self._generation_of(seq) != _GONE]
            self.acknowledged(seq for seq in seqs if seq not in left)
            released.append(Release(rid, left))
        return released

    def _generation_of(self, seq: int) -> int | None:
        delivery = self._where.get(seq)
        return None if delivery is None else delivery.generation
