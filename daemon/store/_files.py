"""Reading and writing files a worker can reach, and the daemon's own files, safely.

Workers run as the same user and know their archive directory: any file there
may have been replaced by a symlink, a FIFO or something huge. So such a file
is opened relative to its directory, never through a symlink (O_NOFOLLOW),
never blocking (O_NONBLOCK, then only a regular file is taken), and read with
a bound. A write never goes through a name a worker could have planted: a new
file is created exclusively under an unpredictable name and renamed over the
old (a rename replaces a symlink, never follows it), so a reader, or the next
daemon after a crash, sees the old content or the new, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

#: How a file under a worker's reach is opened: not through a symlink, not blocking.
SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(OSError):
    """A file the daemon reads or rewrites is a symlink, FIFO, device or directory."""


def open_dir(path: Path | str) -> int:
    """A descriptor of directory `path`, its last component not a symlink."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegularFile(exc.errno, "not a directory of the daemon's", str(path)) from None
        raise


def open_regular(
    name: str | Path,
    flags: int = os.O_RDONLY,
    *,
    dir_fd: int | None = None,
    follow: bool = False,
) -> int:
    """Open `name` (in `dir_fd`) if it is a regular file, else raise NotRegularFile.

    A symlink is refused (not followed), a FIFO opens without waiting for a
    writer and is refused; so is a write-only FIFO with no reader (ENXIO).
    `follow`: a symlink is followed (for the user's own files, never a worker's),
    what it leads to held to the same rules.
    """
    safe = SAFE_FLAGS & ~os.O_NOFOLLOW if follow else SAFE_FLAGS
    try:
        fd = os.open(name, flags | safe, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise NotRegularFile(exc.errno, "not a regular file", str(name)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", str(name))
    return fd


def read_bounded(fd: int, limit: int, *, tail: bool = False) -> bytes:
    """At most `limit` bytes of the regular file `fd`: its start, or its end (`tail`)."""
    offset = max(0, os.fstat(fd).st_size - limit) if tail else 0
    chunks = []
    while limit > 0:
        chunk = os.pread(fd, min(limit, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def read_regular(
    name: str | Path,
    limit: int,
    *,
    dir_fd: int | None = None,
    tail: bool = False,
    follow: bool = False,
) -> bytes:
    """`read_bounded` of `name` opened with `open_regular`."""
    fd = open_regular(name, dir_fd=dir_fd, follow=follow)
    try:
        return read_bounded(fd, limit, tail=tail)
    finally:
        os.close(fd)


def replace_in(dir_fd: int, name: str, data: bytes, *, what: str, durable: bool = False) -> None:
    """Write `data` to a new file in `dir_fd` (0600) and rename it over `name`.

    The temp file's name is unpredictable and it is created exclusively
    without following symlinks, so nothing planted beforehand is written
    through. `durable`: fsync before the rename, for what must outlive the
    machine going down. `what` names the file
    in the error a full disk gives.
    """
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        try:
            if os.write(fd, data) != len(data):
                raise short_write(what, tmp)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def replace_file(path: Path, data: bytes, *, what: str, durable: bool = False) -> None:
    """`replace_in` for a file of the daemon's own directory (its parent is trusted)."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_in(dir_fd, path.name, data, what=what, durable=durable)
    finally:
        os.close(dir_fd)


def short_write(what: str, path: str) -> OSError:
    """A write to a regular file that stopped short: the disk is full."""
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (short write {what})", path)
