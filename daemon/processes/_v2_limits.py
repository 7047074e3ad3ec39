"""What limit nodes a worker needs under cgroup v2, and what each node's files must say:
decided here, without I/O, from the worker's `LimitPlan` and the controllers delegated to
the daemon; `apply_v2` is the I/O that makes it so, step by step.

v2 has one hierarchy, and its no-internal-processes rule: a cgroup that passes a
controller on to its children (`cgroup.subtree_control`) may hold no process itself. So a
worker's limit covers its subtree only if its processes are not in the node that carries
the limit: each node on the way (the runs', the delegation chain's) carries the limits
and passes the controllers on, and the worker's processes live in a leaf of its own node,
``<run>/<root worker>/.../<worker>/self``; its delegates' nodes sit beside that leaf:

    <base>                     subtree_control: +memory +pids   (the base, too)
      <run>                    memory.max (the run's)           +memory +pids
        <worker>               memory.max, pids.max (its own)   +memory +pids
          self                 the worker's processes           (a leaf: nothing passed)
          <delegate>           its limits, if any               +memory +pids
            self               the delegate's processes

The base itself is a child of the cgroup the daemon was delegated; that cgroup, passing
controllers to the base, may hold no process either: the daemon lives in a leaf of its own
there (systemd's `DelegateSubgroup=`, docs/design.md, Limits). Only the controllers some
limit on the way needs are passed on (each one a node passes costs the kernel's
accounting of it). A controller that is not delegated to the daemon is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from subagentd.protocol import Limits

#: The v2 controller each kind of limit needs.
V2_CONTROLLERS = {"memory": "memory", "cpus": "cpu", "pids": "pids"}
#: The CFS period a CPU limit's quota is a share of, in microseconds (v2's default).
CPU_PERIOD_US = 100_000
#: The leaf a worker's own processes live in, in its node.
LEAF = "self"


class ControllerMissing(Exception):
    """A limit needs a v2 controller the daemon was not delegated; the message says which."""


@dataclass(frozen=True)
class NodeStep:
    """One node on a worker's way, root first: its path below the base (empty: the base
    itself), the controllers it passes on to its children, and the files it must say."""

    path: tuple[str, ...]
    passes: tuple[str, ...] = ()
    writes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class V2Layout:
    """Every node a worker needs, root first (the base, each node of its plan, its leaf),
    and the leaf its processes go in."""

    steps: tuple[NodeStep, ...]
    leaf: tuple[str, ...]


def limit_files(limits: Limits | None) -> tuple[tuple[str, str], ...]:
    """The v2 files a node's own limits are written to, and their values: `memory.max`
    with `memory.swap.max` 0 (memory and swap together at most the limit, as v1's memsw;
    a worker past its limit must not go on in swap), `cpu.max` as quota and period, and
    `pids.max` (v2 moves whole processes, so no thread of the daemon's stands there to be
    counted: the value as asked)."""
    if limits is None:
        return ()
    writes: list[tuple[str, str]] = []
    if limits.memory is not None:
        writes += [("memory.max", str(limits.memory)), ("memory.swap.max", "0")]
    if limits.cpus is not None:
        quota = max(1000, round(limits.cpus * CPU_PERIOD_US))
        writes.append(("cpu.max", f"{quota} {CPU_PERIOD_US}"))
    if limits.pids is not None:
        writes.append(("pids.max", str(limits.pids)))
    return tuple(writes)


def needed(values: Iterable[Limits | None]) -> tuple[str, ...]:
    """The v2 controllers the limits on a worker's way need, in a fixed order."""
    kinds = {kind for v in values if v for kind in V2_CONTROLLERS if getattr(v, kind) is not None}
    return tuple(V2_CONTROLLERS[kind] for kind in V2_CONTROLLERS if kind in kinds)


def layout(
    path: tuple[str, ...], values: tuple[Limits | None, ...], delegated: Iterable[str]
) -> V2Layout:
    """The nodes a worker of `path` (runs, then its delegation chain, itself last) with the
    limits `values` (one a node) needs, given the controllers `delegated` to the daemon
    (its cgroup's `cgroup.controllers`). Raises ControllerMissing naming one a limit needs
    that is not delegated; ValueError for a path and values that do not pair."""
    if len(path) != len(values) or not path:
        raise ValueError("a limit plan names each node on its way once, with its limits")
    if LEAF in path:
        raise ValueError(f"no run or worker is named {LEAF!r}: that is a worker's leaf")
    controllers = needed(values)
    missing = [c for c in controllers if c not in set(delegated)]
    if missing:
        said = "controllers are" if len(missing) > 1 else "controller is"
        raise ControllerMissing(
            f"the cgroup v2 {' and '.join(missing)} {said} not delegated to the daemon"
        )
    passes = tuple(f"+{c}" for c in controllers)
    steps = [NodeStep((), passes)]
    for depth, limits in enumerate(values, start=1):
        steps.append(NodeStep(path[:depth], passes, limit_files(limits)))
    leaf = (*path, LEAF)
    steps.append(NodeStep(leaf))
    return V2Layout(tuple(steps), leaf)


def apply_v2(
    plan: V2Layout,
    make: Callable[[tuple[str, ...]], None],
    write: Callable[[tuple[str, ...], str, str], None],
) -> None:
    """Make each node of `plan` (`make`: an existing one is left as it is) and write its
    files (`write(path, file, value)`): its limits first, then what it passes on, since a
    node's children are made after it (a child's interface files exist only once its
    parent passes the controller on). The I/O is the caller's: on a real hierarchy,
    `mkdir` and a write of each file."""
    for step in plan.steps:
        make(step.path)
        for name, value in step.writes:
            write(step.path, name, value)
        if step.passes:
            write(step.path, "cgroup.subtree_control", " ".join(step.passes))
