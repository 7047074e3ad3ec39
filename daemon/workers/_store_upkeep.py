"""The store's upkeep while the daemon runs: the changes a failing disk kept out written
again until they go in, and the store's files checked to be the ones linked in the state
dir though nothing is written. Two housekeeping tasks; the store itself decides."""

from __future__ import annotations

import trio

from .._problems import Problems
from ..store._store import Store

#: A change the store's disk kept out is tried again after this, doubling up to the max.
STORE_RETRY_FIRST = 0.1
STORE_RETRY_MAX = 5.0
#: How often an idle daemon checks that its store's files are still linked (two stats).
STORE_LINK_CHECK_EVERY = 5.0


class StoreUpkeep:
    """The store's two housekeeping tasks, run by the daemon for good."""

    def __init__(self, store: Store, problems: Problems) -> None:
        self._store = store
        self._problems = problems

    def unwritten_problem(self) -> list[str]:
        """What `info` says while changes are kept out (none once every one is in)."""
        count = self._store.unwritten
        if not count:
            return []
        return [
            f"{count} change(s) (endings, acknowledgements) are not yet in the store "
            f"{self._store.path}: a failing disk kept them out; retried until they go in"
        ]

    async def write_what_the_store_kept_out(self) -> None:
        """Retry, backing off, the changes a failing disk kept out of the store (an
        ending, an ack) until they go in: a daemon with nothing else to write must not
        leave them to a crash, which would end those workers again and wake twice."""
        while True:
            wanted = trio.Event()
            self._store.on_unwritten = wanted.set
            delay = STORE_RETRY_FIRST
            while self._store.unwritten:  # kept out before this task began, too
                await trio.sleep(delay)
                delay = min(delay * 2, STORE_RETRY_MAX)
                try:
                    self._store.flush()
                except OSError as exc:
                    self._problems.disk_failed("store", exc)
            await wanted.wait()

    async def check_the_store_is_linked(self) -> None:
        """Each commit checks that the store's files are still the ones linked in the state
        dir; this checks a daemon that writes nothing too, so that a store unlinked while
        it idles is put back before a crash could lose it (`Store.check_linked`)."""
        while True:
            await trio.sleep(STORE_LINK_CHECK_EVERY)
            self._store.check_linked()
