"""The daemon's hold on its store file against every other process: an open file
description lock (F_OFD_SETLK) over the bytes sqlite locks (its pending, reserved and
shared bytes), taken for writing, as sqlite's own exclusive lock would be.

sqlite's own locks are POSIX record locks: the kernel drops them when the process
closes any descriptor of the file, and a reload's exec closes sqlite's (they are
close-on-exec), so a process that opened state.db in the exec's window (a poller, a
person's `sqlite3 state.db`: a WAL reader keeps its shared lock while it is open)
held the new image out. This lock belongs to its descriptor's open file description
instead: the descriptor is carried across the exec (as the state dir's is), so the
lock is never let go between images, and no other process's sqlite gets in (it asks
for a shared lock on those bytes, and is told the database is locked). The store
opens sqlite with no locking of its own (the `unix-none` VFS, exclusive mode: the WAL
index in its memory): this lock is the only one, and an OFD lock and sqlite's POSIX
locks of one process would conflict.

Another process's lock on those bytes (a reader that was there first) is never a
reason to give the store up: `StoreLocked` names the holder, and the daemon waits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._files import SAFE_FLAGS

if TYPE_CHECKING:
    from ..core._carrier import Carrier

#: sqlite's lock bytes in the database file (its `os.h`): PENDING_BYTE, then the
#: reserved byte, then the shared range of 510 bytes.
PENDING_BYTE = 0x40000000
LOCKED_LENGTH = 2 + 510
#: struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (natively aligned).
_FLOCK = struct.Struct("hhqqi")


class StoreLocked(Exception):
    """Another process holds a lock on the store file: the daemon waits, never gives up."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(
            f"the store {path} is locked by {holder}; the daemon waits for it to let go "
            "(a sqlite3 shell or a program reading state.db: close it)"
        )
        self.path = path
        self.holder = holder


@dataclass
class StoreLock:
    """The lock, by its descriptor (close-on-exec but while carried), on the file `path`."""

    path: Path
    fd: int

    @classmethod
    def take(cls, path: Path, inherited: int | None = None) -> StoreLock:
        """Hold the store file at `path` against every other process, or raise StoreLocked.

        `inherited`: the descriptor a reload carried, whose lock is already ours (taking it
        again changes nothing); if it is not the file at `path` now, the file there is
        locked afresh. Either way a descriptor not made the lock is closed.
        """
        if inherited is not None and not _is_file_at(inherited, path):
            with contextlib.suppress(OSError):  # EBADF: not open at all
                os.close(inherited)
            inherited = None
        # An inherited lock is ours already: taking it again is a no-op the kernel confirms.
        fd = (
            os.open(path, os.O_RDWR | os.O_CREAT | SAFE_FLAGS, 0o600)
            if inherited is None
            else inherited
        )
        lock = cls(path, fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            lock._lock()
        except BaseException:
            os.close(fd)
            raise
        return lock

    def follow(self, path: Path) -> None:
        """Hold the file at `path` now, if not already (the one held was set aside, or let
        go of): the new one locked first, then the old descriptor closed."""
        if self.fd >= 0 and self.holds(path):
            return
        fresh = StoreLock.take(path)
        self.release()
        self.path, self.fd = path, fresh.fd

    def holds(self, path: Path) -> bool:
        """Whether the file at `path` is the one locked (not replaced since)."""
        return _is_file_at(self.fd, path)

    def carry(self, carried: Carrier) -> int:
        """Hand the lock to a reload's exec: no other process gets in between images."""
        return carried.carry(self.fd, "the store's lock")

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def detach(self) -> None:
        """Let go of the descriptor without closing it (an exec carried it: tests/inprocess.py)."""
        self.fd = -1

    def _lock(self) -> None:
        request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, PENDING_BYTE, LOCKED_LENGTH, 0)
        try:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, request)
        except (BlockingIOError, PermissionError):  # EAGAIN, or EACCES on some systems
            raise StoreLocked(self.path, self._holder()) from None
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            raise OSError(
                exc.errno,
                f"the filesystem of {self.path} takes no open file description lock "
                f"(F_OFD_SETLK: {exc.strerror}), which keeps other processes out of the "
                "store: put the state dir on a local filesystem (--state-dir)",
            ) from exc

    def _holder(self) -> str:
        """Who holds a lock in the way, as well as the kernel says."""
        request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, PENDING_BYTE, LOCKED_LENGTH, 0)
        try:
            kind, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, request))
        except OSError:
            return "another process"
        what = "a read lock" if kind == fcntl.F_RDLCK else "a write lock"
        if kind == fcntl.F_UNLCK:
            return "another process (it let go just now)"
        if pid <= 0:  # an OFD lock: the kernel does not say whose
            return f"another process ({what})"
        return f"pid {pid} ({describe_process(pid)}; {what})"


def is_store_lock(fd: int) -> bool:
    """Whether the descriptor `fd` holds a store's lock (`StoreLock`), as the kernel says
    of its open file description: a descriptor a checkpoint names wrongly is not one."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as file:
            lines = file.read().splitlines()
    except OSError:
        return False
    # lock:	1: OFDLCK  ADVISORY  WRITE -1 <dev>:<ino> <first> <last>
    held = ["OFDLCK", "ADVISORY", "WRITE"]
    bytes_held = [str(PENDING_BYTE), str(PENDING_BYTE + LOCKED_LENGTH - 1)]
    return any(
        line.split()[2:5] == held and line.split()[-2:] == bytes_held
        for line in lines
        if line.startswith("lock:")
    )


def describe_process(pid: int) -> str:
    """A process as a person would know it: its command line, shortened."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read(4096).split(b"\0")
    except OSError:
        return "gone"
    line = " ".join(a.decode(errors="replace") for a in argv if a)
    return line if len(line) <= 200 else f"{line[:200]}..."


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        held, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(held.st_mode) and (held.st_dev, held.st_ino) == (
        there.st_dev,
        there.st_ino,
    )


def since_text(started: float) -> str:
    """When a wait began, as a log line and `info` say it (UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
