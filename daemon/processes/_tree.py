"""A worker's whole process tree: finding every process of it, and ending them all.

A worker's tree is its leader, everything descended from it, everything in
its process group (children of an exited parent keep the group), and strays:
processes that left the group with setsid and were orphaned to init, found by
the worker id they inherited in their environment (by which alone a tree
whose leader is not known is found, see `end_marked`). Read straight from /proc:
one read of /proc/PID/stat gives parent, group, session and start time
together. Signals go through pidfds opened and then checked against the start
time seen in the scan, so a recycled pid is never signalled. Out of descriptors
(EMFILE, ENFILE), a scan is not believed empty: it is made again until one is
free (`patiently`), and a process found that no pidfd can be opened for is
signalled by its pid.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from .._logging import get_logger

log = get_logger()

T = TypeVar("T")

#: The errors of a process with no descriptor to spare, or a system with none.
DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
#: Out of descriptors, a read of a tree's processes is made again after this, for at
#: most the patience.
DESCRIPTOR_RETRY = 0.01
DESCRIPTOR_PATIENCE = 1.0
#: How soon a tree whose processes no descriptor was left to pin is scanned again.
UNPINNED_LOOK_AGAIN = 0.05


async def patiently(read: Callable[[], Awaitable[T]]) -> T:
    """`read()`, made again every DESCRIPTOR_RETRY seconds while the daemon has no
    descriptor to make it with: a stop asked in a moment of exhaustion waits for one
    rather than fail the worker's supervision, or find no process to signal. Not for
    good: after DESCRIPTOR_PATIENCE the error is raised (the supervision fails, and its
    tree is ended as a failure's is), since a daemon whose descriptors are all held by
    workers, this one's among them, would otherwise wait on forever."""
    waited = 0.0
    while True:
        try:
            return await read()
        except OSError as exc:
            if exc.errno not in DESCRIPTOR_ERRNOS or waited >= DESCRIPTOR_PATIENCE:
                raise
        await trio.sleep(DESCRIPTOR_RETRY)
        waited += DESCRIPTOR_RETRY


@dataclass(eq=False)
class Graces:
    """The grace periods under way between TERM and KILL, which a hurried shutdown (a
    second SIGTERM) ends at once: from then on every tree is killed without one."""

    cut: bool = False
    _under_way: set[trio.CancelScope] = field(default_factory=set)

    @contextlib.contextmanager
    def period(self, seconds: float) -> Iterator[None]:
        """Wait inside for at most `seconds`, or until `end_all`."""
        with trio.move_on_after(0 if self.cut else seconds) as scope:
            self._under_way.add(scope)
            try:
                yield
            finally:
                self._under_way.discard(scope)

    def end_all(self) -> None:
        self.cut = True
        for scope in self._under_way:
            scope.cancel()


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str  # "Z" for a zombie: exited, not yet reaped
    ppid: int
    pgid: int
    starttime: int  # clock ticks after boot; with the pid, a process's identity


def read_stat(pid: int) -> ProcStat | None:
    """The process `pid` as /proc says now; None if it is gone. Raises OSError for want
    of a descriptor (DESCRIPTOR_ERRNOS): a process unread is not a process gone."""
    # os.open/os.read, not open(): no file object per process on a hot path.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in DESCRIPTOR_ERRNOS:
            raise
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return ProcStat(
        pid=pid,
        state=fields[0].decode(),
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        starttime=int(fields[19]),
    )


def scan() -> dict[int, ProcStat]:
    table: dict[int, ProcStat] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := read_stat(int(name))) is not None:
            table[stat.pid] = stat
    return table


def _carries(pid: int, marker: bytes) -> bool:
    """Whether `pid` inherited `marker` in its environment; raises OSError for want of a
    descriptor to read it with (as `read_stat`)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError as exc:
        if exc.errno in DESCRIPTOR_ERRNOS:
            raise
        return False


class ProcessTable:
    """Scans of /proc, shared by everyone who asks at about the same time.

    A caller gets a scan that started after it asked, never an older one, so
    it sees every process forked before its question; but a hundred stops
    asked at once share two scans rather than make a hundred.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._started = 0
        self._finished = 0
        self._latest: dict[int, ProcStat] = {}

    async def scan(self) -> dict[int, ProcStat]:
        fresh_enough = self._started + 1
        async with self._lock:
            if self._finished >= fresh_enough:
                return self._latest
            self._started += 1
            number = self._started
            table = await trio.to_thread.run_sync(scan)
            self._finished, self._latest = number, table
            return table


def tree_members(
    table: dict[int, ProcStat], leader: int, worker_id: str, leader_start: int
) -> list[ProcStat]:
    """Every live process of the tree whose leader is `leader` (its pgid)."""
    now_leader = table.get(leader)
    if now_leader is not None and now_leader.starttime != leader_start:
        roots: set[int] = set()  # the pid was recycled: that process and its group are strangers
    else:
        roots = {pid for pid, stat in table.items() if pid == leader or stat.pgid == leader}
    # A stray was born after the leader yet has a parent older than it: it was
    # orphaned and adopted (by init or a subreaper). Only those pay an environ read.
    marker = f"SUBAGENTD_WORKER_ID={worker_id}".encode()
    me = os.getpid()
    for pid, stat in table.items():
        parent = table.get(stat.ppid)
        if (
            stat.starttime >= leader_start
            and stat.ppid != me
            and (parent is None or parent.starttime < leader_start)
            and pid not in roots
            and _carries(pid, marker)
        ):
            roots.add(pid)
    return with_descendants(table, roots)


def carries_worker_id(pid: int, pid_start: int, worker_id: str) -> bool:
    """Whether `pid` is still the process started at `pid_start` and inherited `worker_id`
    in its environment: a pid and start time alone are anyone's to read in /proc and to
    write where a worker may write (its record). One environ read: for recovery, not for
    every stop (a leader exec'd with a new environment is not recognised)."""
    stat = read_stat(pid)
    marker = f"SUBAGENTD_WORKER_ID={worker_id}".encode()
    return stat is not None and stat.starttime == pid_start and _carries(pid, marker)


def marked_members(table: dict[int, ProcStat], worker_id: str) -> list[ProcStat]:
    """Every live process carrying `worker_id` in its environment, and their descendants:
    a worker's tree when there is no leader to go by. One environ read per process
    (in a thread: it is slow); one that exec'd with a new environment is not found."""
    marker = f"SUBAGENTD_WORKER_ID={worker_id}".encode()
    me = os.getpid()
    roots = {pid for pid in table if pid != me and _carries(pid, marker)}
    return with_descendants(table, roots)


def with_descendants(table: dict[int, ProcStat], roots: set[int]) -> list[ProcStat]:
    children: dict[int, list[int]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found: dict[int, ProcStat] = {}
    pending = list(roots)
    while pending:
        pid = pending.pop()
        if pid in found or pid not in table:
            continue
        found[pid] = table[pid]
        pending.extend(children.get(pid, ()))
    return list(found.values())


class Pinned:
    """Pidfds of processes checked to be the ones scanned, closed on exit; and the pids
    of those no descriptor was left to pin (`unpinned`), which are signalled by pid."""

    def __init__(self, members: Iterable[ProcStat]) -> None:
        self.fds: list[int] = []
        self._pids: list[int] = []  # each fd's
        self.unpinned: list[int] = []
        for stat in members:
            try:
                fd = os.pidfd_open(stat.pid)
            except OSError as exc:
                if exc.errno in DESCRIPTOR_ERRNOS:
                    self.unpinned.append(stat.pid)
                continue  # else gone already
            try:
                now = read_stat(stat.pid)
            except OSError:  # no descriptor to check it with: by its pid, as the rest
                os.close(fd)
                self.unpinned.append(stat.pid)
                continue
            if now is None or now.starttime != stat.starttime:
                os.close(fd)  # the pid was recycled between the scan and the open
                continue
            self.fds.append(fd)
            self._pids.append(stat.pid)

    def signal(self, sig: signal.Signals, *, sent: set[int] | None = None) -> None:
        """Send `sig` to each process (once per pid in `sent`: to some programs a second
        TERM means "quit now"); to an unpinned one by its pid. The one risk, a pid freed
        and reused in the moments since the scan, is taken only for those."""

        def first_time(pid: int) -> bool:
            if sent is None:
                return True
            if pid in sent:
                return False
            sent.add(pid)
            return True

        for pid, fd in zip(self._pids, self.fds, strict=True):
            if not first_time(pid):
                continue
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                # A setuid program the worker ran: not ours to signal. Only a
                # cgroup (cgroup.kill) can end it; the stop goes on without it.
                log.warning("tree.cannot_signal", pidfd=fd, signal=sig.name)
        for pid in filter(first_time, self.unpinned):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    async def wait_exited(self) -> None:
        """Until every pinned process has exited; a moment only if none is pinned (the
        caller scans again), so no wait spins without yielding."""
        for fd in self.fds:
            await trio.lowlevel.wait_readable(fd)
        if self.unpinned and not self.fds:
            await trio.sleep(UNPINNED_LOOK_AGAIN)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self._pids.clear()

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def end_tree(
    processes: ProcessTable,
    leader: int,
    worker_id: str,
    leader_start: int,
    grace: float,
    graces: Graces | None = None,
) -> int:
    """TERM every process of the tree, KILL what is left after `grace`; how many were killed.

    Scans until a scan finds nothing left, so a process forked during the
    stop is caught by the next pass.
    """

    async def find() -> list[ProcStat]:
        return tree_members(await processes.scan(), leader, worker_id, leader_start)

    return await end_found(find, grace, graces)


async def end_marked(processes: ProcessTable, worker_id: str, grace: float) -> int:
    """`end_tree` for a worker whose leader is not known (see `marked_members`)."""

    async def find() -> list[ProcStat]:
        table = await processes.scan()
        return await trio.to_thread.run_sync(marked_members, table, worker_id)

    return await end_found(find, grace, None)


def running(stat: ProcStat) -> bool:
    """Whether a process found still runs: a zombie has exited, unless only its main
    thread has (pthread_exit) and others run on, which a signal still ends."""
    if stat.state != "Z":
        return True
    try:
        return len(os.listdir(f"/proc/{stat.pid}/task")) > 1
    except OSError:
        return False


async def end_found(
    find: Callable[[], Awaitable[list[ProcStat]]],
    grace: float,
    graces: Graces | None,
    termed: set[int] | None = None,
) -> int:
    """TERM what `find` finds until it finds nothing, KILL what is left after `grace`; how
    many were killed. `termed`: pids sent their TERM already (by another search of the same
    stop, as a cgroup's), sent no second one; those this sends are added."""
    termed = set[int]() if termed is None else termed
    with (graces or Graces()).period(grace):
        # Scanned again once each wave has exited: what was forked meanwhile, and what no
        # descriptor was left to pin, get their TERM too.
        while members := [m for m in await patiently(find) if running(m)]:
            with Pinned(members) as pinned:
                pinned.signal(signal.SIGTERM, sent=termed)
                # A stopped process (a paused worker's, `_freezer`) takes its TERM only
                # once continued; to a running one SIGCONT does nothing.
                pinned.signal(signal.SIGCONT)
                await pinned.wait_exited()
        return 0  # all gone within the grace: the scan that said so is the last
    killed = 0
    for _ in range(10):
        members = [m for m in await patiently(find) if running(m)]
        if not members:
            break
        with Pinned(members) as pinned:
            pinned.signal(signal.SIGKILL)
            killed += len(pinned.fds) + len(pinned.unpinned)
            with trio.move_on_after(1.0):
                await pinned.wait_exited()
    return killed
