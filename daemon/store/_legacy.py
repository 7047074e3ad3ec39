"""What an image before the store (schema v2) left, taken into the store once.

Such an image kept each worker's record in `archives/<id>/record.json` (and, for some,
the end of its stdout in `stdout.tail`), each named run in `runs/<id>.json`, and carried
the rest of its registry (runs, ended records, tombstones, turn, launch fence) in a
version 1 checkpoint. `import_old_state` takes the files in at the first start over such
a state dir, in one transaction with the mark that it was done; `import_checkpoint_v1`
takes in what a v1 checkpoint carried when an old image reloads into this one. An archive
is in its worker's reach: its files are read only if regular, never through a symlink,
never blocking, with a bound; one that does not read is skipped and reported, and
recovery rebuilds its worker from the snapshot.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path, PurePath

import msgspec

from .._logging import get_logger
from ..core._registry import LaunchFence, RunRecord, Tombstone, WorkerRecord
from ._archive import STDOUT_TAIL_BYTES, Archive, decode_written, is_spare
from ._files import read_regular
from ._store import Change, LaunchState, Store

log = get_logger()

#: The files of an archive that the store replaces.
RECORD = "record.json"
STDOUT_TAIL = "stdout.tail"
#: A record is a few kilobytes (its argv at most a few hundred more); a larger file is
#: not one the daemon wrote, and is not read.
RECORD_READ_LIMIT = 16 * 1024 * 1024
#: A run file is a few hundred bytes.
RUN_FILE_LIMIT = 1024 * 1024
#: What a problem report says about one worker's archive: (worker id, what is wrong).
Report = Callable[[str], None]


class _CarriedV1(msgspec.Struct):
    id: str
    record: bytes


class CheckpointV1State(msgspec.Struct):
    """What a version 1 checkpoint carried that the store now holds."""

    runs: list[RunRecord]
    ended: list[bytes]  # msgpack WorkerRecords
    tombstones: list[Tombstone]
    live: list[_CarriedV1]
    turn: int
    fence: LaunchFence | None
    fence_epochs: int


def import_old_state(store: Store, root: Path, archives: Path) -> list[str]:
    """Take every record.json, stdout.tail and run file under `root` into the store, once;
    the ids of archives whose record did not read (recovery rebuilds them).

    Done in one transaction with its mark, so a crash midway leaves it to be done again
    whole; the files taken in are removed after (the runs directory is renamed aside).
    If some record did not read, the mark waits for recovery to have rebuilt those
    workers into the store (`mark_old_state_imported`): a crash before would lose them.
    """
    if store.old_state_imported():
        return []
    change = Change()
    unread: list[str] = []
    for path in sorted(archives.iterdir()) if archives.is_dir() else ():
        if is_spare(path) or not path.name.startswith("w-") or path.is_symlink():
            continue  # (a symlink or a file at a worker's name: recovery reports it)
        if not path.is_dir():
            continue
        record = _read_record(Archive(path), store.problems.append)
        if record is None:
            if _has(path, RECORD):
                unread.append(path.name)
            continue
        change.workers.append(record)
        tail = _read_tail(Archive(path))
        if tail is not None:
            change.tails[record.id] = tail
    change.runs = _read_runs(root / "runs", store.problems.append)
    change.old_state_imported = not unread
    store.commit(change, "importing an older state dir")
    for record in change.workers:
        _remove(archives / record.id, (RECORD, STDOUT_TAIL))
    with contextlib.suppress(FileNotFoundError):
        os.replace(root / "runs", root / "runs.imported")
    if change.workers or change.runs:
        log.info("store.old_state_imported", workers=len(change.workers), runs=len(change.runs))
    return unread


def mark_old_state_imported(store: Store) -> None:
    """The records that did not read were rebuilt into the store: the import is done."""
    store.commit(Change(old_state_imported=True), "an older state dir, rebuilt")


def import_checkpoint_v1(store: Store, state: CheckpointV1State, archives: Path) -> None:
    """Take in what a version 1 checkpoint carried (an older image reloading into this
    one): its records, newer than any record.json, replace them."""
    records = []
    for blob in [*state.ended, *(c.record for c in state.live)]:
        try:
            record = msgspec.msgpack.decode(blob, type=WorkerRecord)
        except msgspec.DecodeError as exc:
            store.problems.append(f"a worker's record in the v1 checkpoint does not read: {exc}")
            continue
        record.archive = str(archives / record.id)
        records.append(record)
    change = Change(
        workers=records,
        runs=state.runs,
        tombstones=state.tombstones,
        launch=LaunchState(turn=state.turn, fence=state.fence, fence_epochs=state.fence_epochs),
    )
    store.commit(change, "importing a version 1 checkpoint")


def _read_record(archive: Archive, report: Report) -> WorkerRecord | None:
    """An old image's record.json, if it reads and is its archive's own.

    Its worker may have rewritten it, so who it is and where it lives are
    taken from the directory, never from what it says: a record naming
    another worker is not read, and one naming another archive is corrected.
    Either is reported.
    """
    worker_id = archive.path.name
    try:
        raw = archive.read(RECORD, RECORD_READ_LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:  # NotRegularFile among them: a symlink, a FIFO
        report(f"worker {worker_id}: its record.json of an older image is not read ({exc})")
        return None
    if len(raw) > RECORD_READ_LIMIT:
        report(f"worker {worker_id}: its record.json of an older image is too large; not read")
        return None
    try:
        record = decode_written(raw, WorkerRecord)
    except msgspec.DecodeError as exc:
        report(f"worker {worker_id}: its record.json of an older image does not read ({exc})")
        return None
    if record.id != worker_id:
        report(f"worker {worker_id}: its record.json names worker {record.id!r}; not read")
        return None
    if record.archive != str(archive.path):
        # The same archive under a state dir moved or spelled otherwise is no damage.
        if PurePath(record.archive).parts[-2:] != ("archives", worker_id):
            report(
                f"worker {worker_id}: its record.json names archive {record.archive!r}; "
                f"{archive.path} is used"
            )
        record.archive = str(archive.path)
    return record


def _read_tail(archive: Archive) -> bytes | None:
    with contextlib.suppress(OSError):
        return archive.read(STDOUT_TAIL, STDOUT_TAIL_BYTES, tail=True)
    return None


def _read_runs(runs_dir: Path, report: Report) -> list[RunRecord]:
    runs: list[RunRecord] = []
    if not runs_dir.is_dir() or runs_dir.is_symlink():
        return runs
    for path in sorted(runs_dir.glob("r-*.json")):
        try:
            runs.append(msgspec.json.decode(read_regular(path, RUN_FILE_LIMIT), type=RunRecord))
        except (OSError, msgspec.DecodeError) as exc:
            report(f"the run file {path} of an older image is not read ({exc})")
    return runs


def _has(path: Path, name: str) -> bool:
    return os.path.lexists(path / name)


def _remove(path: Path, names: tuple[str, ...]) -> None:
    """Unlink what the store now holds (a symlink itself, never what it leads to)."""
    with contextlib.suppress(OSError), Archive(path).opened() as dir_fd:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
