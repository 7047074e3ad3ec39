"""A worker's ending, written down: one transaction holding its record's final state
(and so its retention), the wake its parent is owed and, where the journal would not give
it as well, its stdout's tail. So no crash leaves an ending without its wake, or a wake
without its ending ("every ending wakes its parent exactly once", by construction).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from subagentd.protocol import Wake

from .._faults import Faults
from .._logging import get_logger
from .._problems import Problems
from ..core._registry import Registry, WorkerRecord
from ..processes._controllers import LimitsHit
from ..store._archive import STDOUT_TAIL_BYTES
from ..store._journal import Journal, JournalCorrupt
from ..store._store import Change, Store
from ..store._together import GroupCommit
from ._mailbox import Mailbox
from ._reader import Reader

log = get_logger()

#: A journal longer than this has its stdout tail kept in the store when its worker ends.
TAIL_KEPT_FROM_BYTES = 1024 * 1024
#: A wake carries this much of the result, so a parent rarely needs to collect.
WAKE_PREVIEW_CHARS = 200


class Endings:
    def __init__(
        self,
        registry: Registry,
        store: Store,
        reader: Reader,
        mailbox: Mailbox,
        problems: Problems,
        *,
        clock: Callable[[], float],
        faults: Faults,
        ended: Callable[[], None],
    ) -> None:
        self._registry = registry
        self._store = store
        self._reader = reader
        self._mailbox = mailbox
        self._problems = problems
        self._clock = clock
        self._faults = faults
        self._ended = ended
        self._together = GroupCommit(store, "endings")
        #: Endings recorded in this daemon's life (for the `die-in-ending` fault).
        self._count = 0

    def finish(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        failure: str | None = None,
    ) -> None:
        """Record a worker's ending; `failure`: its supervision failed (and says why), so
        it ends `failed` whatever its exit, even if an ending had begun before the fault."""
        keep = self._close(record, journal, returncode, stdout_tail, failure)
        self.record(
            record,
            stdout_tail,
            keep_tail=keep,
            before_commit=None if failure is not None else lambda: self._ending_faults(record),
        )
        self._ended()

    async def finish_together(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        hit: LimitsHit | None = None,
        note: bytes | None = None,
    ) -> None:
        """`finish`, its transaction shared with the endings reached in the same scheduling
        batch (`GroupCommit`); returns once it is written. The ending is made (its state,
        its journal's last entry, its wake) when the batch is written, in the same step,
        so no one sees it before the store has it. `note`: a state entry journaled just
        before the ending's (a stop of many's `stopping`), in the same opening."""
        wakes: list[Wake | None] = []

        def make() -> Change:
            keep = self._close(record, journal, returncode, stdout_tail, None, hit, note)
            change, wake = self._written_down(record, stdout_tail, keep)
            wakes.append(wake)
            return change

        try:
            await self._together.commit(make, lambda: self._ending_faults(record))
        except OSError as exc:
            # Still delivered from memory; written with the next change that goes in.
            self._problems.disk_failed("store (an ending)", exc)
        else:
            self._problems.disk_ok()
        if any(wakes):
            self._mailbox.announce()
        self._ended()

    def _close(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        failure: str | None,
        hit: LimitsHit | None = None,
        note: bytes | None = None,
    ) -> bytes | None:
        """Its terminal state, and its journal's last entry (after `note`, a state entry
        left to it): the stdout tail to keep in the store with its ending, if any."""
        if failure is None:
            self._faults.raise_at("ending", record.name)
        now = self._clock()
        self._registry.ended(record.id, returncode, now)
        if failure is not None:
            record.state = "failed"
            journal = self._note_failure(record, journal, failure, now)
        if hit is not None:
            self._note_limits(record, journal, hit, now)
        try:
            if journal.writable:
                if note is not None:
                    journal.append("state", note, now)
                journal.append("state", f"{record.state} exit_code={returncode}".encode(), now)
        except OSError as exc:
            self._problems.disk_failed(f"journal of {record.id}", exc)
        except JournalCorrupt as exc:  # its file replaced while closed: the ending goes on
            log.error("worker.journal_refused", worker=record.id, error=str(exc))
        ended_as = record.state
        if (delay := self._registry.retry(record, now)) is not None:
            # Not an ending: its next attempt waits out the backoff (its journal goes on).
            self._note(
                record,
                journal,
                f"attempt {record.attempt - 1} ended {ended_as} (exit_code={returncode}): "
                f"attempt {record.attempt} of {record.retries + 1} in {delay:g} s",
                now,
            )
            return None
        journal.close()
        # Its tail serves the collect that follows.
        self._reader.keep_journal_open(record.id, journal)
        # Collect's tail is the journal's end; it is kept in the store, with the ending,
        # only where the journal would not answer as well: when it is long, or its newest
        # entries (all a reader keeps) hold less stdout.
        if (
            journal.size > TAIL_KEPT_FROM_BYTES
            or journal.tail_bytes("stdout", STDOUT_TAIL_BYTES) != stdout_tail
        ):
            return stdout_tail[-STDOUT_TAIL_BYTES:]
        return None

    def _note(self, record: WorkerRecord, journal: Journal, note: str, now: float) -> None:
        try:
            if journal.writable:
                journal.append("note", note.encode(), now)
        except (OSError, JournalCorrupt) as exc:
            log.error("worker.not_noted", worker=record.id, error=str(exc))

    def _note_limits(
        self, record: WorkerRecord, journal: Journal, hit: LimitsHit, now: float
    ) -> None:
        """What its limits did, in its journal; a worker that failed with the kernel having
        OOM-killed in it at a memory limit ends for that reason ("memory_limit")."""
        notes = []
        if hit.oom_kills:
            if record.state == "failed":
                record.reason = "memory_limit"
            peak = "unknown" if hit.peak is None else f"{hit.peak} bytes"
            notes.append(
                f"memory_limit: the kernel killed {hit.oom_kills} of its processes at a "
                f"memory limit (its peak: {peak})"
            )
        if hit.forks_refused:
            notes.append(
                f"pids_limit: {hit.forks_refused} forks refused at a process limit "
                f"(pids.events max {hit.forks_refused})"
            )
        for note in notes:
            log.info("worker.limit_reached", worker=record.id, note=note)
            try:
                if journal.writable:
                    journal.append("note", note.encode(), now)
            except (OSError, JournalCorrupt) as exc:
                log.error("worker.limit_not_noted", worker=record.id, error=str(exc))

    def _ending_faults(self, record: WorkerRecord) -> None:
        """Inside an ending's transaction: the faults the tests inject there."""
        self._count += 1
        if ("die-in-ending", str(self._count)) in self._faults:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-transaction, for the tests
        self._faults.raise_at("record", record.name)

    def without_journal(self, record: WorkerRecord) -> None:
        """Write down the ending of a worker ended (`Registry.ended`) whose journal could not
        be opened: its state and its one wake, nothing journaled."""
        self.record(record)
        self._ended()

    def record(
        self,
        record: WorkerRecord,
        stdout_tail: bytes | None = None,
        *,
        keep_tail: bytes | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Write an ended worker down in one transaction: its record's final state (and
        with it its retention) and one wake for its parent, so no crash leaves one without
        the other. The wake is in the store before anyone sees it."""
        change, wake = self._written_down(record, stdout_tail, keep_tail)
        try:
            self._store.commit(change, "an ending", before_commit=before_commit, redo=True)
        except OSError as exc:
            # Still delivered from memory; written with the next change that goes in.
            self._problems.disk_failed("store (an ending)", exc)
        else:
            self._problems.disk_ok()
        if wake is not None:
            self._mailbox.announce()

    def _written_down(
        self, record: WorkerRecord, stdout_tail: bytes | None, keep_tail: bytes | None
    ) -> tuple[Change, Wake | None]:
        """The change that writes an ended worker down, and the wake it posts (None: one
        was posted before a fault, and is restated as it stands now)."""
        if not record.ended:  # given another attempt (`Registry.retry`): no wake yet
            return Change(workers=[record]), None
        archive = self._reader.archive_of(record.id)

        def tail() -> bytes:
            return self._reader.stdout_tail(record) if stdout_tail is None else stdout_tail

        try:
            preview = archive.result_text(tail)[:WAKE_PREVIEW_CHARS]
        except Exception as exc:  # result_text reads around OSError; the wake matters more
            log.warning("wake.no_preview", worker=record.id, error=str(exc))
            preview = ""
        wake = self._mailbox.wake_for(record, preview)
        change = Change(workers=[record])
        if keep_tail is not None:
            change.tails[record.id] = keep_tail
        if wake is not None:
            change.wakes.append(wake)
        else:  # posted before a fault: as it stands now, wherever the fault left it
            change.restated = self._mailbox.restated(record)
        return change, wake

    def _note_failure(
        self, record: WorkerRecord, journal: Journal, failure: str, now: float
    ) -> Journal:
        """Say in the journal why supervision failed; the journal, written again if the
        ending had closed it before the fault."""
        try:
            if not journal.writable:
                journal.write_again()  # never verified again here: on the event loop
            journal.append("note", failure.encode(), now)
        except Exception:
            log.exception("journal.failure_not_noted", worker=record.id)
        return journal
