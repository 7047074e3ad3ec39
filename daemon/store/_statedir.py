"""The state directory: its lock, and where each worker's archive lives.

One daemon owns a state dir at a time. The lock is an flock on the state
directory itself, so deleting or replacing a file cannot unlock it; the kernel
drops it when its holder dies. The file ``lock`` names the holder's pid and
host, and a held lock is refused naming who holds it: from that file, else
from /proc/locks. Images before this one flocked that file instead, so it is
flocked too (a daemon of either kind keeps the other out) and written in place,
never renamed over; one that is not a regular file of its own (a symlink, a
hard link, a FIFO) is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
from collections.abc import Callable, Container
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from .._logging import get_logger
from ._files import SAFE_FLAGS, open_dir, read_regular, replace_in, short_write

if TYPE_CHECKING:
    from ..core._carrier import Carrier

_WORKER_ID = re.compile(r"w-[A-Za-z0-9_-]{1,64}")
log = get_logger()


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
        #: The file `lock`, flocked for images that lock it rather than the directory.
        self._file_lock_fd: int | None = None

    def acquire(self, lock_fd: int | None = None, lock_file_fd: int | None = None) -> None:
        """Own the state dir, or raise StateDirLocked naming the holder.

        ``lock_fd`` is a lock descriptor inherited across a re-exec: the flock
        is already ours and stays so, and so does the file's, carried beside it
        (``lock_file_fd``; looked for if the image before did not say).
        An image from before the lock moved to the directory hands over a
        flocked ``lock`` file instead: it is kept (older daemons still see it
        held) and the directory is locked too.
        """
        ensure_private_dir(self.root)
        ensure_private_dir(self.archives)
        if lock_fd is not None and not stat.S_ISDIR(os.fstat(lock_fd).st_mode):
            self._file_lock_fd = lock_fd
            lock_fd = None
        if lock_fd is not None:
            self.lock_fd = lock_fd
            self._file_lock_fd = (
                lock_file_fd if lock_file_fd is not None else _carried_file_lock(lock_fd)
            )
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
            self._name_holder(fd, msgspec.json.encode(LockHolder(pid=os.getpid(), host=here)))
        except BaseException:
            os.close(fd)
            raise
        self.lock_fd = fd

    def _name_holder(self, dir_fd: int, holder_json: bytes) -> None:
        """Flock the file `lock` and write the holder into it, or raise StateDirLocked if
        a daemon of an earlier image holds it."""
        handed = self._file_lock_fd
        self._file_lock_fd = None
        if handed is not None and _names(dir_fd, handed):
            file_fd: int | None = handed
        else:
            file_fd = _open_holder_file(dir_fd)
            if handed is not None:
                os.close(handed)  # handed over, but no longer named `lock`
        if file_fd is None:
            # Not a regular file of its own: replaced, never written through.
            replace_in(dir_fd, self.HOLDER, holder_json, what="naming the state dir's holder")
            file_fd = _open_holder_file(dir_fd)
            if file_fd is not None and not _try_flock(file_fd):
                os.close(file_fd)  # replaced again meanwhile: the directory's lock is the real one
                file_fd = None
        else:
            try:
                self._refuse_if_held(file_fd)
                if os.pwrite(file_fd, holder_json, 0) != len(holder_json):
                    raise short_write("naming the state dir's holder", self.HOLDER)
                os.ftruncate(file_fd, len(holder_json))
            except BaseException:
                os.close(file_fd)
                raise
        self._file_lock_fd = file_fd

    def carry(self, carried: Carrier) -> tuple[int, int | None]:
        """Hand the lock to a reload's exec, so that no other daemon can take the state dir
        while it runs; (the directory's, the file `lock`'s if held)."""
        assert self.lock_fd is not None, "only the state dir's owner reloads"
        return (
            carried.carry(self.lock_fd, "the state dir's lock"),
            carried.carry_if(self._file_lock_fd, "the state dir's file `lock`"),
        )

    def _refuse_if_held(self, file_fd: int) -> None:
        """Flock the file `lock`, or raise StateDirLocked: a daemon of an image from before
        the lock moved to the directory holds it."""
        if _try_flock(file_fd):
            return
        holder = _decode_holder(os.pread(file_fd, 4096, 0)) or _flock_holder(file_fd)
        who = f"pid {holder.pid} on {holder.host}" if holder else "another process"
        raise StateDirLocked(
            f"state dir {self.root} is in use by {who} (a daemon of an earlier version); "
            "stop that daemon or pass another --state-dir"
        )

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

    def unrecorded(
        self, known: Callable[[], Container[str]]
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """The worker ids whose archive is here but not in `known()` (the ids the store has
        rows for, asked after the listing: a spawn writes its row before its archive, so
        an archive made meanwhile is not taken for one the store lost), and the names of
        worker ids here that are no directory (a symlink, a file: never followed), with
        what each is. One listing, nothing opened: cheap at 10,000 archives."""
        try:
            with os.scandir(self.archives) as listing:
                entries = list(listing)
        except FileNotFoundError:
            return [], []
        ids = known()
        unrecorded, foreign = [], []
        for entry in entries:
            if entry.name in ids or not _WORKER_ID.fullmatch(entry.name):
                continue  # (spares and other names are not workers': the spares' own)
            if entry.is_symlink():
                foreign.append((entry.name, "a symlink"))
            elif not entry.is_dir(follow_symlinks=False):
                foreign.append((entry.name, "not a directory"))
            else:
                unrecorded.append(entry.name)
        unrecorded.sort()
        foreign.sort()
        return unrecorded, foreign

    def archive_at(self, worker_id: str) -> str | None:
        """`archive`, as a string: for where a thousand are made at once (a reload's
        adoption, recovery), pathlib's joins cost about a fifth of adopting them."""
        if not _WORKER_ID.fullmatch(worker_id):
            return None
        return f"{self.archives}{os.sep}{worker_id}"


def _open_holder_file(dir_fd: int) -> int | None:
    """The file `lock` (created if missing), opened to be written in place; None if it is
    not a regular file with no other name (a symlink, a hard link to a file elsewhere, a
    FIFO, a directory) or cannot be opened."""
    flags = os.O_RDWR | os.O_CREAT | SAFE_FLAGS
    try:
        fd = os.open(StateDir.HOLDER, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        return None
    return fd


def _names(dir_fd: int, fd: int) -> bool:
    """Whether the name `lock` in `dir_fd` is the file open as `fd`."""
    try:
        named = os.stat(StateDir.HOLDER, dir_fd=dir_fd, follow_symlinks=False)
        held = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISREG(named.st_mode) and (named.st_dev, named.st_ino) == (
        held.st_dev,
        held.st_ino,
    )


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _carried_file_lock(dir_fd: int) -> int | None:
    """The flocked `lock` file a reload's exec carried unlisted (an image that kept it
    inheritable and did not name it in the checkpoint), else that file locked afresh;
    None if neither is to be had: the directory's lock, carried too, is the one that counts."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != dir_fd and _names(dir_fd, fd):
            if _try_flock(fd):
                os.set_inheritable(fd, False)
                return fd
            os.close(fd)  # carried, but not the lock's holder: of no use
    fresh = _open_holder_file(dir_fd)
    if fresh is None:
        return None
    if not _try_flock(fresh):
        os.close(fresh)
        # A daemon of an earlier image took it while the exec let go: nothing to refuse now.
        log.warning("state_dir.lock_file_held_by_another", file=StateDir.HOLDER)
        return None
    return fresh


def _read_holder(dir_fd: int) -> LockHolder | None:
    """Who the holder file names, if it is a regular file that names someone."""
    try:
        raw = read_regular(StateDir.HOLDER, 4096, dir_fd=dir_fd)
    except OSError:
        return None
    return _decode_holder(raw)


def _decode_holder(raw: bytes) -> LockHolder | None:
    if not raw.strip():
        return None
    try:
        return msgspec.json.decode(raw, type=LockHolder)
    except msgspec.DecodeError:
        return None


def _flock_holder(fd: int) -> LockHolder | None:
    """Who holds the flock on `fd`'s file or directory, as the kernel lists it."""
    st = os.fstat(fd)
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
