"""Crash recovery: rebuild the registry from the archives when no checkpoint was left.

The last daemon died without handing over. Finished results stay collectable;
workers that were running are `interrupted`, and whatever of their process
trees survived (orphans now) is ended, but only after their leader's start
time shows the pid is still theirs; wakes not yet acknowledged come back from
the wake log, and an interrupted worker posts its own.

Each interrupted worker is recovered in its own fault boundary: its archive is
in its reach, and whatever was planted there (a directory where a file is
written, say) is logged and reported by `info`, never the end of recovery and
so of every later start.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from ._archive import STDOUT_TAIL_BYTES, Archive, is_spare
from ._daemon import Daemon
from ._journal import Journal, JournalCorrupt
from ._process import reap
from ._registry import WorkerRecord
from ._statedir import load_runs

log = structlog.get_logger("subagentd")


async def recover(daemon: Daemon) -> list[str]:
    """Load every archived worker still worth holding; the ids found interrupted."""
    records: list[WorkerRecord] = []
    interrupted: list[str] = []
    archives = daemon.state_dir.archives
    for path in sorted(archives.iterdir()):
        if is_spare(path):
            continue
        archive = Archive(path)
        record = archive.load_record()
        if record is None:
            log.warning("recovery.unreadable_archive", archive=str(path))
            continue
        if not record.ended:
            await _interrupt_alone(daemon, record, archive)
            interrupted.append(record.id)
        if not record.collected:
            records.append(record)
    daemon.registry.restore(
        runs=load_runs(daemon.state_dir.root / "runs"),
        records=records,
        tombstones=[],
        turn=0,
        fence=None,
        fence_epochs=0,
    )
    log.info("recovery.done", retained=len(records), interrupted=interrupted)
    return interrupted


async def _interrupt_alone(daemon: Daemon, record: WorkerRecord, archive: Archive) -> None:
    """`_interrupt`, as a fault boundary: whatever fails, the worker is held as ended."""
    try:
        await _interrupt(daemon, record, archive)
    except Exception as exc:
        log.exception("recovery.worker_failed", worker=record.id)
        daemon.recovery_problems.append(
            f"recovery of worker {record.id} failed partway ({type(exc).__name__}: {exc}); "
            f"it is held as {record.state if record.ended else 'interrupted'}: see the daemon log"
        )
    if not record.ended:
        record.state = "interrupted"
        record.ended_at = daemon.clock()


async def _interrupt(daemon: Daemon, record: WorkerRecord, archive: Archive) -> None:
    posted = next(
        (
            w
            for w in daemon.wakes.pending.values()
            if (w.id, w.attempt) == (record.id, record.attempt)
        ),
        None,
    )
    if posted is not None:
        # It had ended, and its wake was written, just before the daemon died.
        record.state, record.exit_code = posted.state, posted.exit_code
        record.ended_at = daemon.clock()
        archive.write_record(record)
        return
    try:
        await _end_leftovers(daemon, record)
    except Exception as exc:
        log.exception("recovery.tree_not_ended", worker=record.id)
        daemon.recovery_problems.append(
            f"what is left of worker {record.id}'s process tree could not be ended "
            f"({type(exc).__name__}: {exc}): see the daemon log"
        )
    stdout_tail = b""
    try:
        journal = Journal.open(archive.file(Archive.JOURNAL), writable=True)
    except (OSError, JournalCorrupt) as exc:
        log.error("recovery.journal_unusable", worker=record.id, error=str(exc))
    else:
        try:
            if journal.torn_bytes:
                log.warning("recovery.torn_tail_cut", worker=record.id, bytes=journal.torn_bytes)
            stdout_tail = journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
            journal.append("state", b"interrupted (the daemon died while it ran)", daemon.clock())
        except OSError as exc:
            log.error("recovery.journal_unwritable", worker=record.id, error=str(exc))
        finally:
            journal.close()
    record.state = "interrupted"
    record.ended_at = daemon.clock()
    # Each step stands alone: a tail that cannot be written costs no wake, nor the record.
    _alone(daemon, record, "stdout tail", lambda: archive.write_stdout_tail(stdout_tail))
    _alone(daemon, record, "wake", lambda: daemon.post_wake(record, archive))
    _alone(daemon, record, "record", lambda: archive.write_record(record))


async def _end_leftovers(daemon: Daemon, record: WorkerRecord) -> None:
    killed = await daemon.end_leftover_tree(record.id, record.pid, record.pid_start, record.grace)
    if record.pid is not None:
        await reap(record.pid)
    if killed:
        log.warning("recovery.killed_orphans", worker=record.id, processes=killed)


def _alone(daemon: Daemon, record: WorkerRecord, what: str, step: Callable[[], None]) -> None:
    """One step of a worker's recovery; if it fails, that is logged and reported."""
    try:
        step()
    except Exception as exc:
        log.exception("recovery.step_failed", worker=record.id, step=what)
        daemon.recovery_problems.append(
            f"recovery of worker {record.id} could not write its {what} "
            f"({type(exc).__name__}: {exc})"
        )
