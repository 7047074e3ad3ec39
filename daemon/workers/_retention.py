"""Retention: how long what ended is kept, and letting it go.

A handle is released at once when collected, or after the finished TTL when not (a
tombstone is left where a live parent may still ask for its child); each release is one
transaction with the tombstones it makes or drops and the wakes of the implicit run it
takes along.
Archives (and their rows) go after `--keep-archives` days, pruned daily. Deadlines wait
on trio's clock, each for a span worked out from the wall-clock times written down.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from .._faults import Faults
from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry, Tombstone, WorkerRecord
from ..store._archive import prune_archives
from ..store._statedir import StateDir
from ..store._store import Change, Store
from ._mailbox import Mailbox

log = get_logger()


class Retention:
    def __init__(
        self,
        registry: Registry,
        store: Store,
        mailbox: Mailbox,
        state_dir: StateDir,
        problems: Problems,
        *,
        clock: Callable[[], float],
        finished_ttl: float,
        keep_archives_days: float,
        stdout_tail: Callable[[WorkerRecord], bytes],
        faults: Faults,
        released: Callable[[], None],
        run_dropped: Callable[[str], None],
    ) -> None:
        self._registry = registry
        self._store = store
        self._mailbox = mailbox
        self._state_dir = state_dir
        self._problems = problems
        self._clock = clock
        self.finished_ttl = finished_ttl
        self.keep_archives_days = keep_archives_days
        self._stdout_tail = stdout_tail
        self._faults = faults
        self._released = released
        self._run_dropped = run_dropped
        self._changed = trio.Event()

    def ended(self) -> None:
        """A handle ended: its expiry is due some time from now."""
        self._changed.set()

    def collected(self, worker_id: str) -> None:
        """Its result was collected: the handle goes now (a restart must not hold it)."""
        record = self._registry.collect(worker_id)
        self._release(worker_id, changed=record)

    def tombstone_collected(self, stone: Tombstone, answer: str) -> None:
        """A tombstone's result was collected: it keeps the answer (and no longer the
        output it was made from), in the store too, so a repeat collect answers the same
        after a reload or a crash. It goes as any tombstone does: with its parent's handle."""
        stone.answered, stone.output = answer, b""
        self._commit(Change(tombstones=[stone]))

    def _release(
        self, worker_id: str, tombstone: Tombstone | None = None, *, changed: WorkerRecord
    ) -> None:
        """Let a handle go (and what it held up), with the record that changed (collected,
        expired): one transaction with the tombstones and the run it takes along."""
        run = changed.run  # a release cascades within one run
        before = self._registry.tombstones()
        released = self._registry.release(worker_id, tombstone)
        if released:
            log.debug("worker.released", workers=released)
            self._released()
        after = self._registry.tombstones()
        change = Change(
            workers=[changed],
            tombstones=[stone for i, stone in after.items() if before.get(i) is not stone],
            dropped_tombstones=[i for i in before if i not in after],
        )
        if not self._registry.has_run(run):  # an implicit run went with its last worker
            # Nobody can subscribe to it any more: its wakes would wait forever. Its row,
            # if it has one, stays: a resume of its worker takes the run back as it was
            # (stopped, if it was), and a prune drops it with its last worker's row.
            change.acked = self._mailbox.orphans_of(run)
            self._run_dropped(run)
        self._commit(change)

    def _commit(self, change: Change) -> None:
        try:
            self._store.commit(change, "a release")
        except OSError as exc:  # released in memory regardless: a restart holds it again
            self._problems.disk_failed("store (a release)", exc)

    async def expire_handles(self) -> None:
        """Release handles left uncollected past the TTL, exactly when each expires."""
        while True:
            changed = self._changed = trio.Event()
            now = self._clock()
            for worker_id in self._registry.expired(now, self.finished_ttl):
                try:
                    self._expire(worker_id)
                except Exception:  # that handle stays; the others still go
                    log.exception("worker.not_expired", worker=worker_id)
            deadline = self._registry.next_expiry(self.finished_ttl)
            with trio.move_on_after(math.inf if deadline is None else deadline - now):
                await changed.wait()

    def _expire(self, worker_id: str) -> None:
        record = self._registry.worker(worker_id)
        self._faults.raise_at("expire", record.name)
        record.expired = True
        stone = None
        if self._registry.needs_tombstone(worker_id):
            stone = Tombstone.of(record, self._stdout_tail(record))
        self._release(worker_id, stone, changed=record)

    async def prune_archives_once(self) -> None:
        """Delete archives (and rows) of workers that ended more than the keep period ago."""
        cutoff = self._clock() - self.keep_archives_days * 86400
        doomed = [w for w in self._store.ended_before(cutoff) if not self._registry.holds(w)]
        archives = [p for w in doomed if (p := self._state_dir.archive(w)) is not None]
        if not doomed:
            return
        await trio.to_thread.run_sync(prune_archives, archives)
        try:
            self._store.forget(doomed)
        except OSError as exc:
            self._problems.disk_failed("store (pruning)", exc)
        log.info("archives.pruned", count=len(doomed))

    async def prune_archives_daily(self) -> None:
        # On trio's clock, each day from the start: the time a pruning takes (a thread
        # walking the archives) never pushes the next one later.
        due = trio.current_time()
        while True:
            due += 86400
            await trio.sleep_until(due)
            await self.prune_archives_once()
