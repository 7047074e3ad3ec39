"""cgroup v2 limits applied: a worker born straight into its leaf by clone3
(CLONE_INTO_CGROUP, `_born_into`), the nodes above it made and written by the I/O shell
(`_v2_nodes.V2Nodes.place`), and the daemon living in a leaf of the cgroup delegated to
it (`_cgroup.DAEMON_LEAF`), all for real on this machine's v2 hierarchy, which passes on
`hugetlb` only: hugetlb stands in for the memory, cpu and pids controllers a systemd user
service would be delegated (their layout is `_v2_limits`', tested in test_v2_limits.py).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.processes import _born_into
from subagentd.daemon.processes._cgroup import DAEMON_LEAF, LEAF, LIMITED, Cgroups, WorkerCgroup
from subagentd.daemon.processes._freezer import wait_settled, write_freeze
from subagentd.daemon.processes._usage import cgroup_cpu_seconds
from subagentd.daemon.processes._v2_limits import NodeStep, V2Layout
from subagentd.daemon.processes._v2_nodes import V2Nodes, V2NotPlaced
from subagentd.protocol import Limits
from subagentd.protocol.errors import Refused

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .test_resource_limits import FORK_LOOP, _node
from .test_v2_limits import V2_ROOT, needs_v2_hugetlb

MIB = 1024 * 1024
HUGE_2MB = 2 * MIB

needs_clone3 = pytest.mark.skipif(not _born_into.available, reason=_born_into.WHY_NOT)


def test_the_clone3_helper_is_built_at_install() -> None:
    """`make .venv/.installed-stamp` builds it (pyproject's ext-modules): where a compiler
    and the Python headers are, as on this machine and CI, it is there."""
    assert _born_into.available, _born_into.WHY_NOT


@contextlib.contextmanager
def _workers_cgroup() -> Iterator[V2Nodes]:
    """A workers' cgroup of its own below this process's v2 cgroup (the root here), and
    the v2 nodes below it, hugetlb delegated; removed with all below it afterwards."""
    assert V2_ROOT is not None
    base = V2_ROOT / f"subagentd-v2-birth-{os.getpid()}-{next(_MADE)}"
    base.mkdir()
    cgroups = Cgroups(base, home=V2_ROOT, listed_as=str(base.relative_to(V2_ROOT.parent)))
    nodes = V2Nodes(cgroups, V2_ROOT, frozenset({"hugetlb"}), kinds=frozenset())
    try:
        yield nodes
    finally:
        _emptied(base)
        for parent, dirs, _ in os.walk(base, topdown=False):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(Path(parent) / name)
        with contextlib.suppress(OSError):
            base.rmdir()


_MADE = itertools.count()


def _emptied(cgroup: Path, within: float = 10.0) -> None:
    """Kill all in `cgroup` and below, and wait (bounded) until none is left in it."""
    with contextlib.suppress(OSError):
        (cgroup / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + within
    with contextlib.suppress(FileNotFoundError):
        while "populated 1" in (cgroup / "cgroup.events").read_text():
            assert time.monotonic() < deadline, f"{cgroup} not emptied within {within}s"
            time.sleep(0.01)


def _hugetlb(path: tuple[str, ...], limited: tuple[str, ...] = (), pages: int = 4) -> V2Layout:
    """`layout`'s shape with hugetlb standing in for the controllers a limit needs."""
    steps = [NodeStep((), ("+hugetlb",))]
    for depth in range(1, len(path) + 1):
        limit = (("hugetlb.2MB.max", str(pages * HUGE_2MB)),) if path[:depth] == limited else ()
        steps.append(NodeStep(path[:depth], ("+hugetlb",), limit))
    steps.append(NodeStep((*path, LEAF)))
    return V2Layout(tuple(steps), (*path, LEAF))


def _born(leaf: Path, script: str, cwd: Path) -> tuple[int, int]:
    """`script` started by sh born into `leaf`: its pid, and the read end of its stdout."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    fds = [os.dup(stdin), os.dup(out_w), os.dup(out_w)]
    try:
        pid = _born_into.spawn_into(
            leaf,
            ["sh", "-c", script],
            cwd=str(cwd),
            env={"PATH": os.environ["PATH"]},
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
        )
    finally:
        for fd in (*fds, stdin, out_w):
            os.close(fd)
    return pid, out_r


def _lines(fd: int, count: int, within: float = 20.0) -> list[str]:
    """`count` lines read from `fd`, within `within` seconds (else AssertionError)."""
    got = b""
    deadline = time.monotonic() + within
    while got.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {count} lines within {within}s: {got!r}"
        if not (chunk := os.read(fd, 4096)):
            break
        got += chunk
    return got.decode().splitlines()


def _v2_line(pid_text: str) -> str:
    return next(line for line in pid_text.splitlines() if line.startswith("0::"))


@needs_v2_hugetlb
@needs_clone3
def test_a_worker_is_born_in_its_leaf_and_what_it_forks_at_once_too(tmp_path: Path) -> None:
    with _workers_cgroup() as nodes:
        plan = _hugetlb(("r-1", "w-1"), limited=("r-1", "w-1"))
        group = nodes.place(plan)
        assert group.born_into
        assert group.name == "w-1"
        assert group.path == nodes.base / "r-1" / "w-1" / LEAF
        # The limit above the leaf is written, and every node on the way passes it on.
        node = group.path.parent
        assert (node / "hugetlb.2MB.max").read_text().strip() == str(4 * HUGE_2MB)
        for passing in (nodes.cgroups.base, nodes.base, nodes.base / "r-1", node):
            assert "hugetlb" in (passing / "cgroup.subtree_control").read_text().split()
        assert (group.path / "cgroup.subtree_control").read_text().split() == []
        # Its first instruction reads where it is, then it forks a child that does; then
        # both wait (a shell and its background child).
        script = (
            "grep ^0:: /proc/self/cgroup; (grep ^0:: /proc/self/cgroup; exec sleep 30) & "
            "echo forked; exec sleep 30"
        )
        pid, out = _born(group.path, script, tmp_path)
        try:
            lines = _lines(out, 3)
            wanted = f"0::/{group.path.relative_to(V2_ROOT)}"  # type: ignore[arg-type]
            cgroup_lines = [line for line in lines if line.startswith("0::")]
            assert cgroup_lines == [wanted, wanted], lines
            assert _v2_line(Path(f"/proc/{pid}/cgroup").read_text()) == wanted
            members = group.members()
            assert pid in members, members
            assert len(members) >= 2, members  # it, its child (a grep not yet gone)
            # Nothing of this process ever stood there, nor in the nodes above.
            assert os.getpid() not in members
            for interior in (node, nodes.base / "r-1", nodes.base):
                assert (interior / "cgroup.procs").read_text() == ""
            # Its own process group (as posix_spawn's workers have), no fd but 0-2.
            assert os.getpgid(pid) == pid
            assert sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]
        finally:
            os.close(out)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@needs_v2_hugetlb
@needs_clone3
def test_freeze_usage_and_kill_work_on_the_leaf_layout(tmp_path: Path) -> None:
    with _workers_cgroup() as nodes:
        parent = nodes.place(_hugetlb(("r-1", "w-p"), limited=("r-1", "w-p")))
        child = nodes.place(_hugetlb(("r-1", "w-p", "w-c")))
        # The delegate's node is below its parent's, beside the parent's leaf.
        assert child.path.parent.parent == parent.path.parent
        spin = "i=0; while :; do i=$((i+1)); done"
        pids = []
        outs = []
        for group in (parent, child):
            pid, out = _born(group.path, f"echo up; {spin}", tmp_path)
            pids.append(pid)
            outs.append(out)
            assert _lines(out, 1) == ["up"]
        try:
            # Usage: the leaf's own cpu.stat counts its worker's CPU.
            time.sleep(0.3)  # a measure of what it spins meanwhile, not a wait
            spent = cgroup_cpu_seconds(os.fsencode(parent.path / "cpu.stat"))
            assert spent is not None
            assert spent > 0.05, spent
            # A pause of the parent's leaf holds it and not its delegate.
            assert write_freeze(parent, True)
            assert wait_settled([parent], True, 10) == []
            assert "frozen 1" in (parent.path / "cgroup.events").read_text()
            assert "frozen 0" in (child.path / "cgroup.events").read_text()
            before = cgroup_cpu_seconds(os.fsencode(parent.path / "cpu.stat"))
            time.sleep(0.3)
            assert cgroup_cpu_seconds(os.fsencode(parent.path / "cpu.stat")) == before
            write_freeze(parent, False)
            assert wait_settled([parent], False, 10) == []
            # A stop's kill of the leaf ends its worker, not the delegate.
            parent.kill()
            assert os.waitpid(pids[0], 0)[0] == pids[0]
            assert not parent.populated()
            assert child.populated()
            child.kill()
            assert os.waitpid(pids[1], 0)[0] == pids[1]
        finally:
            for out in outs:
                os.close(out)
            for pid in pids:
                with contextlib.suppress(ChildProcessError, ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        # Removed: each leaf, then the nodes nothing uses (the run's last).
        assert child.remove()
        nodes.remove_nodes(child, lambda _: False)
        assert parent.path.parent.is_dir()  # the parent's leaf is still in it
        assert parent.remove()
        nodes.remove_nodes(parent, lambda _: False)
        assert not (nodes.base / "r-1").exists()


@needs_v2_hugetlb
@needs_clone3
def test_no_process_is_born_into_a_node_that_passes_a_controller_on(tmp_path: Path) -> None:
    with _workers_cgroup() as nodes:
        group = nodes.place(_hugetlb(("r-1", "w-1"), limited=("r-1", "w-1")))
        with pytest.raises(OSError, match="busy") as refused:
            _born(group.path.parent, "true", tmp_path)
        assert refused.value.errno == errno.EBUSY
        assert (group.path.parent / "cgroup.procs").read_text() == ""


@needs_v2_hugetlb
def test_a_limit_file_that_will_not_take_its_value_fails_naming_it() -> None:
    with _workers_cgroup() as nodes:
        plan = V2Layout(
            (
                NodeStep((), ("+hugetlb",)),
                NodeStep(("r-1",), ("+hugetlb",), (("hugetlb.2MB.max", "lots"),)),
                NodeStep(("r-1", LEAF)),
            ),
            ("r-1", LEAF),
        )
        with pytest.raises(V2NotPlaced, match=r"hugetlb\.2MB\.max") as failed:
            nodes.place(plan)
        assert failed.value.errno == errno.EINVAL
        # A controller not delegated to it: the write to pass it on fails, naming it.
        missing = V2Layout((NodeStep((), ("+memory",)), NodeStep((LEAF,))), (LEAF,))
        with pytest.raises(V2NotPlaced, match=r"cgroup\.subtree_control"):
            nodes.place(missing)


@needs_v2_hugetlb
@needs_clone3
def test_exec_chdir_and_nul_errors_come_back_from_the_birth(tmp_path: Path) -> None:
    with _workers_cgroup() as nodes:
        group = nodes.place(_hugetlb(("r-1", "w-1")))
        fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        fds = [os.dup(fd) for _ in range(3)]
        try:

            def born(argv: list[str], cwd: str) -> int:
                return _born_into.spawn_into(
                    group.path, argv, cwd=cwd, env={}, stdin=fds[0], stdout=fds[1], stderr=fds[2]
                )

            with pytest.raises(FileNotFoundError) as no_file:
                born(["/no/such/file"], str(tmp_path))
            assert no_file.value.filename == "/no/such/file"
            with pytest.raises(FileNotFoundError) as no_dir:
                born(["/bin/true"], "/no/such/dir")
            assert no_dir.value.filename == "/no/such/dir"
            with pytest.raises(ValueError, match="NUL"):
                born(["/bin/true", "a\0b"], str(tmp_path))
            with pytest.raises(ValueError, match="3 or more"):
                _born_into.spawn_into(
                    group.path,
                    ["/bin/true"],
                    cwd=str(tmp_path),
                    env={},
                    stdin=0,
                    stdout=1,
                    stderr=2,
                )
            # The children that failed were reaped: none is left in the leaf.
            assert group.members() == []
        finally:
            for each in (*fds, fd):
                os.close(each)


def test_a_process_in_a_limited_worker_s_leaf_is_that_worker_s() -> None:
    cgroups = Cgroups(Path("/sys/fs/cgroup/x/subagentd-1"), Path("/x"), "/x/subagentd-1")
    assert cgroups.worker_of("0::/x/subagentd-1/w-flat\n") == "w-flat"
    limited = f"/x/subagentd-1/{LIMITED}"
    assert cgroups.worker_of(f"0::{limited}/r-1/w-p/{LEAF}\n") == "w-p"
    assert cgroups.worker_of(f"0::{limited}/r-1/w-p/w-c/{LEAF}\n") == "w-c"
    # What a worker made inside its own leaf is still its.
    assert cgroups.worker_of(f"0::{limited}/r-1/w-p/{LEAF}/mine/{LEAF}\n") == "w-p"
    # A node between (where no process can be) and the nodes' base: no worker's.
    assert cgroups.worker_of(f"0::{limited}/r-1/w-p\n") is None
    assert cgroups.worker_of(f"0::{limited}\n") is None
    assert cgroups.worker_of(f"0::{limited}/{LEAF}\n") is None


def test_an_adopted_leaf_keeps_its_worker_s_name() -> None:
    leaf = WorkerCgroup(Path(f"/b/{LIMITED}/r-1/w-9/{LEAF}"), Path("/b"), born_into=True)
    assert leaf.name == "w-9"
    assert WorkerCgroup(Path("/b/w-9"), Path("/b")).name == "w-9"


# -- the daemon in a leaf of its delegated cgroup -----------------------------------------


@contextlib.contextmanager
def _delegated_cgroup() -> Iterator[Path]:
    """A v2 cgroup below the root, as one delegated to a user service is: this process
    stands in it only while a daemon is started from it, then goes back."""
    assert V2_ROOT is not None
    delegated = V2_ROOT / f"subagentd-delegated-{os.getpid()}"
    delegated.mkdir()
    try:
        yield delegated
    finally:
        (V2_ROOT / "cgroup.procs").write_text(str(os.getpid()))
        _emptied(delegated)
        for parent, dirs, _ in os.walk(delegated, topdown=False):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(Path(parent) / name)
        with contextlib.suppress(OSError):
            delegated.rmdir()


def _v2_of(pid: int) -> str:
    return _v2_line(Path(f"/proc/{pid}/cgroup").read_text()).removeprefix("0::")


@needs_v2_hugetlb
async def test_the_daemon_lives_in_its_leaf_so_its_cgroup_passes_controllers_on(
    daemon_dirs: DaemonProcess,
) -> None:
    assert V2_ROOT is not None
    with _delegated_cgroup() as delegated:
        (delegated / "cgroup.procs").write_text(str(os.getpid()))
        try:
            daemon_dirs.start()
        finally:
            (V2_ROOT / "cgroup.procs").write_text(str(os.getpid()))
        assert daemon_dirs.proc is not None
        listed = "/" + delegated.name
        assert _v2_of(daemon_dirs.proc.pid) == f"{listed}/{DAEMON_LEAF}"
        # Its cgroup holds no process now: it may pass a controller on (hugetlb here;
        # memory, cpu, pids on a user service), and the workers' cgroup too.
        (delegated / "cgroup.subtree_control").write_text("+hugetlb")
        with trio.fail_after(30):
            async with AsyncClient(daemon_dirs.socket) as client:
                info = await client.info()
                base = Path(info.tree_tracking.removeprefix("cgroup "))
                assert base.parent == delegated
                (base / "cgroup.subtree_control").write_text("+hugetlb")
                script = "echo up; sh -c 'exec sleep 60' & i=0; while :; do i=$((i+1)); done"
                worker = await client.spawn(sh(script))
                await client.wait_for(worker.id, "up", timeout=20)
                assert _v2_of(worker.pid) == f"{listed}/{base.name}/{worker.id}"  # type: ignore[arg-type]
                # Usage, a pause and a stop work as ever on the cgroups below.
                listing = await client.ls(usage=True)
                assert listing[0].usage is not None
                assert listing[0].usage.processes == 2
                await client.pause(worker=worker.id)
                assert "frozen 1" in (base / worker.id / "cgroup.events").read_text()
                await client.unpause(worker=worker.id)
                # A reload's image finds itself in the leaf, and the same workers' cgroup.
                await client.reload()
                assert _v2_of(daemon_dirs.proc.pid) == f"{listed}/{DAEMON_LEAF}"
                assert (await client.info()).tree_tracking == info.tree_tracking
                await client.stop(worker.id)
                ended = await client.wait(worker.id)
                assert ended.state == "stopped"
                assert (base / "cgroup.procs").read_text() == ""
        assert daemon_dirs.terminate() == 0


# -- which kinds are enforced, and how: v1 where it is, else v2, else refused --------------


def _fake_v1_root(tmp_path: Path, kinds: tuple[str, ...]) -> Path:
    """A v1 root holding only the hierarchies `kinds` (links to the real mounts)."""
    root = tmp_path / "v1"
    root.mkdir()
    for name in kinds:
        (root / name).symlink_to(Path("/sys/fs/cgroup") / name)
    return root


needs_v1 = pytest.mark.skipif(
    not all(os.access(f"/sys/fs/cgroup/{n}/tasks", os.W_OK) for n in ("memory", "cpu", "pids")),
    reason="the v1 memory, cpu and pids hierarchies are not writable here",
)


@needs_v1
async def test_a_kind_whose_hierarchy_is_missing_is_refused_and_the_others_enforced(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    root = _fake_v1_root(tmp_path, ("memory", "pids"))
    daemon_dirs.start(f"--cgroup-v1-root={root}")
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            info = await client.info()
            assert info.controls["memory"].enforced
            assert info.controls["pids"].enforced
            cpus = info.controls["cpus"]
            assert not cpus.enforced
            assert f"the cgroup v1 cpu hierarchy is not under {root}" in cpus.how
            # The v2 cpu controller is no way either here: not delegated (hugetlb only).
            assert "cgroup v2 cpu controller is not delegated" in cpus.how
            with pytest.raises(Refused, match=r"cpus limit, which this daemon cannot enforce"):
                await client.spawn(sh("true"), limits=Limits(cpus=0.5, memory=64 * MIB))
            with pytest.raises(Refused, match="v1 cpu hierarchy is not under"):
                await client.new_run(limits=Limits(cpus=1.0))
            # The others hold, for real: a fork loop stops at its process limit, and both
            # limits are written in the worker's nodes, under the root given.
            worker = await client.spawn(
                [sys.executable, "-c", FORK_LOOP], limits=Limits(memory=64 * MIB, pids=20), grace=0
            )
            said = await wait_output(client, worker.id, b"\n")
            assert said == b"refused 81\n", said
            for kind, file, value in (
                ("memory", "memory.limit_in_bytes", 64 * MIB),
                ("pids", "pids.max", 20),
            ):
                node = _node(info, kind, f"{worker.run}/{worker.id}")
                assert node.is_relative_to(root / kind)  # found under the root it was given
                assert int((node / file).read_text()) == value
            await client.stop(worker.id)
            # A spawn without a limit, and one with those enforced, run as ever.
            plain = await client.spawn(sh("true"))
            assert (await client.wait(plain.id)).state == "finished"


@needs_v2_hugetlb
async def test_without_v1_the_v2_controllers_are_the_way_and_refused_naming_why(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    root = _fake_v1_root(tmp_path, ())
    daemon_dirs.start(f"--cgroup-v1-root={root}")
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            info = await client.info()
            for kind, name in (("memory", "memory"), ("cpus", "cpu"), ("pids", "pids")):
                control = info.controls[kind]
                assert not control.enforced
                assert f"cgroup v2 {name} controller is not delegated" in control.how
                assert "has: hugetlb" in control.how
            with pytest.raises(Refused, match="cgroup v2 memory controller is not delegated"):
                await client.spawn(sh("true"), limits=Limits(memory=64 * MIB))
            worker = await client.spawn(sh("true"))
            assert (await client.wait(worker.id)).state == "finished"


def test_without_the_helper_a_delegated_v2_controller_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """The fallback where the extension is not built (no compiler at install): an import
    of it that fails, in a process of its own, and what `info` then says of a delegated
    controller."""
    program = (
        "import sys\n"
        "sys.modules['subagentd.daemon.processes._clone3'] = None\n"
        "from pathlib import Path\n"
        "from subagentd.daemon.processes import _born_into, _controllers\n"
        "assert not _born_into.available\n"
        "v2 = (Path('/sys/fs/cgroup/user'), frozenset({'memory', 'pids'}))\n"
        "assert not _controllers._v2_usable('memory', v2)\n"
        "print(_controllers._not_v1('memory', 'is not mounted', v2))\n"
    )
    said = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "cgroup v2 memory controller, delegated to the daemon" in said
    assert "the clone3 helper" in said
    assert "is not built here" in said


@pytest.mark.parametrize("given", ["", "relative/dir", "/no/such/dir", "/etc/hostname", "/a\tb"])
def test_a_hostile_v1_root_is_refused_naming_the_option(given: str) -> None:
    from .conftest import BIN

    done = subprocess.run(
        [str(BIN / "subagentd"), "--check", f"--cgroup-v1-root={given}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "--cgroup-v1-root" in done.stderr
