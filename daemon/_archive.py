"""A worker's archive directory: what is written there, and how, in one place.

The archive holds the worker's snapshot (what it was asked to run), its input,
its journal, the result file it may write, the tail of its stdout and its last
record. Files are 0600 and written whole or not at all: created exclusively,
renamed over, or (a record) rewritten in place within one page.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import TypeVar

import msgspec
import structlog

from ._files import (
    SAFE_FLAGS,
    NotRegularFile,
    open_dir,
    open_regular,
    read_regular,
    replace_in,
    short_write,
)
from ._journal import Journal, JournalCorrupt
from ._registry import DEFAULT_GRACE, WorkerRecord

_Written = TypeVar("_Written", bound=msgspec.Struct)
log = structlog.get_logger("subagentd")

#: The snapshot's format; a resume refuses one it cannot read.
SNAPSHOT_VERSION = 1
#: The result is the $SUBAGENTD_RESULT file, or else this much of stdout's end.
STDOUT_TAIL_BYTES = 32 * 1024
#: A result file larger than this is cut (the journal keeps the whole output).
RESULT_LIMIT = 1024 * 1024
#: A record up to this size is rewritten in place; one page, so never torn by a kill.
RECORD_IN_PLACE_BYTES = 4096
#: No record or snapshot the daemon writes comes near this; a larger file is not read.
RECORD_READ_LIMIT = 64 * 1024 * 1024
#: What collect says of a result file that is a symlink, FIFO or directory.
RESULT_REFUSED = "[result file is not a regular file: ignored; the end of stdout follows]\n"
#: What it says of one that could not be read ({} says why).
RESULT_UNREADABLE = "[result file could not be read ({}); the end of stdout follows]\n"


def prune_archives(archives: Path, cutoff: float, keep: set[str]) -> int:
    """Delete archives of workers that ended before `cutoff` (not in `keep`); how many."""
    pruned = 0
    for path in archives.iterdir():
        if path.name in keep or is_spare(path):
            continue
        record = Archive(path).load_record()
        if record is not None and record.ended_at is not None and record.ended_at < cutoff:
            shutil.rmtree(path, ignore_errors=True)
            pruned += 1
    return pruned


def decode_written(raw: bytes, kind: type[_Written]) -> _Written:
    """`raw`, a record or snapshot, decoded as `kind`; what older daemons wrote still reads.

    They took a grace of inf or nan, which JSON writes as null: that worker is
    not lost, its grace is the default.
    """
    try:
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError:
            fields = msgspec.json.decode(raw)
            if not isinstance(fields, dict) or fields.get("grace", 0) is not None:
                raise
            fields["grace"] = DEFAULT_GRACE
            return msgspec.convert(fields, kind)
    except RecursionError:
        # Nested past the decoder's depth: damage (a worker can write its own record),
        # reported as any other undecodable file, not an exception nobody expects.
        raise msgspec.DecodeError("nested too deep to decode") from None


def open_new(path: Path, flags: int = 0) -> int:
    """Open a file new to its worker for writing: the empty one a spare archive
    made ahead, else one created exclusively. Never one already written, nor
    anything but a regular file (a spare's directory is in a worker's reach)."""
    try:
        fd = open_regular(path, os.O_WRONLY | flags)
    except FileNotFoundError:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_FLAGS | flags, 0o600)
    st = os.fstat(fd)
    if st.st_size or st.st_nlink != 1:
        os.close(fd)
        raise FileExistsError(errno.EEXIST, "already written", str(path))
    return fd


class Snapshot(msgspec.Struct, kw_only=True):
    """What a worker was asked to run, frozen at spawn."""

    version: int = SNAPSHOT_VERSION
    id: str
    run: str
    parent: str | None
    name: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    agent: str | None
    model: str | None
    timeout: float | None
    grace: float
    has_input: bool
    created_at: float
    #: The git branch HEAD was on in cwd at spawn (None outside a work tree, or detached).
    branch: str | None = None


#: Told of a record that is not its archive's own: (the archive's worker id, what is wrong).
RecordDamage = Callable[[str, str], None]


class Archive:
    JOURNAL = "journal"
    INPUT = "input"
    RESULT = "result"
    STDOUT_TAIL = "stdout.tail"
    SNAPSHOT = "snapshot.json"
    RECORD = "record.json"

    def __init__(self, path: Path, damaged: RecordDamage | None = None) -> None:
        self.path = path
        #: Who hears of a record naming another worker or archive (it is logged regardless).
        self.damaged = damaged

    def create(self) -> None:
        self.path.mkdir(mode=0o700)

    def file(self, name: str) -> Path:
        return self.path / name

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """The archive directory's descriptor; its files are opened relative to it, so
        a worker that replaces the directory itself with a symlink sends no one elsewhere."""
        fd = open_dir(self.path)
        try:
            yield fd
        finally:
            os.close(fd)

    def read(self, name: str, limit: int, *, tail: bool = False) -> bytes:
        """At most `limit` bytes of one of its files; NotRegularFile if it is no regular file."""
        with self.opened() as dir_fd:
            return read_regular(name, limit, dir_fd=dir_fd, tail=tail)

    def replace(self, name: str, data: bytes, *, what: str) -> None:
        with self.opened() as dir_fd:
            _replace_planted(dir_fd, name, data, what=what)

    def write_snapshot(self, snapshot: Snapshot) -> None:
        # Written once, never replaced: into the empty file made ahead, or created exclusively.
        fd = open_new(self.file(self.SNAPSHOT))
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(snapshot))

    def write_input(self, data: bytes) -> Path:
        path = self.file(self.INPUT)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_FLAGS, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def write_record(self, record: WorkerRecord) -> None:
        """Write the worker's record: created once, then rewritten in place.

        Creating a file is the costly part of a write on some filesystems
        (hundreds of microseconds for the inode), so a record that fits in one
        page overwrites the old one with a single pwrite, padded with spaces
        (JSON allows trailing whitespace). Killing the daemon cannot tear a
        one-page write at offset 0: the kernel checks for a fatal signal only
        between pages. A larger record is replaced by a rename, as before; so
        is anything a worker may have put in its place (a symlink, a FIFO, a
        hard link to a file elsewhere), which is never written through.
        """
        data = msgspec.json.encode(record)
        with self.opened() as dir_fd:
            if len(data) <= RECORD_IN_PLACE_BYTES and self._rewrite(dir_fd, data):
                return
            _replace_planted(dir_fd, self.RECORD, data, what="of a worker record")

    def _rewrite(self, dir_fd: int, data: bytes) -> bool:
        """Overwrite the record in place if it is the daemon's own one-page file."""
        try:
            fd = os.open(self.RECORD, os.O_WRONLY | SAFE_FLAGS, dir_fd=dir_fd)
        except OSError:
            return False  # missing, a symlink (ELOOP), a FIFO nobody reads (ENXIO)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return False
            if st.st_size > RECORD_IN_PLACE_BYTES:
                return False
            padded = data.ljust(st.st_size, b" ")
            if os.pwrite(fd, padded, 0) != len(padded):
                raise short_write("to a worker record", str(self.file(self.RECORD)))
            return True
        finally:
            os.close(fd)

    def write_stdout_tail(self, data: bytes) -> None:
        self.replace(self.STDOUT_TAIL, data[-STDOUT_TAIL_BYTES:], what="of a stdout tail")

    def load_record(self) -> WorkerRecord | None:
        """The worker's last record, or None if there is no archive (or it no longer reads).

        Its worker may have rewritten it, so who it is and where it lives are
        taken from this directory, never from what it says: a record naming
        another worker is unreadable (recovery rebuilds it from the snapshot),
        and one naming another archive is corrected. Either is reported.
        """
        try:
            record = decode_written(self.read(self.RECORD, RECORD_READ_LIMIT), WorkerRecord)
        except (OSError, msgspec.DecodeError):
            return None
        worker_id = self.path.name
        if record.id != worker_id:
            self._report(worker_id, f"its record.json names worker {record.id!r}; not read")
            return None
        if record.archive != str(self.path):
            # The same archive under a state dir moved or spelled otherwise is no damage.
            if PurePath(record.archive).parts[-2:] != ("archives", worker_id):
                self._report(
                    worker_id,
                    f"its record.json names archive {record.archive!r}; {self.path} is used",
                )
            record.archive = str(self.path)
        return record

    def _report(self, worker_id: str, problem: str) -> None:
        log.warning("archive.record_damaged", worker=worker_id, problem=problem)
        if self.damaged is not None:
            self.damaged(worker_id, problem)

    def result_text(self, stdout_tail: Callable[[], bytes]) -> str:
        """The worker's result file if it wrote one, else the tail of its stdout.

        A result that is no regular file (a symlink, a FIFO) is not read, nor one
        that cannot be (a lease held on it, no descriptor left): the text says
        so, and the tail of stdout follows.
        """
        note = ""
        try:
            raw = self.read(self.RESULT, RESULT_LIMIT + 1)
        except NotRegularFile:
            note, raw = RESULT_REFUSED, stdout_tail()
        except FileNotFoundError:
            raw = stdout_tail()
        except OSError as exc:
            note, raw = RESULT_UNREADABLE.format(exc.strerror or exc), stdout_tail()
        text = note + raw[:RESULT_LIMIT].decode("utf-8", errors="replace")
        if len(raw) > RESULT_LIMIT:
            text += f"\n[result cut at {RESULT_LIMIT} bytes; the file holds the rest]"
        return text

    def stdout_tail(self, journal: Journal | None = None) -> bytes:
        """The end of the worker's stdout: stdout.tail, else from its journal.

        The file is written at the end only where the journal would not
        answer as well (see Daemon._finish); `journal`: the journal, if open.
        """
        try:
            return self.read(self.STDOUT_TAIL, STDOUT_TAIL_BYTES, tail=True)
        except OSError:
            pass  # not written, something a worker put there, or unreadable: the journal answers
        if journal is None:
            try:
                journal = Journal.open(self.file(self.JOURNAL), writable=False)
            except (OSError, JournalCorrupt):
                return b""
        return journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)

    def forget_stdout_tail(self) -> None:
        """A new attempt begins: the last one's tail no longer ends its stdout."""
        with contextlib.suppress(FileNotFoundError), self.opened() as dir_fd:
            try:
                os.unlink(self.STDOUT_TAIL, dir_fd=dir_fd)
            except IsADirectoryError:
                move_aside(dir_fd, self.STDOUT_TAIL)


class SpareArchives:
    """Archive directories made ahead of need, so a spawn does not wait for new files.

    On some filesystems creating a file costs hundreds of microseconds of
    kernel time (the inode), and a spawn needs a directory and three files.
    A background thread makes them ahead (`make`), named `.spare-*` so that
    nothing takes them for a worker's; a spawn renames one to its worker's id
    and writes into its empty files. With none left, a spawn makes its own.
    """

    PREFIX = ".spare-"
    FILES = (Archive.SNAPSHOT, Archive.JOURNAL, Archive.RECORD)

    def __init__(self, archives: Path, keep: int = 8) -> None:
        self.archives = archives
        self.keep = keep
        self.ready: list[Path] = []

    def take(self, worker_id: str) -> Archive | None:
        """A spare renamed to `worker_id`'s archive; None if there is none.

        Spares are in a worker's reach: one that is no longer as made (a symlink
        in its place, a file written or planted in it) is deleted, and the next
        one taken; with none left, the spawn makes a fresh archive.
        """
        while self.ready:
            spare = self.ready.pop()
            target = self.archives / worker_id
            try:
                spare.rename(target)
                if not stat.S_ISDIR(target.lstat().st_mode):
                    target.unlink()  # a symlink put in its place: not followed
                    continue
            except OSError:
                continue  # removed by hand, say: the next one
            try:
                tampered = not _untouched(target)
            except OSError:
                tampered = False  # cannot look (no descriptor left, say): its writes will tell
            if tampered:
                shutil.rmtree(target, ignore_errors=True)  # never follows a symlink inside
                continue
            return Archive(target)
        return None

    @property
    def wanted(self) -> int:
        return self.keep - len(self.ready)

    def make(self, count: int) -> list[Path]:
        """Make `count` spares (in a thread: this is the slow part)."""
        made = []
        for _ in range(count):
            path = self.archives / f"{self.PREFIX}{secrets.token_hex(6)}"
            path.mkdir(mode=0o700)
            for name in self.FILES:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_FLAGS
                os.close(os.open(path / name, flags, 0o600))
            made.append(path)
        return made

    def reuse_left(self) -> None:
        """Take up the spares an earlier daemon left, if whole and untouched; remove the rest."""
        for path in self.archives.glob(f"{self.PREFIX}*"):
            try:
                whole = _untouched(path)
            except OSError:
                whole = False
            if whole and len(path.name) == len(self.PREFIX) + 12:
                self.ready.append(path)
            else:
                shutil.rmtree(path, ignore_errors=True)


def _replace_planted(dir_fd: int, name: str, data: bytes, *, what: str) -> None:
    """`replace_in`, even over a directory a worker made at `name` (a rename cannot
    replace one): that is moved aside first, and the file written."""
    try:
        replace_in(dir_fd, name, data, what=what)
    except IsADirectoryError:
        move_aside(dir_fd, name)
        replace_in(dir_fd, name, data, what=what)


def move_aside(dir_fd: int, name: str) -> None:
    """Rename what is at `name` to an unused `.name.*.planted` in the same directory.

    For something a worker put where the daemon writes: a rename moves a
    symlink itself, never what it leads to, and nothing leaves the archive
    (deleted with it when it is pruned); nothing is read or walked.
    """
    aside = f".{name}.{secrets.token_hex(8)}.planted"
    os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def is_spare(path: Path) -> bool:
    return path.name.startswith(SpareArchives.PREFIX)


def _untouched(spare: Path) -> bool:
    """A spare as made: its files, nothing else, each empty, regular and unlinked elsewhere."""
    names = sorted(SpareArchives.FILES)
    return sorted(os.listdir(spare)) == names and all(_empty_regular(spare / n) for n in names)


def _empty_regular(path: Path) -> bool:
    """An untouched spare file: empty, regular and not a link to anything else."""
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_nlink == 1
