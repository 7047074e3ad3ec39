"""The queue on trio: workers spawned over a cap wait here, written down, and start in
their turn as slots free. The decisions are the registry's schedule (`core/_schedule.py`);
this part holds what a queued worker starts with, starts each in its turn, and ends
unstarted the queued ones a stop reaches.

A queued worker is in the store (`WorkerRecord.queued`, its snapshot in its archive), so a
reload or a crash keeps it queued, in order. Its record is written out of the queue before
its process is started, so a crash at any point starts it at most once: a record that
says it started and has no process is ended `interrupted` by recovery, never started
again.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from subagentd.protocol import TERMINAL_STATES, WorkerView
from subagentd.protocol.errors import RemoteError

from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry, WorkerRecord
from ..store._archive import Archive
from ..store._journal import Journal
from ..store._store import Change, Store
from ._reader import Reader
from ._resumable import read_snapshot
from ._supervisor import LiveWorker, Supervisor

log = get_logger()

#: Why a queued worker that a stop reached ended (`WorkerView.reason`).
NEVER_STARTED = "never_started"
#: Why one that started after others ended: one of them could not do what it waited for.
SKIPPED = "skipped"
#: While the daemon takes no launches (a reload's fence), the queue looks again after this.
GATE_RETRY = 0.05


@dataclass
class Held:
    """What a queued worker starts with (as its spawn resolved it)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin: str | None
    stdin_open: bool


class Queue:
    """Queued workers: held, started in their turn, ended unstarted when stopped."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        reader: Reader,
        supervisor: Supervisor,
        problems: Problems,
        *,
        clock: Callable[[], float],
        launch: Callable[[LiveWorker, Held], Awaitable[WorkerView]],
        end_unstarted: Callable[[LiveWorker, str], None],
        end_unopened: Callable[[WorkerRecord], None],
        environment: Callable[[dict[str, str]], dict[str, str]],
        may_launch: Callable[[], bool],
    ) -> None:
        """`launch`: start a registered worker's process (the spawner's); `environment`: a
        worker's whole environment from what its snapshot froze; `may_launch`: whether the
        daemon starts workers now (not while a reload fences launches)."""
        self._registry = registry
        self._store = store
        self._reader = reader
        self._supervisor = supervisor
        self._problems = problems
        self._clock = clock
        self._launch = launch
        self._end_unstarted = end_unstarted
        self._end_unopened = end_unopened
        self._environment = environment
        self._may_launch = may_launch
        #: What each queued worker of this image's spawns starts with; one queued before
        #: a reload or a crash starts from its snapshot.
        self._held: dict[str, Held] = {}
        self._wanted = trio.Event()

    def hold(self, live: LiveWorker, held: Held) -> WorkerView:
        """A worker registered over a cap waits (its record, queued, is in the store)."""
        self._held[live.record.id] = held
        self._supervisor.hold_queued(live)
        if live.record.waits_for_others:
            self.slot_freed()  # what it waits for may have come already
        log.info(
            "worker.queued",
            worker=live.record.id,
            run=live.record.run,
            position=live.record.queue_position,
        )
        return live.record.view()

    def restore(self) -> None:
        """After a restart or a reload (the registry restored): hold each queued worker,
        to be waited for, and start whoever's turn it is."""
        for worker_id in self._registry.schedule.queued():
            record = self._registry.handle(worker_id)
            if record is not None and (live := self._live_of(record)) is not None:
                self._supervisor.hold_queued(live)
        self.slot_freed()

    def retrying(self, record: WorkerRecord, journal: Journal) -> None:
        """A worker that failed, given another attempt: it waits in the queue (its record,
        with its `retry_at`, written by its would-be ending's transaction)."""
        self._supervisor.hold_queued(LiveWorker(record=record, journal=journal))
        log.info("worker.retrying", worker=record.id, attempt=record.attempt, at=record.retry_at)
        self.slot_freed()

    def slot_freed(self) -> None:
        """A worker ended (or caps changed): whoever's turn it is may start."""
        self._wanted.set()

    def end_stopped(self, ids: list[str]) -> None:
        """End, unstarted, the queued workers among `ids` that a stop reached: one ending
        (and wake) each, `stopped` before their process ever began."""
        for record in self._registry.queued_among(ids):
            if record.stop_reason is None:
                continue
            self._held.pop(record.id, None)
            live = self._live_of(record)
            if live is None:
                continue
            if record.attempt == 1:
                record.reason = NEVER_STARTED
                why = f"stopped ({record.stop_reason}) while queued: never started"
            else:
                why = f"stopped ({record.stop_reason}) before attempt {record.attempt} started"
            self._end_unstarted(live, why)

    async def run(self) -> None:
        """Start each queued worker in its turn, for good, from the moment the image serves
        (recovery done, supervision hosted)."""
        await self._supervisor.wait_serving()
        while True:
            # A retry waiting out its backoff is due by the wall clock: woken for it too.
            due = self._registry.schedule.next_due(self._clock())
            with trio.move_on_after(math.inf if due is None else max(0.0, due - self._clock())):
                await self._wanted.wait()
            self._wanted = trio.Event()
            while True:
                # A reload's fence is a flag of the spawner's, no event: looked at again
                # soon. Asked before each start: one taken from the queue is started.
                while not self._may_launch():  # noqa: ASYNC110
                    await trio.sleep(GATE_RETRY)
                self._check_after()
                starting = self._registry.dequeue(self._clock(), most=1)
                if not starting:
                    break
                await self._start(starting[0])

    def _check_after(self) -> None:
        """Each worker held back until others have ended (or are ready): let it take its
        place once they have; end it, skipped, once one of them cannot do what it waits for."""
        for record in self._registry.blocked():
            if record.stop_reason is not None:
                continue  # its stop ends it
            verdict = self._after(record)
            if verdict is None:
                continue
            if not verdict:
                self._registry.unblock(record.id)
                continue
            live = self._live_of(record)
            if live is not None:
                record.stop_reason, record.reason = "after", SKIPPED
                self._held.pop(record.id, None)
                self._end_unstarted(live, verdict)

    def _after(self, record: WorkerRecord) -> str | None:
        """What the workers `record` starts after say: "" (go), a reason to skip it, or
        None (wait on)."""
        waiting = False
        for named in record.after:
            waiting |= self._reader.lookup(named).state not in TERMINAL_STATES
        for named in record.after_ok:
            found = self._reader.lookup(named)
            if found.state not in TERMINAL_STATES:
                waiting = True
            elif found.state != "finished":
                return (
                    f"skipped: worker {named} ended {found.state} (exit_code="
                    f"{found.exit_code}), and this one starts only after it finishes"
                )
        for named in record.after_ready:
            found = self._reader.lookup(named)
            if found.ready_at is not None:
                continue
            if found.state in TERMINAL_STATES:
                return f"skipped: worker {named} ended {found.state} before it was ready"
            waiting = True
        return None if waiting else ""

    async def _start(self, record: WorkerRecord) -> None:
        """Start one worker whose turn came: its record out of the queue first (in the store
        before its process exists, so no crash starts it twice), then its process."""
        held = self._held.pop(record.id, None)
        live = self._live_of(record)
        if live is None:
            return
        with self._supervisor.launching(), trio.CancelScope(shield=True):
            try:
                if held is None:
                    held = self._from_snapshot(record)
                self._store.commit(Change(workers=[record]), "a queued worker's start")
            except (OSError, RemoteError) as exc:
                log.error("worker.queued_start_failed", worker=record.id, error=str(exc))
                self._supervisor.hold_queued(live)  # for end_unstarted to take it back
                self._end_unstarted(live, f"could not start from the queue: {exc}")
                return
            self._supervisor.add(live)
            try:
                await self._launch(live, held)
            except RemoteError as exc:  # ended already, and said so (out of descriptors)
                log.warning("worker.queued_start_refused", worker=record.id, error=str(exc))
            except Exception as exc:
                log.exception("worker.queued_start_failed", worker=record.id)
                if live.process is None and not live.ended.is_set():
                    self._end_unstarted(live, f"failed to start ({type(exc).__name__}: {exc})")

    def _live_of(self, record: WorkerRecord) -> LiveWorker | None:
        """The queued worker as its ending or start needs it: its journal open."""
        live = self._supervisor.take_queued(record.id)
        if live is not None:
            return live
        try:
            journal = Journal.open(self._journal_path(record.id), writable=True)
        except Exception as exc:  # a damaged archive: it ends, said, and nothing starts
            log.error("worker.queued_journal", worker=record.id, error=str(exc))
            self._held.pop(record.id, None)
            self._registry.ended(record.id, None, self._clock())
            record.reason = NEVER_STARTED
            self._end_unopened(record)  # its one wake, as every ending's
            return None
        return LiveWorker(record=record, journal=journal)

    def _journal_path(self, worker_id: str) -> Path:
        return self._reader.archive_of(worker_id).file(Archive.JOURNAL)

    def _from_snapshot(self, record: WorkerRecord) -> Held:
        archive = self._reader.archive_of(record.id)
        snapshot = read_snapshot(archive, record.id)
        return Held(
            argv=snapshot.argv,
            cwd=snapshot.cwd,
            env=self._environment(snapshot.env),
            stdin=str(archive.file(Archive.INPUT)) if snapshot.has_input else None,
            stdin_open=snapshot.stdin_open,
        )
