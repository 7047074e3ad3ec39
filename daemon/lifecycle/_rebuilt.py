"""A reload's handoff rebuilt from what the kernel shows, when the checkpoint handed
over cannot be read (a bug of the image before, bytes cut short): exiting would leave
every live worker running unsupervised, so the new image takes over from what no
process can lie about instead.

The descriptors the old image carried are still this process's, and inheritable (all
it opened itself since the exec are close-on-exec), and each says what it is: the
state dir's lock (the directory itself), the file `lock`, the store's lock (state.db),
the listening socket (bound to the socket path), pipes, the output relays' sockets
(each asked what it holds: `ask_inventory`). The store names the live
workers, their pids and their pipes' inodes as they were started (both ends of a pipe
are one inode; a row of an image before that: /proc/<pid>/fd says which pipe is each
one's stdin, stdout and stderr now, which a worker that made another's its own fools).
What nothing claims is closed: a connection that asked for the reload (its client
connects again; the reload's answer is lost), a journal (opened again from its path
and verified whole). A worker whose pipes cannot be found is adopted without them, or,
if its pid is not it, stopped, as a checkpoint's unadoptable worker is.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat

from .._logging import get_logger
from .._settings import Settings
from ..core._registry import WorkerRecord
from ..processes._relay import CarriedRelay, ask_inventory, worker_of
from ..serving._listener import bound_for
from ..store._statedir import StateDir
from ..store._store import STORE_NAME
from ._checkpoint import CHECKPOINT_VERSION, CarriedWorker, Checkpoint

log = get_logger()

#: A descriptor the rebuilt handoff did not find (the lock, the socket): taken afresh.
NOT_FOUND = -1
_PIPE = re.compile(r"pipe:\[(\d+)\]")


def rebuilt_handoff(settings: Settings) -> tuple[Checkpoint, dict[int, int]]:
    """The handoff the inherited descriptors make, less its live workers (the store,
    not open yet, names them: `with_live_workers`); and the pipes, by inode."""
    root = settings.state_dir
    wanted = {
        "lock": _identity(root),
        "lock_file": _identity(root / StateDir.HOLDER),
        "store_lock": _identity(root / STORE_NAME),
    }
    found: dict[str, int] = {}
    pipes: dict[int, int] = {}
    relays: list[CarriedRelay] = []
    listen_fd, listen_owned = NOT_FOUND, True
    for fd in _inherited():
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        os.set_inheritable(fd, False)  # into no worker, nor the next image, unlisted
        ident = (st.st_dev, st.st_ino)
        name = next((n for n, i in wanted.items() if i == ident and n not in found), None)
        if name is not None:
            found[name] = fd
        elif stat.S_ISFIFO(st.st_mode):
            pipes[st.st_ino] = fd
        elif stat.S_ISSOCK(st.st_mode) and listen_fd == NOT_FOUND and _listens_at(fd):
            listen_fd, listen_owned = fd, _bound_at(fd, settings)
        elif stat.S_ISSOCK(st.st_mode) and (relay := ask_inventory(fd)) is not None:
            relays.append(relay)  # an output relay, asked what it holds
        else:
            os.close(fd)  # a requester's connection, a journal: see the module's docstring
    log.warning(
        "reload.rebuilt",
        found=sorted(found),
        listening=listen_fd != NOT_FOUND,
        pipes=len(pipes),
        relays=len(relays),
    )
    return Checkpoint(
        version=CHECKPOINT_VERSION,
        image_generation=0,  # unknown: counted afresh
        reloads=0,
        listen_fd=listen_fd,
        listen_owned=listen_owned,
        lock_fd=found.get("lock", NOT_FOUND),
        lock_file_fd=found.get("lock_file"),
        store_lock_fd=found.get("store_lock"),
        live=[],
        settings=settings,
        relays=relays,
    ), pipes


def with_live_workers(
    handoff: Checkpoint, held: list[WorkerRecord], pipes: dict[int, int]
) -> Checkpoint:
    """`handoff` with every worker the store holds as running, each with its pipes as
    /proc shows them (taken from `pipes`; those left over are closed)."""
    live = []
    relayed = {  # by worker id: the relay's pid, the stream key, the kinds still open
        worker_of(key): (r.pid, key, kinds)
        for r in handoff.relays
        for key, kinds in r.streams.items()
    }
    for record in held:
        if record.ended or record.pid is None or record.pid_start is None:
            continue
        ends: dict[int, int | None] = {}
        for number in (0, 1, 2):
            inode = (
                record.pipes[number] if record.pipes is not None else _pipe_at(record.pid, number)
            )
            ends[number] = pipes.pop(inode, None) if inode else None
        live.append(
            CarriedWorker(
                id=record.id,
                pid=record.pid,
                pid_start=record.pid_start,
                stdin=ends[0],
                stdout=ends[1],
                stderr=ends[2],
                relay=relayed[record.id][0] if record.id in relayed else None,
                relay_key=relayed[record.id][1] if record.id in relayed else "",
                relayed=relayed[record.id][2] if record.id in relayed else [],
            )
        )
    for fd in pipes.values():
        os.close(fd)
    pipes.clear()
    handoff.live = live
    return handoff


def _pipe_at(pid: int, number: int) -> int:
    """The inode of the pipe `pid` has as its fd `number` now (0: none)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{number}")
    except OSError:
        return 0
    match = _PIPE.fullmatch(target)
    return int(match[1]) if match else 0


def _inherited() -> list[int]:
    """This process's inheritable descriptors above the standard three."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if fd > 2 and os.get_inheritable(fd):
                fds.append(fd)
    return fds


def _identity(path: os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _listens_at(fd: int) -> bool:
    """Whether `fd` is a listening Unix socket: the control socket (there is one)."""
    sock = socket.socket(fileno=fd)
    try:
        return bool(
            sock.family == socket.AF_UNIX
            and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        )
    except OSError:
        return False
    finally:
        sock.detach()


def _bound_at(fd: int, settings: Settings) -> bool:
    """Whether the socket was made for the socket path (else the service manager's, or
    one it cannot tell: never unlinked)."""
    try:
        return bound_for(fd) == settings.socket
    except (OSError, ValueError):
        return False
