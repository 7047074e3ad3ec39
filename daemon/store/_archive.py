"""A worker's archive directory: what is written there, and how, in one place.

The archive holds what a person reads: the worker's snapshot (what it was asked to
run, written once, exclusively), its input, its journal, and the result file it may
write. Its record, and where needed the tail of its stdout, are in the store
(`_store.py`), out of the worker's reach. Files are 0600 and created exclusively.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec

from subagentd.protocol import Limits

from .._logging import get_logger
from ..core._registry import DEFAULT_GRACE
from ._files import (
    SAFE_FLAGS,
    NotRegularFile,
    open_dir,
    open_regular,
    read_regular,
)
from ._journal import Journal, read_tail

_Written = TypeVar("_Written", bound=msgspec.Struct)
log = get_logger()

#: The snapshot's format; a resume refuses one it cannot read.
SNAPSHOT_VERSION = 1
#: The result is the $SUBAGENTD_RESULT file, or else this much of stdout's end.
STDOUT_TAIL_BYTES = 32 * 1024
#: A result file larger than this is cut (the journal keeps the whole output).
RESULT_LIMIT = 1024 * 1024
#: No record or snapshot the daemon writes comes near this; a larger file is not read.
RECORD_READ_LIMIT = 64 * 1024 * 1024
#: What collect says of a result file that is a symlink, FIFO or directory.
RESULT_REFUSED = "[result file is not a regular file: ignored; the end of stdout follows]\n"
#: What it says of one that could not be read ({} says why).
RESULT_UNREADABLE = "[result file could not be read ({}); the end of stdout follows]\n"


#: An archive is renamed to this prefix and its name before it is deleted: what a pruning
#: cannot delete whole (a directory inside that its user cannot empty) is then no worker's
#: archive, which recovery would take for one whose row the store lost (its row goes
#: after), and the next pruning tries it again.
PRUNED_PREFIX = ".pruned-"


def prune_archives(archives: list[Path]) -> None:
    """Delete these archives (of workers that ended before the keep period), and what
    earlier prunings beside them could not delete whole."""
    for parent in {path.parent for path in archives}:
        for left in parent.glob(f"{PRUNED_PREFIX}*"):
            shutil.rmtree(left, ignore_errors=True)
    for path in archives:
        doomed = path.with_name(f"{PRUNED_PREFIX}{path.name}")
        try:
            os.rename(path, doomed)  # a symlink is moved itself, never followed
        except FileNotFoundError:
            continue
        except OSError:
            doomed = path  # (deleted where it is: as much of it as can be)
        shutil.rmtree(doomed, ignore_errors=True)  # never follows a symlink inside


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


class FrozenAgent(msgspec.Struct, kw_only=True):
    """An agent's definition in agents.toml as it stood at the spawn (before the spawn's own
    timeout, grace or env were laid over it): what a resume compares today's with."""

    command: list[str]
    model: str = ""
    timeout: float = 0
    grace: float | None = None
    env: dict[str, str] = {}


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
    #: The commit HEAD was at in cwd at spawn (None outside a work tree, before the first
    #: commit, where it could not be read, and in snapshots written before it was kept).
    head: str | None = None
    #: The agent's definition at spawn, for `agent` (None otherwise, and in snapshots
    #: written before it was kept).
    agent_def: FrozenAgent | None = None
    #: Its stdin a pipe the daemon holds for `send` (`spawn --stdin open`): a resumed
    #: attempt gets one again (False in snapshots written before it was kept).
    stdin_open: bool = False
    #: Its own limits (its agent's, with the spawn's laid over them): a resumed attempt
    #: runs under them again (None: none, and in snapshots written before they were kept).
    limits: Limits | None = None


class Archive:
    JOURNAL = "journal"
    INPUT = "input"
    RESULT = "result"
    SNAPSHOT = "snapshot.json"

    def __init__(self, path: Path) -> None:
        self.path = path

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
        """At most `limit` bytes of one of its files; NotRegularFile if it is no regular file.
        No context manager: read at every ending (its result, most often not there), where
        a generator's cleanup of the FileNotFoundError cost as much as the reading."""
        dir_fd = open_dir(self.path)
        try:
            return read_regular(name, limit, dir_fd=dir_fd, tail=tail)
        finally:
            os.close(dir_fd)

    def has_snapshot(self) -> bool:
        """Whether a snapshot was written here: anything under its name but nothing or an
        empty file (a spare archive's, never written: its spawn was refused). Not read, nor
        followed: what is wrong with one that is there, a resume says."""
        try:
            with self.opened() as dir_fd:
                st = os.stat(self.SNAPSHOT, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # the directory is not the daemon's any more: reading it says so
        return not (stat.S_ISREG(st.st_mode) and st.st_size == 0)

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

    def result_text(self, stdout_tail: Callable[[], bytes]) -> str:
        """The worker's result file if it wrote one, else the tail of its stdout.

        A result that is no regular file (a symlink, a FIFO) is not read, nor one
        that cannot be (a lease held on it, no descriptor left): the text says
        so, and the tail of stdout follows.
        """
        note = ""
        # Most workers write none: one look that needs no descriptor and raises nothing
        # says so (a stop_run's 10,000 endings each opened the archive, then failed to
        # open the result). What is there, whatever it is, is opened as before.
        if not os.access(f"{self.path}/{self.RESULT}", os.F_OK, follow_symlinks=False):
            raw = stdout_tail()
        else:
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
        """The end of the worker's stdout, from its journal (`journal`: if open).

        Only the journal's end is read, never all of it: as long as its worker
        made it, this is on the event loop. Where the journal's end would not
        give it as well, the store keeps it (see Daemon._stdout_tail).
        """
        if journal is not None:
            return journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
        try:
            return read_tail(self.file(self.JOURNAL), "stdout", STDOUT_TAIL_BYTES)
        except OSError:
            return b""


class SpareArchives:
    """Archive directories made ahead of need, so a spawn does not wait for new files.

    On some filesystems creating a file costs hundreds of microseconds of
    kernel time (the inode), and a spawn needs a directory and three files.
    A background thread makes them ahead (`make`), named `.spare-*` so that
    nothing takes them for a worker's; a spawn renames one to its worker's id
    and writes into its empty files. A spare of an older image (it had a record.json
    too) is not as made: removed, as any other. With none left, a spawn makes its own.
    """

    PREFIX = ".spare-"
    FILES = (Archive.SNAPSHOT, Archive.JOURNAL)

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
