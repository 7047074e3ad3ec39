"""Where this daemon can have the kernel enforce a worker's limits (memory, CPU, processes),
and the limit nodes it makes there.

Found once, at start (`Controllers.find`), kind by kind:

- cgroup v1, as on a host whose `memory`, `cpu` and `pids` hierarchies are mounted v1 and
  writable (root): limit nodes under the daemon's own cgroup in each hierarchy,
  ``<its cgroup>/subagentd-<digest>/<run>/<worker>/<delegated worker>/...``: a node per
  run, then a node per worker nested along its delegation chain. The kernel's limits are
  hierarchical, so a worker's limit covers it and all it delegated, and a run's covers
  the run. v1 has no no-internal-processes rule: each worker's processes sit in its own
  node, its delegated workers' in nodes below it.
- else the cgroup v2 controller, where it is delegated to the daemon and the clone3
  helper is built (`_born_into`): the nodes `_v2_limits` decides, made by `_v2_nodes`, the
  worker born in its leaf there (`Controllers.v2_group`). Else refused, naming why.

A worker whose run, ancestors and self have no limit is placed in no node at all: the
common case costs nothing. A limited one is born in its nodes (`LimitNodes.born_in`): the
daemon's forking thread steps into them for the fork, as it steps into the worker's v2
cgroup, under the same lock. A node goes once its worker has ended (`remove_unless`, in a
thread); a clean start sweeps what a dead daemon left (`Controllers.sweep`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from subagentd.protocol import LIMIT_KINDS, Control, Limits
from subagentd.protocol.errors import Refused

from .._logging import get_logger
from . import _born_into
from ._cgroup import _FORK_LOCK, Cgroups, WorkerCgroup
from ._forker import FORKER
from ._v2_limits import limit_files
from ._v2_nodes import V2Nodes

log = get_logger()

#: The v1 hierarchy (its controller's name) each kind of limit is enforced in.
V1_HIERARCHIES = {"memory": "memory", "cpus": "cpu", "pids": "pids"}
#: How a spare node's name begins (no run's or worker's id begins so).
SPARE_PREFIX = ".spare-"
#: At most this many nodes are kept a spare each (the parents of recent limited spawns).
SPARE_PARENTS = 64
#: Held while the spares are taken, made or removed (by the forker, and by a removal's
#: thread, which holds the fork lock first).
_POOL_LOCK = threading.Lock()
#: The CFS period a CPU limit's quota is a share of (the kernel's default, 100 ms).
CPU_PERIOD_US = 100_000


class LimitsNotPlaced(OSError):
    """A worker's limit nodes could not be made or entered; the message says which."""


@dataclass
class Hierarchy:
    """One writable v1 hierarchy: `base`, this daemon's limit nodes; `home`, the daemon's
    own cgroup there (its forking thread goes back to it)."""

    kind: str
    base: Path
    home: Path
    #: `base` made (at the first limited spawn); removed again only at `close`.
    made: bool = False
    #: Spare nodes made ahead, by the node they were made in (`take_spare`): a mkdir costs
    #: 20-140 us here (a memory node the most), a rename of a spare a fifth of that.
    spares: dict[Path, list[Path]] = field(default_factory=dict)
    #: Whether its nodes have memory.memsw.limit_in_bytes (the kernel accounts swap): looked
    #: for at the first memory limit written.
    memsw: bool | None = None

    def take_spare(self, parent: Path) -> Path | None:
        """A spare node made in `parent`, taken out of the pool; None if there is none."""
        with _POOL_LOCK:
            found = self.spares.get(parent)
            return found.pop() if found else None

    def replenish(self, parent: Path) -> None:
        """Make `parent` a spare node if it has none (in the forker, after a spawn into it):
        empty, with the kernel's default limits, so a worker given it writes its own."""
        with _POOL_LOCK:
            found = self.spares.get(parent)
            if found or (found is None and len(self.spares) >= SPARE_PARENTS):
                return
            spare = parent / f"{SPARE_PREFIX}{os.urandom(4).hex()}"
            try:
                spare.mkdir()
            except OSError:  # its parent gone meanwhile (its worker ended), or a name taken
                return
            self.spares.setdefault(parent, []).append(spare)

    def remove_spares_of(self, node: Path) -> bool:
        """Remove `node`'s spares if they are all the nodes below it, then `node`; whether it
        went. (A node's link count is two and the number of nodes below it.)"""
        with _POOL_LOCK:
            found = self.spares.get(node)
            if not found:
                return False
            try:
                if os.stat(node).st_nlink - 2 > len(found):
                    return False  # a worker's node below it too
            except FileNotFoundError:
                del self.spares[node]
                return True
            for spare in found:
                _rmdir(spare)
            del self.spares[node]
        return _rmdir(node)

    def remove_all_spares(self) -> None:
        with _POOL_LOCK:
            for found in self.spares.values():
                for spare in found:
                    _rmdir(spare)
            self.spares.clear()


@dataclass(frozen=True)
class LimitPlan:
    """Where a worker goes and what each node on its way says: `path`, the run's node then
    the worker ids of its delegation chain, root first, itself last; `values`, the limits
    of each (the run's, each ancestor's, its own; an empty Limits: none of that node's
    own; None: not known, its record gone)."""

    path: tuple[str, ...]
    values: tuple[Limits | None, ...]
    #: Below a parent placed in nodes (whose own ancestors' records may be gone): placed
    #: even where no value on its way is known here.
    nested: bool = False
    #: For the tests (SUBAGENTD_FAULT `hold-in-nodes`): a FIFO the forking thread waits on,
    #: standing in the nodes, before the fork (until a writer has opened and closed it).
    hold: Path | None = None

    @property
    def relative(self) -> str:
        """Its leaf's path below each hierarchy's base, as a worker's record keeps it."""
        return "/".join(self.path)


@dataclass(frozen=True)
class LimitsHit:
    """What a worker's limits did to it, read from its nodes once its tree has ended."""

    #: Processes of it the kernel OOM-killed at a memory limit (`memory.oom_control`).
    oom_kills: int = 0
    #: The most memory its node (it and what it delegated) held, in bytes; None: unknown.
    peak: int | None = None
    #: Forks refused at a process limit (`pids.events` max).
    forks_refused: int = 0


def v2_hit(leaf: WorkerCgroup, v1: LimitsHit | None = None) -> LimitsHit:
    """What its v2 limits did to a worker born in `leaf` (its tree ended, its leaf not yet
    removed), with what its v1 ones did (`v1`): its processes' OOM kills (the leaf's
    `memory.events` oom_kill), the peak of its node (it and its delegates: `memory.peak`)
    and forks refused (the leaf's `pids.events` max). A file the host lacks counts none."""
    found = v1 or LimitsHit()
    oom_kills, peak, refused = found.oom_kills, found.peak, found.forks_refused
    node = leaf.path.parent
    with contextlib.suppress(OSError, ValueError):
        oom_kills += _field(leaf.path / "memory.events", "oom_kill")
    with contextlib.suppress(OSError, ValueError):
        peak = int(_read(node / "memory.peak"))
    with contextlib.suppress(OSError, ValueError):
        refused += _field(leaf.path / "pids.events", "max")
    return LimitsHit(oom_kills=oom_kills, peak=peak, forks_refused=refused)


@dataclass(frozen=True)
class LimitNodes:
    """One worker's limit nodes, in each hierarchy that enforces a kind of limit."""

    hierarchies: tuple[Hierarchy, ...]
    relative: str
    plan: LimitPlan | None = None
    _leaves: dict[str, Path] = field(default_factory=dict, compare=False)

    def leaf(self, hierarchy: Hierarchy) -> Path:
        return hierarchy.base / self.relative

    def memory_leaf(self) -> Path | None:
        """Its node in the v1 memory hierarchy; None if it was placed in none (no memory
        limit on its way). An adopted worker's nodes name every hierarchy: one it was not
        placed in has no node there, and its usage reads as from /proc."""
        for hierarchy in self.hierarchies:
            if hierarchy.kind == "memory":
                return self.leaf(hierarchy)
        return None

    def enter(self) -> Callable[[], None]:
        """Make the nodes (their limits written) and step the calling thread into them:
        what it forks then is born in them. Called in the forker (`_forker`), under the
        fork lock, as a v2 cgroup's `born_in` is. Returns what takes the thread back out,
        for the forker to call once the child has forked (its caller has gone on).

        The thread alone, by its id in each node's `tasks` (v1 moves a thread on its own):
        the daemon's other threads would count against the nodes' process limits. A
        process limit on the way counts that thread too while it stands there, so each is
        written one higher, and lowered again before the thread leaves (the tree never
        has one more than its limit; for those microseconds it may have one fewer).
        Raises LimitsNotPlaced (the thread back home) naming the node that would not.
        """
        assert self.plan is not None, "born in the nodes of a plan"
        tid = str(threading.get_native_id()).encode()
        raised: list[tuple[Path, int]] = []
        moved: list[Hierarchy] = []
        try:
            for hierarchy in self.hierarchies:
                raised += _make(hierarchy, self.plan)
            for hierarchy in self.hierarchies:
                _write(self.leaf(hierarchy) / "tasks", tid)
                moved.append(hierarchy)
            if self.plan.hold is not None:
                self.plan.hold.read_bytes()
        except OSError as exc:
            self._leave(tid, raised, moved)
            raise LimitsNotPlaced(
                exc.errno,
                f"its limits could not be set under {self.hierarchies[0].base.parent}: "
                f"{exc.strerror or exc} ({exc.filename})",
            ) from exc
        return functools.partial(self._leave, tid, raised, moved, replenish=True)

    def _leave(
        self,
        tid: bytes,
        raised: list[tuple[Path, int]],
        moved: list[Hierarchy],
        *,
        replenish: bool = False,
    ) -> None:
        """The thread's way out of the nodes: the process limits lowered to what was asked
        first, then home; then a spare node made where this worker's came from (and one in
        the base, for a new run's), ready for the next spawn there."""
        for node, value in raised:
            _lower_pids(node, value)
        for hierarchy in moved:
            try:
                _write(hierarchy.home / "tasks", tid)
            except OSError as exc:
                log.critical("limits.cannot_return", node=str(self.leaf(hierarchy)), error=str(exc))
        if replenish:
            for hierarchy in self.hierarchies:
                hierarchy.replenish(self.leaf(hierarchy).parent)
                hierarchy.replenish(hierarchy.base)

    def hit(self) -> LimitsHit:
        """What its limits did (its tree has ended; its nodes not yet removed)."""
        oom_kills, peak, refused = 0, None, 0
        for hierarchy in self.hierarchies:
            leaf = self.leaf(hierarchy)
            with contextlib.suppress(OSError, ValueError):
                if hierarchy.kind == "memory":
                    oom_kills = _field(leaf / "memory.oom_control", "oom_kill")
                    peak = int(_read(leaf / "memory.max_usage_in_bytes"))
                elif hierarchy.kind == "pids":
                    refused = _field(leaf / "pids.events", "max")
        return LimitsHit(oom_kills=oom_kills, peak=peak, forks_refused=refused)

    def remove_unless(self, wanted: Callable[[str], bool]) -> None:
        """Remove the worker's nodes, then each above it (the run's last) that nothing uses
        any longer, unless `wanted(its worker id)` says a new attempt uses them: for a
        thread, under the fork lock, as `WorkerCgroup.remove_unless` is."""
        worker_id = self.relative.rsplit("/", 1)[-1]
        with _FORK_LOCK:
            if wanted(worker_id):
                return
            for hierarchy in self.hierarchies:
                node = self.leaf(hierarchy)
                while node != hierarchy.base and (_rmdir(node) or hierarchy.remove_spares_of(node)):
                    hierarchy.spares.pop(node, None)
                    node = node.parent


class Controllers:
    """What this daemon can enforce, and where: `controls`, for `info`, by kind."""

    def __init__(
        self,
        hierarchies: dict[str, Hierarchy],
        controls: dict[str, Control],
        v2: V2Nodes | None = None,
    ) -> None:
        self.hierarchies = hierarchies
        self.controls = controls
        #: The kinds enforced by a cgroup v2 controller, and where; None: none is.
        self.v2 = v2

    @classmethod
    def off(cls, why: str) -> Controllers:
        return cls({}, {kind: Control(enforced=False, how=why) for kind in LIMIT_KINDS})

    @classmethod
    def find(
        cls,
        state_dir: Path,
        *,
        v1_root: Path | None = None,
        cgroups: Cgroups | None = None,
    ) -> Controllers:
        """Each kind's v1 hierarchy where the daemon may write it (its base made at the first
        limited spawn); else its v2 controller, where it is delegated to the daemon (whose
        workers' cgroups are `cgroups`) and the clone3 helper is built; else why not.
        `v1_root`: where the v1 hierarchies are looked for (each a directory named after
        its controller) in place of the mounts /proc/self/mountinfo lists."""
        digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        own = _own_v1_cgroups()
        v2 = _v2_delegated(cgroups)
        hierarchies: dict[str, Hierarchy] = {}
        controls: dict[str, Control] = {}
        v2_kinds: set[str] = set()
        for kind, name in V1_HIERARCHIES.items():
            mount = _v1_mount(name) if v1_root is None else _v1_under(v1_root, name)
            if mount is None:
                where = "is not mounted" if v1_root is None else f"is not under {v1_root}"
                why = _not_v1(name, where, v2)
            else:
                home = mount / own.get(name, "/").lstrip("/")
                # Made at the first limited spawn, not here: a daemon no one asks for a
                # limit leaves no trace in the hierarchies.
                base = home / f"subagentd-{digest}"
                if os.access(home, os.W_OK) and os.access(home / "tasks", os.W_OK):
                    hierarchies[kind] = Hierarchy(kind=kind, base=base, home=home)
                    controls[kind] = Control(enforced=True, how=_v1_how(kind, base))
                    continue
                why = _not_v1(name, f"{home} is not writable by the daemon", v2)
            if cgroups is not None and v2 is not None and _v2_usable(name, v2):
                v2_kinds.add(kind)
                controls[kind] = Control(enforced=True, how=_v2_how(kind, cgroups))
            else:
                controls[kind] = Control(enforced=False, how=why)
        nodes = None
        if v2_kinds and cgroups is not None and v2 is not None:
            nodes = V2Nodes(cgroups, v2[0], v2[1], frozenset(v2_kinds))
        return cls(hierarchies, controls, nodes)

    def refuse_unenforced(self, limits: Limits | None, asking: str) -> None:
        """Refused naming why, for a request (`asking`) with a limit this daemon cannot
        enforce: a limit the kernel does not hold is no limit."""
        if not limits:
            return
        for kind in LIMIT_KINDS:
            control = self.controls.get(kind)
            if getattr(limits, kind) is not None and (control is None or not control.enforced):
                why = control.how if control is not None else "not known to this daemon"
                raise Refused(
                    f"{asking} asks for a {kind} limit, which this daemon cannot enforce: "
                    f"{why}. Ask without it (subagentctl info lists what is enforced)"
                )

    def nodes(self, plan: LimitPlan | None) -> LimitNodes | None:
        """The nodes a worker of `plan` is born in; None when nothing on its way has a
        limit (it is placed in no node)."""
        if plan is None or not self.hierarchies or not (plan.nested or any(plan.values)):
            return None
        # Only the hierarchies of the kinds limited on its way (each costs a node and two
        # moves a spawn); all where an ancestor's record, so its limits, is not known
        # (None; one known to have none is an empty Limits).
        unknown = plan.nested and None in plan.values[1:-1]
        used = tuple(
            hierarchy
            for kind, hierarchy in self.hierarchies.items()
            if unknown or any(getattr(v, kind) is not None for v in plan.values if v)
        )
        return LimitNodes(used or tuple(self.hierarchies.values()), plan.relative, plan)

    def places(self, plan: LimitPlan) -> bool:
        """Whether a worker of `plan` is placed in limit nodes (v1 or v2): its record keeps
        the path then."""
        return self.nodes(plan) is not None or self._v2_wanted(plan)

    def v2_group(self, plan: LimitPlan | None) -> WorkerCgroup | None:
        """The leaf of its v2 limit nodes a worker of `plan` is born in (made, its limits
        written: `V2NotPlaced` if not); None when no limit enforced by v2 is on its way.
        A delegate of a worker placed there is placed below it, whatever it asks: its
        parent's limits cover it only there."""
        if plan is None or self.v2 is None or not self._v2_wanted(plan):
            return None
        return self.v2.place(self.v2.layout_for(plan.path, plan.values))

    def _v2_wanted(self, plan: LimitPlan) -> bool:
        if self.v2 is None:
            return False
        if self.v2.wants(plan.values):
            return True
        return plan.nested and self.v2.base.joinpath(*plan.path[:-1]).is_dir()

    def nodes_at(self, relative: str) -> LimitNodes | None:
        """The nodes a worker was placed in (`LimitPlan.relative`, as its record keeps it),
        for an image that did not start it: what its ending reads and removes (in every
        hierarchy: one it was not placed in has no such node, read as nothing)."""
        if not relative or not self.hierarchies:
            return None
        return LimitNodes(tuple(self.hierarchies.values()), relative)

    def settle(self) -> None:
        """The image is about to end (an exec, a stop): the forker's last job finished (its
        thread home, its process limits lowered), and the spare nodes removed (the next
        image does not know them; a spare it finds is swept at a clean start)."""
        FORKER.settle()
        for hierarchy in self.hierarchies.values():
            hierarchy.remove_all_spares()

    def close(self) -> None:
        """The daemon stops with nothing live: its bases go, if empty."""
        self.settle()
        for hierarchy in self.hierarchies.values():
            _rmdir(hierarchy.base)
            hierarchy.made = False
        if self.v2 is not None:
            _rmdir(self.v2.base)

    def sweep(self) -> None:
        """At a clean start: remove every empty node a dead image left, deepest first (one
        still holding a process, a live worker's, stays)."""
        if self.v2 is not None:
            self.v2.sweep()
        for hierarchy in self.hierarchies.values():
            if not hierarchy.base.is_dir():
                continue
            for parent, dirs, _ in os.walk(hierarchy.base, topdown=False):
                for name in dirs:
                    _rmdir(Path(parent) / name)
            hierarchy.spares.clear()
            # The base too, if nothing is left in it (a daemon killed with nothing live left
            # it empty): made again at the next limited spawn.
            if _rmdir(hierarchy.base):
                hierarchy.made = False


def _make(hierarchy: Hierarchy, plan: LimitPlan) -> list[tuple[Path, int]]:
    """Make the nodes of `plan` in `hierarchy` (those there already are reused; a missing
    one is a spare renamed where there is one), writing each one's limit of this
    hierarchy's kind; the nodes whose process limit was raised by one for the thread that
    steps in (`_lower_pids` takes it back)."""
    raised: list[tuple[Path, int]] = []
    node = hierarchy.base
    if not hierarchy.made:
        with contextlib.suppress(FileExistsError):
            node.mkdir()
        hierarchy.made = True
    for name, limits in zip(plan.path, plan.values, strict=True):
        parent, node = node, node / name
        if not os.path.isdir(node):
            _place(hierarchy, parent, node)
        value = getattr(limits, hierarchy.kind) if limits else None
        if value is None:
            continue
        if hierarchy.kind == "memory":
            _write_memory(hierarchy, node, value)
        elif hierarchy.kind == "cpus":
            # Over the period a node is made with (the kernel's default, never changed
            # here): one write, not two, on a limited spawn's path.
            quota = max(1000, round(value * CPU_PERIOD_US))
            _write(node / "cpu.cfs_quota_us", str(quota).encode())
        else:
            _write(node / "pids.max", str(value + 1).encode())
            raised.append((node, value))
    return raised


def _place(hierarchy: Hierarchy, parent: Path, node: Path) -> None:
    """Make `node`: a spare of its parent's renamed (v1 renames a node within its parent),
    else a new one. A spare is empty and has the kernel's default limits (no process ever
    enters one, and a limit it needs is written next)."""
    spare = hierarchy.take_spare(parent)
    if spare is not None:
        try:
            os.rename(spare, node)
            return
        except FileExistsError:  # made meanwhile (by no one but this daemon): the spare stays
            with _POOL_LOCK:
                hierarchy.spares.setdefault(parent, []).append(spare)
            return
        except OSError as exc:  # swept, or removed by hand: made anew
            log.warning("limits.spare_lost", node=str(spare), error=str(exc))
    with contextlib.suppress(FileExistsError):
        node.mkdir()


def _write_memory(hierarchy: Hierarchy, node: Path, value: int) -> None:
    """memory.limit_in_bytes, and memory.memsw.limit_in_bytes (memory and swap together)
    where the kernel accounts swap: else a worker past its limit would go on in swap.
    memsw may never be below the memory limit, so the order depends on which way it goes."""
    text = str(value).encode()
    memsw = node / "memory.memsw.limit_in_bytes"
    if hierarchy.memsw is None:
        hierarchy.memsw = memsw.exists()
    try:
        _write(node / "memory.limit_in_bytes", text)
        if hierarchy.memsw:
            _write(memsw, text)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not hierarchy.memsw:
            raise
        _write(memsw, text)  # raised above an earlier memsw: that one first
        _write(node / "memory.limit_in_bytes", text)


def _lower_pids(node: Path, value: int) -> None:
    """Take back the one `_make` added to a node's process limit: `value` again."""
    try:
        _write(node / "pids.max", str(value).encode())
    except OSError as exc:
        log.error("limits.pids_not_lowered", node=str(node), error=str(exc))


def _rmdir(node: Path) -> bool:
    """Remove a node; False if it is in use (a process in it, or a node below)."""
    try:
        os.rmdir(node)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
            return False
        log.warning("limits.not_removed", node=str(node), error=str(exc))
        return False
    return True


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read().decode().strip()


def _field(path: Path, name: str) -> int:
    """A counter of a "name value" file (memory.oom_control, pids.events); 0 if absent."""
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _own_v1_cgroups() -> dict[str, str]:
    """This process's cgroup in each v1 hierarchy, by controller name."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(","):
                    if name:
                        found[name] = path
    except (OSError, ValueError):
        pass
    return found


def _v1_mount(name: str) -> Path | None:
    """Where the v1 hierarchy of controller `name` is mounted; None if it is not."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                separator = fields.index("-")
                if fields[separator + 1] == "cgroup" and name in fields[-1].split(","):
                    return Path(fields[4])
    except (OSError, ValueError):
        return None
    return None


def _v2_delegated(cgroups: Cgroups | None = None) -> tuple[Path, frozenset[str]] | None:
    """The cgroup v2 delegated to the daemon (its workers' cgroup's parent; else its own)
    and the controllers it has (`cgroup.controllers`: those it may pass on to its
    children, the daemon living in a leaf of its own there); None without v2."""
    try:
        if cgroups is not None:
            home = cgroups.base.parent
        else:
            with open("/proc/self/mountinfo") as f:
                mount = next(Path(line.split()[4]) for line in f if " - cgroup2 " in line)
            with open("/proc/self/cgroup") as f:
                own = next(line[3:].strip() for line in f if line.startswith("0::"))
            home = mount / own.lstrip("/")
        return home, frozenset(_read(home / "cgroup.controllers").split())
    except (OSError, StopIteration, ValueError):
        return None


def _v2_usable(name: str, v2: tuple[Path, frozenset[str]]) -> bool:
    """Whether the v2 controller `name` is delegated and workers can be born below it."""
    return name in v2[1] and _born_into.available


def _v1_under(root: Path, name: str) -> Path | None:
    """The v1 hierarchy of controller `name` under `root` (a directory of that name, or a
    link to its mount); None if there is none."""
    mount = root / name
    return mount if (mount / "tasks").exists() else None


def _v2_how(kind: str, cgroups: Cgroups) -> str:
    files = " and ".join(name for name, _ in limit_files(_EXAMPLE[kind]))
    return (
        f"cgroup v2 {files} of nodes under {cgroups.base}/.limited (a run's, then each "
        "worker's, nested; a worker's processes in a leaf of its node, born there by "
        "clone3)"
    )


#: One limit of each kind, for the files it is written to (`_v2_how`).
_EXAMPLE = {"memory": Limits(memory=1 << 30), "cpus": Limits(cpus=1.0), "pids": Limits(pids=1)}


def _not_v1(name: str, why: str, v2: tuple[Path, frozenset[str]] | None) -> str:
    """Why a kind is not enforced: its v1 hierarchy's reason, and what v2 has for it."""
    if v2 is None:
        there = "and there is no cgroup v2 hierarchy"
    elif name in v2[1]:
        there = (
            f"and the cgroup v2 {name} controller, delegated to the daemon ({v2[0]}), "
            f"cannot be used: {_born_into.WHY_NOT} (docs/design.md, Limits)"
        )
    else:
        has = ", ".join(sorted(v2[1])) or "none"
        there = (
            f"and the cgroup v2 {name} controller is not delegated to the daemon ({v2[0]} "
            f"has: {has}; a systemd user service with Delegate=yes gets what the user's "
            "manager has, README, Limits)"
        )
    return f"the cgroup v1 {name} hierarchy {why}, {there}"


def _v1_how(kind: str, base: Path) -> str:
    what = {
        "memory": "memory.limit_in_bytes and memory.memsw.limit_in_bytes",
        "cpus": f"cpu.cfs_quota_us over cpu.cfs_period_us ({CPU_PERIOD_US} us)",
        "pids": "pids.max",
    }[kind]
    return f"cgroup v1 {what} of nodes under {base} (a run's, then each worker's, nested)"
