"""The OS side of one worker: its pid, the read ends of its output pipes and, for a
worker spawned with its stdin open, the write end of its stdin. No pidfd: a live worker
holds its pipes only (2 descriptors, 3 with its stdin open).

Every worker, whether this image spawned it or adopted it across a reload, is the
daemon's own child: its exit is told by SIGCHLD (`_reaper`), and it is reaped by its
pid, never by waitpid(-1), so no other reaper can steal its status nor this one
another's. Unreaped, its pid is no one else's, so it is signalled by its pid; a stop
that pins its tree opens a pidfd for it then (`pin`). The fds live here and nowhere
else, which is what lets a reload hand them to the next image.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..store._files import open_regular
from . import _born_into, _spawn
from ._cgroup import _FORK_LOCK, WorkerCgroup
from ._controllers import LimitNodes, LimitsNotPlaced
from ._forker import FORKER
from ._reaper import REAPER, Watched
from ._tree import DESCRIPTOR_ERRNOS, read_stat

if TYPE_CHECKING:
    from ..core._carrier import Carrier
    from ._relay import RelayStream

#: What a pump's source takes: where each chunk read goes (`Supervisor._deliverer`).
Deliver = Callable[[bytes], Awaitable[None]]

#: One read takes at most this much of what a pipe has ready, and makes one journal entry.
ENTRY_BYTES = 512 * 1024
#: A read this long found the pipe full at the kernel's default size (64 KiB): its worker
#: writes faster than it is read, and its pipe is grown to PIPE_BYTES (see `grow_pipe`).
FULL_PIPE_BYTES = 64 * 1024
#: What a fast writer's pipe is grown to: room for two reads, so the worker writes on
#: while the daemon journals the last read (fs.pipe-max-size's default).
PIPE_BYTES = 1024 * 1024


#: What a call that makes a descriptor raises when the daemon has none to spare.


class SpawnFailed(Exception):
    """The worker's command could not be executed; the message names it."""


class OutOfDescriptors(SpawnFailed):
    """The daemon (or the system) has no file descriptor to spare for a worker's pipes."""

    def __init__(self, exc: OSError, wanted: str = "its pipes") -> None:
        name = errno.errorcode.get(exc.errno or 0, "?")
        super().__init__(
            f"the daemon is out of file descriptors ({name}: {exc.strerror or exc}): "
            f"the worker could not get {wanted}"
        )


class _CgroupRequired(Exception):
    """The worker's cgroup could not be used, and it may not start without one."""


@dataclass(eq=False)
class WorkerProcess:
    pid: int
    #: How the reaper tells of its exit; the process is our unreaped child until `reap`.
    watched: Watched
    starttime: int  # from /proc/PID/stat: with the pid, the process's identity
    stdout: int | None
    stderr: int | None
    #: The write end of its stdin pipe (non-blocking), for a worker spawned with stdin
    #: open; None otherwise, and once closed.
    stdin: int | None = None
    #: Its stdin was open and has been closed (an eof sent, or the worker closed its end).
    stdin_closed: bool = False
    #: Its own cgroup, holding its whole tree; None where the tree is found by scanning /proc.
    cgroup: WorkerCgroup | None = None
    #: Why it has no cgroup although one was asked for.
    cgroup_error: str | None = None
    #: Its limit nodes (`_controllers`); None: nothing on its way has a limit.
    limit_nodes: LimitNodes | None = None
    #: It has been reaped (or given up to the reaper): its pid may be anyone's.
    reaped: bool = False
    #: Once reaped, its returncode (None: not known).
    returncode: int | None = None
    #: Its output streams an output relay holds (`_relay`), by kind: `stdout` and
    #: `stderr` are None then, and the daemon holds no descriptor of them.
    relayed: dict[str, RelayStream] | None = None

    @classmethod
    def spawn(
        cls,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin_path: str | None,
        stdin_open: bool = False,
        cgroup: WorkerCgroup | None = None,
        cgroup_required: bool = False,
        limit_nodes: LimitNodes | None = None,
    ) -> WorkerProcess:
        """Start `argv` in its own process group (and `cgroup`) with piped stdout and stderr;
        its stdin the file at `stdin_path`, a pipe the daemon writes (`stdin_open`), or
        /dev/null. A `cgroup` that cannot be used is done without (the tree is found by
        scanning), unless `cgroup_required`: then SpawnFailed, before anything runs."""
        made: list[int] = []  # every descriptor this spawn made, closed if it goes no further
        stdin_w: int | None = None
        try:
            if stdin_open:
                stdin, stdin_w = os.pipe2(os.O_CLOEXEC)
                made += (stdin, stdin_w)
            else:
                # The input file is in the worker's archive, in reach of an earlier attempt.
                stdin = (
                    open_regular(stdin_path)
                    if stdin_path
                    else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                )
                made.append(stdin)
            os.set_blocking(stdin, True)  # opened without blocking; the worker reads as usual
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            made += (out_r, out_w)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            made += (err_r, err_w)
        except OSError as exc:
            for fd in made:
                os.close(fd)
            if exc.errno in DESCRIPTOR_ERRNOS:
                raise OutOfDescriptors(exc) from exc
            raise SpawnFailed(
                f"cannot open the worker's input {stdin_path}: {exc.strerror}"
            ) from exc
        born = functools.partial(
            _birth, argv, cwd, env, stdin, out_w, err_w, cgroup, cgroup_required, limit_nodes
        )
        try:
            # A worker with limits is forked from the forker's thread (`_forker`: never the
            # daemon's leader in a worker's memory node); one without, here.
            pid, cgroup, cgroup_error = FORKER.call(born) if limit_nodes else born()[0]
        except _CgroupRequired as exc:
            for end in (out_r, err_r, stdin_w):  # the others: `finally`
                if end is not None:
                    os.close(end)
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in DESCRIPTOR_ERRNOS:
                raise OutOfDescriptors(cause) from cause
            raise SpawnFailed(
                f"{exc}: a worker outside its cgroup would be no worker's to the daemon, and "
                "its connections would act for the user; nothing was started"
            ) from exc
        except (OSError, ValueError, TypeError) as exc:  # ValueError: a NUL in an argument
            for end in (out_r, err_r, stdin_w):
                if end is not None:
                    os.close(end)
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.remove()
            if isinstance(exc, OSError) and exc.errno in DESCRIPTOR_ERRNOS:
                raise OutOfDescriptors(exc) from exc  # Popen's own pipe, not the exec
            if isinstance(exc, LimitsNotPlaced):
                raise SpawnFailed(f"cannot start {argv[0]!r}: {exc.strerror}") from exc
            reason = getattr(exc, "strerror", None) or str(exc)
            raise SpawnFailed(f"cannot execute {argv[0]!r} in {cwd}: {reason}") from exc
        finally:
            for fd in (out_w, err_w, stdin):
                os.close(fd)
        # The child is ours and unreaped, so its pid is no one else's until it is reaped.
        try:
            stat = read_stat(pid)  # its start time: OSError only for want of a descriptor
        except OSError as exc:
            # Unwatchable, so it must not run on: end it before anyone relies on it.
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            for end in (out_r, err_r, stdin_w):
                if end is not None:
                    os.close(end)
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.remove()
            if exc.errno in DESCRIPTOR_ERRNOS:
                raise OutOfDescriptors(exc) from exc
            raise SpawnFailed(f"cannot watch {argv[0]!r} (pid {pid}): {exc}") from exc
        assert stat is not None, "an unreaped child always has a /proc entry"
        # No await since the start: none missed. One with limits was forked by the
        # forker's thread, so is its child (`Reaper.watch`).
        watched = REAPER.watch(pid, stat.starttime, elsewhere=limit_nodes is not None)
        for end in (out_r, err_r, stdin_w):
            if end is not None:
                os.set_blocking(end, False)  # a send never waits for room: see write_stdin
        return cls(
            pid=pid,
            watched=watched,
            starttime=stat.starttime,
            stdout=out_r,
            stderr=err_r,
            stdin=stdin_w,
            cgroup=cgroup,
            cgroup_error=cgroup_error,
            limit_nodes=limit_nodes,
        )

    @classmethod
    def adopt(
        cls,
        pid: int,
        starttime: int,
        stdout: int | None,
        stderr: int | None,
        cgroup: WorkerCgroup | None = None,
        stdin: int | None = None,
        *,
        elsewhere: bool = False,
    ) -> WorkerProcess:
        """Take over a worker handed across an exec: same pid (still our child), same pipes
        (close-on-exec again: see `_carried.take_back`).

        `cgroup`: the one the image before put the worker in, if it is there still (the
        launcher looks, once for all it adopts). `elsewhere`: forked by the forker's
        thread, in this image or one before (it has limit nodes: `Reaper.watch`).

        Raises ProcessLookupError if the pid is not a child of this process. A child
        unreaped keeps its pid, so no /proc read is needed to know it is the worker still
        (one a worker: a reload adopting 1,000 spent ~50 ms on them); whether it is our
        child at all, one waitid that reaps nothing says (it may have exited meanwhile,
        during the exec: the reaper's first look finds it, and its supervision reaps it).
        """
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError as exc:
            raise ProcessLookupError(f"pid {pid} is not this daemon's child") from exc
        return cls(
            pid=pid,
            watched=REAPER.watch(pid, starttime, elsewhere=elsewhere),
            starttime=starttime,
            stdout=stdout,
            stderr=stderr,
            stdin=stdin,
            cgroup=cgroup,
        )

    def carry(self, carried: Carrier) -> tuple[int | None, int | None, int | None]:
        """Hand the pipes to a reload's exec; (stdout, stderr, stdin). The pid stays our
        child, unreaped (exited or not), so the next image watches the same process."""
        return (
            carried.carry_if(self.stdout, f"worker pid {self.pid}'s stdout"),
            carried.carry_if(self.stderr, f"worker pid {self.pid}'s stderr"),
            carried.carry_if(self.stdin, f"worker pid {self.pid}'s stdin"),
        )

    def outputs(self) -> dict[str, Callable[[Deliver], Awaitable[None]]]:
        """Its output streams still open, by kind, each a pump's source: a pipe the daemon
        reads, or a stream its relay forwards (the pump's source is a port)."""
        sources: dict[str, Callable[[Deliver], Awaitable[None]]] = {}
        for kind in ("stdout", "stderr"):
            fd = getattr(self, kind)
            if fd is not None:
                sources[kind] = functools.partial(pump, fd)
            elif self.relayed is not None and kind in self.relayed:
                sources[kind] = self.relayed[kind].pump
        return sources

    async def output_pending(self) -> int | None:
        """After its exit, what its relay still holds of its output (0: nothing; None: the
        relay did not say in time). A pipe the daemon reads itself has nothing the daemon
        cannot see: 0."""
        if self.relayed is None:
            return 0
        streams = list(self.relayed.values())
        for stream in streams:
            if stream.chunks:
                return len(stream.chunks)
        still = [s for s in streams if not s.eof and s.refused is None and s.relay is not None]
        if not still:
            return 0
        # One probe answers for both of the worker's streams (they share its key).
        return await still[0].pending()

    def close_stdin(self) -> None:
        """Close the write end of its stdin: the worker reads end of file."""
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None
            self.stdin_closed = True

    async def wait_exited(self) -> None:
        """Wait until the process has exited, without reaping it.

        Until `reap`, the zombie keeps its pid, and so the worker's process
        group id, from being recycled: finding and ending its tree stays safe.
        """
        await self.watched.exited.wait()

    def reap(self) -> int | None:
        """Collect the exited process; its returncode (negative: the signal that killed
        it), None if someone else reaped it (never, but said in the log)."""
        assert self.watched.exited.is_set(), "reaped before its exit was told"
        if not self.reaped:
            self.reaped = True
            self.returncode = REAPER.reap(self.watched)
        return self.returncode

    def signal(self, sig: signal.Signals) -> bool:
        """Send `sig` by its pid, which is no one else's while it is unreaped; False if it
        was reaped (or is not ours to signal)."""
        if self.reaped:
            return False
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def pin(self) -> int | None:
        """A pidfd of the process, opened now for a stop that waits on it (the caller
        closes it); None once it is reaped, or with no descriptor to spare."""
        if self.reaped:
            return None
        try:
            return os.pidfd_open(self.pid)
        except OSError:
            return None

    def abandon(self) -> None:
        """Its supervision lets it go, perhaps before it exited: reaped once it has, so
        no zombie is left behind."""
        if not self.reaped:
            self.reaped = True
            REAPER.abandon(self.watched)

    def unwatch(self) -> None:
        """Leave it to another reaper (`reap` below, by a pidfd): the reaper forgets it."""
        if not self.reaped:
            self.reaped = True
            REAPER.forget(self.watched)

    def close(self) -> None:
        for name in ("stdout", "stderr"):
            fd = getattr(self, name)
            if fd is not None:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
                setattr(self, name, None)
        if self.relayed:
            for stream in self.relayed.values():
                if stream.relay is not None:
                    stream.relay.drop(stream.worker)  # what is still open of it
            self.relayed = None
        self.close_stdin()


def _birth(
    argv: list[str],
    cwd: str,
    env: Mapping[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
    cgroup: WorkerCgroup | None,
    cgroup_required: bool,
    limit_nodes: LimitNodes | None,
) -> tuple[tuple[int, WorkerCgroup | None, str | None], Callable[[], None] | None]:
    """Fork and exec a worker in its cgroup and limit nodes, under the fork lock: its pid,
    the cgroup it has (None if `cgroup` could not be used and is not required), why not;
    and what takes the calling thread out of its limit nodes (None: none), for the caller
    to call once the worker has its answer (`_forker`)."""
    cgroup_error = None
    with _FORK_LOCK, contextlib.ExitStack() as birthplace:
        if cgroup is not None:
            try:
                cgroup.create()
                if not cgroup.born_into:  # else born in it by clone3, at `_start`
                    birthplace.enter_context(cgroup.born_in())
            except OSError as exc:  # its tree is found by scanning, as without cgroups
                with contextlib.suppress(OSError):
                    cgroup.remove()
                cgroup_error = f"cannot use {cgroup.path}: {exc.strerror or exc}"
                cgroup = None
                if cgroup_required:
                    raise _CgroupRequired(cgroup_error) from exc
        # Its limits hold from its first instruction, or it does not start: SpawnFailed
        # (LimitsNotPlaced) naming the node that would not take it.
        leave = limit_nodes.enter() if limit_nodes is not None else None
        try:
            if cgroup is not None and cgroup.born_into:
                # Its v2 limits hold from its first instruction; no process of the
                # daemon's stands in its nodes (`_born_into`).
                pid = _born_into.spawn_into(
                    cgroup.path, argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr
                )
            else:
                pid = _start(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
        except BaseException:
            if leave is not None:
                leave()
            raise
    return (pid, cgroup, cgroup_error), leave


def _start(
    argv: list[str], *, cwd: str, env: Mapping[str, str], stdin: int, stdout: int, stderr: int
) -> int:
    """Fork and exec `argv` (its own process group, only the three fds given); its pid.
    Exec errors are raised here, synchronously."""
    if _spawn.available and min(stdin, stdout, stderr) > 2:
        # vfork and exec on the calling thread: no thread hop, no Popen (see _spawn).
        return _spawn.spawn(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
    # Popen only forks and execs here: its C fork_exec is safe in a threaded process
    # and reports exec errors synchronously. Its finaliser would waitpid() a child it
    # thinks unreaped and steal the status the worker's reap expects: tell it the child
    # is accounted for, which leaves the worker's reap (`_reaper`) as the only one.
    popen = subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=dict(env),
        process_group=0,
        close_fds=True,
    )
    popen.returncode = 0
    return popen.pid


def write_nowait(fd: int, data: bytes) -> int:
    """Write what the pipe `fd` (non-blocking) takes of `data` now; how much it took.

    Raises BrokenPipeError only if it took nothing: its reader is gone."""
    view = memoryview(data)
    written = 0
    while written < len(data):
        try:
            written += os.write(fd, view[written:])
        except BlockingIOError:
            break
        except BrokenPipeError:
            if not written:
                raise
            break
    return written


async def pump(fd: int, deliver: Deliver) -> None:
    """Read `fd` until end of file, handing what each read takes to `deliver`.

    One read takes what the pipe holds, up to ENTRY_BYTES, and makes one chunk: a
    worker writing fast fills few large entries rather than many small ones. The pump
    reads first and waits only once the pipe is empty, so a full pipe costs one read,
    not a trip through epoll; it yields after each chunk, so a worker that floods its
    output holds the daemon for one chunk at a time. A pipe found full is grown once.
    """
    grown = False
    while True:
        try:
            chunk = os.read(fd, ENTRY_BYTES)
        except BlockingIOError:
            try:
                await trio.lowlevel.wait_readable(fd)
            except trio.ClosedResourceError:
                return
            continue
        if not chunk:
            return
        if not grown and len(chunk) >= FULL_PIPE_BYTES:
            grown = True
            grow_pipe(fd)
        await deliver(chunk)
        await trio.lowlevel.checkpoint()


def grow_pipe(fd: int) -> None:
    """Make the pipe `fd` hold PIPE_BYTES, so its fast writer fills it while the daemon
    journals: fewer, longer reads, and fewer wakes of the writer. Only a pipe found full
    is grown: the kernel counts a pipe's size against its user's pipe-user-pages-soft,
    past which that user's new pipes get two pages. Refused (past that limit, or past
    fs.pipe-max-size where an administrator lowered it), the pipe stays as it was."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)


async def reap(pid: int) -> None:
    """Collect `pid` once it has exited, if it is our child; through its pidfd, as always."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with trio.move_on_after(5.0):
            await trio.lowlevel.wait_readable(pidfd)
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - readable: exited
    except ChildProcessError:
        pass  # not ours (an orphan of a dead daemon): init reaps it
    finally:
        os.close(pidfd)
