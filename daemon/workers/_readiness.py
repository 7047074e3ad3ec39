"""Readiness: a worker spawned with a `ready` pattern is marked ready once a line of its
output (this attempt's) matches, searched as `wait_for` searches (`Reader.wait_for`, RE2,
line by line, from the journal). Written down with its time, so a reload or a restart
keeps it; `wait` with `ready` answers once the worker is ready or has ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry, WorkerRecord
from ..store._store import Change, Store
from ._reader import Reader
from ._supervisor import Supervisor

log = get_logger()


class Readiness:
    """One search a live worker with a ready pattern, until it matches or the worker ends."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        reader: Reader,
        supervisor: Supervisor,
        problems: Problems,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._store = store
        self._reader = reader
        self._supervisor = supervisor
        self._problems = problems
        self._clock = clock
        self._nursery: trio.Nursery | None = None
        #: Searches asked before the nursery runs (a restart's), started with it.
        self._pending: list[WorkerRecord] = []
        #: Set when each worker's search is over (ready, or ended): what `wait_ready` awaits.
        self._over: dict[str, trio.Event] = {}
        #: Told each time a worker becomes ready (the queue: who starts after it).
        self.on_ready: Callable[[], None] = lambda: None

    async def run(self) -> None:
        """Host the searches, for good."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for record in self._pending:
                nursery.start_soon(self._search, record)
            self._pending.clear()
            await trio.sleep_forever()

    def watch(self, record: WorkerRecord) -> None:
        """Search a worker's output for its ready pattern, from this attempt's start."""
        if record.ready_pattern is None or record.ready_at is not None:
            return
        if record.id in self._over:
            return  # searched already (a retry's next attempt: the search goes on)
        self._over[record.id] = trio.Event()
        if self._nursery is None:
            self._pending.append(record)
        else:
            self._nursery.start_soon(self._search, record)

    def restore(self) -> None:
        """After a restart or a reload: search again for every live worker not yet ready."""
        for record in self._registry.handles():
            if not record.ended and record.queued is None:
                self.watch(record)

    async def wait_ready(self, worker_id: str) -> None:
        """Return once the worker is ready or its search is over (it ended)."""
        record = self._registry.handle(worker_id)
        if record is None or record.ended or record.ready_at is not None:
            return
        over = self._over.get(worker_id)
        if over is None:  # queued, or between attempts: its next one's search
            await self._supervisor.wait_ended([worker_id])
            return
        await over.wait()

    async def _search(self, record: WorkerRecord) -> None:
        over = self._over[record.id]
        try:
            assert record.ready_pattern is not None
            found = await self._reader.wait_for(
                record.id, record.ready_pattern, math.inf, since=record.ready_since
            )
            if found.outcome == "matched" and not record.ended:
                self._ready(record, found.line or "")
        except Exception:
            log.exception("worker.ready_search_failed", worker=record.id)
        finally:
            over.set()
            if self._over.get(record.id) is over:
                del self._over[record.id]

    def _ready(self, record: WorkerRecord, line: str) -> None:
        now = self._clock()
        record.ready_at = now
        live = self._supervisor.get(record.id)
        try:
            if live is not None and live.journal.writable:
                live.journal.append("note", f"ready: {line}"[:4096].encode(), now)
            self._store.commit(Change(workers=[record]), "a worker's readiness")
        except OSError as exc:
            self._problems.disk_failed("store (a worker's readiness)", exc)
        log.info("worker.ready", worker=record.id, attempt=record.attempt)
        self.on_ready()
