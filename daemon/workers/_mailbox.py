"""Parents' wakes on trio: what each ending posts, who is subscribed, and acknowledgements.

The queue itself (`_wakes.WakeQueue`) is the pure core: at most one wake per worker
attempt, each held until acknowledged. The mailbox wraps it for the daemon: it makes an
ending's wake (the caller commits it in the ending's own transaction), wakes the
subscribers once it is committed, and writes acknowledgements through to the store.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from subagentd.protocol import Subscribe, Wake, op
from subagentd.protocol.errors import Invalid

from .._logging import get_logger
from ..core._registry import Registry, Tombstone, WorkerRecord
from ..core._wakes import WakeKey
from ..store._store import Store
from ..store._wake_log import open_wakes

log = get_logger()

#: Wakes in one page of a subscription. A wake is at most about 1.5 KiB (ids, a preview of
#: 200 characters), so a page stays near 1.5 MiB, far under the frame limit, however many
#: wakes a parent left unacknowledged.
WAKES_PER_PAGE = 1000


class Mailbox:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        *,
        old_log: Path,
        lookup: Callable[[str], WorkerRecord | Tombstone],
    ) -> None:
        self._store = store
        self._registry = registry
        self._lookup = lookup
        self._queue = open_wakes(store, old_log)
        self._posted = trio.Event()

    def wake_for(self, record: WorkerRecord, preview: str) -> Wake | None:
        """The wake this ending owes its parent, or None if this attempt posted one
        already. Held in memory at once; the caller commits it with the ending."""
        return self._queue.post(
            worker=record.id,
            run=record.run,
            parent=record.parent,
            state=record.state,
            exit_code=record.exit_code,
            preview=preview,
            attempt=record.attempt,
            reason=record.reason,
        )

    def restated(self, record: WorkerRecord) -> list[Wake]:
        """The unacknowledged wake this attempt posted, made to say its worker's state now.

        Nobody has read it: a fault's handling reaches here without a checkpoint after
        the post (a fault after the reap awaits nothing). The caller writes it again
        whole: the transaction that first wrote it may have been rolled back by the fault.
        """
        found = []
        for wake in self._queue.pending.values():
            if (wake.id, wake.attempt) == (record.id, record.attempt):
                wake.state, wake.exit_code = record.state, record.exit_code
                found.append(wake)
        return found

    def posted(self, record: WorkerRecord) -> Wake | None:
        """The unacknowledged wake of the worker's current attempt, if it posted one."""
        return next(
            (
                w
                for w in self._queue.pending.values()
                if (w.id, w.attempt) == (record.id, record.attempt)
            ),
            None,
        )

    def posted_by_attempt(self) -> dict[tuple[str, int], Wake]:
        """Every unacknowledged wake by the (worker, attempt) that posted it: `posted` for
        many workers at once (recovery's), in one walk of the pending wakes."""
        return {(w.id, w.attempt): w for w in self._queue.pending.values()}

    def announce(self) -> None:
        """A wake was committed: subscribers that follow see it now."""
        posted, self._posted = self._posted, trio.Event()
        posted.set()

    def key(self, run: str | None, worker: str | None) -> WakeKey:
        """The parent a subscription is for, checked: it exists."""
        if (run is None) == (worker is None):
            raise Invalid(f"{op(Subscribe)} is to the wakes of one parent: give run or worker")
        key: WakeKey = ("run", run) if run is not None else ("worker", worker)  # type: ignore[assignment]
        if not self._queue.pending_for(key):
            if run is not None:
                self._registry.run(run)
            else:
                self._lookup(key[1])
        return key

    async def subscribe(
        self, key: WakeKey, follow: bool, send: Callable[[list[Wake], bool], Awaitable[None]]
    ) -> None:
        """Send every unacknowledged wake for `key`; with `follow`, then each new one."""
        sent = 0
        first = True  # the first page always goes: it confirms the subscription
        while True:
            posted = self._posted
            wakes = self._queue.pending_for(key, after=sent)
            if wakes or first:
                # However many are pending, no page is over the frame limit: a page of
                # WAKES_PER_PAGE, then the next (`complete` on the last only).
                for at in range(0, max(len(wakes), 1), WAKES_PER_PAGE):
                    page = wakes[at : at + WAKES_PER_PAGE]
                    await send(page, not follow and at + WAKES_PER_PAGE >= len(wakes))
            first = False
            if not follow:
                return
            if wakes:
                sent = wakes[-1].seq
            else:
                await posted.wait()

    def ack(self, seqs: list[int]) -> None:
        self._queue.ack(seqs)
        try:
            self._store.ack_wakes(seqs)
        except OSError as exc:
            log.error("wakes.write_failed", error=str(exc))

    def skip_seqs(self) -> None:
        """The store lost rows, and perhaps the wakes given since its floor: seqs go on
        from far ahead (`Store.skip_seqs`), so none is given twice."""
        self._queue.last_seq = max(self._queue.last_seq, self._store.skip_seqs())

    def orphans_of(self, run: str) -> list[int]:
        """Acknowledge, in memory, the wakes of a run nobody can subscribe to any more (it
        went with its last worker); their seqs, for the caller's transaction to delete."""
        orphaned = self._queue.of_run(run)
        self._queue.ack(orphaned)
        return orphaned
