"""Holding a worker's processes still (a pause) and letting them go on, by the kernel's
freezer where the worker has a cgroup, else by SIGSTOP and SIGCONT over its tree.

With a cgroup (v2): ``cgroup.freeze`` written 1 freezes every process in it and in the
cgroups below it, what they fork meanwhile included; the kernel says it is done by
``frozen 1`` in ``cgroup.events``, which it signals (POLLPRI, as it does ``populated``),
so a pause waits for that, in a thread, bounded on trio's clock (`SETTLE_SECONDS`).
Written 0, they go on.
A frozen process keeps its pid, its pipes and its memory; what a TERM would do waits for
the thaw (a stop thaws first), while ``cgroup.kill`` ends a frozen cgroup at once. The v1
``freezer`` hierarchy is not used: wherever the daemon has its own v2 cgroup for a
worker, that cgroup has ``cgroup.freeze`` (Linux 5.2 and later), which does the same.
What moved itself out of the cgroup (`_escapes`: a worker may write `cgroup.procs`
elsewhere) is not frozen with it: once the cgroup is frozen (nothing in it forks any
more), what of its tree is outside the cgroup (in the worker's process group, forked by
what is in the cgroup, or orphaned carrying its worker id, and what they forked) is found
by the stop's escape search (`_escapes.outside_cgroups`: the processes started since the
worker, not all of /proc) and stopped by SIGSTOP, with the limits below; an unpause
continues it.

Without one: every process of the tree found by scanning /proc (`_tree.tree_members`) is
sent SIGSTOP, through a pidfd checked against the scan, and /proc scanned again until a
scan finds none not yet stopped (at most `STOP_SCANS` scans, and `SETTLE_SECONDS`). Its
limits: a process forked between a scan and its parent's stop is found by the next scan,
yet a process that left the tree in that moment (a double fork, setsid, with the worker
id dropped from its environment) is not found, and runs on; a process stopped by SIGSTOP
can be continued by anyone allowed to signal it (the worker's own other processes, the
user), which the daemon does not see until it next reads the tree; and a process in
uninterruptible sleep stops only when it wakes. SIGCONT lets them go on. A daemon that
dies (a crash, a kill -9) orphans each worker's process group, and the kernel sends an
orphaned group holding a stopped process SIGHUP then SIGCONT (POSIX job control): a
paused tree does not stay stopped past a crash, and most of it ends on that SIGHUP;
recovery ends the rest. A reload (an exec, the same process) orphans nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from .._logging import get_logger
from ._cgroup import WorkerCgroup
from ._tree import Pinned, ProcessTable, ProcStat, patiently, read_stat, running, tree_members

log = get_logger()

#: What `DaemonInfo.controls["freeze"]` says of each mechanism.
CGROUP_FREEZE = "cgroup v2 cgroup.freeze"
SIGSTOP_FREEZE = "SIGSTOP/SIGCONT over the process tree (scan)"
#: How long a pause waits for the kernel to say its processes are held (a cgroup's
#: "frozen 1", or every process of a tree stopped) before it answers regardless.
SETTLE_SECONDS = 5.0
#: The settling thread's own bound, past `SETTLE_SECONDS` (`settle` tells it to stop at
#: that bound, on trio's clock): never reached unless the event loop is held up.
THREAD_SECONDS = 60.0
#: Scans of /proc a SIGSTOP pause makes at most, until one finds nothing left to stop.
STOP_SCANS = 50
#: A worker's tree as a scan finds it: its leader's pid, its id, its leader's start time.
Tree = tuple[int, str, int]


# -- with a cgroup: cgroup.freeze --------------------------------------------


def write_freeze(group: WorkerCgroup, frozen: bool) -> bool:
    """Ask the kernel to freeze the cgroup (or thaw it), at once; False if it is gone."""
    try:
        fd = os.open(group.path / "cgroup.freeze", os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        os.write(fd, b"1" if frozen else b"0")
    finally:
        os.close(fd)
    return True


def freeze_asked(group: WorkerCgroup) -> bool:
    """Whether the cgroup is asked to be frozen (its `cgroup.freeze` reads 1): the
    kernel's word on whether a worker is paused, which a new image reads at a reload."""
    try:
        with open(group.path / "cgroup.freeze", "rb") as f:
            return f.read().strip() == b"1"
    except FileNotFoundError:
        return False


def wait_settled(
    groups: Iterable[WorkerCgroup], frozen: bool, seconds: float, stop: int | None = None
) -> list[str]:
    """Until each cgroup's `cgroup.events` says ``frozen 1`` (or 0, if not `frozen`),
    woken by the kernel's POLLPRI on it, for at most `seconds` in all, or until `stop` (a
    pipe's read end, which this closes) is readable: blocking, for a thread. The names of
    those that did not settle in time (a cgroup gone counts as settled: nothing is left in
    it to hold)."""
    want = b"frozen 1" if frozen else b"frozen 0"
    deadline = time.monotonic() + seconds
    unsettled: list[str] = []
    told = False
    try:
        for group in groups:
            try:
                fd = os.open(group.path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                poll = select.poll()
                poll.register(fd, select.POLLPRI | select.POLLERR)
                if stop is not None:
                    poll.register(stop, select.POLLIN)
                while (events := _events(fd)) is not None and want not in events:
                    left = deadline - time.monotonic()
                    if left <= 0 or told:
                        unsettled.append(group.name)
                        break
                    ready = poll.poll(max(1, int(left * 1000)))
                    told = any(ready_fd == stop for ready_fd, _ in ready)
            finally:
                os.close(fd)
    finally:
        if stop is not None:
            os.close(stop)
    return unsettled


async def settle(groups: list[WorkerCgroup], frozen: bool, seconds: float) -> list[str]:
    """Wait for the kernel to say each cgroup is frozen (or thawed), bounded by `seconds`
    on trio's clock (so a test's MockClock drives the bound); the names of those it had
    not said so of in time. The wait itself is the kernel's, in a thread (`wait_settled`):
    at the bound the thread is told to stop, and what has settled by then is read once."""
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
    try:
        with trio.move_on_after(seconds):
            return await trio.to_thread.run_sync(
                wait_settled, groups, frozen, THREAD_SECONDS, stop_r, abandon_on_cancel=True
            )
    finally:
        # The thread, if it still waits, stops (it owns `stop_r`: one that has returned
        # closed it, so the write may find no reader).
        with contextlib.suppress(BrokenPipeError):
            os.write(stop_w, b"\0")
        os.close(stop_w)
    return unsettled_now(groups, frozen)


def unsettled_now(groups: Iterable[WorkerCgroup], frozen: bool) -> list[str]:
    """The names of the cgroups whose `cgroup.events` does not say they are frozen (or
    thawed) now; a cgroup gone counts as settled."""
    want = b"frozen 1" if frozen else b"frozen 0"
    unsettled: list[str] = []
    for group in groups:
        try:
            with open(group.path / "cgroup.events", "rb") as f:
                if want not in f.read():
                    unsettled.append(group.name)
        except FileNotFoundError:
            continue
    return unsettled


def _events(fd: int) -> bytes | None:
    """The text of a `cgroup.events`; None once its cgroup is removed (nothing is left
    in it to hold)."""
    try:
        return os.pread(fd, 4096, 0)
    except OSError as exc:
        if exc.errno in (errno.ENODEV, errno.ENOENT):
            return None
        raise


async def freeze_cgroups(groups: list[WorkerCgroup], frozen: bool) -> list[str]:
    """Freeze (or thaw) each cgroup, then wait for the kernel to say so (bounded); the
    names of those it had not said so of in time."""
    asked = [group for group in groups if write_freeze(group, frozen)]
    if not asked:
        return []
    return await settle(asked, frozen, SETTLE_SECONDS)


def cgroup_pids(groups: Iterable[WorkerCgroup]) -> set[int]:
    """The pids in each cgroup and in the cgroups below it (a worker may make some)."""
    pids: set[int] = set()
    for group in groups:
        for where, _, names in os.walk(group.path):
            if "cgroup.procs" in names:
                with (
                    contextlib.suppress(OSError, ValueError),
                    open(os.path.join(where, "cgroup.procs"), "rb") as f,
                ):
                    pids.update(int(pid) for pid in f.read().split())
    return pids


# -- without: SIGSTOP and SIGCONT over the tree ------------------------------
#: What a pause holds by signals, found again at each call: a scanned tree's processes,
#: or what of a cgroup's tree is outside it.
Find = Callable[[], Awaitable[list[ProcStat]]]


def tree_finder(processes: ProcessTable, trees: list[Tree]) -> Find:
    """Every live process of each tree, by a scan of /proc."""

    async def find() -> list[ProcStat]:
        table = await processes.scan()
        return [m for tree in trees for m in tree_members(table, *tree) if running(m)]

    return find


async def stop_found(find: Find) -> bool:
    """SIGSTOP every process `find` finds, finding again until every process found is
    stopped and none was not yet sent one (bounded: `STOP_SCANS`, `SETTLE_SECONDS`);
    False if that did not come in time (the pause stands: what was found is stopped).
    The first search and its signals are outside the bound: a search slower than it (a
    loaded machine, thousands of processes) must not leave a pause that stopped nothing."""
    sent: set[tuple[int, int]] = set()

    async def stop_fresh() -> bool:
        """One search, and SIGSTOP to what it found not yet sent one; True if it found
        nothing fresh and everything stopped."""
        members = await patiently(find)
        fresh = [m for m in members if (m.pid, m.starttime) not in sent]
        if not fresh and all(m.state in ("T", "t") for m in members):
            return True
        with Pinned(fresh) as pinned:
            pinned.signal(signal.SIGSTOP)
        sent.update((m.pid, m.starttime) for m in fresh)
        return False

    if await stop_fresh():
        return True
    with trio.move_on_after(SETTLE_SECONDS):
        for _ in range(STOP_SCANS - 1):
            await trio.lowlevel.checkpoint()
            if await stop_fresh():
                return True
    return False


async def continue_found(find: Find) -> None:
    """SIGCONT every process `find` finds (a second search finds what a first missed)."""
    sent: set[int] = set()
    for _ in range(2):
        members = [m for m in await patiently(find) if m.pid not in sent]
        with Pinned(members) as pinned:
            pinned.signal(signal.SIGCONT, sent=sent)


async def stop_trees(processes: ProcessTable, trees: list[Tree]) -> bool:
    """`stop_found` over each tree found by scanning /proc."""
    return await stop_found(tree_finder(processes, trees))


async def continue_trees(processes: ProcessTable, trees: list[Tree]) -> None:
    """`continue_found` over each tree found by scanning /proc."""
    await continue_found(tree_finder(processes, trees))


def stopped_now(pid: int, pid_start: int) -> bool:
    """Whether the process (its leader) is stopped (state T): the kernel's word on whether
    a tree without a cgroup is paused, which a new image reads at a reload."""
    with contextlib.suppress(OSError):
        stat = read_stat(pid)
        return stat is not None and stat.starttime == pid_start and stat.state in ("T", "t")
    return False
