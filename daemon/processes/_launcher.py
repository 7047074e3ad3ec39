"""The launcher port: how a worker's process is started, adopted after an exec, and how its
whole tree is ended. Everything above it (supervision, reload, recovery) knows a worker's
processes only through what a launcher returns and does.

The one launcher today is `LocalLauncher`: fork and exec on this machine, each worker in a
cgroup of its own where the daemon's cgroup is delegated, else its tree found by scanning
/proc. A launcher elsewhere (a cluster) implements the same `Launcher` protocol; the
`WorkerProcess` it hands back is the worker's identity (pid and start time, as a checkpoint
carries them), its output pipes, and the wait for its exit.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import trio

from subagentd.protocol import Control, Usage

from .._logging import get_logger
from ._cgroup import Cgroups, Leader, WorkerCgroup, end_cgroup, peer_cgroup
from ._controllers import Controllers, LimitNodes, LimitPlan, LimitsHit, v2_hit
from ._escapes import (
    MarkerSearch,
    StopBatch,
    end_escaped,
    end_marked_by,
    outside_by_worker,
)
from ._freezer import (
    CGROUP_FREEZE,
    SIGSTOP_FREEZE,
    Find,
    Tree,
    cgroup_pids,
    continue_found,
    continue_trees,
    freeze_asked,
    freeze_cgroups,
    stop_found,
    stop_trees,
    stopped_now,
    write_freeze,
)
from ._process import SpawnFailed, WorkerProcess
from ._relay import Relays
from ._tree import Graces, ProcessTable, ProcStat, end_marked, end_tree
from ._usage import UsageReader, WorkerTree
from ._v2_nodes import V2Nodes

log = get_logger()

#: At the daemon's shutdown, what is left in its cgroups, or carries one of its workers'
#: ids elsewhere, has this long between its TERM and its KILL.
SWEEP_GRACE = 1.0


@dataclass(frozen=True)
class PauseDone:
    """What a pause did: the workers the kernel had not said are held by the bound
    (`unsettled`, still being held), and the pids of each worker's processes it held
    outside the worker's cgroup (moved out of it: stopped by SIGSTOP, `_escapes`)."""

    unsettled: list[str] = field(default_factory=list)
    held_outside: dict[str, list[int]] = field(default_factory=dict)


class Launcher(Protocol):
    #: How trees are tracked, and if not by cgroups why not (reported by `info`).
    tree_tracking: str
    #: Grace periods under way; a hurried shutdown ends them all.
    graces: Graces
    #: The output relays holding workers' pipes past the daemon's descriptor threshold.
    relays: Relays
    #: Which limits the kernel enforces here, and where (`_controllers`).
    controllers: Controllers

    @property
    def authority(self) -> Literal["kernel", "token"]:
        """Who says whom a connection acts as: "kernel" where the launcher can tell which
        worker a local process belongs to (`worker_of_process`), whatever its environment
        says; "token" where it cannot, and a connection is whom its token says
        (protocol/README.md, Authority)."""
        ...

    def worker_of_process(self, pid: int, pidfd: int | None) -> str | None:
        """The worker process `pid` (a connection's peer; `pidfd`, its pidfd if the socket
        gave one) belongs to, None if none; always None where `authority` is "token". Raises
        PeerUnplaced where it cannot tell, OSError where it could not read (EMFILE)."""
        ...

    async def start(
        self,
        worker_id: str,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin_path: str | None,
        stdin_open: bool = False,
        limits: LimitPlan | None = None,
    ) -> WorkerProcess:
        """Start a worker's process; raises SpawnFailed (OutOfDescriptors) naming why not.
        `stdin_open`: its stdin a pipe whose write end the process hands back. `limits`:
        the limit nodes it is born in (`Controllers.nodes`)."""
        ...

    def adopt(
        self,
        worker_id: str,
        pid: int,
        pid_start: int,
        stdout: int | None,
        stderr: int | None,
        stdin: int | None = None,
        relayed: tuple[int, str, list[str]] | None = None,
        limit_path: str = "",
    ) -> WorkerProcess:
        """Take over a worker a previous image started; ProcessLookupError if it is gone.
        `relayed`: the pid of the relay holding its streams, their key, and their kinds.
        `limit_path`: where its limit nodes are (`LimitPlan.relative`; empty: none)."""
        ...

    def limits_hit(self, process: WorkerProcess) -> LimitsHit | None:
        """What its limits did to a worker whose tree has ended; None: it had none."""
        ...

    def adopting(self) -> contextlib.AbstractContextManager[None]:
        """Around a reload's adoption of many workers (nothing spawned meanwhile): what
        `adopt` looks up for each may be looked up once for all."""
        ...

    @property
    def freeze(self) -> Control:
        """How `pause` holds a tree still (`info`'s ``controls["freeze"]``)."""
        ...

    async def pause(self, targets: list[tuple[str, WorkerProcess]]) -> PauseDone:
        """Hold each worker's whole tree still (its id, its process), until `unpause`;
        returns once the kernel says they are held, or after a bound: the ids it had not
        said so of by then (still being held), and what of each tree it held outside the
        worker's cgroup."""
        ...

    async def unpause(self, targets: list[tuple[str, WorkerProcess]]) -> None:
        """Let each worker's tree go on (the ids that `pause` held)."""
        ...

    async def carry_pauses(
        self, held: list[tuple[str, WorkerProcess]], let_go: list[tuple[str, WorkerProcess]]
    ) -> None:
        """After a reload, of the workers that were paused: hold `held` whole (a pause
        that the reload cut short may have stopped its leader, not yet what it forked), and
        let `let_go` go on whole (its leader was let go: an unpause cut short, or someone
        else's SIGCONT, may have left the rest stopped, which no unpause would then reach)."""
        ...

    def thaw_now(self, process: WorkerProcess) -> None:
        """At once, on the event loop: a paused worker is being stopped, and its tree must
        take its TERM (a tree without a cgroup is sent SIGCONT with it instead)."""
        ...

    def paused_now(self, process: WorkerProcess) -> bool:
        """Whether the kernel holds the worker's tree still (after a reload: what an image
        before paused)."""
        ...

    def term_leader(self, process: WorkerProcess) -> bool:
        """TERM the worker's own process now, as the stop is asked, where the rest of its
        tree is found without it (its cgroup): its exit then overlaps the search. True if
        sent (`end_tree` is then told, and sends it no second one)."""
        ...

    async def end_tree(
        self,
        worker_id: str,
        process: WorkerProcess,
        grace: float,
        *,
        hurried: bool = True,
        leader_termed: bool = False,
        leader_exited: trio.Event | None = None,
    ) -> int:
        """TERM the worker's whole tree, KILL what is left after `grace`; how many were
        killed. `hurried`: a hurried shutdown may cut the grace short. `leader_termed`:
        `term_leader` sent the worker's own process its TERM. `leader_exited`: set by the
        worker's supervision once its own process has exited (the supervision waits on
        its pidfd), so the stop waits on that rather than on a descriptor of its own;
        None where no supervision waits (its fault's cleanup)."""
        ...

    async def end_leftover_tree(
        self, worker_id: str, pid: int | None, pid_start: int | None, grace: float
    ) -> int:
        """End what is left of a worker no one watches (a dead image's), found by what
        the launcher kept of it, else by the leader named, else by its worker id."""
        ...

    def holds_tree(self, worker_id: str) -> bool:
        """Whether the launcher itself keeps track of the worker's tree (so no leader pid
        is needed to find it)."""
        ...

    def usage(self, workers: Sequence[tuple[str, WorkerProcess]]) -> dict[str, Usage]:
        """What each of `workers` (its id and live process) takes now, by id (`_usage`);
        read when asked, never an error for one that goes meanwhile."""
        ...

    def released(self, process: WorkerProcess) -> None:
        """The worker's attempt has ended and been reaped: let go of what held its tree
        (its cgroup, removed by the next `remove_released`, or at `close`)."""
        ...

    async def remove_released(self, wanted: Callable[[str], bool]) -> None:
        """Remove what `released` let go of since, but what a worker `wanted` again (a
        resumed one's) uses."""
        ...

    def remove_released_now(self) -> None:
        """`remove_released`, at once, on the event loop: the image is about to end (an
        exec, a stop) and takes none of it along."""
        ...

    async def sweep(self, live: Container[str]) -> None:
        """At a clean start: end what dead images left, but for the workers in `live`."""
        ...

    async def sweep_at_shutdown(self, since_of: Callable[[str], int | None]) -> None:
        """The daemon stops, its workers ended: end what is left in any of its cgroups
        (known workers' or not) and what carries one of its workers' ids anywhere
        (`since_of`: when that worker's process started, 0 if not known, None for an id
        that is not this daemon's)."""
        ...

    def close(self, *, anything_live: bool) -> None:
        """The daemon stops: let go of the launcher's own resources if nothing runs."""
        ...


class LocalLauncher:
    """Fork and exec here, into a per-worker cgroup where there is one."""

    def __init__(
        self,
        cgroups: Cgroups | None,
        tree_tracking: str,
        relays: Relays | None = None,
        controllers: Controllers | None = None,
    ) -> None:
        #: Where workers' cgroups go; None: their trees are found by scanning /proc.
        self.cgroups = cgroups
        self.tree_tracking = tree_tracking
        self.controllers = (
            controllers if controllers is not None else Controllers.off("not asked for")
        )
        self.graces = Graces()
        #: None: no worker is relayed (a threshold no descriptor reaches).
        self.relays = relays if relays is not None else Relays(1 << 62)
        self.processes = ProcessTable()
        #: Searches of /proc for what left its worker's cgroup, shared by the stops asked
        #: at about the same time.
        #: The live workers' own processes (by pid, our unreaped children): never one
        #: that left another worker's cgroup.
        self.leaders: set[int] = set()
        self.markers = MarkerSearch(self.leaders)
        #: The batch stops asked now join (`term_leader`), until the first of them ends.
        self._batch: StopBatch | None = None
        self._batch_of: dict[int, StopBatch] = {}  # by leader pid, until its tree has ended
        #: The workers' cgroups present, listed once for a reload's adoption of many (a
        #: stat each was a quarter of adopting 1,000): only while `adopting`.
        self._present: frozenset[str] | None = None
        #: Ended workers' cgroups, released and not yet removed (`remove_released`).
        self._unremoved: list[WorkerCgroup] = []
        self._usage = UsageReader()
        #: Ended workers' limit nodes, likewise.
        self._unremoved_nodes: list[LimitNodes] = []
        #: A dead image's v2-limited workers' leaves, by worker id (`_leftover_group`).
        self._leftover_leaves: dict[str, WorkerCgroup] | None = None

    @property
    def authority(self) -> Literal["kernel", "token"]:
        return "kernel" if self.cgroups is not None else "token"

    def worker_of_process(self, pid: int, pidfd: int | None) -> str | None:
        if self.cgroups is None:
            return None
        return self.cgroups.worker_of(peer_cgroup(pid, pidfd))

    def _group(self, worker_id: str) -> WorkerCgroup | None:
        return self.cgroups.worker(worker_id) if self.cgroups else None

    def _v2_group(self, limits: LimitPlan | None) -> WorkerCgroup | None:
        """Its v2 limit nodes' leaf, made (`Controllers.v2_group`); SpawnFailed naming the
        file that would not take its limits, before anything runs."""
        try:
            return self.controllers.v2_group(limits)
        except OSError as exc:
            raise SpawnFailed(f"{exc.strerror or exc}; nothing was started") from exc

    def _adopted_group(self, worker_id: str) -> WorkerCgroup | None:
        """The cgroup the image before put the worker in, if it is there still (None: its
        tree was found by scanning /proc)."""
        if self.cgroups is None:
            return None
        group = self.cgroups.worker(worker_id)
        present = worker_id in self._present if self._present is not None else group.exists()
        return group if present else None

    def _adopted_leaf(self, limit_path: str) -> WorkerCgroup | None:
        """The leaf of its v2 limit nodes an adopted worker was born in, if any."""
        v2 = self.controllers.v2
        return v2.group_at(limit_path) if v2 is not None and limit_path else None

    @contextlib.contextmanager
    def adopting(self) -> Iterator[None]:
        self._present = self.cgroups.present() if self.cgroups is not None else None
        try:
            yield
        finally:
            self._present = None

    async def start(
        self,
        worker_id: str,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin_path: str | None,
        stdin_open: bool = False,
        limits: LimitPlan | None = None,
    ) -> WorkerProcess:
        if self.relays.soon_wanted():  # a compare: nothing more below the threshold
            await self.relays.make_room(2)  # before the fork: a cancel here loses nothing
        if self.cgroups is not None:
            self.markers.spawning()  # its stop's search reads only the pids handed out since
        # On the event loop, not in a thread: a posix_spawn (vfork) costs less than the
        # hop to a thread and back (see _spawn), and blocks only until the exec.
        process = WorkerProcess.spawn(
            argv,
            cwd=cwd,
            env=env,
            stdin_path=stdin_path,
            stdin_open=stdin_open,
            # A worker with cgroup v2 limits: the leaf of its v2 nodes, born in by clone3.
            cgroup=self._v2_group(limits) or self._group(worker_id),
            # Where connections are placed by cgroup, one outside every worker's acts for
            # the user: a worker must never start outside its own.
            cgroup_required=self.authority == "kernel",
            limit_nodes=self.controllers.nodes(limits),
        )
        if process.cgroup_error is not None:
            log.warning("worker.no_cgroup", worker=worker_id, error=process.cgroup_error)
        self.leaders.add(process.pid)
        assert process.stdout is not None
        assert process.stderr is not None
        pipes = {"stdout": process.stdout, "stderr": process.stderr}
        streams = self.relays.relay(worker_id, pipes)
        if streams is not None:  # the relay holds them now: the daemon, none
            process.relayed = streams
            process.stdout = process.stderr = None
        return process

    def adopt(
        self,
        worker_id: str,
        pid: int,
        pid_start: int,
        stdout: int | None,
        stderr: int | None,
        stdin: int | None = None,
        relayed: tuple[int, str, list[str]] | None = None,
        limit_path: str = "",
    ) -> WorkerProcess:
        process = WorkerProcess.adopt(
            pid,
            pid_start,
            stdout,
            stderr,
            cgroup=self._adopted_leaf(limit_path) or self._adopted_group(worker_id),
            stdin=stdin,
            elsewhere=bool(limit_path),
        )
        # The kernel kept its nodes, and its limits in them, across the exec.
        process.limit_nodes = self.controllers.nodes_at(limit_path)
        if relayed is not None:
            relay_pid, key, kinds = relayed
            relay = self.relays.by_pid(relay_pid)
            # A relay not adopted: its streams are lost (their pumps say so, and the
            # worker ends interrupted); an empty relay stands for it.
            process.relayed = (
                relay.adopt(key, kinds)
                if relay is not None
                else self.relays.lost_streams(key, kinds, relay_pid)
            )
        self.leaders.add(process.pid)
        return process

    @property
    def freeze(self) -> Control:
        return Control(
            enforced=True, how=CGROUP_FREEZE if self.cgroups is not None else SIGSTOP_FREEZE
        )

    async def pause(self, targets: list[tuple[str, WorkerProcess]]) -> PauseDone:
        groups = {p.cgroup.name: p.cgroup for _, p in targets if p.cgroup is not None}
        trees = [
            (p.pid, worker_id, p.starttime)
            for worker_id, p in targets
            if p.cgroup is None and not p.reaped
        ]
        unsettled = await freeze_cgroups(list(groups.values()), True) if groups else []
        if trees and not await stop_trees(self.processes, trees):
            unsettled += [worker_id for _, worker_id, _ in trees]
        held: dict[str, set[int]] = {}
        if groups:
            # What moved itself out of its cgroup is not frozen with it: stopped.
            escaped = _cgrouped_trees(targets)
            if not await stop_found(self._outside(escaped, list(groups.values()), held)):
                unsettled += [worker_id for _, worker_id, _ in escaped]
        outside = {worker_id: sorted(pids) for worker_id, pids in held.items() if pids}
        return PauseDone(unsettled, outside)

    def _outside(
        self,
        trees: list[Tree],
        groups: list[WorkerCgroup],
        found_for: dict[str, set[int]] | None = None,
    ) -> Find:
        """What of these cgroups' trees runs outside them, by the stop's escape search
        (the processes started since the oldest of them), for a pause or an unpause;
        `found_for`: where the pids found are kept, by worker (each search adds to it)."""
        since = min((start for _, _, start in trees), default=0)

        async def find() -> list[ProcStat]:
            marked = await self.markers.marked(since)
            by_worker = outside_by_worker(marked, trees, cgroup_pids(groups))
            if found_for is not None:
                for worker_id, found in by_worker.items():
                    found_for.setdefault(worker_id, set()).update(stat.pid for stat in found)
            return [stat for found in by_worker.values() for stat in found]

        return find

    async def unpause(self, targets: list[tuple[str, WorkerProcess]]) -> None:
        groups = [p.cgroup for _, p in targets if p.cgroup is not None]
        trees = [
            (p.pid, worker_id, p.starttime)
            for worker_id, p in targets
            if p.cgroup is None and not p.reaped
        ]
        if groups:
            await freeze_cgroups(groups, False)
            await continue_found(self._outside(_cgrouped_trees(targets), groups))
        if trees:
            await continue_trees(self.processes, trees)

    async def carry_pauses(
        self, held: list[tuple[str, WorkerProcess]], let_go: list[tuple[str, WorkerProcess]]
    ) -> None:
        # A cgroup is held or let go whole by the kernel; asked again, at once. What of
        # its tree is outside it, or a tree without one, is stopped or continued whole.
        if held:
            await self.pause(held)
        if let_go:
            await self.unpause(let_go)

    def thaw_now(self, process: WorkerProcess) -> None:
        if process.cgroup is not None:
            try:
                write_freeze(process.cgroup, False)
            except OSError as exc:  # cgroup.kill ends it after the grace regardless
                log.error("cgroup.not_thawed", cgroup=str(process.cgroup.path), error=str(exc))

    def paused_now(self, process: WorkerProcess) -> bool:
        if process.cgroup is not None:
            return freeze_asked(process.cgroup)
        return stopped_now(process.pid, process.starttime)

    def term_leader(self, process: WorkerProcess) -> bool:
        # Only where a cgroup finds the tree: a scan of /proc TERMs all it finds at once,
        # the leader among them, and must not send it a second.
        if process.cgroup is None or process.reaped:
            return False
        if self._batch is None:
            self._batch = StopBatch()
        self._batch.join(process.pid, process.starttime)
        self._batch_of[process.pid] = self._batch
        process.signal(signal.SIGTERM)  # by its pid: unreaped, it is no one else's
        return True

    async def end_tree(
        self,
        worker_id: str,
        process: WorkerProcess,
        grace: float,
        *,
        hurried: bool = True,
        leader_termed: bool = False,
        leader_exited: trio.Event | None = None,
    ) -> int:
        graces = self.graces if hurried else None
        # Exited, or about to be ended: from here its pid is no live worker's to skip.
        self.leaders.discard(process.pid)
        if process.cgroup is not None:
            # Unreaped (a live worker is reaped by its supervision only once its tree is
            # ended), its pid is no one else's: signalled by pid, waited for by the event
            # its supervision sets; no descriptor of its own.
            leader = None
            if not process.reaped and leader_exited is not None:
                leader = Leader(process.pid, leader_exited)
            termed: set[int] = set()
            deadline = trio.current_time() + grace
            batch = self._batch_of.pop(process.pid, None)
            if batch is self._batch:
                self._batch = None  # stops asked from now on are another request's
            try:
                killed = await end_cgroup(
                    process.cgroup,
                    grace,
                    graces,
                    leader,
                    leader_termed=leader_termed,
                    termed=termed,
                )
            finally:
                if batch is not None:
                    batch.emptied(process.pid)
            if batch is not None:
                # A stop (its TERM came from `term_leader`), not a worker ending by itself:
                # what moved itself out of the cgroup goes too, within what is left of the
                # grace. Searched once every cgroup of the batch is empty, so nothing of
                # their trees is left to fork a child the search would miss, and one search
                # serves the batch (docs/design.md, "Stopping exactly what you mean").
                found = await batch.searched(self.markers)
                if found is not None and not found.carriers(worker_id, process.starttime):
                    return killed  # nearly every one of a stop_run's: nothing escaped
                left = max(0.0, deadline - trio.current_time())
                killed += await end_escaped(
                    self.markers, worker_id, process.starttime, left, graces, termed
                )
            return killed
        return await end_tree(
            self.processes, process.pid, worker_id, process.starttime, grace, graces
        )

    def _leftover_group(self, worker_id: str) -> WorkerCgroup | None:
        """A dead image's worker's cgroup: its flat one, else the leaf of its v2 limit nodes
        (all of a dead image's leaves listed once, at the first asking: a leftover's leaf
        was there before this image made any)."""
        group = self._group(worker_id)
        if group is None or group.exists() or self.controllers.v2 is None:
            return group
        if self._leftover_leaves is None:
            assert self.cgroups is not None
            self._leftover_leaves = {g.name: g for g in self.cgroups.limited_leaves()}
        leaf = self._leftover_leaves.get(worker_id)
        return leaf if leaf is not None and leaf.exists() else group

    async def end_leftover_tree(
        self, worker_id: str, pid: int | None, pid_start: int | None, grace: float
    ) -> int:
        group = self._leftover_group(worker_id)
        if group is not None and group.exists():
            with contextlib.suppress(OSError):  # a paused one's: its TERM must reach it
                write_freeze(group, False)
            killed = await end_cgroup(group, grace)
            _remove(group)
            return killed
        if pid is None or pid_start is None:
            return await end_marked(self.processes, worker_id, grace)
        return await end_tree(self.processes, pid, worker_id, pid_start, grace)

    def limits_hit(self, process: WorkerProcess) -> LimitsHit | None:
        nodes = process.limit_nodes
        hit = nodes.hit() if nodes is not None else None
        if process.cgroup is not None and process.cgroup.born_into:
            return v2_hit(process.cgroup, hit)
        return hit

    def holds_tree(self, worker_id: str) -> bool:
        group = self._leftover_group(worker_id)
        return group is not None and group.exists()

    def usage(self, workers: Sequence[tuple[str, WorkerProcess]]) -> dict[str, Usage]:
        trees = [
            WorkerTree(
                worker_id,
                process.pid,
                process.starttime,
                None if process.cgroup is None else process.cgroup.path,
                _v1_memory_of(process),
            )
            for worker_id, process in workers
        ]
        return self._usage.read(trees)

    def released(self, process: WorkerProcess) -> None:
        self.leaders.discard(process.pid)
        self._usage.forget(process.pid, process.starttime)
        if (batch := self._batch_of.pop(process.pid, None)) is not None:
            batch.emptied(process.pid)  # ended without its tree's end (never left waiting)
        if process.cgroup is not None:
            # Removed by `remove_released`, many to a thread: an rmdir of a cgroup a
            # process has just left costs ~40-90 us here, 10,000 of them the event loop's
            # most costly step after the TERMs in a stop_run of 10,000.
            self._unremoved.append(process.cgroup)
        if process.limit_nodes is not None:
            self._unremoved_nodes.append(process.limit_nodes)

    async def remove_released(self, wanted: Callable[[str], bool]) -> None:
        """Remove the cgroups released since (`released`), in a thread, but those of
        workers `wanted` again (resumed meanwhile: their new attempt uses it)."""
        groups, self._unremoved = self._unremoved, []
        nodes, self._unremoved_nodes = self._unremoved_nodes, []
        if groups or nodes:
            await trio.to_thread.run_sync(_remove_all, groups, wanted, nodes, self.controllers.v2)

    async def sweep(self, live: Container[str]) -> None:
        if self.cgroups is not None:
            for group in self.cgroups.leftovers():
                if group.name in live:
                    continue
                killed = await end_cgroup(group, 0)
                if killed:
                    log.warning("cgroup.leftover_killed", cgroup=str(group.path), processes=killed)
                _remove(group)
        # Then the limit nodes a dead image left, now empty (a live worker's hold its
        # processes, and stay).
        await trio.to_thread.run_sync(self.controllers.sweep)

    async def sweep_at_shutdown(self, since_of: Callable[[str], int | None]) -> None:
        if self.cgroups is not None:
            groups = self.cgroups.all_below()
            async with trio.open_nursery() as nursery:
                for group in groups:
                    nursery.start_soon(self._sweep_group, group)
            for group in groups:  # deepest first: a cgroup goes once those below it have
                if group.path.parent != self.cgroups.home:
                    _remove(group)
        killed = await end_marked_by(self.markers, since_of, SWEEP_GRACE, self.graces)
        if killed:
            log.warning("shutdown.marked_killed", processes=killed)

    async def _sweep_group(self, group: WorkerCgroup) -> None:
        killed = await end_cgroup(group, SWEEP_GRACE, self.graces)
        if killed:
            log.warning("shutdown.cgroup_killed", cgroup=str(group.path), processes=killed)

    def remove_released_now(self) -> None:
        self.controllers.settle()
        groups, self._unremoved = self._unremoved, []
        for group in groups:
            _remove(group)
            _remove_v2_nodes(group, self.controllers.v2, lambda _: False)
        nodes, self._unremoved_nodes = self._unremoved_nodes, []
        for node in nodes:
            node.remove_unless(lambda _: False)

    def close(self, *, anything_live: bool) -> None:
        self.relays.close()
        self.remove_released_now()  # before their parent
        if self.cgroups is not None and not anything_live:
            self.cgroups.remove()
        if not anything_live:
            self.controllers.close()


def _v1_memory_of(process: WorkerProcess) -> Path | None:
    """The v1 memory node a worker was born in, if any (a memory limit on its way made it):
    its usage's memory is read from there, its delegates' nodes below it included (as its
    limit covers them). None: no such node (it is read from /proc)."""
    nodes = process.limit_nodes
    return nodes.memory_leaf() if nodes is not None else None


def _remove_all(
    groups: list[WorkerCgroup],
    wanted: Callable[[str], bool],
    nodes: list[LimitNodes],
    v2: V2Nodes | None = None,
) -> None:
    """Remove ended workers' cgroups and limit nodes (in a thread), but those `wanted`
    again."""
    for group in groups:
        _remove(group, wanted)
        _remove_v2_nodes(group, v2, wanted)
    for node in nodes:
        node.remove_unless(wanted)


def _remove_v2_nodes(
    group: WorkerCgroup, v2: V2Nodes | None, wanted: Callable[[str], bool]
) -> None:
    """A v2-limited worker's leaf removed: the nodes above it nothing uses any longer."""
    if group.born_into and v2 is not None:
        v2.remove_nodes(group, wanted)


def _remove(group: WorkerCgroup, wanted: Callable[[str], bool] | None = None) -> None:
    """Remove an ended worker's cgroup; one that will not go is left to the next start."""
    try:
        if not (group.remove() if wanted is None else group.remove_unless(wanted)):
            log.warning("cgroup.busy", cgroup=str(group.path))
    except OSError as exc:
        log.warning("cgroup.not_removed", cgroup=str(group.path), error=str(exc))


def _cgrouped_trees(targets: list[tuple[str, WorkerProcess]]) -> list[Tree]:
    """The trees of the targets that have cgroups: leader, worker id, start (what of them
    left their cgroups is found by them)."""
    return [
        (p.pid, worker_id, p.starttime)
        for worker_id, p in targets
        if p.cgroup is not None and not p.reaped
    ]
