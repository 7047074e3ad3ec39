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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from ._files import replace_file, short_write
from ._journal import Journal, JournalCorrupt
from ._registry import DEFAULT_GRACE, WorkerRecord

_Written = TypeVar("_Written", bound=msgspec.Struct)

#: The snapshot's format; a resume refuses one it cannot read.
SNAPSHOT_VERSION = 1
#: The result is the $SUBAGENTD_RESULT file, or else this much of stdout's end.
STDOUT_TAIL_BYTES = 32 * 1024
#: A result file larger than this is cut (the journal keeps the whole output).
RESULT_LIMIT = 1024 * 1024
#: A record up to this size is rewritten in place; one page, so never torn by a kill.
RECORD_IN_PLACE_BYTES = 4096


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
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError:
        fields = msgspec.json.decode(raw)
        if not isinstance(fields, dict) or "grace" not in fields or fields["grace"] is not None:
            raise
        fields["grace"] = DEFAULT_GRACE
        return msgspec.convert(fields, kind)


def open_new(path: Path, flags: int = 0) -> int:
    """Open a file new to its worker for writing: the empty one a spare archive
    made ahead, else one created exclusively. Never one already written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags)
    except FileNotFoundError:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flags, 0o600)
    if os.fstat(fd).st_size:
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


class Archive:
    JOURNAL = "journal"
    INPUT = "input"
    RESULT = "result"
    STDOUT_TAIL = "stdout.tail"
    SNAPSHOT = "snapshot.json"
    RECORD = "record.json"

    def __init__(self, path: Path) -> None:
        self.path = path

    def create(self) -> None:
        self.path.mkdir(mode=0o700)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_snapshot(self, snapshot: Snapshot) -> None:
        # Written once, never replaced: into the empty file made ahead, or created exclusively.
        fd = open_new(self.file(self.SNAPSHOT))
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(snapshot))

    def write_input(self, data: bytes) -> Path:
        path = self.file(self.INPUT)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
        between pages. A larger record is replaced by a rename, as before.
        """
        data = msgspec.json.encode(record)
        path = self.file(self.RECORD)
        if len(data) <= RECORD_IN_PLACE_BYTES:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            else:
                try:
                    size = os.fstat(fd).st_size
                    if size <= RECORD_IN_PLACE_BYTES:
                        padded = data.ljust(size, b" ")
                        if os.pwrite(fd, padded, 0) != len(padded):
                            raise short_write("to a worker record", str(path))
                        return
                finally:
                    os.close(fd)
        replace_file(path, data, what="of a worker record")

    def write_stdout_tail(self, data: bytes) -> None:
        replace_file(
            self.file(self.STDOUT_TAIL), data[-STDOUT_TAIL_BYTES:], what="of a stdout tail"
        )

    def load_record(self) -> WorkerRecord | None:
        """The worker's last record, or None if there is no archive (or it no longer reads)."""
        try:
            return decode_written(self.file(self.RECORD).read_bytes(), WorkerRecord)
        except (OSError, msgspec.DecodeError):
            return None

    def result_text(self, stdout_tail: Callable[[], bytes]) -> str:
        """The worker's result file if it wrote one, else the tail of its stdout."""
        try:
            with open(self.file(self.RESULT), "rb") as f:
                raw = f.read(RESULT_LIMIT + 1)
        except FileNotFoundError:
            raw = stdout_tail()
        text = raw[:RESULT_LIMIT].decode("utf-8", errors="replace")
        if len(raw) > RESULT_LIMIT:
            text += f"\n[result cut at {RESULT_LIMIT} bytes; the file holds the rest]"
        return text

    def stdout_tail(self, journal: Journal | None = None) -> bytes:
        """The end of the worker's stdout: stdout.tail, else from its journal.

        The file is written at the end only where the journal would not
        answer as well (see Daemon._finish); `journal`: the journal, if open.
        """
        try:
            return self.file(self.STDOUT_TAIL).read_bytes()
        except FileNotFoundError:
            pass
        if journal is None:
            try:
                journal = Journal.open(self.file(self.JOURNAL), writable=False)
            except (OSError, JournalCorrupt):
                return b""
        return journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)

    def forget_stdout_tail(self) -> None:
        """A new attempt begins: the last one's tail no longer ends its stdout."""
        with contextlib.suppress(FileNotFoundError):
            self.file(self.STDOUT_TAIL).unlink()


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
        """A spare renamed to `worker_id`'s archive; None if there is none."""
        while self.ready:
            spare = self.ready.pop()
            target = self.archives / worker_id
            try:
                spare.rename(target)
            except OSError:
                continue  # removed by hand, say: the next one
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
                os.close(os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            made.append(path)
        return made

    def reuse_left(self) -> None:
        """Take up the spares an earlier daemon left, if whole and untouched; remove the rest."""
        for path in self.archives.glob(f"{self.PREFIX}*"):
            try:
                whole = all((path / name).stat().st_size == 0 for name in self.FILES)
            except OSError:
                whole = False
            if whole and len(path.name) == len(self.PREFIX) + 12:
                self.ready.append(path)
            else:
                shutil.rmtree(path, ignore_errors=True)


def is_spare(path: Path) -> bool:
    return path.name.startswith(SpareArchives.PREFIX)
