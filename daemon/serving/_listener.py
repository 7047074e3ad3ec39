"""The control socket on disk: created private, a stale one replaced safely.

The socket is bound under a temporary name in the 0700 runtime directory,
made 0600, and renamed over the public path, so a client never finds a
half-made socket, and a live daemon's socket is never taken from it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..store._statedir import ensure_private_dir

if TYPE_CHECKING:
    from ..core._carrier import Carrier

BACKLOG = 4096
#: The first descriptor systemd passes to a socket-activated service.
SD_LISTEN_FDS_START = 3


class SocketInUse(Exception):
    """A live daemon already answers at the socket path."""


class ControlSocket:
    """The listening socket and the file it was bound to."""

    def __init__(self, sock: socket.socket, path: Path, *, owned: bool = True) -> None:
        self.sock = sock
        self.path = path
        self.owned = owned  # False: the service manager made the file and keeps it
        # A socket file's inode is not the socket's: remember which file is ours.
        self.inode = os.stat(path).st_ino if owned else 0

    @classmethod
    def inherited(cls, fd: int, path: Path, *, owned: bool = True) -> ControlSocket:
        """The listening socket an earlier image handed across the exec (close-on-exec
        again: see `_carried.take_back`)."""
        return cls(socket.socket(fileno=fd), path, owned=owned)

    def carry(self, carried: Carrier) -> int:
        """Hand the listening socket to a reload's exec: connects wait in its backlog."""
        return carried.carry(self.sock.fileno(), "the listening socket")

    def remove(self) -> None:
        """Unlink the socket file if it is still ours (a successor may have replaced it)."""
        if not self.owned:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                self.path.unlink()


def bind_control_socket(path: Path) -> ControlSocket:
    ensure_private_dir(path.parent)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    if _answers(path):
        raise SocketInUse(
            f"a daemon already serves at {path}; stop it first or pass another --socket"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # what `bound_for` reads back
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(tmp))
        os.chmod(tmp, 0o600)
        sock.listen(BACKLOG)
        os.replace(tmp, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return ControlSocket(sock, path)


def bound_for(fd: int) -> Path | None:
    """The path the listening socket `fd` was made for by `bind_control_socket`, read from
    the socket itself: bound as `.NAME.PID` beside it, then renamed to NAME. None if its
    bound name is not of that form. Raises OSError if `fd` is no socket."""
    sock = socket.socket(fileno=fd)
    try:
        name = sock.getsockname()
    finally:
        sock.detach()
    if not isinstance(name, str) or not name:
        return None
    bound = Path(name)
    head, dot, pid = bound.name.rpartition(".")
    if not (head.startswith(".") and len(head) > 1 and dot and pid.isdigit()):
        return None
    return bound.with_name(head[1:])


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:  # absent, refused (stale), or not a socket at all
        return False
    finally:
        probe.close()
    return True


def activated_socket(path: Path) -> ControlSocket | None:
    """The listening socket systemd passed (socket activation), if it passed one to us.

    The LISTEN_* variables are consumed here, so no worker ever sees them.
    """
    pid, fds = os.environ.pop("LISTEN_PID", None), os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid is None or fds is None or int(pid) != os.getpid() or int(fds) < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    os.set_inheritable(SD_LISTEN_FDS_START, False)
    return ControlSocket(sock, path, owned=False)
