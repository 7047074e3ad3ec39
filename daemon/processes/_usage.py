"""What a live worker takes now: CPU time and recent CPU %, memory now and at peak, and
how many processes it has, read when a client asks (`status`, a listing with ``usage``,
``info`` with ``usage``) and never otherwise: no task polls.

Where each figure comes from, best first (protocol/README.md, Usage, says the same):

- CPU seconds: the worker's v2 cgroup's ``cpu.stat`` ``usage_usec`` (the kernel keeps it
  in every v2 cgroup, the cpu controller or not; it counts what has exited too). Without
  a cgroup: ``utime + stime + cutime + cstime`` of each of its processes, from
  /proc/PID/stat (a process reaped by one outside the tree takes its time along, so the
  figure is kept from going down: the largest seen).
- Memory now and at peak: the v2 cgroup's ``memory.current`` / ``memory.peak`` where the
  memory controller is enabled there; else the worker's v1 memory cgroup's own
  ``memory.stat`` (``cache`` + ``rss`` + ``swap``, its node's alone: a limited delegate's
  node below it is that delegate's, so `info`'s totals count each once) and, as peak,
  ``memory.max_usage_in_bytes`` (v1 keeps none but its subtree's: it and what it
  delegated) where it has one (made for a worker with a memory limit; the caller names
  it); else the sum of the resident sizes
  of its processes (/proc/PID/statm; pages two of them share are counted twice), and as
  peak the largest such sum this reader saw, never less than the largest process's
  ``VmHWM`` (/proc/PID/status, three times statm's cost: read at a worker's first
  reading and then at most every `PEAKS_EVERY` seconds, so a process's peak may show
  that much late).
- Processes: the members of its cgroup, else its tree as `_tree.tree_members` finds it
  in one scan of /proc shared by every worker of the request.

Bare `os.open`/`os.read` (a file object costs twice), on the event loop: a worker costs a
few reads of small kernel-made files (three for a worker of one process in a cgroup:
cgroup.procs, cpu.stat, statm; bench/usage.py has what they cost), the /proc scan of a
daemon without cgroups once per request. A process
or cgroup that goes while it is read is left out: the figures are those of what was
there, never an error.

`UsageReader` keeps, per worker attempt (its leader's pid and start time), the reading
the recent CPU % is measured from and the largest memory seen; `forget` lets go of it
once the attempt has ended.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from subagentd.protocol import Usage

from .._logging import get_logger
from ._tree import ProcStat, running, scan, tree_members

log = get_logger()

#: The recent CPU % is measured over the time since the reading before, if that was this
#: long ago at least (a shorter interval is noise: a tick is 10 ms) ...
RECENT_AT_LEAST = 0.2
#: ... and at most this long (older, it says little of now): else since the worker began.
RECENT_AT_MOST = 60.0

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
#: How often, at most, a worker's processes' own peaks (VmHWM, in /proc/PID/status, three
#: times the cost of statm's resident size) are read into its /proc peak.
PEAKS_EVERY = 10.0
Source = Literal["cgroup", "proc"]
#: What a read of a file that is gone, or of a process that has exited, raises.
_GONE = frozenset({errno.ENOENT, errno.ESRCH, errno.ENODEV, errno.EINVAL})


def _read(path: bytes | str) -> bytes | None:
    """A small kernel-made file's bytes; None if it (or its process, its cgroup) is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    try:
        return os.read(fd, 4096)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    finally:
        os.close(fd)


def _number(path: bytes | str) -> int | None:
    raw = _read(path)
    try:
        return int(raw) if raw is not None else None
    except ValueError:  # "max", or empty
        return None


def cgroup_cpu_seconds(cpu_stat: bytes) -> float | None:
    """``usage_usec`` of a cgroup's cpu.stat (its path), in seconds; None if it is gone."""
    raw = _read(cpu_stat)
    if raw is None:
        return None
    for line in raw.splitlines():
        if line.startswith(b"usage_usec "):
            return int(line[11:]) / 1e6
    return None


def cgroup_members(procs: bytes) -> list[int]:
    """The pids listed in a cgroup's cgroup.procs (its path; none if it is gone)."""
    try:
        fd = os.open(procs, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    listed = bytearray()
    try:
        listed += os.read(fd, 65536)
        # A short answer (under a page: the kernel's first buffer) is the whole list, and
        # the read that would say so is spared; a longer one is read to its end.
        while len(listed) >= 4096 and (chunk := os.read(fd, 65536)):
            listed += chunk
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
    finally:
        os.close(fd)
    me = os.getpid()
    return [pid for pid in map(int, listed.split()) if pid != me]


@dataclass(frozen=True)
class ProcessMemory:
    rss: int  # bytes resident now
    hwm: int  # bytes resident at its peak


def process_rss(pid: int) -> int | None:
    """Bytes resident of /proc/`pid`/statm (its second field, in pages: a third of the cost
    of status); None if the process is gone."""
    raw = _read(f"/proc/{pid}/statm")
    if raw is None:
        return None
    fields = raw.split()
    return int(fields[1]) * _PAGE if len(fields) > 1 else None


def process_memory(pid: int) -> ProcessMemory | None:
    """VmRSS and VmHWM of /proc/`pid`/status (one read gives both; statm has no peak);
    None if the process is gone, or is a zombie (which has none)."""
    raw = _read(f"/proc/{pid}/status")
    if raw is None:
        return None
    rss = hwm = None
    for line in raw.splitlines():
        if line.startswith(b"VmHWM:"):
            hwm = int(line.split()[1]) * 1024
        elif line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
            break  # VmRSS follows VmHWM
    if rss is None:
        return None
    return ProcessMemory(rss, rss if hwm is None else max(hwm, rss))


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime of /proc/`pid`/stat (its own and its reaped
    children's), in seconds; None if it is gone."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    # Fields 14 to 17 of stat(5), counted here from field 3 (the state).
    return sum(int(f) for f in fields[11:15]) / _TICK


def boot_seconds() -> float:
    """Seconds since boot, on the clock /proc/PID/stat's start times count on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class WorkerTree:
    """One live worker as its usage is read: its id, its leader (pid and start time in
    clock ticks after boot: the attempt's identity), its v2 cgroup (None: found by /proc),
    and the v1 memory cgroup it has, if any (a limited worker's)."""

    worker_id: str
    pid: int
    starttime: int
    cgroup: Path | None = None
    v1_memory: Path | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.starttime


@dataclass(frozen=True)
class _Files:
    """The kernel files one worker's usage is read from, named once for its attempt (a
    path built a reading cost as much as a read): its cgroup's, and whether its memory
    controller is there (`cgroup.controllers`, read once: a missing file tried each time
    costs a failed open)."""

    procs: bytes | None = None
    cpu: bytes | None = None
    memory: bytes | None = None
    memory_peak: bytes | None = None
    #: `memory` is a v1 memory.stat, whose node's own lines are summed (`_v1_own`).
    memory_stat: bool = False

    @classmethod
    def of(cls, tree: WorkerTree) -> _Files:
        v2 = tree.cgroup
        procs: bytes | None = None
        cpu: bytes | None = None
        if v2 is not None:
            procs, cpu = _named(v2, "cgroup.procs", "cpu.stat")
            enabled = (_read(os.fsencode(v2 / "cgroup.controllers")) or b"").split()
            if b"memory" in enabled:
                current, peak = _named(v2, "memory.current", "memory.peak")
                return cls(procs, cpu, current, peak)
        if tree.v1_memory is not None:
            stat, peak = _named(tree.v1_memory, "memory.stat", "memory.max_usage_in_bytes")
            return cls(procs, cpu, stat, peak, memory_stat=True)
        return cls(procs, cpu)


def _named(folder: Path, *names: str) -> list[bytes]:
    return [os.fsencode(folder / name) for name in names]


@dataclass
class _Seen:
    """What the reader keeps of one worker attempt between readings."""

    files: _Files
    at: float  # seconds since boot, of the reading the recent CPU % is measured from
    cpu: float  # its CPU seconds then
    #: The recent CPU % last measured: what a reading too soon after `at` says again.
    percent: float | None = None
    #: The largest CPU seconds read (a /proc sum may fall when a process is reaped away).
    cpu_most: float = 0.0
    #: The largest memory summed from /proc, or of one process's VmHWM read.
    memory_most: int = 0
    #: When its processes' VmHWM were last read (None: never).
    peaks_at: float | None = None


class UsageReader:
    """Reads workers' usage, keeping what the recent CPU % and a /proc peak need."""

    def __init__(self, clock: Callable[[], float] = boot_seconds) -> None:
        self._clock = clock
        self._seen: dict[tuple[int, int], _Seen] = {}

    def read(self, trees: Sequence[WorkerTree]) -> dict[str, Usage]:
        """The usage of each of `trees`, by worker id; one whose files could not be read
        (for want of a descriptor: not a vanishing) is left out. One scan of /proc serves
        those without a cgroup (made only if there is one)."""
        table: dict[int, ProcStat] | None = None
        found: dict[str, Usage] = {}
        for tree in trees:
            try:
                if tree.cgroup is None and table is None:
                    table = scan()
                found[tree.worker_id] = self._one(tree, table)
            except OSError as exc:
                # Not a vanishing (that reads as what was there) but a read refused: no
                # descriptor to spare (EMFILE), say. The worker is answered without its
                # usage rather than the request failing, or figures made up.
                log.warning("usage.unread", worker=tree.worker_id, error=str(exc))
        return found

    def forget(self, pid: int, starttime: int) -> None:
        """The attempt whose leader this was has ended: nothing of it is kept."""
        self._seen.pop((pid, starttime), None)

    def __len__(self) -> int:
        return len(self._seen)

    def _one(self, tree: WorkerTree, table: dict[int, ProcStat] | None) -> Usage:
        now = self._clock()
        seen = self._seen.get(tree.key)
        files = _Files.of(tree) if seen is None else seen.files
        if files.procs is not None and files.cpu is not None:
            pids = cgroup_members(files.procs)
            cpu = cgroup_cpu_seconds(files.cpu)
        else:
            assert table is not None
            members = tree_members(table, tree.pid, tree.worker_id, tree.starttime)
            pids = [m.pid for m in members if running(m)]
            cpu = None
        if cpu is None:  # no cgroup, or it went as it was read
            cpu = sum(filter(None, map(process_cpu_seconds, pids)), 0.0)
        peaks = seen is None or seen.peaks_at is None or now - seen.peaks_at >= PEAKS_EVERY
        memory, peak, source = _memory(files, pids, peaks=peaks)
        if seen is None:
            percent = self._since_start(tree, now, cpu)
            seen = self._seen[tree.key] = _Seen(files, at=now, cpu=cpu, percent=percent)
        else:
            cpu = max(cpu, seen.cpu_most)
            percent = self._recent(tree, seen, now, cpu)
        seen.cpu_most = cpu
        if source == "proc":
            seen.memory_most = peak = max(seen.memory_most, memory, peak or 0)
            if peaks:
                seen.peaks_at = now
        return Usage(
            cpu_seconds=cpu,
            cpu_percent=percent,
            memory=memory,
            memory_peak=peak,
            processes=len(pids),
            source=source,
        )

    def _recent(self, tree: WorkerTree, seen: _Seen, now: float, cpu: float) -> float | None:
        """The CPU % over the time since the reading kept; one within `RECENT_AT_LEAST` of
        it says again what was last measured (it is no new interval), one more than
        `RECENT_AT_MOST` after it is measured since the worker began. Either way the
        reading becomes the one the next is measured from, but a too-soon one."""
        interval = now - seen.at
        if interval < RECENT_AT_LEAST:
            return seen.percent if seen.percent is not None else self._since_start(tree, now, cpu)
        percent: float | None = max(0.0, (cpu - seen.cpu) / interval * 100)
        if interval > RECENT_AT_MOST:
            percent = self._since_start(tree, now, cpu)
        seen.at, seen.cpu, seen.percent = now, cpu, percent
        return percent

    @staticmethod
    def _since_start(tree: WorkerTree, now: float, cpu: float) -> float | None:
        elapsed = now - tree.starttime / _TICK
        return cpu / elapsed * 100 if elapsed > 0 else None


def _v1_own(stat: bytes) -> int | None:
    """A v1 memory node's own memory, of its memory.stat: page cache, resident anonymous
    memory and swap (the lines before the hierarchical ones); None if it is gone."""
    raw = _read(stat)
    if raw is None:
        return None
    total = 0
    for line in raw.splitlines():
        key, _, value = line.partition(b" ")
        if key in (b"cache", b"rss", b"swap"):
            total += int(value)
        elif key == b"hierarchical_memory_limit":
            break
    return total


def _memory(
    files: _Files, pids: list[int], *, peaks: bool = True
) -> tuple[int, int | None, Source]:
    """Memory now, at peak, and whence: ("cgroup" if a cgroup's counter, else "proc").
    From /proc, the peak is the largest process's VmHWM if `peaks`, else 0 (the caller
    keeps the largest seen)."""
    if files.memory is not None:
        current = _v1_own(files.memory) if files.memory_stat else _number(files.memory)
        if current is not None:
            return (
                current,
                None if files.memory_peak is None else _number(files.memory_peak),
                "cgroup",
            )
    memory = hwm = 0
    if not peaks:
        return sum(filter(None, map(process_rss, pids))), 0, "proc"
    for pid in pids:
        if (found := process_memory(pid)) is not None:
            memory += found.rss
            hwm = max(hwm, found.hwm)
    return memory, hwm, "proc"
