"""cgroup v2 limit nodes: the files and values decided without I/O (`_v2_limits.layout`,
called here), and the mechanics they rest on tried for real on this machine's v2
hierarchy, which passes on only `hugetlb`: a node that passes a controller on holds no
process (the no-internal-processes rule), a leaf beside its delegates' nodes does, and a
limit written on the node above holds for the leaf and the delegates together."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from subagentd.daemon.processes._v2_limits import (
    LEAF,
    ControllerMissing,
    NodeStep,
    V2Layout,
    apply_v2,
    layout,
    limit_files,
    needed,
)
from subagentd.protocol import Limits

MIB = 1024 * 1024
ALL = ("memory", "cpu", "pids", "hugetlb")


def test_a_worker_s_limits_go_on_its_node_and_its_processes_in_a_leaf() -> None:
    plan = layout(("r-1", "w-1"), (None, Limits(memory=64 * MIB, pids=20)), ALL)
    assert plan.leaf == ("r-1", "w-1", LEAF)
    assert plan.steps == (
        NodeStep((), ("+memory", "+pids")),
        NodeStep(("r-1",), ("+memory", "+pids")),
        NodeStep(
            ("r-1", "w-1"),
            ("+memory", "+pids"),
            (("memory.max", str(64 * MIB)), ("memory.swap.max", "0"), ("pids.max", "20")),
        ),
        NodeStep(("r-1", "w-1", LEAF)),  # a leaf: passes nothing, holds the processes
    )


def test_a_delegate_nests_below_its_parent_beside_the_parent_s_leaf() -> None:
    path = ("r-1", "w-parent", "w-child")
    plan = layout(path, (Limits(cpus=1.5), Limits(memory=96 * MIB), None), ALL)
    assert plan.leaf == (*path, LEAF)
    by_path = {step.path: step for step in plan.steps}
    # The run's CPU limit and the parent's memory limit both pass down to the child.
    assert by_path[("r-1",)].writes == (("cpu.max", "150000 100000"),)
    assert by_path[("r-1", "w-parent")].passes == ("+memory", "+cpu")
    assert by_path[path].writes == ()  # its own: none; its parent's covers it
    assert by_path[path].passes == ("+memory", "+cpu")
    # Every node but the leaf passes controllers on, so holds no process: the parent's
    # processes are in its own leaf, beside the child's node.
    assert [s.path for s in plan.steps if not s.passes] == [plan.leaf]


def test_only_the_controllers_a_limit_needs_are_passed_on() -> None:
    assert needed([None, Limits(pids=5), None]) == ("pids",)
    assert needed([Limits(cpus=0.5), Limits(memory=MIB)]) == ("memory", "cpu")
    assert needed([None, None]) == ()
    plan = layout(("r-1", "w-1"), (None, None), ())  # nothing asked: nothing needed
    assert all(step.passes == () and step.writes == () for step in plan.steps)


def test_cpu_quota_has_a_floor_and_the_period_beside_it() -> None:
    assert limit_files(Limits(cpus=0.001)) == (("cpu.max", "1000 100000"),)
    assert limit_files(Limits(cpus=64.0)) == (("cpu.max", "6400000 100000"),)
    assert limit_files(None) == ()


@pytest.mark.parametrize(
    ("delegated", "named"),
    [((), "memory and pids controllers are"), (("memory",), "pids controller is")],
)
def test_a_controller_not_delegated_is_refused_naming_it(
    delegated: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ControllerMissing, match=named):
        layout(("r-1", "w-1"), (Limits(memory=MIB), Limits(pids=3)), delegated)


@pytest.mark.parametrize(
    ("path", "values"),
    [((), ()), (("r-1",), ()), (("r-1", "w-1"), (None,)), (("r-1", LEAF), (None, None))],
)
def test_a_plan_that_does_not_pair_or_names_the_leaf_is_refused(
    path: tuple[str, ...], values: tuple[Limits | None, ...]
) -> None:
    with pytest.raises(ValueError, match=r"once, with its limits|a worker's leaf"):
        layout(path, values, ALL)


def test_apply_writes_limits_before_what_a_node_passes_on() -> None:
    done: list[tuple[str, ...]] = []
    plan = layout(("r-1", "w-1"), (Limits(pids=4), None), ALL)
    apply_v2(
        plan,
        make=lambda path: done.append(("mkdir", *path)),
        write=lambda path, name, value: done.append(("write", *path, name, value)),
    )
    assert done == [
        ("mkdir",),
        ("write", "cgroup.subtree_control", "+pids"),
        ("mkdir", "r-1"),
        ("write", "r-1", "pids.max", "4"),
        ("write", "r-1", "cgroup.subtree_control", "+pids"),
        ("mkdir", "r-1", "w-1"),
        ("write", "r-1", "w-1", "cgroup.subtree_control", "+pids"),
        ("mkdir", "r-1", "w-1", LEAF),
    ]


# -- the mechanics, for real, with the one controller this v2 hierarchy passes on -------


def _v2_root() -> Path | None:
    """This process's v2 cgroup, if it may make nodes there that pass hugetlb on (it has
    the controller, and may pass it on: the root cgroup, exempt from the rule, or one
    passing it already)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mount = next(Path(line.split()[4]) for line in f if " - cgroup2 " in line)
        with open("/proc/self/cgroup") as f:
            own = next(line[3:].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    home = mount / own.lstrip("/")
    if "hugetlb" not in (home / "cgroup.controllers").read_text().split():
        return None
    passing = "hugetlb" in (home / "cgroup.subtree_control").read_text().split()
    if not passing and home != mount:
        return None
    return home if os.access(home / "cgroup.subtree_control", os.W_OK) else None


V2_ROOT = _v2_root()
needs_v2_hugetlb = pytest.mark.skipif(
    V2_ROOT is None, reason="no writable v2 cgroup passing hugetlb on to its children"
)


@contextlib.contextmanager
def _base() -> Iterator[Path]:
    assert V2_ROOT is not None
    # Passed on from the root if it is not yet (and left so: others may use it since).
    (V2_ROOT / "cgroup.subtree_control").write_text("+hugetlb")
    base = V2_ROOT / f"subagentd-v2-test-{os.getpid()}"
    base.mkdir()
    try:
        yield base
    finally:
        for parent, dirs, _ in os.walk(base, topdown=False):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(Path(parent) / name)
        with contextlib.suppress(OSError):
            base.rmdir()


def _hugetlb_layout(path: tuple[str, ...], limited: tuple[str, ...]) -> V2Layout:
    """`layout`'s shape with hugetlb standing in for a delegated controller: every node on
    the way passes it on, `limited` carries a hugetlb limit, the leaf passes nothing."""
    steps = [NodeStep((), ("+hugetlb",))]
    for depth in range(1, len(path) + 1):
        writes = (("hugetlb.2MB.max", str(4 * 2 * MIB)),) if path[:depth] == limited else ()
        steps.append(NodeStep(path[:depth], ("+hugetlb",), writes))
    steps.append(NodeStep((*path, LEAF)))
    return V2Layout(tuple(steps), (*path, LEAF))


def _real(base: Path) -> tuple[object, object]:
    def make(path: tuple[str, ...]) -> None:
        with contextlib.suppress(FileExistsError):
            base.joinpath(*path).mkdir()

    def write(path: tuple[str, ...], name: str, value: str) -> None:
        base.joinpath(*path, name).write_text(value)

    return make, write


def _move(node: Path, pid: int) -> None:
    with open(node / "cgroup.procs", "w") as f:
        f.write(str(pid))


@needs_v2_hugetlb
def test_on_real_v2_a_worker_lives_in_its_leaf_and_its_node_above_holds_no_process() -> None:
    with _base() as base:
        parent = _hugetlb_layout(("r-1", "w-parent"), limited=("r-1", "w-parent"))
        child = _hugetlb_layout(("r-1", "w-parent", "w-child"), limited=())
        make, write = _real(base)
        apply_v2(parent, make, write)  # type: ignore[arg-type]
        apply_v2(child, make, write)  # type: ignore[arg-type]
        node = base / "r-1" / "w-parent"
        assert (node / "hugetlb.2MB.max").read_text().strip() == str(8 * MIB)
        # The delegate's node, below the limited one, has the controller's files: the
        # limit above covers it (hierarchical), and its own leaf beside its parent's.
        unlimited = (node / "w-child" / "hugetlb.2MB.max").read_text().strip()
        assert int(unlimited) > 8 * MIB  # none of its own
        assert (node / LEAF).is_dir()
        assert (node / "w-child" / LEAF).is_dir()
        sleeper = subprocess.Popen(["sleep", "30"])
        try:
            # A node passing a controller on refuses a process: no internal processes.
            for interior in (node, node / "w-child", base / "r-1"):
                with pytest.raises(OSError, match="busy") as refused:
                    _move(interior, sleeper.pid)
                assert refused.value.errno == errno.EBUSY, interior
            for leaf in (node / LEAF, node / "w-child" / LEAF):
                _move(leaf, sleeper.pid)
                assert (leaf / "cgroup.procs").read_text().split() == [str(sleeper.pid)]
            # The node above counts what is in the leaves below it.
            assert "populated 1" in (node / "cgroup.events").read_text()
        finally:
            _move(V2_ROOT, sleeper.pid)  # type: ignore[arg-type]
            sleeper.kill()
            sleeper.wait()
