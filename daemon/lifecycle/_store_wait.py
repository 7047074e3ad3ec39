"""Opening the store at a start or a reload's handoff, waiting for as long as it takes
while another process holds a lock on it (`StoreLocked`): someone else's lock is never
a reason to give the store, or the daemon and its workers, up. What it waits for is
logged when the wait begins and when it ends, and told to every client meanwhile
(`serving/_waiting.py`: `info` says it, every other request is answered `busy`).

A handoff waits too while the store cannot be opened at all (`StoreUnusable`: a full
disk, a permission taken away): the new image holds every worker the old one carried
(they are its children, their pipes its descriptors), and exiting would leave them
running unsupervised. A start refuses instead, as before: nothing is running yet, and
the person starting it is there to read why.

SIGTERM or SIGINT ends either wait (`WaitStopped`): a start's with nothing run, a
handoff's once its caller has ended the workers it carried (`_serve`), as any stop
ends them. The exec left those signals blocked for a handoff: they are let in for the
wait alone (SIGHUP stays blocked: there is nothing to reload yet), then blocked again,
so one that comes as the store opens waits for the serving image's receiver.
"""

from __future__ import annotations

import functools
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .._logging import get_logger
from ..serving._waiting import WaitingServer
from ..store._store import Store, StoreTooNew, StoreUnusable
from ..store._store_lock import StoreLocked, since_text

log = get_logger()

#: How soon the store is tried again, doubling up to the max.
RETRY_FIRST = 0.05
RETRY_MAX = 1.0


class WaitStopped(Exception):
    """Told to stop while a start waited for its store: nothing ran, nothing is lost."""


#: What ends a wait for the store.
_STOPPING = {signal.SIGTERM, signal.SIGINT}


async def _stop_on_signal(scope: trio.CancelScope, stopped: list[str], *, blocked: bool) -> None:
    """At the first SIGTERM or SIGINT, say which in `stopped` and end the wait; `blocked`:
    those signals are blocked (a handoff's, across the exec): let in meanwhile only."""
    with trio.open_signal_receiver(*_STOPPING) as signals:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)
        try:
            async for signum in signals:
                stopped.append(signal.Signals(signum).name)
                log.info("store.wait_stopped", signal=stopped[0])
                scope.cancel()
                return
        finally:
            if blocked:  # before the receiver closes: what it holds is raised again, held
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)


@dataclass
class StoreWait:
    """What the daemon waits for before its store is open, and since when (wall clock)."""

    why: str
    since: float

    def told(self) -> str:
        return f"waiting since {since_text(self.since)} for the store: {self.why}"


class StoreWaiting:
    """Opening the store at `path` (`lock_fd`: its lock as a reload carried it)."""

    def __init__(self, path: Path, lock_fd: int | None, *, handoff: bool) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self._handoff = handoff
        #: The wait under way, if any.
        self.current: StoreWait | None = None

    def try_open(self) -> Store | None:
        """The store, or None if it must be waited for (said in the log); a start's
        StoreUnusable and StoreTooNew are raised."""
        lock_fd, self._lock_fd = self._lock_fd, None  # closed by any attempt that fails
        try:
            store = Store.open(self.path, lock_fd)
        except StoreLocked as exc:
            self._waiting(str(exc), "locked")
        except StoreTooNew:
            raise
        except StoreUnusable as exc:
            if not self._handoff:
                raise
            self._waiting(str(exc), "unusable")
        else:
            if self.current is not None:
                log.warning(
                    "store.wait_over",
                    path=str(self.path),
                    waited_s=round(time.time() - self.current.since, 3),
                )
                self.current = None
            return store
        return None

    async def open(self, control: socket.socket, server: WaitingServer) -> Store:
        """The store, once it can be had; until then `server` answers on `control`. A
        SIGTERM or SIGINT meanwhile raises WaitStopped (a handoff's caller then ends the
        workers it carried)."""
        delay = RETRY_FIRST
        stopped: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, control)
            nursery.start_soon(
                functools.partial(
                    _stop_on_signal, nursery.cancel_scope, stopped, blocked=self._handoff
                )
            )
            while (store := self.try_open()) is None:
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
            nursery.cancel_scope.cancel()
        if stopped:
            raise WaitStopped(f"stopped by {stopped[0]} while it waited for its store")
        return store

    def told(self) -> str:
        return self.current.told() if self.current is not None else "opening the store"

    def _waiting(self, why: str, kind: str) -> None:
        if self.current is not None and self.current.why == why:
            return
        self.current = StoreWait(why, self.current.since if self.current else time.time())
        log.error("store.waiting", kind=kind, why=why, since=since_text(self.current.since))
