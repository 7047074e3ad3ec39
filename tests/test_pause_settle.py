"""A pause's 5 s settle bound (`_freezer.SETTLE_SECONDS`), on trio's MockClock
(autojump_threshold=0): a pause whose processes the kernel never says are held answers
at the bound, five seconds of trio time, not before and not later, and in milliseconds of
real time; one that settles answers at once. Real processes and real cgroups: what never
settles is a process something outside its tree keeps continuing (the SIGSTOP way's
limit), and a cgroup never asked to freeze (the kernel never says "frozen 1" of it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.daemon.processes._cgroup import WorkerCgroup
from subagentd.daemon.processes._freezer import (
    SETTLE_SECONDS,
    freeze_cgroups,
    settle,
    stop_found,
    tree_finder,
    write_freeze,
)
from subagentd.daemon.processes._tree import ProcessTable, read_stat

from .inprocess import held
from .test_v2_limits import V2_ROOT, needs_v2_hugetlb

#: What a bound answered on the mock clock may take of real time (its waits are a thread
#: hop and a scan of /proc or a poll, never the bound's five seconds).
REAL_AT_MOST = 4.0


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


@contextlib.contextmanager
def _continued(pid: int) -> Iterator[None]:
    """A process outside `pid`'s tree continuing it over and over (anyone allowed to
    signal it may): a SIGSTOP pause of it never settles."""
    continuer = subprocess.Popen(["sh", "-c", f"while kill -CONT {pid} 2>/dev/null; do :; done"])
    try:
        yield
    finally:
        continuer.kill()
        continuer.wait()


async def test_a_sigstop_pause_that_never_settles_answers_at_its_bound(
    autojump_clock: MockClock, sleeper: subprocess.Popen[bytes]
) -> None:
    stat = read_stat(sleeper.pid)
    assert stat is not None
    find = tree_finder(ProcessTable(), [(sleeper.pid, "w-unsettled", stat.starttime)])
    with _continued(sleeper.pid):
        began, real = trio.current_time(), time.monotonic()
        assert not await stop_found(find)
        elapsed = trio.current_time() - began
    # The first search is outside the bound (it found no deadline to jump to), the rest
    # within it: the answer at the bound exactly.
    assert elapsed == pytest.approx(SETTLE_SECONDS)
    assert time.monotonic() - real < REAL_AT_MOST


async def test_a_sigstop_pause_that_settles_answers_at_once(
    autojump_clock: MockClock, sleeper: subprocess.Popen[bytes]
) -> None:
    stat = read_stat(sleeper.pid)
    assert stat is not None
    find = tree_finder(ProcessTable(), [(sleeper.pid, "w-settles", stat.starttime)])
    began = trio.current_time()
    with held(autojump_clock):  # the kernel's stop is a real event, before any deadline
        assert await stop_found(find)
    assert trio.current_time() - began < SETTLE_SECONDS
    os.kill(sleeper.pid, 18)  # SIGCONT, for its fixture's kill and wait


@contextlib.contextmanager
def _cgroup_holding(pid: int) -> Iterator[WorkerCgroup]:
    """A v2 cgroup of the test's own, `pid` in it; put back and removed afterwards."""
    assert V2_ROOT is not None
    path = V2_ROOT / f"subagentd-settle-{os.getpid()}"
    path.mkdir()
    try:
        (path / "cgroup.procs").write_text(str(pid))
        yield WorkerCgroup(path, V2_ROOT)
    finally:
        (path / "cgroup.freeze").write_text("0")
        with contextlib.suppress(ProcessLookupError, OSError):
            (V2_ROOT / "cgroup.procs").write_text(str(pid))
        _rmdir_when_empty(path)


def _rmdir_when_empty(path: Path, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            path.rmdir()
            return
        except OSError:
            assert time.monotonic() < deadline, f"{path} still busy"
            time.sleep(0.01)


@needs_v2_hugetlb
async def test_a_freeze_the_kernel_never_settles_answers_at_its_bound(
    autojump_clock: MockClock, sleeper: subprocess.Popen[bytes]
) -> None:
    with _cgroup_holding(sleeper.pid) as group:
        # Never asked to freeze: the kernel never says "frozen 1" of it.
        began, real = trio.current_time(), time.monotonic()
        assert await settle([group], True, SETTLE_SECONDS) == [group.name]
        assert trio.current_time() - began == pytest.approx(SETTLE_SECONDS)
        assert time.monotonic() - real < REAL_AT_MOST
        # The waiting thread was told to stop at the bound: another wait is answered as
        # promptly, and the freeze, once asked, settles.
        assert await settle([group], True, SETTLE_SECONDS) == [group.name]
        began = trio.current_time()
        with held(autojump_clock):
            assert await freeze_cgroups([group], True) == []
        assert trio.current_time() - began < SETTLE_SECONDS
        assert "frozen 1" in (group.path / "cgroup.events").read_text()
        assert write_freeze(group, False)
