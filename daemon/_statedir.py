"""The state directory: its lock, and where each worker's archive lives.

One daemon owns a state dir at a time. The lock is an flock on the state
directory itself, so deleting or replacing a file cannot unlock it; the kernel
drops it when its holder dies. The file ``lock`` only names the holder's pid
and host (written by rename, read without following a symlink), and a held
lock is refused naming who holds it: from that file, else from /proc/locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
from pathlib import Path

import msgspec

from ._files import open_dir, read_regular, replace_file, replace_in
from ._registry import RunRecord

#: A run file is a few hundred bytes; a bigger one is not one of the daemon's.
RUN_FILE_LIMIT = 1024 * 1024
_WORKER_ID = re.compile(r"w-[A-Za-z0-9_-]{1,64}")


class StateDirLocked(Exception):
    """Another daemon owns this state dir."""


class LockHolder(msgspec.Struct):
    pid: int
    host: str


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) 0700; refuse one another user owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        path.chmod(0o700)


class StateDir:
    #: Names the holder; the lock itself is on the directory.
    HOLDER = "lock"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.archives = root / "archives"
        #: A descriptor of the state directory, flocked (carried across a reload's exec).
        self.lock_fd: int | None = None
        self._file_lock_fd: int | None = None  # handed over by an image that locked `lock`

    def acquire(self, lock_fd: int | None = None) -> None:
        """Own the state dir, or raise StateDirLocked naming the holder.

        ``lock_fd`` is a lock descriptor inherited across a re-exec: the flock
        is already ours and stays so. An image from before the lock moved to
        the directory hands over a flocked ``lock`` file instead: it is kept
        (older daemons still see it held) and the directory is locked too.
        """
        ensure_private_dir(self.root)
        ensure_private_dir(self.archives)
        if lock_fd is not None and not stat.S_ISDIR(os.fstat(lock_fd).st_mode):
            self._file_lock_fd = lock_fd
            os.set_inheritable(lock_fd, False)  # never carried again: the directory's lock is
            lock_fd = None
        if lock_fd is not None:
            self.lock_fd = lock_fd
            return
        path = self.root / self.HOLDER
        fd = open_dir(self.root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or _flock_holder(fd)
            os.close(fd)
            who = f"pid {holder.pid} on {holder.host}" if holder else "another process"
            raise StateDirLocked(
                f"state dir {self.root} is in use by {who}; stop that daemon or pass "
                "another --state-dir"
            ) from None
        holder = _read_holder(fd)
        here = socket.gethostname()
        if holder is not None and holder.host != here:
            # flock does not reach across hosts on every network filesystem.
            os.close(fd)
            raise StateDirLocked(
                f"state dir {self.root} is locked by pid {holder.pid} on host {holder.host}; "
                f"if that daemon is gone, remove {path}"
            )
        try:
            holder_json = msgspec.json.encode(LockHolder(pid=os.getpid(), host=here))
            replace_in(fd, self.HOLDER, holder_json, what="naming the state dir's holder")
        except BaseException:
            os.close(fd)
            raise
        self.lock_fd = fd

    def release(self) -> None:
        """Give the state dir up cleanly: no file names a holder any more."""
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(
                    self.HOLDER, dir_fd=self.lock_fd
                )  # a symlink there is removed, not followed
            os.close(self.lock_fd)
            self.lock_fd = None
        if self._file_lock_fd is not None:
            os.close(self._file_lock_fd)
            self._file_lock_fd = None

    def archive(self, worker_id: str) -> Path | None:
        """Where the worker's archive lives; None for a string that is no worker id."""
        if not _WORKER_ID.fullmatch(worker_id):
            return None  # never join a path from an id like "../x"
        return self.archives / worker_id


def _read_holder(dir_fd: int) -> LockHolder | None:
    """Who the holder file names, if it is a regular file that names someone."""
    try:
        raw = read_regular(StateDir.HOLDER, 4096, dir_fd=dir_fd)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        return msgspec.json.decode(raw, type=LockHolder)
    except msgspec.DecodeError:
        return None


def _flock_holder(dir_fd: int) -> LockHolder | None:
    """Who holds the flock on `dir_fd`'s directory, as the kernel lists it."""
    st = os.fstat(dir_fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF"; waiters' lines hold "->".
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields and fields[5] == device:
            return LockHolder(pid=int(fields[4]), host=socket.gethostname())
    return None


def save_run(runs_dir: Path, run: RunRecord) -> None:
    """Runs outlive a crash: nesting and stop flags are on disk, one small file each."""
    runs_dir.mkdir(mode=0o700, exist_ok=True)
    replace_file(runs_dir / f"{run.id}.json", msgspec.json.encode(run), what="of a run file")


def load_runs(runs_dir: Path) -> list[RunRecord]:
    runs = []
    for path in runs_dir.glob("r-*.json") if runs_dir.exists() else ():
        # A run file half written by a crash is skipped: its workers still name the run.
        with contextlib.suppress(OSError, msgspec.DecodeError):
            runs.append(msgspec.json.decode(read_regular(path, RUN_FILE_LIMIT), type=RunRecord))
    return runs
