"""A worker's processes that left its cgroup: found by the worker id they carry, and ended.

A worker's cgroup holds whatever it forks, unless a process moves itself out: a delegated
user service may write `cgroup.procs` anywhere in its subtree (the daemon's own cgroup, a
sibling worker's, one it makes), root anywhere, and `systemd-run --scope` moves a process
into a scope of the user's manager. It keeps the `SUBAGENTD_WORKER_ID` it inherited, so a
stop ends what carries the worker's id outside its cgroup too, and the daemon's shutdown
ends what carries any of its workers' ids (`MarkerSearch`; the guarantee and its limits
are in docs/design.md, "Stopping exactly what you mean").

One search reads /proc/PID/stat of the processes whose pids were handed out since the
oldest worker asked about started (`_pidclock`: of every process, if the pid counter may
have gone round since), and the environment of the orphans among them (`search`): its
cost grows with the forks since, not with the machine's processes nor with the stops,
since the stops asked together share one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import trio

from ._pidclock import WHOLE, PidClock, PidSample
from ._tree import (
    DESCRIPTOR_ERRNOS,
    Graces,
    ProcStat,
    end_found,
    patiently,
    read_stat,
    running,
    with_descendants,
)

#: What a worker's processes inherit in their environment, before the worker's id.
MARKER = b"SUBAGENTD_WORKER_ID="
#: At most this many worker ids are taken from one process's environment (getenv reads
#: the first; a child of a worker that set its own has two).
MARKERS_READ = 4
#: The pids handed out since a worker started are read one by one where they are at most
#: this many numbers, or a fifth of the tasks on the machine (a failed open of a pid not
#: in use costs a few microseconds, about what a listing of /proc costs per process, 36
#: ms for 11,000 under load here; a pid in use a `stat` read, five times that, which a
#: listing may take from `Recall`); more, and they are picked from one listing.
PROBE_MAX = 128
PROBE_PER_TASK = 1 / 5


@dataclass(frozen=True)
class Marked:
    """One search of /proc: every process, and those carrying a worker id by that id."""

    table: dict[int, ProcStat]
    by_worker: dict[str, list[int]]

    def carriers(self, worker_id: str, since: int) -> list[ProcStat]:
        """The processes carrying `worker_id` started at or after `since` (a process older
        than the worker cannot be its: one that merely claims its id is spared), and
        everything descended from them (a child that cleared its environment)."""
        roots = {
            pid for pid in self.by_worker.get(worker_id, ()) if self.table[pid].starttime >= since
        }
        if not roots:  # the common case: nothing escaped, and no walk of every process
            return []
        found = []
        for stat in with_descendants(self.table, roots):
            # Read again: the table may hold what an earlier search read (`Recall`).
            now = read_stat(stat.pid)
            if now is not None and now.starttime == stat.starttime and running(now):
                found.append(now)
        return found


def outside_cgroups(
    marked: Marked, trees: Iterable[tuple[int, str, int]], inside: Collection[int]
) -> list[ProcStat]:
    """What of each worker's tree runs outside its cgroup (`inside`: the pids in the
    workers' cgroups): for a pause, while the tree still runs (a stop searches once the
    cgroup is empty). Each tree is a leader's pid, its worker id and its start; its
    processes outside are those of the search started since, in the leader's process
    group or forked by a process inside, those carrying its worker id, and what they
    forked. Read again (the search may recall an older state)."""
    return [stat for found in outside_by_worker(marked, trees, inside).values() for stat in found]


def outside_by_worker(
    marked: Marked, trees: Iterable[tuple[int, str, int]], inside: Collection[int]
) -> dict[str, list[ProcStat]]:
    """`outside_cgroups`, by the worker each process was found for (the worker of the
    process its search started from, the nearest on its way up; a process found from
    two workers' counts for the first)."""
    table = marked.table
    root_of: dict[int, str] = {}
    for leader, worker_id, since in trees:
        for pid, stat in table.items():
            if (
                pid not in inside
                and stat.starttime >= since
                and (stat.pgid == leader or stat.ppid in inside)
            ):
                root_of.setdefault(pid, worker_id)
        for stat in marked.carriers(worker_id, since):
            root_of.setdefault(stat.pid, worker_id)
    found: dict[str, list[ProcStat]] = {}
    for stat in with_descendants(table, set(root_of)):
        now = read_stat(stat.pid)
        same = now is not None and now.starttime == stat.starttime
        if stat.pid not in inside and same and now is not None and running(now):
            found.setdefault(_root_worker(stat, table, root_of), []).append(now)
    return found


def _root_worker(stat: ProcStat, table: dict[int, ProcStat], root_of: dict[int, str]) -> str:
    """The worker of the nearest search root at or above `stat` (one is: it was found as
    a root's descendant)."""
    seen: set[int] = set()
    current: ProcStat | None = stat
    while current is not None and current.pid not in seen:
        if current.pid in root_of:
            return root_of[current.pid]
        seen.add(current.pid)
        current = table.get(current.ppid)
    return next(iter(root_of.values()))  # not reached: every descendant has its root


def worker_ids_of(pid: int) -> list[str]:
    """The worker ids process `pid` carries in its environment (none if it cannot be read:
    another user's process, to a daemon not run as root, is not ours to end anyway).
    Raises OSError for want of a descriptor, as `read_stat` does."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in DESCRIPTOR_ERRNOS:
            raise
        return []
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return []
    finally:
        os.close(fd)
    environ = b"".join(chunks)
    if MARKER not in environ:  # the common case: one search of the bytes, no split
        return []
    found = [
        entry[len(MARKER) :].decode(errors="replace")
        for entry in environ.split(b"\0")
        if entry.startswith(MARKER)
    ]
    return found[:MARKERS_READ]  # a forger's thousand claims cost no more than a few


@dataclass
class Recall:
    """What a search read, for the next to take again where nothing can have changed: the
    `stat` of each process on its arc and the worker ids of the orphans among them, read
    after `sample` was taken."""

    stats: dict[int, ProcStat] = field(default_factory=dict)
    ids: dict[int, list[str]] = field(default_factory=dict)
    sample: PidSample | None = None


def search(
    since: int,
    leaders: Collection[int] = (),
    clock: PidClock | None = None,
    recall: Recall | None = None,
) -> Marked:
    """The processes started at or after `since` (clock ticks after boot), by the pids
    handed out since (`clock`; all, without one), and the worker ids carried by the
    orphans among them: never the daemon, nor the `leaders` of live workers (the daemon's
    children, each carrying its own id), which are not even read.

    Made once nothing of a tree is left in its cgroup, whatever of it still runs was
    orphaned (its parents in the cgroup have exited) or descends from what was: so only
    the children of where an orphan goes, the daemon's ancestors (init, a subreaper such
    as the user's systemd) and the daemon, have their environment read, and what they
    forked is theirs by its parent (`Marked.carriers`), forked later, so on the same arc
    of pids. The machine's older processes, a thousand agents of another daemon among
    them, cost nothing.

    `recall`, what the last search read (updated here for the next): a process whose pid
    was not handed out again since is the same process, and its parent is the same while
    that parent runs, so it is taken from there once its parent is read (one read per
    parent: the bench's or a shell's hundred children cost one); its environment too (one
    a process rewrites in place, or gains by an exec, between two searches is not read
    again: docs/design.md).
    """
    me = os.getpid()
    # Always asked (the whole cycle for a `since` of 0): its sample is the one `recall`
    # keeps, and `renewed` reaches to.
    arc = WHOLE if clock is None else clock.arc_since(since)
    span = arc.span()
    pids: Iterable[int]
    listed = False
    tasks = clock.now.tasks if clock is not None and clock.now is not None else 0
    if span is not None and span <= max(PROBE_MAX, tasks * PROBE_PER_TASK):
        pids = arc.pids()  # not known to be in use: none is taken from `recall`
    else:
        listed = True
        names = os.listdir("/proc")
        if clock is not None:
            arc2 = clock.arc_since(since)  # read after the listing: all it lists is on it
            arc = arc if arc.whole else arc2
        pids = [int(name) for name in names if name.isdigit()]
    # What was handed out since the last search's reads began: read again; the rest may be
    # taken from them.
    kept = listed and recall is not None and clock is not None and clock.now is not None
    renewed = clock.arc_after(recall.sample) if kept and recall is not None and clock else WHOLE
    recalled: dict[int, ProcStat] = {}
    if kept and not renewed.whole and recall is not None:
        recalled = recall.stats
    stats: dict[int, ProcStat] = {}
    taken: set[int] = set()  # from `recalled`, their parents not yet read
    for pid in pids:
        if pid not in arc or pid == me or pid in leaders:
            continue
        if pid not in renewed and (old := recalled.get(pid)) is not None:
            stats[pid] = old
            taken.add(pid)
        elif (stat := read_stat(pid)) is not None:
            stats[pid] = stat
    fresh: dict[int, ProcStat | None] = {}

    def runs(pid: int) -> bool:
        """Whether `pid`, not handed out again since the last search, still runs."""
        if pid in renewed:
            return False
        if pid in stats and pid not in taken:  # read in this search already
            return stats[pid].state != "Z"
        if pid not in fresh:
            fresh[pid] = stat = read_stat(pid)
            if pid in taken:
                taken.discard(pid)
                if stat is None:
                    del stats[pid]
                else:
                    stats[pid] = stat
        stat = fresh[pid]
        return stat is not None and stat.state != "Z"

    for pid in list(taken):
        if pid in taken and not runs(stats[pid].ppid):  # orphaned since: read again
            taken.discard(pid)
            if (stat := read_stat(pid)) is None:
                del stats[pid]
            else:
                stats[pid] = stat
    table = {pid: stat for pid, stat in stats.items() if stat.starttime >= since}
    adopters = _ancestors(me)
    by_worker: dict[str, list[int]] = {}
    ids: dict[int, list[str]] = {}
    recalled_ids = recall.ids if recalled and recall is not None else {}
    for stat in table.values():
        if stat.ppid in adopters:
            old_ids = recalled_ids.get(stat.pid) if stat.pid in taken else None
            ids[stat.pid] = found = worker_ids_of(stat.pid) if old_ids is None else old_ids
            for worker_id in found:
                by_worker.setdefault(worker_id, []).append(stat.pid)
    if recall is not None and clock is not None:
        recall.stats, recall.ids, recall.sample = stats, ids, clock.now
    return Marked(table, by_worker)


def _ancestors(pid: int) -> set[int]:
    """`pid` and every ancestor of it, init (1) always among them: where an orphan of a
    worker's tree goes."""
    found = {1}
    while pid not in found and (stat := read_stat(pid)) is not None:
        found.add(pid)
        pid = stat.ppid
    return found


class MarkerSearch:
    """Searches of /proc for worker ids, shared by every stop asked at about the same time.

    A caller gets a search that started after it asked, and reached back to the start it
    asked for, so it sees every process forked before its question; but a run's ten
    thousand stops share one or two searches rather than make ten thousand.
    """

    def __init__(self, leaders: Collection[int] = ()) -> None:
        #: The live workers' own pids (the launcher's, kept up to date): never searched.
        self._leaders = leaders
        #: Which pids were handed out since when (`spawning` keeps it close behind).
        self.clock = PidClock()
        #: What the last search read, for the next to take again (`Recall`).
        self._recall = Recall()
        self._lock = trio.Lock()
        self._started = 0
        self._finished = 0
        self._latest = Marked({}, {})
        self._latest_since = 0
        #: The starts asked for by callers waiting for the next search.
        self._waiting: list[int] = []
        #: How many searches were made (for tests and `info`'s cost figures).
        self.made = 0

    def spawning(self) -> None:
        """A worker is about to be forked: a sample of the pid counter before it, unless
        one was taken a moment ago, so its stop reads only the pids handed out since."""
        self.clock.take_if_stale()

    async def marked(self, since: int) -> Marked:
        fresh_enough = self._started + 1
        self._waiting.append(since)
        async with self._lock:
            if self._finished >= fresh_enough and self._latest_since <= since:
                return self._latest
            self._started += 1
            number = self._started
            reach = min([since, *self._waiting])
            self._waiting.clear()
            found = await trio.to_thread.run_sync(
                search, reach, self._leaders, self.clock, self._recall
            )
            self.made += 1
            self._finished, self._latest, self._latest_since = number, found, reach
            return found


@dataclass(eq=False)
class StopBatch:
    """The stops asked together (one request's: a stop_run's thousands, a worker's subtree,
    a shutdown's all): each, its cgroup empty, waits for the others' to be, so that one
    search serves them all rather than one search each as their trees end one by one."""

    #: The leaders' pids of those whose cgroups are not yet empty.
    pending: set[int] = field(default_factory=set)
    all_empty: trio.Event = field(default_factory=trio.Event)
    #: The earliest start of the batch's workers' processes: how far back its search
    #: reaches, for every one of them.
    since: int | None = None
    #: The batch's one search, once its cgroups are all empty (`searched`).
    found: Marked | None = None
    _searching: trio.Event | None = None

    def join(self, leader: int, since: int = 0) -> None:
        self.pending.add(leader)
        self.since = since if self.since is None else min(self.since, since)

    async def searched(self, markers: MarkerSearch) -> Marked | None:
        """The one search made for the whole batch once its cgroups are all empty: its
        thousands of stops ask it as one, not each in turn through the search's lock,
        and each waits once (the first asking waits for the emptying, then searches; the
        others wait for that search alone: one task switch each, not two). None if the
        search was cancelled (each then asks `markers` itself)."""
        if self._searching is None:
            self._searching = trio.Event()
            try:
                await self.all_empty.wait()
                self.found = await markers.marked(self.since or 0)
            finally:
                self._searching.set()
        elif not self._searching.is_set():
            await self._searching.wait()
        return self.found

    def emptied(self, leader: int) -> None:
        self.pending.discard(leader)
        if not self.pending:
            self.all_empty.set()


async def end_escaped(
    markers: MarkerSearch,
    worker_id: str,
    since: int,
    grace: float,
    graces: Graces | None = None,
    termed: set[int] | None = None,
) -> int:
    """TERM what carries `worker_id` and was started at or after `since`, wherever it runs,
    KILL what is left after `grace`; how many were killed. Searches again until a search
    finds nothing, so a child forked meanwhile is found by the next. `termed`: the pids
    already sent a TERM by this stop (its cgroup's), which get no second one."""

    async def find() -> list[ProcStat]:
        return (await markers.marked(since)).carriers(worker_id, since)

    if not [found for found in await patiently(find) if running(found)]:
        # What a stop of thousands finds for nearly each: nothing escaped. No grace period
        # (a cancel scope with a deadline each) is entered for it (bench/README.md).
        return 0
    return await end_found(find, grace, graces, termed)


async def end_marked_by(
    markers: MarkerSearch, since_of: Callable[[str], int | None], grace: float, graces: Graces
) -> int:
    """At the daemon's shutdown: end what carries any of its workers' ids (`since_of`: when
    that worker's process started, 0 if not known; None for an id that is not one of ours,
    as another daemon's worker's), wherever it runs; how many were killed."""

    async def find() -> list[ProcStat]:
        marked = await markers.marked(0)
        found: dict[int, ProcStat] = {}
        for worker_id in marked.by_worker:
            since = since_of(worker_id)
            if since is not None:
                found.update((s.pid, s) for s in marked.carriers(worker_id, since))
        return list(found.values())

    return await end_found(find, grace, graces)
