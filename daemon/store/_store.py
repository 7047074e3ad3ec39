"""The store: what the daemon knows, in one sqlite database (`<state>/state.db`, WAL mode),
each change one `BEGIN IMMEDIATE` transaction, so a crash at any point leaves every change
whole or absent. It may touch only that file (and its -wal and -shm) in the state dir,
and its seq mark beside them (`_seq_mark.py`).

The daemon holds the database in exclusive locking mode (it alone uses it, under the
state dir's lock; the WAL index lives in its memory, so there is no -shm file while it
runs). What keeps every other process out is not sqlite's lock but the daemon's own
(`_store_lock.py`): an OFD lock on sqlite's lock bytes, by a descriptor a reload's exec
carries, so the new image opens the database again without ever having let go of it;
sqlite itself locks nothing (the `unix-none` VFS). A lock another process holds (a
reader there before the daemon) raises `StoreLocked`: the daemon waits, and says so.

Durability: `synchronous=NORMAL`. In WAL mode a commit is then written to the WAL before
it returns (so it survives kill -9 of the daemon, which is what every guarantee here is
about) but fsynced only at checkpoints, so a machine crash may lose the last commits
(never tear one: the WAL's checksums stop replay at the first incomplete frame). That is
what the hand-written wake log it replaces promised (appended, not fsynced), at a sixth
to a ninth of FULL's cost per post and per ack (`bench/store.py`: 50 and 29 us, against
317 and 258 us with FULL, against 4.6 and 2.9 us for the old log's append).

The schema has a version (the table `schema_version`, one row per migration applied) and
moves forward one step at a time: `MIGRATIONS[n]` takes version n-1 to n, all pending steps
in one transaction. An image reads every version up to `SCHEMA_VERSION` (it migrates them)
and refuses a newer one; `subagentd --check` lists them, and a reload refuses an image that
cannot read the version in use.

Version 1 held the wakes:

    schema_version(version INTEGER PRIMARY KEY, migrated_at REAL, by TEXT)
    counters(name TEXT PRIMARY KEY, value INTEGER)  -- 'wake_seq': the highest seq given
    wakes(seq INTEGER PRIMARY KEY, worker, attempt, run, parent, state, exit_code,
          preview, posted_at, UNIQUE (worker, attempt))  -- the unacknowledged ones
    TRIGGER wake_seq_rises AFTER INSERT ON wakes  -- wake_seq = max(wake_seq, seq)

A post inserts the wake (and the trigger raises `wake_seq`) in one transaction; an ack
deletes it. `wake_seq` outlives every row, and the seq mark outside the WAL (raised
before a commit needs it) outlives a WAL that loses commits, so no seq is ever given
twice.

Version 2 holds the rest of what the daemon knows, so that an ending (its
record, its wake, its retention) is one transaction, and recovery and `latest_resumable`
are queries:

    workers(id TEXT PRIMARY KEY, run, parent, cwd, spawned_at, ended_at,
            held INTEGER,   -- 1 while not ended, or ended and neither collected nor expired
            record BLOB,    -- the whole WorkerRecord, msgpack
            tail BLOB)      -- the end of its stdout, only where its journal's end would
                            -- not give it as well (a long journal, stderr last)
            INDEX (cwd, spawned_at)  -- latest_resumable(cwd): the snapshots' index
            INDEX (run)              -- a run's workers, released or not
            INDEX (id) WHERE held    -- what recovery and a reload take back
            (no index on ended_at: pruning, once a day, scans; an ending writes one page
            fewer, bench/store.py)
    runs(id TEXT PRIMARY KEY, record BLOB)           -- RunRecord, msgpack
    tombstones(id TEXT PRIMARY KEY, parent, stone BLOB)  -- Tombstone, msgpack
    launch(singleton INTEGER PRIMARY KEY CHECK (singleton = 1), turn, fence_epoch,
           fence_cancelled, fence_epochs)  -- fence_epoch NULL: no fence
    counters gains 'old_state_imported' (1 once record.json and runs/ files were taken in)

A row holds its columns for the queries and the whole record as one msgpack blob (not a
column a field, as first planned): a field added to WorkerRecord needs no migration, and
a row that does not decode is one thing, reported and costing only itself. The
snapshots' index is the workers' (cwd, spawned_at): a worker's first start is its
snapshot's time, so no table of its own is needed. Wakes keep no foreign key to workers:
a wake imported from an old wake log may name a worker no record tells of.

Version 3 (this image) adds the idempotency keys of spawns and resumes
(`core/_request_keys.py`), each written in the transaction that records the worker it
made, so no crash leaves a worker without its key or a key without its worker:

    request_keys(caller TEXT, key TEXT, worker TEXT, digest BLOB, at REAL,
                 PRIMARY KEY (caller, key)) WITHOUT ROWID
            -- caller '' is the user, else the worker whose token sent it; read whole at
            -- start (bounded by the ttl and a count per caller), dropped by key as forgotten

A damaged database (sqlite's own errors, or `PRAGMA quick_check` at open) is set aside with
its WAL, reported, and replaced by a fresh one holding what could be read back from it; a
symlink or anything but a regular file of ours at its name is set aside, never followed
(at a companion's name, that companion alone). What sqlite would lose unsaid is found by
`_salvage.py` and reported too: an empty database beside a WAL (set aside whole, not left
for sqlite to delete the WAL), commits a damaged WAL drops, and the database's or WAL's
name unlinked or replaced while the daemon runs (a whole copy is put back in its place).
Wherever the store may have lost rows (`Store.damaged`), recovery reconciles it with the
archives (`lifecycle/_recovery.py`), and no seq is given twice: the next skips far ahead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from subagentd.protocol import Wake

from .._logging import get_logger
from ..core._registry import LaunchFence, RunRecord, Tombstone, WorkerRecord
from ..core._request_keys import KeyRecord
from ._files import SAFE_FLAGS
from ._salvage import FileIdentity, WalTail, copy_whole, empty_beside_wal, relinked_why, wal_tail
from ._seq_mark import SEQ_MARK_NAME, SeqMark
from ._store_lock import StoreLock, StoreLocked, is_store_lock

log = get_logger()

#: The file's name in the state dir.
STORE_NAME = "state.db"
#: The schema this image writes.
SCHEMA_VERSION = 3
#: Every version this image reads (older ones are migrated forward); `--check` lists them.
READS_VERSIONS = tuple(range(1, SCHEMA_VERSION + 1))
#: How far seqs skip ahead when the store's record of the highest one given is lost: the
#: seqs given before are then unknown, and no daemon gives out this many wakes in its life.
SEQ_SKIP_WITHOUT_FLOOR = 2**32
#: How far above the store's floor the seq mark beside it is believed (`SeqMark.read`):
#: past a skip or two and whatever a WAL could lose, short of what a planted one could ask.
SEQ_MARK_BELIEVED = 2**40
#: What follows the database's name in the files sqlite keeps beside it. (A WAL-mode store
#: makes no -journal, but sqlite opens one it finds, to see whether it is hot, at every
#: open and reopen: a FIFO there blocks the open for good, a directory fails it.)
_COMPANIONS = ("", "-wal", "-shm", "-journal")
_WAKE_COLUMNS = ("seq", "id", "run", "parent", "state", "exit_code", "preview", "attempt")


#: The WAL is cut back to this after each checkpoint (see _connect).
WAL_SIZE_LIMIT = 4 * 1024 * 1024


class StoreUnusable(Exception):
    """No store can be had: the daemon cannot start (the message says why and what to do)."""


class StoreTooNew(StoreUnusable):
    """The database was written by a newer image: this one cannot read it."""


class StoreWriteFailed(OSError):
    """A change was not committed (a full disk, an I/O error): it is not in the store."""


# -- migrations ------------------------------------------------------------------


def _to_v1(db: sqlite3.Connection) -> None:
    db.execute(
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID"
    )
    db.execute("INSERT INTO counters VALUES ('wake_seq', 0)")
    db.execute(
        """CREATE TABLE wakes (
            seq INTEGER PRIMARY KEY,
            worker TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            run TEXT NOT NULL,
            parent TEXT,
            state TEXT NOT NULL,
            exit_code INTEGER,
            preview TEXT NOT NULL,
            posted_at REAL NOT NULL,
            UNIQUE (worker, attempt)
        )"""
    )
    # The floor rises with every post by construction, not by each writer remembering to.
    db.execute(
        """CREATE TRIGGER wake_seq_rises AFTER INSERT ON wakes BEGIN
            UPDATE counters SET value = max(value, NEW.seq) WHERE name = 'wake_seq';
        END"""
    )


def _to_v2(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE workers (
            id TEXT PRIMARY KEY,
            run TEXT NOT NULL,
            parent TEXT,
            cwd TEXT NOT NULL,
            spawned_at REAL NOT NULL,
            ended_at REAL,
            held INTEGER NOT NULL,
            record BLOB NOT NULL,
            tail BLOB
        )"""
    )
    db.execute("CREATE INDEX workers_by_cwd ON workers (cwd, spawned_at)")
    db.execute("CREATE INDEX workers_by_run ON workers (run)")
    db.execute("CREATE INDEX workers_held ON workers (id) WHERE held")
    db.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, record BLOB NOT NULL)")
    db.execute("CREATE TABLE tombstones (id TEXT PRIMARY KEY, parent TEXT, stone BLOB NOT NULL)")
    db.execute(
        """CREATE TABLE launch (
            singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
            turn INTEGER NOT NULL,
            fence_epoch INTEGER,
            fence_cancelled INTEGER NOT NULL,
            fence_epochs INTEGER NOT NULL
        )"""
    )
    db.execute("INSERT INTO launch VALUES (1, 0, NULL, 0, 0)")


def _to_v3(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE request_keys (
            caller TEXT NOT NULL,
            key TEXT NOT NULL,
            worker TEXT NOT NULL,
            digest BLOB NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (caller, key)
        ) WITHOUT ROWID"""
    )


#: MIGRATIONS[n] takes the schema from version n-1 to n (0: an empty database).
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _to_v1, 2: _to_v2, 3: _to_v3}


@dataclass(frozen=True)
class LaunchState:
    """The launch turn and fence, as the registry holds them."""

    turn: int = 0
    fence: LaunchFence | None = None
    fence_epochs: int = 0


@dataclass
class Change:
    """What one transaction writes: all of it, or (a crash, a full disk) none of it.

    An ending is `Change(workers=[record], wakes=[wake])`: the record's final state, its
    retention (held, collected, expired are the record's) and its parent's wake together.
    """

    workers: list[WorkerRecord] = field(default_factory=list)
    #: The end of a worker's stdout, kept where its journal would not give it as well;
    #: b"" clears it (a new attempt); a worker written without one keeps what it had.
    tails: dict[str, bytes] = field(default_factory=dict)
    wakes: list[Wake] = field(default_factory=list)
    #: Posted wakes written again as they now stand (their worker's state changed before
    #: anyone read them, or a fault rolled back the transaction that first wrote them).
    restated: list[Wake] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)
    dropped_runs: list[str] = field(default_factory=list)
    tombstones: list[Tombstone] = field(default_factory=list)
    dropped_tombstones: list[str] = field(default_factory=list)
    launch: LaunchState | None = None
    #: The state dir of an image before the store was taken in: never again.
    old_state_imported: bool = False
    #: Idempotency keys, with the worker each made (in the same change as that worker).
    keys: list[KeyRecord] = field(default_factory=list)
    #: (caller, key) of keys forgotten: their time is up, or their caller has many newer.
    dropped_keys: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(
            (
                self.workers,
                self.wakes,
                self.restated,
                self.acked,
                self.runs,
                self.dropped_runs,
                self.tombstones,
                self.dropped_tombstones,
                self.launch is not None,
                self.old_state_imported,
                self.keys,
                self.dropped_keys,
            )
        )


# -- the store ------------------------------------------------------------------


class Store:
    def __init__(
        self,
        path: Path,
        db: sqlite3.Connection,
        problems: list[str],
        lock: StoreLock | None = None,
    ) -> None:
        self.path = path
        self._db = db
        #: The hold on the store file against other processes (carried by a reload).
        self.lock = lock
        #: What opening found wrong, for a person to see (`info.problems`).
        self.problems = problems
        #: Changes the daemon went on without, that a full disk kept out (`commit`'s redo).
        self._unwritten: list[Change] = []
        #: Called when a change is kept to be redone: the daemon then retries `flush`
        #: until it goes in, not waiting for some other change to carry it.
        self.on_unwritten: Callable[[], None] = lambda: None
        #: Whether rows it held may be lost (it was set aside, emptied, its WAL cut, or
        #: archives were found without rows): recovery then trusts the journals' endings.
        self.damaged = False
        #: Whether the WAL ended inside a commit (`WalTail.unsure`: cut through it, or torn
        #: by a kill -9): its last commit may be lost unsaid, so recovery trusts the
        #: journals' endings over `interrupted` here too, though nothing is called damage.
        self.tail_unsure = False
        self._seqs_skipped = False
        #: The highest seq it may have given, outside the WAL (read again by `open`).
        self.seq_mark = SeqMark(path.with_name(SEQ_MARK_NAME), 0, problems)
        #: The files the store has open, by suffix ("", "-wal"): see `check_linked`.
        self._opened: dict[str, FileIdentity | None] = {}
        #: Called when a transaction went in and no change is kept out any more: what
        #: `info` says of a failing store has passed.
        self.on_written: Callable[[], None] = lambda: None

    @classmethod
    def open(cls, path: Path, lock_fd: int | None = None) -> Store:
        """The store at `path`, migrated to this image's schema; `lock_fd`: its lock, as a
        reload carried it (`StoreLock.take`).

        Whatever is wrong with the file costs only what it must: a symlink or a
        non-regular file there is set aside unfollowed, a damaged database is set aside
        and what can be read from it carried into a fresh one; both are reported. Raises
        StoreTooNew for a schema from a newer image, StoreUnusable if no database can be
        made (the disk is full, the directory unwritable); StoreLocked (`lock_fd` closed)
        while another process holds a lock on it.
        """
        problems: list[str] = []
        lock: StoreLock | None = None
        try:
            if lock_fd is not None and not StoreLock(path, lock_fd).holds(path):
                lock_fd = _inherited_put_back(path, lock_fd, problems)
            lost = _set_aside_foreign(path, problems)
            lost |= _set_aside_empty(path, problems)
            # A WAL is left only by a daemon that did not close the store (a kill, an exec).
            left_wal = os.path.lexists(f"{path}-wal")
            lock = StoreLock.take(path, lock_fd)
            try:
                db = _connect(path, lock)
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) and not _is_damage(exc):
                    raise
                db = _recover_from_damage(path, str(exc), problems, lock)
                lost = True
            tail = _report_dropped_commits(path, db, problems) if left_wal else WalTail()
            lost |= tail.dropped > 0
        except (sqlite3.Error, OSError) as exc:
            if lock is not None:
                lock.release()
            raise StoreUnusable(
                f"cannot open the store {path}: {exc}; free space or fix the state dir's "
                "permissions, then start again"
            ) from exc
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        store = cls(path, db, problems, lock)
        store._remember_files()
        store.tail_unsure = tail.unsure
        store.seq_mark = SeqMark.read(
            store.seq_mark.path, _read_floor(db), SEQ_MARK_BELIEVED, problems
        )
        if lost:
            store.damaged = True
            store.skip_seqs()
        return store

    @property
    def version(self) -> int:
        return _version(self._db)

    @contextlib.contextmanager
    def transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """One change, whole or not at all; a failure to commit raises StoreWriteFailed."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _write_failed(what, exc) from exc
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise _write_failed(what, exc) from exc
            raise
        # Two stats: a change written into a file no name links any more is put back now,
        # not lost at the next start.
        self.check_linked()
        if not self._unwritten:  # else said once they are written too (commit_all, flush)
            self.on_written()

    # -- the files, still linked --

    def _remember_files(self) -> None:
        for suffix in ("", "-wal"):
            self._opened[suffix] = FileIdentity.of(f"{self.path}{suffix}")

    def check_linked(self) -> bool:
        """Whether the names `state.db` and `state.db-wal` still link the files the store
        has open; if not (unlinked, or another file put there), a whole copy of the store
        is put back in place so that nothing written since is lost, and it is reported.
        False while it could not be put back (tried again at the next commit or check)."""
        why = []
        for suffix, opened in self._opened.items():
            name = f"{self.path}{suffix}"
            if opened is None:  # sqlite makes the WAL at the first write
                self._opened[suffix] = FileIdentity.of(name)
            elif (said := relinked_why(name, opened)) is not None:
                why.append(f"{self.path.name}{suffix} {said}")
        if not why:
            return True
        try:
            aside = self._put_back()
        except (sqlite3.Error, OSError, StoreLocked) as exc:
            self._problem_once(
                f"the store {self.path} is no longer linked in the state dir "
                f"({'; '.join(why)}) and a whole copy could not be put back ({exc}): tried "
                "again at each change; until then a restart loses what was written since"
            )
            return False
        self._problem(
            f"the store {self.path} was no longer linked in the state dir while the daemon "
            f"ran ({'; '.join(why)}, not by the daemon): a whole copy was put back in its "
            "place, nothing written is lost"
            + (f"; what was at its name is kept as {aside}" if aside else "")
        )
        return True

    def _put_back(self) -> Path | None:
        """Copy the open store whole into a new file and rename it over `state.db`, then
        open that: the old connection's files are let go. What another process put at the
        names is renamed aside, never written through; where it went (None: nothing).
        If the rename fails, the store goes on in the whole copy (put back at the next
        check), never without a database."""
        copy = copy_whole(self._db, self.path.parent, self.path.name)
        # The copy is held before it is renamed into place, and before the store lets go
        # of the file it has: the copy sat in the state dir under a name any process may
        # read there, and one that locked it first would hold the store out.
        try:
            held = StoreLock.take(copy)
        except (StoreLocked, OSError) as exc:
            copy.unlink(missing_ok=True)
            if isinstance(exc, StoreLocked):
                raise OSError(errno.EAGAIN, f"its copy was locked first by {exc.holder}") from exc
            raise
        # Closed first: its last checkpoint goes into the file it has open, and sqlite
        # then deletes the WAL by name, which no new database's WAL holds yet.
        self._db.close()
        if self.lock is not None:
            self.lock.release()
        self.lock = held
        opened_at, aside = copy, None
        try:
            for suffix in _COMPANIONS:
                name = f"{self.path}{suffix}"
                if not os.path.lexists(name):
                    continue
                opened = self._opened.get(suffix)
                if opened is not None and relinked_why(name, opened) is None:
                    if suffix:  # its own old WAL, never to be replayed into the copy
                        os.unlink(name)
                    continue  # its own database, which the copy replaces
                aside = aside or self.path.with_name(f"{self.path.name}.not-ours-{_stamp()}")
                os.rename(name, f"{aside}{suffix}")
            os.replace(copy, self.path)
            opened_at = self.path
        finally:
            # The lock went with the copy, to whichever name it has now.
            self.lock.path = opened_at
            self._db = _connect(opened_at, self.lock)
            self._remember_files()
        return aside

    def skip_seqs(self) -> int:
        """Raise the seq floor far ahead, once: rows were lost, and with them perhaps the
        wakes given since the floor read here was written. The new floor."""
        floor = self._wake_floor()
        if not self._seqs_skipped:
            self._seqs_skipped = True
            floor += SEQ_SKIP_WITHOUT_FLOOR
            with self.transaction("skipping seqs past a damaged store's") as db:
                _raise_floor(db, floor)
        return floor

    def known_workers(self) -> set[str]:
        """The id of every worker with a row, released or not (recovery compares them
        with the archives: one query, no record decoded)."""
        return {worker_id for (worker_id,) in self._db.execute("SELECT id FROM workers")}

    # -- wakes --

    def wakes(self) -> tuple[list[Wake], int]:
        """Every unacknowledged wake, and the highest seq ever given. A row that does not
        read as a wake is reported and removed: it costs only itself."""
        floor = self._wake_floor()
        wakes, bad = [], []
        for row in self._db.execute(
            "SELECT seq, worker, run, parent, state, exit_code, preview, attempt FROM wakes"
        ):
            try:
                wakes.append(msgspec.convert(dict(zip(_WAKE_COLUMNS, row, strict=True)), Wake))
            except msgspec.ValidationError as exc:
                bad.append(row[0])
                self._problem(f"wake {row[0]} in {self.path} does not read ({exc}): removed")
        if bad:
            self.ack_wakes(bad)
        return wakes, max([floor, *(w.seq for w in wakes)])

    def post_wake(self, wake: Wake) -> None:
        self.seq_mark.cover(wake.seq)
        with self.transaction("posting a wake") as db:
            _insert_wake(db, wake, or_ignore=False)  # and the floor rises (a trigger)

    def restate_wake(self, wake: Wake) -> None:
        """A posted wake, not yet delivered, now says its worker's new state."""
        with self.transaction("restating a wake") as db:
            db.execute(
                "UPDATE wakes SET state = ?, exit_code = ? WHERE seq = ?",
                (wake.state, wake.exit_code, wake.seq),
            )

    def ack_wakes(self, seqs: list[int]) -> None:
        if not seqs:
            return
        # After any ending still to be written: else its wake would come back acked.
        self.commit(Change(acked=seqs), "acknowledging wakes", redo=True)

    def import_wakes(self, wakes: list[Wake], floor: int) -> list[Wake]:
        """Take in wakes from elsewhere (an old wake log, a damaged store) with their
        seqs, and raise the floor to `floor`; those taken in. A seq at or below the
        store's floor was given here already (imported before, or acknowledged since):
        skipped, so importing twice resurrects nothing."""
        with self.transaction("importing wakes") as db:
            below = _read_floor(db)
            fresh = [w for w in wakes if w.seq > below]
            for wake in fresh:
                _insert_wake(db, wake, or_ignore=True)
            _raise_floor(db, floor)
        return fresh

    # -- what the daemon knows --

    def commit(
        self,
        change: Change,
        what: str,
        *,
        before_commit: Callable[[], None] | None = None,
        redo: bool = False,
    ) -> None:
        """Write `change` in one transaction; StoreWriteFailed if it did not go in.
        `before_commit` runs inside it, its writes made: a fault injected there (see
        SUBAGENTD_FAULT) rolls all of them back, as a crash there would.

        `redo`: the caller goes on as if it were written (an ending, an ack), so a change
        that fails to go in (a full disk) is kept and written, in order, in the
        transaction of the next change that does: else the disk's return would leave the
        store saying a worker that ended still runs (a restart would end it again as
        `interrupted`, and wake its parent twice)."""
        self.commit_all([(change, before_commit)], what, redo=redo)

    def commit_all(
        self,
        changes: list[tuple[Change, Callable[[], None] | None]],
        what: str,
        *,
        redo: bool = False,
    ) -> None:
        """`commit` for several changes, in order, in one transaction: each with what runs
        once its writes are made. A fault in any rolls back all of them."""
        changes = [(change, before_commit) for change, before_commit in changes if change]
        if not changes:
            return
        self._cover([*self._unwritten, *(change for change, _ in changes)])
        try:
            with self.transaction(what) as db:
                for earlier in self._unwritten:
                    _write(db, earlier)
                for change, before_commit in changes:
                    _write(db, change)
                    if before_commit is not None:
                        before_commit()
        except StoreWriteFailed:
            if redo:
                self._unwritten.extend(change for change, _ in changes)
                self.on_unwritten()
            raise
        if self._unwritten:
            self._unwritten.clear()
            self.on_written()

    def _cover(self, changes: list[Change]) -> None:
        """The seq mark raised over the wakes of `changes`, before the commit that holds
        them: a WAL that loses that commit must not lose their seqs with it."""
        self.seq_mark.cover(max((w.seq for c in changes for w in c.wakes), default=0))

    @property
    def unwritten(self) -> int:
        """How many changes the daemon went on without are still kept out of the store."""
        return len(self._unwritten)

    def flush(self) -> None:
        """Write the changes a full disk kept out, in order, in one transaction;
        StoreWriteFailed (and they stay kept) if they still do not go in."""
        if not self._unwritten:
            return
        self._cover(self._unwritten)
        with self.transaction("changes kept out by a failing disk") as db:
            for earlier in self._unwritten:
                _write(db, earlier)
        self._unwritten.clear()
        self.on_written()

    def commit_changed(self, records: list[WorkerRecord], what: str) -> None:
        """Write those of `records` (workers held: not ended, or not yet released) whose
        rows say otherwise than their record in memory, in one transaction: what a
        reload's checkpoint needs, at the cost of the few that changed, not of all."""
        try:
            rows = dict(self._db.execute("SELECT id, record FROM workers WHERE held"))
        except sqlite3.Error:  # rows that do not read: every record is written anew
            rows = {}
        changed = [r for r in records if rows.get(r.id) != _encoder.encode(r)]
        self.commit(Change(workers=changed), what)
        # None changed is no commit, and so no check: the next image opens the store by
        # its name, and a name unlinked since the last check would give it an empty one.
        self.check_linked()

    def held_workers(self) -> tuple[list[WorkerRecord], list[str]]:
        """The workers the daemon holds handles for (not ended, or ended and neither
        collected nor expired) and every worker above one (a handle goes only after the
        workers it delegated: `Registry.release`), and the ids of those whose row does
        not decode (each reported; recovery rebuilds them from their snapshot)."""
        return self._workers(
            # UNION, not UNION ALL: a parent link that loops (a damaged row) ends the walk.
            "WITH RECURSIVE kept(id) AS ("
            " SELECT id FROM workers WHERE held"
            " UNION SELECT workers.parent FROM workers JOIN kept ON workers.id = kept.id"
            " WHERE workers.parent IS NOT NULL"
            ") SELECT id, record FROM workers WHERE id IN kept",
            (),
        )

    def worker(self, worker_id: str) -> WorkerRecord | None:
        """A worker's record, released or not; None if unknown (or its row is damaged)."""
        found, _ = self._workers("SELECT id, record FROM workers WHERE id = ?", (worker_id,))
        return found[0] if found else None

    def workers_of_run(self, run_id: str) -> list[WorkerRecord]:
        return self._workers("SELECT id, record FROM workers WHERE run = ?", (run_id,))[0]

    def runs_started_in(self, cwd: str) -> dict[str, float]:
        """Each run a top-level worker was spawned into in `cwd`, with its first spawn."""
        rows = self._db.execute(
            "SELECT run, min(spawned_at) FROM workers WHERE cwd = ? AND parent IS NULL "
            "GROUP BY run",
            (cwd,),
        )
        return {str(run): float(at) for run, at in rows}

    def tail(self, worker_id: str) -> bytes | None:
        """The stdout tail kept for a worker, if one was (else its journal's end serves)."""
        row = self._db.execute("SELECT tail FROM workers WHERE id = ?", (worker_id,)).fetchone()
        return bytes(row[0]) if row is not None and row[0] else None

    def ended_before(self, cutoff: float) -> list[str]:
        """Workers that ended before `cutoff`: their archives may be pruned."""
        rows = self._db.execute("SELECT id FROM workers WHERE ended_at < ?", (cutoff,))
        return [str(row[0]) for row in rows]

    def forget(self, worker_ids: list[str]) -> None:
        """Drop the rows of workers whose archives were pruned, and the row of each
        implicit run they leave with no worker (kept for its stop until nothing could
        be resumed into it)."""
        if worker_ids:
            with self.transaction("forgetting pruned workers") as db:
                runs = {
                    str(row[0])
                    for i in worker_ids
                    for row in db.execute("SELECT run FROM workers WHERE id = ?", (i,))
                }
                db.executemany("DELETE FROM workers WHERE id = ?", [(i,) for i in worker_ids])
                for run in runs:
                    if db.execute("SELECT 1 FROM workers WHERE run = ?", (run,)).fetchone():
                        continue
                    saved = self._run_row(db, run)
                    if saved is not None and saved.implicit:
                        db.execute("DELETE FROM runs WHERE id = ?", (run,))

    def run(self, run_id: str) -> RunRecord | None:
        """A run's saved row (a named run's, or an implicit run's once it was stopped,
        reopened or resumed); None if it has none, or its row does not read."""
        return self._run_row(self._db, run_id)

    def _run_row(self, db: sqlite3.Connection, run_id: str) -> RunRecord | None:
        row = db.execute("SELECT record FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        try:
            return _run_decoder.decode(row[0])
        except (msgspec.DecodeError, TypeError) as exc:
            self._problem_once(f"run {run_id}'s row in {self.path} does not read ({exc})")
            return None

    def runs(self) -> list[RunRecord]:
        return self._decoded("SELECT id, record FROM runs", RunRecord, "run")

    def tombstones(self) -> list[Tombstone]:
        return self._decoded("SELECT id, stone FROM tombstones", Tombstone, "tombstone")

    def launch(self) -> LaunchState:
        row = self._db.execute(
            "SELECT turn, fence_epoch, fence_cancelled, fence_epochs FROM launch"
        ).fetchone()
        if row is None:
            return LaunchState()
        turn, epoch, cancelled, epochs = row
        fence = None if epoch is None else LaunchFence(epoch=epoch, cancelled=bool(cancelled))
        return LaunchState(turn=int(turn), fence=fence, fence_epochs=int(epochs))

    def request_keys(self) -> list[KeyRecord]:
        """Every idempotency key kept (the caller forgets the old ones)."""
        rows = self._db.execute("SELECT caller, key, worker, digest, at FROM request_keys")
        return [
            KeyRecord(str(caller), str(key), str(worker), bytes(digest), float(at))
            for caller, key, worker, digest, at in rows
        ]

    def old_state_imported(self) -> bool:
        row = self._db.execute(
            "SELECT value FROM counters WHERE name = 'old_state_imported'"
        ).fetchone()
        return row is not None and bool(row[0])

    def _workers(self, sql: str, args: tuple[object, ...]) -> tuple[list[WorkerRecord], list[str]]:
        records, damaged = [], []
        for worker_id, blob in self._db.execute(sql, args):
            try:
                record = _worker_decoder.decode(blob)
                if record.id != worker_id:
                    raise msgspec.ValidationError(f"it names worker {record.id!r}")
            except (msgspec.DecodeError, TypeError) as exc:
                damaged.append(str(worker_id))
                self._problem_once(f"worker {worker_id}'s row in {self.path} does not read ({exc})")
                continue
            records.append(record)
        return records, damaged

    def _decoded(self, sql: str, kind: type[_Row], what: str) -> list[_Row]:
        decoder = msgspec.msgpack.Decoder(kind)
        found = []
        for key, blob in self._db.execute(sql):
            try:
                found.append(decoder.decode(blob))
            except (msgspec.DecodeError, TypeError) as exc:
                self._problem_once(f"{what} {key}'s row in {self.path} does not read ({exc})")
        return found

    def _problem_once(self, problem: str) -> None:
        if problem not in self.problems:
            self._problem(problem)

    def _wake_floor(self) -> int:
        """The highest seq given: the store's own floor, or the mark beside it where the
        WAL lost commits that gave seqs (nothing may have said so)."""
        return max(_read_floor(self._db), self.seq_mark.marked)

    def _problem(self, problem: str) -> None:
        log.error("store.problem", problem=problem)
        self.problems.append(problem)

    def close(self) -> None:
        """Close the store, put back first if its name no longer links it (the next start
        opens it by that name: else what it held since it was unlinked is lost)."""
        with contextlib.suppress(sqlite3.Error, OSError):
            self.check_linked()
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        if self.lock is not None:
            self.lock.release()  # after sqlite's last write: no other process before it


def _read_floor(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM counters WHERE name = 'wake_seq'").fetchone()
    return int(row[0]) if row is not None else 0


def _raise_floor(db: sqlite3.Connection, seq: int) -> None:
    db.execute(
        "INSERT INTO counters VALUES ('wake_seq', ?) "
        "ON CONFLICT (name) DO UPDATE SET value = max(value, excluded.value)",
        (seq,),
    )


def _insert_wake(db: sqlite3.Connection, wake: Wake, *, or_ignore: bool) -> None:
    verb = "INSERT OR IGNORE" if or_ignore else "INSERT"
    db.execute(
        f"{verb} INTO wakes (seq, worker, attempt, run, parent, state, exit_code, preview, "
        "posted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            wake.seq,
            wake.id,
            wake.attempt,
            wake.run,
            wake.parent,
            wake.state,
            wake.exit_code,
            wake.preview,
            time.time(),
        ),
    )


_worker_decoder = msgspec.msgpack.Decoder(WorkerRecord)
_run_decoder = msgspec.msgpack.Decoder(RunRecord)
_encoder = msgspec.msgpack.Encoder()
_Row = TypeVar("_Row", RunRecord, Tombstone)


def _held(record: WorkerRecord) -> bool:
    return not record.ended or not (record.collected or record.expired)


def _write(db: sqlite3.Connection, change: Change) -> None:
    if change.workers:
        db.executemany(
            "INSERT INTO workers (id, run, parent, cwd, spawned_at, ended_at, held, record, tail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
            "run = excluded.run, parent = excluded.parent, cwd = excluded.cwd, "
            "spawned_at = excluded.spawned_at, ended_at = excluded.ended_at, held = excluded.held, "
            "record = excluded.record, tail = coalesce(excluded.tail, workers.tail)",
            [
                (
                    r.id,
                    r.run,
                    r.parent,
                    r.cwd,
                    r.spawned_at,
                    r.ended_at,
                    _held(r),
                    _encoder.encode(r),
                    change.tails.get(r.id),
                )
                for r in change.workers
            ],
        )
    for wake in change.wakes:
        _insert_wake(db, wake, or_ignore=False)  # and the floor rises (a trigger)
    for wake in change.restated:
        db.execute("DELETE FROM wakes WHERE seq = ?", (wake.seq,))
        _insert_wake(db, wake, or_ignore=False)
    # Each statement only if it has rows: an ending (a record and a wake) is most of the
    # changes, and ten empty statements cost it more than its own two.
    if change.acked:
        db.executemany("DELETE FROM wakes WHERE seq = ?", [(s,) for s in change.acked])
    if change.runs:
        db.executemany(
            "INSERT OR REPLACE INTO runs VALUES (?, ?)",
            [(run.id, _encoder.encode(run)) for run in change.runs],
        )
    if change.dropped_runs:
        db.executemany("DELETE FROM runs WHERE id = ?", [(r,) for r in change.dropped_runs])
    if change.tombstones:
        db.executemany(
            "INSERT OR REPLACE INTO tombstones VALUES (?, ?, ?)",
            [(t.id, t.parent, _encoder.encode(t)) for t in change.tombstones],
        )
    if change.dropped_tombstones:
        db.executemany(
            "DELETE FROM tombstones WHERE id = ?", [(t,) for t in change.dropped_tombstones]
        )
    if change.old_state_imported:
        db.execute("INSERT OR REPLACE INTO counters VALUES ('old_state_imported', 1)")
    # Dropped first: a key forgotten may be taken again by this very change.
    if change.dropped_keys:
        db.executemany("DELETE FROM request_keys WHERE caller = ? AND key = ?", change.dropped_keys)
    if change.keys:
        db.executemany(
            "INSERT OR REPLACE INTO request_keys VALUES (?, ?, ?, ?, ?)",
            [(k.caller, k.key, k.worker, k.digest, k.at) for k in change.keys],
        )
    if (launch := change.launch) is not None:
        fence = launch.fence
        db.execute(
            "UPDATE launch SET turn = ?, fence_epoch = ?, fence_cancelled = ?, fence_epochs = ?",
            (
                launch.turn,
                None if fence is None else fence.epoch,
                fence is not None and fence.cancelled,
                launch.fence_epochs,
            ),
        )


# -- opening ------------------------------------------------------------------


def _connect(path: Path, lock: StoreLock) -> sqlite3.Connection:
    """Open, check and migrate the database at `path` (made if missing), which `lock`
    holds (taken on it afresh if it holds another file: one set aside)."""
    lock.follow(path)
    # Transactions are ours (BEGIN IMMEDIATE); locks are `lock`'s: sqlite takes none.
    db = sqlite3.connect(_uri(path), uri=True, isolation_level=None)
    try:
        _refuse_if_swapped(path)
        if not lock.holds(path):
            raise sqlite3.DatabaseError(f"{path} was replaced while it was opened")
        # The daemon is the store's only user (it holds the state dir's lock): exclusive
        # locking keeps the WAL's index in its memory (no -shm, no lock calls per change);
        # without sqlite's own locks, it is what WAL mode needs (no shared memory).
        db.execute("PRAGMA locking_mode = EXCLUSIVE")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        # Else the WAL keeps the size of the largest transaction it ever held (a reload
        # of thousands, an import of an old state dir) for as long as the daemon runs.
        db.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        verdict = [row[0] for row in db.execute("PRAGMA quick_check")]
        if verdict != ["ok"]:
            raise sqlite3.DatabaseError(f"quick_check: {'; '.join(map(str, verdict[:5]))}")
        _migrate(db, path)
    except BaseException:
        db.close()
        raise
    return db


def _uri(path: Path) -> str:
    """`path` as sqlite's URI, opened with no locking of sqlite's own (`StoreLock` locks)."""
    return f"file:{urllib.parse.quote(os.fspath(path))}?vfs=unix-none"


def _version(db: sqlite3.Connection) -> int:
    exists = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if exists is None:
        return 0
    return int(db.execute("SELECT max(version) FROM schema_version").fetchone()[0] or 0)


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        found = _version(db)
        if found > SCHEMA_VERSION:
            raise StoreTooNew(
                f"the store {path} has schema version {found}, written by a newer subagentd; "
                f"this one reads {list(READS_VERSIONS)}: run the newer one"
            )
        if found == 0:
            db.execute(
                "CREATE TABLE schema_version "
                "(version INTEGER PRIMARY KEY, migrated_at REAL NOT NULL, by TEXT NOT NULL)"
            )
        for version in range(found + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version](db)
            db.execute(
                "INSERT INTO schema_version VALUES (?, ?, ?)",
                (version, time.time(), f"subagentd pid {os.getpid()}"),
            )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if found not in (0, SCHEMA_VERSION):
        log.info("store.migrated", path=str(path), version_from=found, to=SCHEMA_VERSION)


def _is_damage(exc: sqlite3.OperationalError) -> bool:
    """Whether an error at open says the file is damaged, not that it cannot be reached."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _write_failed(what: str, exc: sqlite3.Error) -> StoreWriteFailed:
    full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    code = errno.ENOSPC if full else errno.EIO
    return StoreWriteFailed(code, f"{os.strerror(code)} ({what} in the store: {exc})")


def _stamp() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"


def _foreign(path: Path) -> str | None:
    """Why the name `path` is not a file of the store's own (None if it is, or is absent)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} names (a hard link to a file elsewhere)"
    if st.st_uid != os.getuid():
        return f"a file of uid {st.st_uid}"
    return None


def _set_aside_foreign(path: Path, problems: list[str]) -> bool:
    """Rename aside, unfollowed, what is not a regular file of ours among the database and
    its companions: sqlite would open through a symlink. The database not ours, all go
    (a WAL belongs to its database); a companion not ours, that one alone (the WAL's
    commits are then lost: recovery rebuilds from the archives what they held; the -shm
    holds none). Whether rows the store held may be lost."""
    why = {c: w for c in _COMPANIONS if (w := _foreign(Path(f"{path}{c}"))) is not None}
    if not why:
        return False
    said = "; ".join(f"{path.name}{c} is {w}" for c, w in why.items())
    if "" in why:
        aside = _move_aside(path, "not-ours")
        problem = (
            f"the store {path} was not the daemon's own ({said}): set aside, unfollowed, "
            f"as {aside}; the daemon starts with a store rebuilt from the archives "
            "(unacknowledged wakes it held, if any, come again from the workers' endings)"
        )
    else:
        aside = path.with_name(f"{path.name}.not-ours-{_stamp()}")
        for companion in why:
            os.rename(f"{path}{companion}", f"{aside}{companion}")
        problem = (
            f"a file beside the store {path} was not the daemon's own ({said}): set aside "
            f"alone, unfollowed, as {aside}{'/'.join(why)}; the store itself is kept"
            + (" (the commits its WAL held are rebuilt from the archives)" if "-wal" in why else "")
        )
    log.error("store.not_ours", problem=problem)
    problems.append(problem)
    return "" in why or "-wal" in why


def _set_aside_empty(path: Path, problems: list[str]) -> bool:
    """Set aside, as damaged, an empty database beside a WAL with frames (sqlite would
    delete the WAL and start empty, unsaid); whether it was."""
    wal_size = empty_beside_wal(path)
    if wal_size is None:
        return False
    aside = _move_aside(path, "damaged")
    problem = (
        f"the store {path} was empty (0 bytes) beside its WAL of {wal_size} bytes, which "
        f"sqlite would have deleted: both kept as {aside}; a fresh store is rebuilt from the "
        "archives"
    )
    log.error("store.damaged", problem=problem)
    problems.append(problem)
    return True


def _report_dropped_commits(path: Path, db: sqlite3.Connection, problems: list[str]) -> WalTail:
    """Report commits the WAL holds that sqlite dropped (a frame cut short or corrupted
    before them), keeping a copy of that WAL; what its tail holds."""
    try:
        tail = wal_tail(path, db)
    except (OSError, sqlite3.Error) as exc:
        log.warning("store.wal_unchecked", error=str(exc))
        return WalTail()
    if tail.unsure:
        log.warning("store.wal_tail_unsure", dropped=tail.dropped)
    if not (dropped := tail.dropped):
        return tail
    kept = path.with_name(f"{path.name}-wal.damaged-{_stamp()}")
    try:
        shutil.copyfile(f"{path}-wal", kept, follow_symlinks=False)
    except OSError as exc:
        kept_said = f"not kept ({exc.strerror or exc})"
    else:
        kept_said = f"kept as {kept}"
    problem = (
        f"the store's WAL {path}-wal was cut short or corrupted: {dropped} commit(s) after "
        f"the damage were dropped by sqlite ({kept_said}); what they held is rebuilt from the "
        "archives"
    )
    log.error("store.wal_damaged", problem=problem)
    problems.append(problem)
    return tail


def _inherited_put_back(path: Path, fd: int, problems: list[str]) -> int:
    """The store's lock a reload carried (`fd`) holds a file that is no longer the one at
    `path`: another process put its own there during the exec. The file the old image had
    open is what the store is (its WAL still at its name): a whole copy of it, held before
    it is linked, is renamed into place, and what was there set aside. The lock on the copy;
    or `fd` itself if it holds no store's lock (a checkpoint named it wrongly: let go)."""
    if not is_store_lock(fd):
        return fd
    copy = path.with_name(f".{path.name}.put-back-{secrets.token_hex(8)}")
    try:
        held = StoreLock.take(
            copy, os.open(copy, os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_FLAGS, 0o600)
        )
        try:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                copied = os.copy_file_range(fd, held.fd, size - offset, offset, offset)
                if copied == 0:
                    raise OSError(errno.EIO, f"{path}: the file held came short of its size")
                offset += copied
            os.fsync(held.fd)
            aside = path.with_name(f"{path.name}.not-ours-{_stamp()}")
            for suffix in ("", "-shm"):  # its WAL is the store's, else sqlite says it is damaged
                if os.path.lexists(f"{path}{suffix}"):
                    os.rename(f"{path}{suffix}", f"{aside}{suffix}")
            os.replace(copy, path)
        except BaseException:
            held.release()
            copy.unlink(missing_ok=True)
            raise
    finally:
        os.close(fd)
    problem = (
        f"the store {path} was replaced by another file during a reload's exec (kept as "
        f"{aside}): the store the daemon had open was put back whole in its place"
    )
    log.error("store.replaced_in_exec", problem=problem)
    problems.append(problem)
    return held.fd


def _refuse_if_swapped(path: Path) -> None:
    """Refuse a database whose name became a symlink while sqlite opened it."""
    why = _foreign(path)
    if why is not None:
        raise sqlite3.DatabaseError(f"{path} became {why} while it was opened")


def _move_aside(path: Path, why: str) -> Path:
    """Rename the database and its companions to `<name>.<why>-<time>-<pid>`; the new name.
    A rename moves a symlink itself, never what it points to."""
    aside = path.with_name(f"{path.name}.{why}-{_stamp()}")
    for companion in _COMPANIONS:
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{path}{companion}", f"{aside}{companion}")
    return aside


def _recover_from_damage(
    path: Path, error: str, problems: list[str], lock: StoreLock
) -> sqlite3.Connection:
    """Set the damaged database aside, read back what it still gives, and start a fresh
    one with that. Only what sat in damaged pages is lost; no seq is given twice.

    The fresh file is held (`lock` moves to it) before it is renamed into place, and the
    damaged one let go only then (salvage reads it with sqlite's own locks): a reader
    that opened the name in between would have made a file there, held it, and been
    taken for the store at the next try, with nothing of the damaged one in it."""
    fresh = path.with_name(f".{path.name}.fresh-{secrets.token_hex(8)}")
    held = StoreLock.take(
        fresh, os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_FLAGS, 0o600)
    )
    try:
        aside = _move_aside(path, "damaged")
        os.replace(fresh, path)
    except BaseException:
        held.release()
        fresh.unlink(missing_ok=True)
        raise
    lock.release()
    lock.path, lock.fd = path, held.fd
    wakes, floor, unread = _salvage(aside)
    db = _connect(path, lock)
    store = Store(path, db, problems)
    store.import_wakes(wakes, floor)
    unread_rows = _carry_rows(aside, db)
    lost = (
        "every wake in it was read back"
        if unread is None
        else f"wakes in its damaged pages are lost ({unread}); {len(wakes)} were read back"
    )
    if unread_rows is not None:
        lost += f"; records in its damaged pages are lost ({unread_rows})"
    problem = (
        f"the store {path} was damaged ({error}): it is kept as {aside}; a fresh one "
        f"replaces it; {lost}"
    )
    log.error("store.damaged", problem=problem)
    problems.append(problem)
    return db


def _salvage(path: Path) -> tuple[list[Wake], int, str | None]:
    """The wakes a damaged database still gives, the seq floor to start from, and what
    could not be read (None: nothing). Rows are read from both ends, so a damaged page in
    the middle costs only the rows on it."""
    wakes: dict[int, Wake] = {}
    unread: list[str] = []
    floor: int | None = None
    try:
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        return [], SEQ_SKIP_WITHOUT_FLOOR, str(exc)
    try:
        try:
            floor = _read_floor(db)
        except sqlite3.Error as exc:
            unread.append(f"the highest seq given: {exc}")
        for order in ("ASC", "DESC"):
            try:
                for row in db.execute(
                    "SELECT seq, worker, run, parent, state, exit_code, preview, attempt "
                    f"FROM wakes ORDER BY seq {order}"
                ):
                    with contextlib.suppress(msgspec.ValidationError):
                        wake = msgspec.convert(dict(zip(_WAKE_COLUMNS, row, strict=True)), Wake)
                        wakes[wake.seq] = wake
            except sqlite3.Error as exc:
                unread.append(f"reading wakes {order.lower()}ending: {exc}")
    finally:
        db.close()
    highest = max(wakes, default=0)
    start = max(floor, highest) if floor is not None else highest + SEQ_SKIP_WITHOUT_FLOOR
    return sorted(wakes.values(), key=lambda w: w.seq), start, "; ".join(unread) or None


#: The tables a damaged database's rows are carried from, by their key; `launch` and
#: `counters` hold one row each of their kind, which replaces the fresh store's.
_CARRIED_TABLES = {
    "workers": ("id", "INSERT OR IGNORE"),
    "runs": ("id", "INSERT OR IGNORE"),
    "tombstones": ("id", "INSERT OR IGNORE"),
    "launch": ("singleton", "INSERT OR REPLACE"),
    "request_keys": ("at", "INSERT OR IGNORE"),
}


def _carry_rows(path: Path, db: sqlite3.Connection) -> str | None:
    """Copy into `db` every row of the damaged database at `path` that still reads (from
    both ends of each table, so a damaged page costs only its rows); what could not be
    read (None: nothing). A database of schema version 1 has none of these tables."""
    unread: list[str] = []
    try:
        old = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        return str(exc)
    try:
        tables = {row[0] for row in old.execute("SELECT name FROM sqlite_master")}
    except sqlite3.Error as exc:
        old.close()
        return f"its list of tables: {exc}"
    try:
        db.execute("BEGIN IMMEDIATE")
        for table, (key, verb) in _CARRIED_TABLES.items():
            if table not in tables:
                continue
            for order in ("ASC", "DESC"):
                try:
                    for row in old.execute(f"SELECT * FROM {table} ORDER BY {key} {order}"):
                        marks = ", ".join("?" * len(row))
                        db.execute(f"{verb} INTO {table} VALUES ({marks})", row)
                except sqlite3.Error as exc:
                    unread.append(f"{table} {order.lower()}ending: {exc}")
        with contextlib.suppress(sqlite3.Error):
            for name, value in old.execute(
                "SELECT name, value FROM counters WHERE name != 'wake_seq'"
            ):
                db.execute("INSERT OR REPLACE INTO counters VALUES (?, ?)", (name, value))
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise
    finally:
        old.close()
    return "; ".join(unread) or None
