"""Crash recovery: rebuild the registry from the store.

The last daemon died without handing over (or handed over only its live pids: a
reload's new image takes the rest from here too). The store says which workers it
held: finished results stay collectable; workers not ended in the store were
running, and are `interrupted`, and whatever of their process trees survived
(orphans now) is ended: by its cgroup, else from the leader its record names only
if that pid is still the process started then and carries the worker's id (see
`_leader`), else by that id alone. Wakes not yet acknowledged come back from the
store, and an interrupted worker's ending (record and wake) is one transaction.

Each interrupted worker is recovered in its own fault boundary: its archive is in
its reach, and whatever was planted there is logged and reported by `info`, never
the end of recovery and so of every later start. A row that no longer decodes (or
an older image's record.json that did not) is rebuilt from the snapshot and the
journal's last state: such a worker cannot escape recovery, and its leftovers are
found by the worker id they inherited, there being no pid to go by (`_rebuild`
says what is lost).

The store is reconciled with the archives (`reconcile`): a spawn writes its row before
its archive exists, so an archive without a row means the store lost rows (an emptied
or replaced database, a WAL cut short). Such a worker is rebuilt as a damaged row is,
comes back as its journal says it ended (else `interrupted`, its leftover tree ended by
its worker id), and wakes its parent again: after such damage a wake may come twice,
never not at all. Where the store may have lost rows, or its WAL ended inside a commit
(cut there, or torn), a worker its row says running but its journal says ended (since
that attempt began) takes that ending (its ending's commit was lost), not `interrupted`.
Without damage, reconciling is a listing and one query, no archive read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import trio

from subagentd.protocol import TERMINAL_STATES, Wake, WorkerState
from subagentd.protocol.errors import Refused

from .._daemon import Daemon
from .._logging import get_logger
from ..core._recovering import RecoveryProgress
from ..core._registry import WorkerRecord, new_token
from ..processes._process import reap
from ..processes._tree import carries_worker_id, read_stat
from ..store._archive import STDOUT_TAIL_BYTES, Archive, prune_archives
from ..store._journal import Journal, JournalCorrupt
from ..store._store import Change
from ..workers._resumable import read_snapshot

log = get_logger()


async def recover(
    daemon: Daemon,
    *,
    carried: frozenset[str] = frozenset(),
    unread: list[str] | None = None,
    held: tuple[list[WorkerRecord], list[str]] | None = None,
) -> list[str]:
    """Take back every worker the store holds; the ids found interrupted.

    `carried`: workers a reload carried live (adopted, not interrupted); `unread`: ids
    whose record did not read elsewhere (an older image's record.json), rebuilt too;
    `held`: `Store.held_workers()` as the caller just read it, with nothing written since
    (else it is read here).
    """
    progress = daemon.recovering  # None for a reload's new image: it serves after
    records, damaged = held if held is not None else daemon.store.held_workers()
    # First: it may find that the store lost rows, which changes what an unended row means.
    records += await reconcile(daemon, rebuilt_below=unread or ())
    interrupted: list[str] = []
    rebuilding = list(dict.fromkeys([*damaged, *(unread or ())]))
    if progress is not None:
        progress.begin("rebuilding damaged records", len(rebuilding), trio.current_time())
    for worker_id in rebuilding:
        path = daemon.state_dir.archive(worker_id)
        rebuilt = await _rebuild_alone(daemon, Archive(path)) if path is not None else None
        if rebuilt is not None:
            records.append(rebuilt)
        await _took(progress)
    # A queued worker never started: it stays queued, in its place (`workers/_queue.py`).
    running = [r for r in records if not r.ended and r.queued is None and r.id not in carried]
    if progress is not None:
        progress.begin("ending what was running", len(running), trio.current_time())
        # A test's hold: see protocol/README.md, Recovery.
        await daemon.faults.hold_at("recovery", "held")
    # Each worker's wake, if it posted one, found once for all (not a walk of every
    # pending wake a worker: 10,000 finished and 2,000 running made that seconds).
    posted = daemon.mailbox.posted_by_attempt() if running else {}
    for record in running:
        archive = daemon.reader.archive_of(record.id)
        await _interrupt_alone(daemon, record, archive, posted.get((record.id, record.attempt)))
        interrupted.append(record.id)
        await _took(progress)
    if progress is not None:
        progress.begin("rebuilding the registry", len(records), trio.current_time())
    launch = daemon.store.launch()
    daemon.registry.restore(
        runs=daemon.store.runs(),
        records=records,
        tombstones=daemon.store.tombstones(),
        turn=launch.turn,
        fence=launch.fence,
        fence_epochs=launch.fence_epochs,
    )
    # What clients see: an earlier image may have taken it from a rewritten record.
    for record in daemon.registry.handles():
        record.archive = _archive_at(daemon, record.id)
    for stone in daemon.registry.tombstones().values():
        stone.archive = _archive_at(daemon, stone.id)
    daemon.spawner.queue.restore()
    daemon.spawner.readiness.restore()
    log.info("recovery.done", retained=len(records), interrupted=interrupted)
    return interrupted


async def reconcile(daemon: Daemon, *, rebuilt_below: Iterable[str] = ()) -> list[WorkerRecord]:
    """The workers whose archive the store has no row for, rebuilt from their archives
    and written to the store (the ended ones with their wake), each in its own fault
    boundary; the not-ended ones are left to the caller to interrupt. Archive names that
    are no directory are reported, never followed. Run before `Registry.restore` (as
    `recover` does); run after it, take each record in with `Registry.restore_worker`.
    `rebuilt_below`: ids without a row that `recover` rebuilds itself (an older image's
    record.json that did not read: no store lost them), neither rebuilt nor said here."""
    unread = set(rebuilt_below)
    unrecorded, foreign = daemon.state_dir.unrecorded(lambda: daemon.store.known_workers() | unread)
    for name, what in foreign:
        daemon.problems.recovery.append(
            f"archive {daemon.state_dir.archives / name} is {what}: skipped, not followed"
        )
    if not unrecorded:
        return []
    rebuilt: list[WorkerRecord] = []
    pruned: list[Path] = []
    # A pruning deletes archives before their rows: one it could not delete whole, of a
    # worker that ended before the keep period, is its leftover, not a row lost. (Never
    # one whose handle could still be held, uncollected: a pruning keeps those.)
    retention = daemon.retention
    kept_for = max(retention.keep_archives_days * 86400, retention.finished_ttl)
    cutoff = daemon.clock() - kept_for
    for worker_id in unrecorded:
        archive = Archive(daemon.state_dir.archives / worker_id)
        record = await _rebuild_alone(daemon, archive, row_lost=True)
        if record is not None and record.ended_at is not None and record.ended_at < cutoff:
            pruned.append(archive.path)
        elif record is not None:
            rebuilt.append(record)
    if pruned:
        await trio.to_thread.run_sync(prune_archives, pruned)
        unrecorded = [w for w in unrecorded if daemon.state_dir.archives / w not in pruned]
        if not unrecorded:
            return []
    if rebuilt:  # (an archive that cannot be rebuilt is said again at each start, no more)
        daemon.store.damaged = True
        daemon.mailbox.skip_seqs()  # before any wake below is given its seq
    for record in rebuilt:
        if record.ended:  # its wake went with its row, delivered or not: posted again
            _alone(daemon, record, "ending", functools.partial(daemon.endings.record, record))
    shown = ", ".join(unrecorded[:5]) + (", ..." if len(unrecorded) > 5 else "")
    problem = (
        f"the store {daemon.store.path} had no row for {len(unrecorded)} worker(s) whose "
        f"archive is on disk ({shown}): it lost them; {len(rebuilt)} rebuilt from their "
        "archives (as their journals say they ended, else interrupted)"
    )
    if len(rebuilt) < len(unrecorded):
        problem += f", {len(unrecorded) - len(rebuilt)} not: their snapshots do not read"
    log.error("recovery.rows_lost", problem=problem, workers=len(unrecorded))
    daemon.problems.recovery.append(problem)
    return rebuilt


def _archive_at(daemon: Daemon, worker_id: str) -> str:
    """Where the state dir keeps the worker's archive, as `Reader.archive_of` says, as a
    string (made for every record here, at every reload: pathlib's joins cost)."""
    at = daemon.state_dir.archive_at(worker_id)
    return at if at is not None else str(daemon.reader.archive_of(worker_id).path)  # NotFound


async def _rebuild_alone(
    daemon: Daemon, archive: Archive, *, row_lost: bool = False
) -> WorkerRecord | None:
    """`_rebuild`, as a fault boundary: if it fails, that archive is left as it is."""
    try:
        return await _rebuild(daemon, archive, row_lost=row_lost)
    except Exception as exc:
        log.exception("recovery.rebuild_failed", archive=str(archive.path))
        daemon.problems.recovery.append(
            f"archive {archive.path} has no readable record, and rebuilding one failed "
            f"({type(exc).__name__}: {exc}): see the daemon log"
        )
        return None


async def _rebuild(
    daemon: Daemon, archive: Archive, *, row_lost: bool = False
) -> WorkerRecord | None:
    """A record for a worker whose row (or record.json) does not read, or that has no
    row at all (`row_lost`: the store lost it), from what does.

    The snapshot gives what the worker ran and where it belongs; the journal's
    last state entry whether it had ended. Lost with the record: its pid (its
    tree is found by the worker id its processes inherited, so one that exec'd
    with a new environment escapes), its token, and its attempt (taken as 1).
    Without a snapshot nothing is listed, but what still runs is ended.
    """
    worker_id = archive.path.name
    try:
        snapshot = read_snapshot(archive, worker_id)
    except (Refused, OSError) as exc:
        log.warning("recovery.unreadable_archive", archive=str(archive.path), error=str(exc))
        if row_lost:
            # The refusal is a resume's ("cannot be resumed: <why>; start it afresh").
            why = getattr(exc, "message", str(exc)).partition("cannot be resumed: ")[2]
            daemon.problems.recovery.append(
                f"archive {archive.path} has no row in the store and cannot be rebuilt "
                f"({why.removesuffix('; start it afresh') or exc}): skipped, what still ran "
                "of it ended"
            )
        if worker_id.startswith("w-"):
            killed = await daemon.launcher.end_leftover_tree(worker_id, None, None, 0)
            if killed:
                log.warning("recovery.killed_orphans", worker=worker_id, processes=killed)
        return None
    record = WorkerRecord(
        id=worker_id,
        run=snapshot.run,
        parent=snapshot.parent,
        name=snapshot.name,
        state="running",
        argv=snapshot.argv,
        cwd=snapshot.cwd,
        agent=snapshot.agent,
        grace=snapshot.grace,
        timeout=snapshot.timeout,
        token=new_token(),
        archive=str(archive.path),
        started_at=snapshot.created_at,
    )
    why = (
        "its row was lost with the store's damage" if row_lost else "its record did not read"
    ) + ": rebuilt from its snapshot and journal by recovery"
    try:
        journal = Journal.open(archive.file(Archive.JOURNAL), writable=True)
    except (OSError, JournalCorrupt) as exc:
        log.error("recovery.journal_unusable", worker=worker_id, error=str(exc))
    else:
        try:
            _last_state(journal, record)
            journal.append("note", why.encode(), daemon.clock())
        except OSError as exc:
            log.error("recovery.journal_unwritable", worker=worker_id, error=str(exc))
        finally:
            journal.close()
    log.warning("recovery.record_rebuilt", worker=worker_id, state=record.state)
    if not row_lost:  # those are said in one line by `reconcile`
        daemon.problems.recovery.append(f"worker {worker_id}: {why}")
    if record.ended and not row_lost:  # one whose row was lost: `reconcile` writes it
        _alone(daemon, record, "record", lambda: _commit(daemon, record))
    return record


def _last_state(journal: Journal, record: WorkerRecord, *, since: float | None = None) -> None:
    """Take an ending from the journal's last state entry, if it names one (written at
    or after `since`: an attempt's start, so an earlier attempt's ending is not its)."""
    recent = journal.read(max(0, journal.last_seq - 64), 64)
    states = [e for e in recent if e.kind == "state"]
    if not states or (since is not None and states[-1].at < since):
        return
    words = states[-1].data.decode(errors="replace").split()
    if words and words[0] in TERMINAL_STATES:
        record.state = cast(WorkerState, words[0])
        record.ended_at = states[-1].at
        code = words[1].removeprefix("exit_code=") if len(words) > 1 else ""
        record.exit_code = int(code) if code.lstrip("-").isdigit() else None


def _paused_when_it_died(journal: Journal, record: WorkerRecord) -> bool:
    """Whether the attempt was paused as the daemon died: its record says so, or its
    journal's last pause entry of this attempt is `paused` (a pause is journaled at once,
    its record committed only with the next change). Its recent entries only: a paused
    worker writes nothing after its pause but what its pipe held."""
    if record.paused_since is not None:
        return True
    recent = journal.read(max(0, journal.last_seq - 64), 64)
    said = [
        e.data
        for e in recent
        if e.kind == "state" and e.data in (b"paused", b"unpaused") and e.at >= record.started_at
    ]
    return bool(said) and said[-1] == b"paused"


async def _took(progress: RecoveryProgress | None) -> None:
    """One more worker taken back: said in `info`, and the server's turn (it answers
    meanwhile: `info` at once, the rest `recovering`)."""
    if progress is not None:
        progress.took()
        await trio.lowlevel.checkpoint()


async def _interrupt_alone(
    daemon: Daemon, record: WorkerRecord, archive: Archive, posted: Wake | None
) -> None:
    """`_interrupt`, as a fault boundary: whatever fails, the worker is held as ended."""
    try:
        await _interrupt(daemon, record, archive, posted)
    except Exception as exc:
        log.exception("recovery.worker_failed", worker=record.id)
        daemon.problems.recovery.append(
            f"recovery of worker {record.id} failed partway ({type(exc).__name__}: {exc}); "
            f"it is held as {record.state if record.ended else 'interrupted'}: see the daemon log"
        )
    if not record.ended:
        record.state = "interrupted"
        record.ended_at = daemon.clock()


async def _interrupt(
    daemon: Daemon, record: WorkerRecord, archive: Archive, posted: Wake | None
) -> None:
    """End what is left of a worker that was running: `posted` is the wake its attempt
    posted, if it had ended just before the daemon died."""
    if posted is not None:
        # It had ended, and its wake was written, just before the daemon died.
        record.state, record.exit_code = posted.state, posted.exit_code
        record.ended_at = daemon.clock()
        _commit(daemon, record)
        return
    try:
        await _end_leftovers(daemon, record)
    except Exception as exc:
        log.exception("recovery.tree_not_ended", worker=record.id)
        daemon.problems.recovery.append(
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
            if daemon.store.damaged or daemon.store.tail_unsure:
                # The store may have lost its ending's commit (damage, or a WAL ending
                # inside a commit, cut there or torn): its journal, written first, says how
                # this attempt ended. (Else a journal's ending without the commit is a
                # kill -9 between the two: that ending never was, it is `interrupted`.)
                _last_state(journal, record, since=record.started_at)
            stdout_tail = journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
            if not record.ended:
                if _paused_when_it_died(journal, record):  # its pause ends with it
                    record.unpause(daemon.clock())
                    journal.append("state", b"unpaused", daemon.clock())
                journal.append(
                    "state", b"interrupted (the daemon died while it ran)", daemon.clock()
                )
        except OSError as exc:
            log.error("recovery.journal_unwritable", worker=record.id, error=str(exc))
        finally:
            journal.close()
    if not record.ended:
        record.state = "interrupted"
        record.ended_at = daemon.clock()
    # Its record, its wake and its stdout's tail (read before the note above) in one
    # transaction: a crash now leaves it to be recovered again, never half recovered.
    _alone(
        daemon,
        record,
        "ending",
        lambda: daemon.endings.record(record, stdout_tail, keep_tail=stdout_tail),
    )


def _commit(daemon: Daemon, record: WorkerRecord) -> None:
    daemon.store.commit(Change(workers=[record]), "a recovered record")


async def _end_leftovers(daemon: Daemon, record: WorkerRecord) -> None:
    leader = _leader(daemon, record)
    start = record.pid_start if leader is not None else None
    killed = await daemon.launcher.end_leftover_tree(record.id, leader, start, record.grace)
    if leader is not None:
        await reap(leader)
    if killed:
        log.warning("recovery.killed_orphans", worker=record.id, processes=killed)


def _leader(daemon: Daemon, record: WorkerRecord) -> int | None:
    """The pid its record names, if that process is the worker's (it carries the worker's
    id); else None, and its tree is found by that id alone, or is its cgroup. The record
    is in its worker's reach, and any process's pid and start time are in /proc/PID/stat:
    believed, a planted pair had recovery signal any process of the user's, and its group.
    One environ read per interrupted worker, at recovery only."""
    pid, start = record.pid, record.pid_start
    if pid is None or start is None or daemon.launcher.holds_tree(record.id):
        return None  # no leader named, or its cgroup holds the tree: no pid is needed
    if carries_worker_id(pid, start, record.id):
        return pid
    named = read_stat(pid)
    if named is not None and named.starttime == start and named.state != "Z":
        # Alive, and the very process named, yet not the worker's: planted, or a leader
        # that exec'd with a new environment (which then runs on: said here).
        log.warning("recovery.leader_not_the_workers", worker=record.id, pid=pid)
        daemon.problems.recovery.append(
            f"worker {record.id}'s record names pid {pid}, which does not carry its worker id: "
            "not signalled (its processes were found by that id instead; if it is the worker's "
            "own, end it by hand)"
        )
    return None


def _alone(daemon: Daemon, record: WorkerRecord, what: str, step: Callable[[], None]) -> None:
    """One step of a worker's recovery; if it fails, that is logged and reported."""
    try:
        step()
    except Exception as exc:
        log.exception("recovery.step_failed", worker=record.id, step=what)
        daemon.problems.recovery.append(
            f"recovery of worker {record.id} could not write its {what} "
            f"({type(exc).__name__}: {exc})"
        )
