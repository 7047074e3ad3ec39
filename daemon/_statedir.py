"""The state directory: its lock, and where each worker's archive lives.

One daemon owns a state dir at a time. The lock is an flock on ``lock``, whose
content names the holder's pid and host: the kernel drops an flock when its
holder dies, so a free lock with a dead pid in it is stale and taken over,
and a held one is refused naming who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from pathlib import Path

import msgspec

from ._files import replace_file
from ._registry import RunRecord

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
    def __init__(self, root: Path) -> None:
        self.root = root
        self.archives = root / "archives"
        self.lock_fd: int | None = None

    def acquire(self, lock_fd: int | None = None) -> None:
        """Own the state dir, or raise StateDirLocked naming the holder.

        ``lock_fd`` is a lock descriptor inherited across a re-exec: the flock
        is already ours and stays so.
        """
        ensure_private_dir(self.root)
        ensure_private_dir(self.archives)
        if lock_fd is not None:
            self.lock_fd = lock_fd
            return
        path = self.root / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, msgspec.json.encode(LockHolder(pid=os.getpid(), host=here)), 0)
        self.lock_fd = fd

    def release(self) -> None:
        """Give the state dir up cleanly: the lock names no holder any more."""
        if self.lock_fd is not None:
            os.ftruncate(self.lock_fd, 0)
            os.close(self.lock_fd)
            self.lock_fd = None

    def archive(self, worker_id: str) -> Path | None:
        """Where the worker's archive lives; None for a string that is no worker id."""
        if not _WORKER_ID.fullmatch(worker_id):
            return None  # never join a path from an id like "../x"
        return self.archives / worker_id


def _read_holder(fd: int) -> LockHolder | None:
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return None
    try:
        return msgspec.json.decode(raw, type=LockHolder)
    except msgspec.DecodeError:
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
            runs.append(msgspec.json.decode(path.read_bytes(), type=RunRecord))
    return runs
