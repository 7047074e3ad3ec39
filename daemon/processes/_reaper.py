"""Which of the daemon's children exited, told by SIGCHLD: no descriptor held a worker.

A worker is the daemon's own child, so once it exits it stays a zombie until the daemon
reaps it, and its pid (its process group's id) cannot be recycled meanwhile. The reaper
never reaps a worker's zombie itself: it hands the exit to the worker
(`Watched.exited`), whose supervision ends what is left of its tree and then reaps it
by its pid (`WorkerProcess.reap`). Across a reload's exec the zombie keeps the exit
status (the same process, the same children), and the new image's reaper finds it at
its start (`run` collects once before the first SIGCHLD).

One task waits for SIGCHLD and then peeks, `waitid(P_ALL, WNOWAIT)`, at the first
zombie the kernel has (one peek walks every child of the daemon: ~1 ms with 10,000
live): a watched worker's is handed over. The peek sees only the first, and that one
stays a zombie (handed, its supervision still ending its tree) or is a child that is
not a worker's (trio's, as a reload's `--check` child, reaped by the thread that waits
for it): the watched workers that could be behind it are then asked one by one,
`waitid(P_PID, WNOWAIT)`, and the loop waits for the next SIGCHLD (each exit sends one,
and is found by the look it starts). Behind an own zombie, those are the ones forked
after it (the kernel keeps a parent's children in the order they were forked, and start
times follow that order); behind a stranger's, every watched worker, and again every
while (STRANGER_RETRY_*) until it is gone. A child that is not a watched worker's is
never reaped here ("no other reaper steals": nor does this one), and the asking is
paced by its own cost (PROBE_SHARE), so a lingering zombie can neither starve a
worker's exit nor make the loop spin.

That order is each thread's: a child is its forking thread's, and the peek walks the
children of the calling thread (the event loop's) first, then each other thread's. A
worker forked by another thread (one with limits, by the forker, `_forker`), or one such
that an exec handed to the event loop's thread at the end of its list (a reload's), is
watched `elsewhere`: behind any zombie, so asked at every asking.
"""

from __future__ import annotations

import bisect
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import trio

from .._logging import get_logger

log = get_logger()

#: While the peek is blocked, asking the workers one by one takes at most this share of
#: the daemon's time: the next asking waits this many times as long as the last took.
PROBE_SHARE = 0.2
#: An asking that took less than this (a few hundred workers) is not paced.
PROBE_GAP = 0.001
#: While a stranger's zombie blocks the peek, the workers are asked again after this,
#: doubling up to the max (its reaper, trio's thread, says nothing when it reaps it).
STRANGER_RETRY_FIRST = 0.01
STRANGER_RETRY_MAX = 1.0

#: What blocked the peek: a zombie handed already ("own"), a stranger's, or nothing.
Blocked = Literal["own", "stranger"] | None


@dataclass(eq=False)
class Watched:
    """A worker's process as the reaper knows it, until its worker reaps it."""

    pid: int
    starttime: int
    #: Set once it has exited (a zombie, not reaped yet).
    exited: trio.Event = field(default_factory=trio.Event)
    handed: bool = False
    #: Its supervision let it go unexited (a fault): reaped here when it exits.
    abandoned: bool = False
    #: Forked by another thread than the event loop's (`Reaper.watch`).
    elsewhere: bool = False


class Reaper:
    """The daemon's children that are workers', and the SIGCHLD loop handing their exits."""

    def __init__(self) -> None:
        self._watched: dict[int, Watched] = {}
        #: (starttime, pid) of the watched, sorted; entries of those gone are skipped.
        self._order: list[tuple[int, int]] = []
        #: The watched forked `elsewhere`, by pid: asked at every asking.
        self._elsewhere: dict[int, Watched] = {}
        self._wake = trio.Event()

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, pid: int, starttime: int, *, elsewhere: bool = False) -> Watched:
        """Watch a child just spawned or adopted (our child, unreaped): with no await
        between its start and this, an exit meanwhile is found by the next peek.
        `elsewhere`: forked by a thread other than the event loop's (now or in the image
        before), so anywhere in the peek's walk."""
        watched = self._watched[pid] = Watched(pid, starttime, elsewhere=elsewhere)
        if elsewhere:
            self._elsewhere[pid] = watched
            return watched
        if len(self._order) > 2 * len(self._watched) + 64:  # of those gone, kept till now
            self._order = sorted(
                (w.starttime, w.pid) for w in self._watched.values() if not w.handed
            )
        key = (starttime, pid)
        if not self._order or self._order[-1] <= key:
            self._order.append(key)
        else:
            bisect.insort(self._order, key)
        return watched

    def reap(self, watched: Watched) -> int | None:
        """Reap an exited watched child by its pid; its returncode (negative: the signal
        that killed it), None if it was not there to reap (reaped by someone else)."""
        self.forget(watched)
        try:
            info = os.waitid(os.P_PID, watched.pid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            log.error("reaper.stolen", pid=watched.pid)
            return None
        if info is None:  # not exited after all: never the case once `exited` is set
            log.error("reaper.not_exited", pid=watched.pid)
            return None
        if info.si_code == os.CLD_EXITED:
            return info.si_status
        return -info.si_status

    def abandon(self, watched: Watched) -> None:
        """Its supervision gives it up before it exited: reaped here once it has, so no
        zombie is left behind."""
        watched.abandoned = True
        if watched.handed:
            self._reap_abandoned(watched)

    def forget(self, watched: Watched) -> None:
        """Watch it no longer (reaped, or left to another reaper)."""
        if self._watched.get(watched.pid) is watched:
            del self._watched[watched.pid]
        if self._elsewhere.get(watched.pid) is watched:
            del self._elsewhere[watched.pid]

    def _hand(self, watched: Watched) -> None:
        watched.handed = True
        if watched.abandoned:
            self._reap_abandoned(watched)
        else:
            watched.exited.set()

    def _reap_abandoned(self, watched: Watched) -> None:
        self.reap(watched)
        log.info("worker.reaped_late", pid=watched.pid)

    def collect(self) -> Blocked:
        """Hand every exit the kernel has for a watched worker; what blocked the peek, if
        anything (the workers behind it were then asked one by one)."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return None  # no child at all
            if info is None or info.si_pid == 0:
                return None
            watched = self._watched.get(info.si_pid)
            if watched is not None and not watched.handed:
                self._hand(watched)
                if watched.abandoned:
                    continue  # reaped here: the next peek sees past it
            # The first zombie stays (handed, unreaped) or is a stranger's: the next peek
            # would see it again, so those behind it are asked (one peek walks every
            # child of the daemon: ~1 ms with 10,000 live).
            self._probe(None if watched is None else watched.starttime)
            return "stranger" if watched is None else "own"

    def _probe(self, since: int | None) -> None:
        """Ask each watched worker not yet handed, started at `since` or later (None:
        every one), whether it has exited. Those handed (or gone) leave the order as
        they are passed, so an asking costs what is still running, not what ended."""
        start = 0 if since is None else bisect.bisect_left(self._order, (since, -1))
        running: list[tuple[int, int]] = []
        for key in self._order[start:]:
            watched = self._watched.get(key[1])
            if watched is None or watched.handed or watched.starttime != key[0]:
                continue
            try:
                info = os.waitid(os.P_PID, key[1], os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue  # reaped by someone else: said when its worker reaps it
            if info is not None and info.si_pid:
                self._hand(watched)
            else:
                running.append(key)
        self._order[start:] = running
        for pid, watched in list(self._elsewhere.items()):
            if self._watched.get(pid) is not watched or watched.handed:
                del self._elsewhere[pid]
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if info is not None and info.si_pid:
                del self._elsewhere[pid]
                self._hand(watched)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hand exits until cancelled: once at the start (what exited before, or during a
        reload's exec, sent its SIGCHLD to no one), then at each SIGCHLD; while the peek
        is blocked by an own zombie, also once it is reaped; by a stranger's, also every
        while (its reaper tells us nothing)."""
        with trio.open_signal_receiver(signal.SIGCHLD) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signalled, signals)
                task_status.started()
                await self._collecting()

    async def _signalled(self, signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            self._wake.set()

    async def _collecting(self) -> None:
        retry = STRANGER_RETRY_FIRST
        while True:
            self._wake = trio.Event()  # before the look: a SIGCHLD during it looks again
            began = time.perf_counter()
            blocked = self.collect()
            if blocked is None:
                retry = STRANGER_RETRY_FIRST
                await self._wake.wait()
                continue
            # Paced by its cost: a lingering zombie makes no spin of asking.
            took = time.perf_counter() - began
            if took >= PROBE_GAP:
                await trio.sleep(took / PROBE_SHARE)
            else:
                await trio.lowlevel.checkpoint()
            if blocked == "own":
                # Each exit behind it sends a SIGCHLD, and is found by the asking then.
                await self._wake.wait()
            else:
                with trio.move_on_after(retry):
                    await self._wake.wait()
                retry = min(retry * 2, STRANGER_RETRY_MAX)


#: The daemon's one reaper: SIGCHLD, and the children it tells of, are the process's.
REAPER = Reaper()
