"""Which pids can have been handed out since a moment: the kernel's pid counter as a clock.

A search for what left a stopped worker's cgroup needs only the processes forked since
that worker started, and pids are handed out in order: each fork takes the next free pid
after the last one handed out, up to `pid_max`, then from the bottom again. So the pids
handed out between a `PidSample` taken before the worker started and now lie on the arc
of that cycle from the sample's last pid to now's (`PidArc`), unless the counter has gone
once round since, which takes more passes than the forks counted since can make (each
pass hands out a pid, or skips one held: by a task, or by a group or session whose leader
has exited, `HELD_PER_TASK`); then every pid may be new, and the arc is the whole
(`arc_since`).

Read from /proc/loadavg (the last pid handed out in the reader's pid namespace, and how
many tasks exist), /proc/stat (how many forks since boot) and /proc/sys/kernel/pid_max:
three small reads. Forks the kernel refuses after it took a pid (a pids controller's
limit) move the counter uncounted, and a privileged process may set it back
(ns_last_pid); docs/design.md says what that leaves.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass

#: After a wrap the counter starts again above the pids the kernel keeps for its own.
RESERVED_PIDS = 300
#: Pid numbers held per task, beyond its own, counted against a full cycle: a group or
#: session outlives its leader while a member runs, and holds the leader's number (a
#: task may hold two: its group's and its session's). Half a number a task is far above
#: what a machine's shells and services leave (a few dozen); a process that makes
#: thousands of leaderless groups to hide a full cycle could as well clear its id.
HELD_PER_TASK = 0.5
#: A sample is kept at most this often (clock ticks) when asked for at a spawn.
SAMPLE_EVERY = 10
#: Samples kept; past this the older half is thinned to every other one.
SAMPLES_KEPT = 256

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class PidSample:
    """The pid counter at a moment: read before `tick`, so every process started after
    `tick` (clock ticks after boot, as /proc/PID/stat's start time) got a later pid."""

    last_pid: int
    forks: int  # since boot, every namespace's (an upper bound on this one's)
    tasks: int  # existing then, every namespace's
    tick: int


@dataclass(frozen=True)
class PidArc:
    """The pids handed out after `after` up to `upto` (round the cycle below `pid_max`);
    all if `whole`."""

    after: int
    upto: int
    pid_max: int
    whole: bool = False

    def __contains__(self, pid: int) -> bool:
        if self.whole:
            return True
        if self.after <= self.upto:
            return self.after < pid <= self.upto
        return pid > self.after or pid <= self.upto  # the counter wrapped once since

    def span(self) -> int | None:
        """How many pid numbers the arc covers (None if whole)."""
        if self.whole:
            return None
        if self.after <= self.upto:
            return self.upto - self.after
        return max(0, self.pid_max - 1 - self.after) + self.upto

    def pids(self) -> range | list[int]:
        """Every pid number on the arc, oldest first (not for a whole one)."""
        if self.after <= self.upto:
            return range(self.after + 1, self.upto + 1)
        return [*range(self.after + 1, self.pid_max), *range(1, self.upto + 1)]


WHOLE = PidArc(0, 0, 0, whole=True)


def arc_since(then: PidSample | None, now: PidSample, pid_max: int) -> PidArc:
    """The pids that can have been handed out since `then` (the whole cycle without one,
    or if the counter may have gone round since)."""
    if then is None:
        return WHOLE
    forks = now.forks - then.forks
    if forks < 0:
        return WHOLE  # not this boot's counter (a checkpoint restored elsewhere)
    # A full cycle passes every number once: handed out (a fork since), or skipped as held
    # (by a task then or forked since, or a group or session whose leader had exited).
    passes = forks + (then.tasks + forks) + HELD_PER_TASK * then.tasks
    if passes >= pid_max - RESERVED_PIDS:
        return WHOLE
    return PidArc(then.last_pid, now.last_pid, pid_max)


def now_tick() -> int:
    """Clock ticks after boot, as /proc/PID/stat counts a process's start."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * _TICKS_PER_SECOND // 1_000_000_000


def _read(path: str, limit: int = 1 << 20) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        size = 0
        while size < limit and (chunk := os.read(fd, 65536)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_sample() -> PidSample | None:
    """The counter now (None where /proc does not say, or says it of another pid
    namespace than the one /proc lists). The counter is read before the clock, so the
    sample's tick is after it."""
    if not _proc_is_ours():
        return None
    try:
        loadavg = _read("/proc/loadavg").split()
        stat = _read("/proc/stat")
        at = stat.index(b"\nprocesses ") + len(b"\nprocesses ")
        forks = int(stat[at : stat.index(b"\n", at)])
        tasks = int(loadavg[3].split(b"/")[1])
        last_pid = int(loadavg[4])
    except (OSError, ValueError, IndexError):
        return None
    return PidSample(last_pid, forks, tasks, now_tick())


def read_pid_max() -> int | None:
    try:
        return int(_read("/proc/sys/kernel/pid_max"))
    except (OSError, ValueError):
        return None


@functools.cache
def _proc_is_ours() -> bool:
    """Whether /proc lists the pid namespace the daemon forks in (loadavg's last pid is
    the reader's namespace's; /proc's listing the mount's)."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


class PidClock:
    """Samples of the pid counter, taken at searches and at spawns (at most every
    SAMPLE_EVERY ticks), so that a stop finds one taken before its worker started."""

    def __init__(self) -> None:
        self._samples: list[PidSample] = []
        self._lock = threading.Lock()  # taken at spawns on the loop, at searches in a thread
        #: The sample the last `arc_since` took, and the pid_max it read.
        self.now: PidSample | None = None
        self.pid_max: int | None = None
        self.take()

    def take(self) -> PidSample | None:
        sample = read_sample()
        if sample is not None:
            self._keep(sample)
        return sample

    def _keep(self, sample: PidSample) -> None:
        with self._lock:
            self._samples.append(sample)
            if len(self._samples) > SAMPLES_KEPT:  # thinned, not cut: an old worker's stays
                half = len(self._samples) // 2
                self._samples[:half] = self._samples[:half:2]

    def take_if_stale(self) -> None:
        """At a spawn: a sample if none was taken in the last SAMPLE_EVERY ticks."""
        latest = self._samples[-1].tick if self._samples else None
        if latest is None or now_tick() - latest >= SAMPLE_EVERY:
            self.take()

    def before(self, tick: int) -> PidSample | None:
        """The latest sample taken before `tick` began (so before anything started at or
        after it was forked); None if there is none."""
        with self._lock:
            for sample in reversed(self._samples):
                if sample.tick < tick:
                    return sample
        return None

    def arc_since(self, tick: int) -> PidArc:
        """The pids that can have been handed out to processes started at or after
        `tick`: the whole cycle if there is no sample from before it to go by."""
        now = read_sample()
        pid_max = read_pid_max()
        self.now, self.pid_max = now, pid_max
        if now is None or pid_max is None:
            return WHOLE
        arc = arc_since(self.before(tick), now, pid_max)
        self._keep(now)
        return arc

    def arc_after(self, then: PidSample | None) -> PidArc:
        """The pids handed out between `then` and the sample the last `arc_since` took."""
        if self.now is None or self.pid_max is None:
            return WHOLE
        return arc_since(then, self.now, self.pid_max)
