"""Opening the store at a start or a reload's handoff, waiting for as long as it takes
while another process holds a lock on it (`StoreLocked`): someone else's lock is never
a reason to give the store, or the daemon and its workers, up. What it waits for is
logged when the wait begins and when it ends, and kept (`StoreWait`) for `info`.

A handoff waits too while the store cannot be opened at all (`StoreUnusable`: a full
disk, a permission taken away): the new image holds every worker the old one carried
(they are its children, their pipes its descriptors), and exiting would leave them
running unsupervised. A start refuses instead, as before: nothing is running yet, and
the person starting it is there to read why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .._logging import get_logger
from ..store._store import Store, StoreTooNew, StoreUnusable
from ..store._store_lock import StoreLocked, since_text

log = get_logger()

#: How soon the store is tried again, doubling up to the max.
RETRY_FIRST = 0.05
RETRY_MAX = 1.0


@dataclass
class StoreWait:
    """What the daemon waits for before its store is open, and since when (wall clock)."""

    why: str
    since: float

    def problem(self) -> str:
        return f"waiting since {since_text(self.since)} for the store: {self.why}"


class StoreWaiting:
    """The wait under way, if any, for whoever reports it (`info`, the log)."""

    def __init__(self) -> None:
        self.current: StoreWait | None = None

    async def open(self, path: Path, lock_fd: int | None, *, handoff: bool) -> Store:
        """The store at `path` (`lock_fd`: its lock as a reload carried it), once it can
        be had; a start's StoreUnusable and StoreTooNew are raised."""
        delay = RETRY_FIRST
        while True:
            try:
                store = Store.open(path, lock_fd)
            except StoreLocked as exc:
                self._waiting(str(exc), "locked")
            except StoreTooNew:
                raise
            except StoreUnusable as exc:
                if not handoff:
                    raise
                self._waiting(str(exc), "unusable")
            else:
                if self.current is not None:
                    log.warning(
                        "store.wait_over",
                        path=str(path),
                        waited_s=round(time.time() - self.current.since, 3),
                    )
                    self.current = None
                return store
            lock_fd = None  # closed by the attempt: the next one opens the file afresh
            await trio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    def _waiting(self, why: str, kind: str) -> None:
        if self.current is not None and self.current.why == why:
            return
        self.current = StoreWait(why, self.current.since if self.current else time.time())
        log.error("store.waiting", kind=kind, why=why, since=since_text(self.current.since))
