"""A worker's processes that left its cgroup: found by the worker id they carry, and ended.

A worker's cgroup holds whatever it forks, unless a process moves itself out: a delegated
user service may write `cgroup.procs` anywhere in its subtree (the daemon's own cgroup, a
sibling worker's, one it makes), root anywhere, and `systemd-run --scope` moves a process
into a scope of the user's manager. It keeps the `SUBAGENTD_WORKER_ID` it inherited, so a
stop ends what carries the worker's id outside its cgroup too, and the daemon's shutdown
ends what carries any of its workers' ids (`MarkerSearch`; the guarantee and its limits
are in docs/design.md, "Stopping exactly what you mean").

One search reads /proc/PID/stat of every process and the environment of the orphans
started since the oldest worker asked about (`search`): its cost grows with the
machine's processes, not with the stops, since the stops asked together share one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import trio

from ._tree import (
    DESCRIPTOR_ERRNOS,
    Graces,
    ProcStat,
    end_found,
    patiently,
    running,
    with_descendants,
)
from ._tree import scan as scan_table

#: What a worker's processes inherit in their environment, before the worker's id.
MARKER = b"SUBAGENTD_WORKER_ID="
#: At most this many worker ids are taken from one process's environment (getenv reads
#: the first; a child of a worker that set its own has two).
MARKERS_READ = 4


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
        return [stat for stat in with_descendants(self.table, roots) if running(stat)]


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


def search(since: int, leaders: Collection[int] = ()) -> Marked:
    """Every process now, and the worker ids carried by the orphans among them started at
    or after `since` (clock ticks after boot): never the daemon, nor the `leaders` of live
    workers (the daemon's children, each carrying its own id).

    Made once nothing of a tree is left in its cgroup, whatever of it still runs was
    orphaned (its parents in the cgroup have exited) or descends from what was: so only
    the children of where an orphan goes, the daemon's ancestors (init, a subreaper such
    as the user's systemd) and the daemon, have their environment read, and what they
    forked is theirs by its parent (`Marked.carriers`). A machine's other processes, a
    thousand agents of another daemon among them, cost one `stat` each.
    """
    table = scan_table()
    me = os.getpid()
    adopters = _ancestors(table, me)
    by_worker: dict[str, list[int]] = {}
    for stat in table.values():
        if (
            stat.ppid not in adopters
            or stat.starttime < since
            or stat.pid == me
            or stat.pid in leaders
        ):
            continue
        for worker_id in worker_ids_of(stat.pid):
            by_worker.setdefault(worker_id, []).append(stat.pid)
    return Marked(table, by_worker)


def _ancestors(table: dict[int, ProcStat], pid: int) -> set[int]:
    """`pid` and every ancestor of it in `table`, init (1) always among them."""
    found = {1}
    while pid not in found and (stat := table.get(pid)) is not None:
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
        self._lock = trio.Lock()
        self._started = 0
        self._finished = 0
        self._latest = Marked({}, {})
        self._latest_since = 0
        #: The starts asked for by callers waiting for the next search.
        self._waiting: list[int] = []
        #: How many searches were made (for tests and `info`'s cost figures).
        self.made = 0

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
            found = await trio.to_thread.run_sync(search, reach, self._leaders)
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
        """The one search made for the whole batch once its cgroups are empty: its
        thousands of stops ask it as one, not each in turn through the search's lock.
        None if the search was cancelled (each then asks `markers` itself)."""
        if self.found is None and self._searching is None:
            self._searching = trio.Event()
            try:
                self.found = await markers.marked(self.since or 0)
            finally:
                self._searching.set()
        elif self.found is None and self._searching is not None:
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
