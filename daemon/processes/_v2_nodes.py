"""The cgroup v2 limit nodes made so: the I/O shell of `_v2_limits` (which decides them).

A worker with a limit of a kind enforced by a v2 controller (where its v1 hierarchy is
not writable, and the controller is delegated to the daemon) lives in a leaf of its
node, below the workers' cgroup (`_cgroup`): ``<base>/.limited/<run>/<worker>/.../self``.
The cgroups above `.limited` (the one delegated to the daemon, which then holds only the
daemon's own leaf, `_cgroup.DAEMON_LEAF`, and the workers' cgroup) pass on the
controllers too, once each. The worker is born in its leaf (`_born_into`, clone3 with
CLONE_INTO_CGROUP): no process of the daemon's ever stands in a limited node.

Its leaf is its `WorkerCgroup` (`born_into`): what a stop, a pause and usage read of a
worker's cgroup they read there; the flat cgroups of the other workers are beside
`.limited`, unchanged. A removal takes the leaf, then each node above it nothing uses.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from subagentd.protocol import Limits

from .._logging import get_logger
from ._cgroup import _FORK_LOCK, LEAF, LIMITED, Cgroups, WorkerCgroup
from ._v2_limits import V2_CONTROLLERS, V2Layout, apply_v2, layout

log = get_logger()


class V2NotPlaced(OSError):
    """A worker's v2 nodes could not be made or written; the message says which."""


@dataclass
class V2Nodes:
    """Where v2-limited workers go: `kinds`, the limits enforced here; `delegated`, the
    controllers the daemon's cgroup has (`cgroup.controllers`)."""

    cgroups: Cgroups
    #: The cgroup delegated to the daemon (the workers' cgroup's parent).
    delegated_at: Path
    delegated: frozenset[str]
    kinds: frozenset[str]
    #: Controllers the cgroups above `.limited` pass on already (written once each).
    _passed: set[str] = field(default_factory=set)

    @property
    def base(self) -> Path:
        return self.cgroups.base / LIMITED

    def layout_for(self, path: tuple[str, ...], values: tuple[Limits | None, ...]) -> V2Layout:
        """The nodes of a worker of `path` whose way has `values`, its limits of the kinds
        enforced here only (the others are v1's). ControllerMissing naming one not
        delegated."""
        return layout(path, tuple(_only(v, self.kinds) for v in values), self.delegated)

    def wants(self, values: tuple[Limits | None, ...]) -> bool:
        """Whether a limit of a kind enforced here is on the way."""
        return any(getattr(v, kind) is not None for v in values if v for kind in self.kinds)

    def place(self, plan: V2Layout) -> WorkerCgroup:
        """Make `plan`'s nodes (their files written) and its leaf: the worker's cgroup, for
        `_born_into` to bear it in. V2NotPlaced naming the file that would not take it."""
        with _FORK_LOCK:
            passes = plan.steps[0].passes
            try:
                self._pass_above(passes)
                apply_v2(plan, self._make, self._write)
            except OSError as exc:
                raise V2NotPlaced(
                    exc.errno, f"cannot place the worker's cgroup v2 limits: {exc}"
                ) from exc
        return WorkerCgroup(self.base.joinpath(*plan.leaf), self.cgroups.home, born_into=True)

    def group_at(self, relative: str) -> WorkerCgroup | None:
        """The leaf of a worker placed at `relative` (`LimitPlan.relative`), if it is there
        (an adopted worker's: the kernel kept it across the exec)."""
        if not relative:
            return None
        leaf = self.base / relative / LEAF
        return WorkerCgroup(leaf, self.cgroups.home, born_into=True) if leaf.is_dir() else None

    def remove_nodes(self, group: WorkerCgroup, wanted: Callable[[str], bool]) -> None:
        """Once its leaf has gone: each node above it nothing uses any longer (the run's
        last), unless `wanted(its worker id)` says a new attempt uses them."""
        with _FORK_LOCK:
            if wanted(group.name) or group.path.is_dir():
                return
            node = group.path.parent
            while node != self.base and _rmdir(node):
                node = node.parent

    def sweep(self) -> None:
        """At a clean start: every empty node a dead image left, deepest first."""
        for parent, dirs, _ in os.walk(self.base, topdown=False):
            for name in dirs:
                _rmdir(Path(parent) / name)

    def _pass_above(self, passes: tuple[str, ...]) -> None:
        """The controllers `passes` passed on by the cgroups above `.limited` (the one
        delegated to the daemon, and the workers' cgroup): once each."""
        wanted = [c for c in passes if c.lstrip("+") not in self._passed]
        if not wanted:
            return
        for cgroup in (self.delegated_at, self.cgroups.base):
            _write(cgroup / "cgroup.subtree_control", " ".join(wanted))
        self._passed.update(c.lstrip("+") for c in wanted)

    def _make(self, path: tuple[str, ...]) -> None:
        with contextlib.suppress(FileExistsError):
            self.base.joinpath(*path).mkdir()

    def _write(self, path: tuple[str, ...], name: str, value: str) -> None:
        _write(self.base.joinpath(*path) / name, value)


def _only(limits: Limits | None, kinds: frozenset[str]) -> Limits | None:
    """`limits` of `kinds` only; None if none of those is set."""
    if limits is None:
        return None
    kept = {kind: getattr(limits, kind) for kind in V2_CONTROLLERS if kind in kinds}
    return Limits(**kept) if any(v is not None for v in kept.values()) else None


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise OSError(exc.errno, f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _rmdir(node: Path) -> bool:
    try:
        os.rmdir(node)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            log.warning("limits.v2_not_removed", node=str(node), error=str(exc))
        return False
    return True
