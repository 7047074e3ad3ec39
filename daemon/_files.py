"""Writing the daemon's own files whole: a reader, or the next daemon after a
crash, sees the old content or the new, never a mix of the two."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def replace_file(path: Path, data: bytes, *, what: str, durable: bool = False) -> None:
    """Write `data` to a temp file beside `path` (0600) and rename it over `path`.

    `durable`: fsync before the rename, for what must outlive the machine going
    down (the checkpoint, the wake log), not only the daemon. `what` names the
    file in the error a full disk gives.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if os.write(fd, data) != len(data):
            raise short_write(what, str(tmp))
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def short_write(what: str, path: str) -> OSError:
    """A write to a regular file that stopped short: the disk is full."""
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (short write {what})", path)
