"""Crash recovery: rebuild the registry from the archives when no checkpoint was left.

The last daemon died without handing over. Finished results stay collectable;
workers that were running are `interrupted`, and whatever of their process
trees survived (orphans now) is ended, but only after their leader's start
time shows the pid is still theirs; wakes not yet acknowledged come back from
the wake log, and an interrupted worker posts its own.
"""

from __future__ import annotations

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
            await _interrupt(daemon, record, archive)
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
    if record.pid is not None:
        killed = await daemon.end_leftover_tree(
            record.id, record.pid, record.pid_start, record.grace
        )
        await reap(record.pid)
        if killed:
            log.warning("recovery.killed_orphans", worker=record.id, processes=killed)
    stdout_tail = b""
    try:
        journal = Journal.open(archive.file(Archive.JOURNAL), writable=True)
    except (OSError, JournalCorrupt) as exc:
        log.error("recovery.journal_unusable", worker=record.id, error=str(exc))
    else:
        if journal.torn_bytes:
            log.warning("recovery.torn_tail_cut", worker=record.id, bytes=journal.torn_bytes)
        journal.append("state", b"interrupted (the daemon died while it ran)", daemon.clock())
        stdout_tail = journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
        journal.close()
    record.state = "interrupted"
    record.ended_at = daemon.clock()
    archive.write_stdout_tail(stdout_tail)
    daemon.post_wake(record, archive)
    archive.write_record(record)
