"""Stopping: exactly the scope asked, and nothing of its process trees left alive."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.client import AsyncClient, Client
from subagentd.protocol import Cancel, Cancelled, Stop, Stopped
from subagentd.protocol.errors import RunStopped

from .conftest import DaemonProcess
from .helpers import alive, follow_stdout, sh, stop_ids, wait_output
from .inprocess import at, held, in_process


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


# A worker whose tree holds every kind of process a stop must find: a plain
# child, a grandchild that left the group with setsid and ignores TERM, and
# one that double-forked away and was orphaned to init.
TREE = r"""
sleep 60 &
echo child $!
setsid sh -c 'trap "" TERM; echo setsid $$; exec sleep 60' &
( setsid sh -c 'echo orphan $$; exec sleep 60' & )
trap '' TERM
while :; do sleep 0.1; done
"""


@pytest.fixture
async def tracked(tracking: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(tracking.socket) as client:
        yield client


# Double-forked away, out of the group and session, with nothing of the
# worker left in its environment: only the worker's cgroup still knows it.
HIDDEN = "( setsid env -i sh -c 'echo hidden $$; exec sleep 60' & ); exec sleep 60"


def _pids(stdout: bytes) -> dict[str, int]:
    return {m[1].decode(): int(m[2]) for m in re.finditer(rb"(\w+) (\d+)\n", stdout)}


async def test_stop_leaves_no_process_of_the_tree_alive(tracked: AsyncClient) -> None:
    client = tracked
    with trio.fail_after(30):
        # No grace: what is tested is that every process is found (the grace is
        # tests/test_workers.py's, on the mock clock).
        worker = await client.spawn(sh(TREE), grace=0)
        pids = _pids(await follow_stdout(client, worker.id, lambda out: len(_pids(out)) == 3))
        assert set(pids) == {"child", "setsid", "orphan"}
        assert all(alive(pid) for pid in pids.values())
        assert await client.stop(worker.id)
        assert worker.pid is not None
        left = {name: pid for name, pid in {**pids, "leader": worker.pid}.items() if alive(pid)}
        assert left == {}
        assert (await client.status(worker.id)).state == "stopped"


async def test_a_worker_that_ends_takes_its_background_processes_with_it(
    tracked: AsyncClient,
) -> None:
    client = tracked
    with trio.fail_after(30):
        worker = await client.spawn(sh("sleep 60 & echo bg $!; exit 0"), grace=0.5)
        seen = await wait_output(client, worker.id, b"\n")
        view = await client.wait(worker.id)
        assert view.state == "finished"
        assert not alive(int(seen.split()[1]))


@pytest.mark.parametrize("tracking", ["cgroup"], indirect=True)
async def test_a_hidden_orphan_is_found_by_its_cgroup(tracked: AsyncClient) -> None:
    client = tracked
    with trio.fail_after(30):
        worker = await client.spawn(sh(HIDDEN), grace=0.5)
        pid = _pids(await follow_stdout(client, worker.id, lambda out: b"\n" in out))["hidden"]
        assert alive(pid)
        assert await client.stop(worker.id)
        assert not alive(pid)
        assert (await client.status(worker.id)).state == "stopped"


@pytest.mark.parametrize("tracking", ["cgroup"], indirect=True)
async def test_a_worker_cgroup_is_carried_across_a_reload_and_removed_at_its_end(
    tracking: DaemonProcess,
) -> None:
    async with AsyncClient(tracking.socket) as client:
        base = Path((await client.info()).tree_tracking.removeprefix("cgroup "))
        with trio.fail_after(30):
            worker = await client.spawn(sh(HIDDEN), grace=0.5)
            pid = _pids(await follow_stdout(client, worker.id, lambda out: b"\n" in out))["hidden"]
            assert (base / worker.id).is_dir()
            assert (await client.reload()).carried_live == 1
            assert await client.stop(worker.id)
            assert not alive(pid)
            assert not _procs(base / worker.id)  # the tree is gone before the answer,
            while (base / worker.id).exists():  # its empty cgroup right after it
                await client.info()


@pytest.mark.parametrize("tracking", ["cgroup"], indirect=True)
async def test_after_a_crash_the_next_daemon_ends_what_the_cgroups_hold(
    tracking: DaemonProcess,
) -> None:
    with Client(tracking.socket) as client:
        worker = client.spawn(sh(HIDDEN))
        base = Path(client.info().tree_tracking.removeprefix("cgroup "))
    with trio.fail_after(30):
        async with AsyncClient(tracking.socket) as client:
            pid = _pids(await follow_stdout(client, worker.id, lambda out: b"\n" in out))["hidden"]
    tracking.kill()
    assert alive(pid)
    tracking.start()
    with Client(tracking.socket) as client:
        assert client.status(worker.id).state == "interrupted"
    assert not alive(pid)
    assert not (base / worker.id).exists()


async def test_stop_one_leaves_siblings_running(client: AsyncClient) -> None:
    with trio.fail_after(30):
        run = await client.new_run()
        a = await client.spawn(["sleep", "60"], run=run)
        a_child = await client.spawn(["sleep", "60"], parent=a.id)
        b = await client.spawn(["sleep", "60"], run=run)
        b_child = await client.spawn(["sleep", "60"], parent=b.id)
        assert a_child.run == run
        stopped = await stop_ids(client, a.id)
        assert stopped == sorted([a.id, a_child.id])
        for sibling in (b, b_child):
            view = await client.status(sibling.id)
            assert view.state == "running"
            assert view.pid is not None
            assert alive(view.pid)
        assert await stop_ids(client, a.id) == []  # one-way: a second stop changes nothing
        await client.stop_run(run)


async def test_stop_run_stops_nested_runs_and_refuses_later_spawns(client: AsyncClient) -> None:
    with trio.fail_after(30):
        outer = await client.new_run()
        inner = await client.new_run(outer=outer)
        elsewhere = await client.spawn(["sleep", "60"])
        workers = [await client.spawn(["sleep", "60"], run=r) for r in (outer, inner, inner)]
        stopped = await client.stop_run(outer)
        assert stopped == sorted(w.id for w in workers)
        for w in workers:
            assert (await client.status(w.id)).state == "stopped"
        for r in (outer, inner):
            with pytest.raises(RunStopped):
                await client.spawn(["true"], run=r)
        assert (await client.status(elsewhere.id)).state == "running"
        assert await client.stop_run(outer) == []
        await client.stop(elsewhere.id)


async def test_a_run_of_many_workers_stops_in_parallel(client: AsyncClient) -> None:
    # Each ignores TERM for a while before it exits: stopped one after another
    # they would take count * delay; stopped in parallel, about one delay.
    count, delay = 40, 0.5
    with trio.fail_after(count * delay * 0.75):
        run = await client.new_run()
        script = f"trap 'sleep {delay}; exit 0' TERM; echo up; while :; do sleep 0.1; done"
        workers = [await client.spawn(sh(script), run=run) for _ in range(count)]
        for w in workers:
            await wait_output(client, w.id, b"up")
        assert len(await client.stop_run(run)) == count
        assert {(await client.status(w.id)).state for w in workers} == {"stopped"}


async def test_timeout_takes_the_subtree(autojump_clock: MockClock, short_tmp: Path) -> None:
    timeout = 600.0
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):  # real starts: the timeout must not run meanwhile
            parent = await client.spawn(["sleep", "100000"], timeout=timeout)
            child = await client.spawn(["sleep", "100000"], parent=parent.id)
        started = d.wall.trio_time(d.record(parent.id).started_at)
        async with at(autojump_clock, started + timeout - 0.01):  # not a moment early
            assert d.record(parent.id).stop_reason is None  # asked at the deadline
            assert (await client.status(child.id)).state == "running"
        async with at(autojump_clock, started + timeout):
            assert (await client.wait(parent.id)).state == "timed_out"
            assert (await client.wait(child.id)).state == "stopped"


# Says when TERM comes, and carries on until its release file appears: a stop of it stays
# in flight for as long as a test likes (its grace is long).
LINGERING = 'trap "echo TERM" TERM; echo up; while [ ! -e "$1" ]; do sleep 0.05; done'


async def test_a_stop_in_flight_shows_as_stopping_and_a_second_stop_or_cancel_says_so(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn([*sh(LINGERING), "sh", str(release)], grace=600)
            bystander = await client.spawn(["sleep", "60"], run=worker.run)
            await wait_output(client, worker.id, b"up\n")
            assert not (await client.status(worker.id)).stopping
            first = await client.request(Stop(id=0, worker=worker.id, wait=False))
            assert first == Stopped(id=first.id, found=True, stopped=[worker.id])
            await wait_output(client, worker.id, b"TERM\n")  # sent; its tree runs on

            view = await client.status(worker.id)
            assert (view.state, view.stopping) == ("running", True)
            listed = {w.id: w for w in await client.ls()}
            assert listed[worker.id].stopping
            assert not listed[bystander.id].stopping
            states = [
                e.data for e in (await client.watch_page(worker.id)).entries if e.kind == "state"
            ]
            assert states[-1] == b"stopping reason=user"

            again = await client.request(Stop(id=0, worker=worker.id, wait=False))
            assert isinstance(again, Stopped)
            assert (again.stopped, again.already_stopping) == ([], [worker.id])
            cancelled = await client.request(Cancel(id=0, scope=f"run:{worker.run}"))
            assert isinstance(cancelled, Cancelled)
            assert (cancelled.cancelled, cancelled.already_stopping) == (
                [bystander.id],
                [worker.id],
            )
            await client.wait(bystander.id)

            # subagentctl says the same, to a person and to a program.
            table = (await trio.to_thread.run_sync(daemon.ctl, "ls")).stdout.splitlines()
            row = next(line.split() for line in table if line.startswith(worker.id))
            assert row[2] == "stopping"
            stop = await trio.to_thread.run_sync(daemon.ctl, "stop", "--no-wait", worker.id)
            assert (stop.returncode, stop.stdout) == (0, "")
            assert stop.stderr == f"{worker.id} already stopping\n"
            cancel = await trio.to_thread.run_sync(daemon.ctl, "cancel", f"worker:{worker.id}")
            assert (cancel.returncode, cancel.stdout) == (0, "")
            assert cancel.stderr == f"{worker.id} already stopping\n"
            stop_json = await trio.to_thread.run_sync(
                daemon.ctl, "--json", "stop", "--no-wait", worker.id
            )
            assert json.loads(stop_json.stdout) == {"stopped": [], "already_stopping": [worker.id]}
            shown = await trio.to_thread.run_sync(daemon.ctl, "--json", "status", worker.id)
            assert json.loads(shown.stdout)["stopping"] is True
            watched = await trio.to_thread.run_sync(daemon.ctl, "watch", worker.id)
            assert "[state] stopping reason=user\n" in watched.stderr

            release.touch()
            ended = await client.wait(worker.id)
            assert (ended.state, ended.stopping) == ("stopped", False)
            assert not (await client.status(worker.id)).stopping


async def test_a_stop_in_flight_is_still_shown_after_a_reload_and_journaled_once(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    release = short_tmp / "release"
    async with in_process(short_tmp) as d:
        with held(autojump_clock):  # real processes; no grace may run out meanwhile
            async with d.client() as client:
                worker = await client.spawn([*sh(LINGERING), "sh", str(release)], grace=600)
                await wait_output(client, worker.id, b"up\n")
                assert await client.stop(worker.id, wait=False)
                await wait_output(client, worker.id, b"TERM\n")
            await d.reload_in_place()
            async with d.client() as client:
                assert (await client.status(worker.id)).stopping  # carried, still in flight
                again = await client.request(Stop(id=0, worker=worker.id, wait=False))
                assert isinstance(again, Stopped)
                assert again.already_stopping == [worker.id]
                release.touch()
                assert (await client.wait(worker.id)).state == "stopped"
                entries = (await client.watch_page(worker.id)).entries
        states = [e.data.split()[0] for e in entries if e.kind == "state"]
        assert states == [b"running", b"stopping", b"stopped"]


async def test_a_stopped_leader_gets_one_term_while_the_rest_of_its_tree_is_found(
    tracked: AsyncClient,
) -> None:
    """A stop TERMs each process of the tree once, the leader too (pinned by its own
    pidfd where its cgroup holds the tree): never a second TERM (to some programs a
    second means "quit now"), then KILL after the grace."""
    script = 'trap "echo TERM" TERM; sleep 60 & echo up; while :; do sleep 0.05; done'
    with trio.fail_after(30):
        worker = await tracked.spawn(sh(script), grace=1.0)
        await wait_output(tracked, worker.id, b"up\n")
        await tracked.stop(worker.id)
        page = await tracked.watch_page(worker.id)
    said = b"".join(e.data for e in page.entries if e.kind == "stdout")
    assert said == b"up\nTERM\n"
    assert (await tracked.status(worker.id)).state == "stopped"


# A tree whose leader ignores TERM (its grace runs on) and whose two children end on it.
# Each child sets TERM back to its default, then says its pid: not before, or a TERM
# could come while the subshell still ignores it.
_CHILD = "(trap - TERM; exec sh -c 'echo $$; exec sleep 600') &"
_DEAF_LEADER = sh(f'trap "" TERM; {_CHILD} {_CHILD} while :; do wait; done')


async def _stop_a_deaf_leader(tracking: DaemonProcess, *, spare: int | None) -> None:
    """Spawn `_DEAF_LEADER` (grace 600 s), set the daemon's soft descriptor limit to
    `spare` above what it holds (None: below it, so none can be opened), stop the worker
    without waiting, give the limit back, and return once each child has ended: on its
    TERM, since the grace is far off. The worker is still stopping then."""
    assert tracking.proc is not None
    daemon_pid = tracking.proc.pid
    children: list[int] = []
    limits = resource.prlimit(daemon_pid, resource.RLIMIT_NOFILE)
    try:
        with trio.fail_after(30):
            async with AsyncClient(tracking.socket) as client:
                worker = await client.spawn(_DEAF_LEADER, grace=600)
                assert worker.pid is not None
                children.append(worker.pid)  # killed at the end, with the rest
                out = await follow_stdout(client, worker.id, lambda out: out.count(b"\n") == 2)
                children += [int(pid) for pid in out.split()]
                pins = [os.pidfd_open(pid) for pid in children[1:]]
                try:
                    held = len(os.listdir(f"/proc/{daemon_pid}/fd"))
                    soft = 3 if spare is None else held + spare
                    resource.prlimit(daemon_pid, resource.RLIMIT_NOFILE, (soft, limits[1]))
                    assert await client.stop(worker.id, wait=False)
                    if spare is None:
                        resource.prlimit(daemon_pid, resource.RLIMIT_NOFILE, limits)
                    for pin in pins:
                        await trio.lowlevel.wait_readable(pin)
                finally:
                    for pin in pins:
                        os.close(pin)
                resource.prlimit(daemon_pid, resource.RLIMIT_NOFILE, limits)
                view = await client.status(worker.id)
                assert (view.state, view.stopping) == ("running", True), view
    finally:
        with contextlib.suppress(ProcessLookupError):
            resource.prlimit(daemon_pid, resource.RLIMIT_NOFILE, limits)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("tracking", ["cgroup", "scan"], indirect=True)
async def test_a_stop_out_of_descriptors_still_terms_every_process_of_the_tree(
    tracking: DaemonProcess,
) -> None:
    """A daemon with no descriptor to spare for a pidfd per process still TERMs each
    one at once, not only when the grace runs out (its leader through its own pidfd,
    the rest by the pid just read from the cgroup, or from /proc: a scan used to skip
    every process it could not pin, and they ran on, TERM-less, for the whole grace)."""
    # Room for two descriptors more: the leader's pin and one child's.
    await _stop_a_deaf_leader(tracking, spare=2)


@pytest.mark.parametrize("tracking", ["cgroup", "scan"], indirect=True)
async def test_a_stop_asked_with_no_descriptor_left_waits_for_one_then_terms_the_tree(
    tracking: DaemonProcess,
) -> None:
    """With not one descriptor to spare when the stop is asked, the leader still gets its
    TERM (through the pidfd it has held since its spawn), and the rest of the tree theirs
    once a descriptor is free again: the cgroup (or /proc) is read again until then, for
    up to a second (before, the cgroup read's EMFILE failed the worker's supervision at
    once: the tree was killed without its grace and the worker ended `failed`; a /proc
    scan took the processes it could not read for gone)."""
    # Below what it holds: no descriptor can be opened, however many a thread of its own
    # was holding a moment ago; given back as soon as the stop is answered.
    await _stop_a_deaf_leader(tracking, spare=None)


def _procs(cgroup: Path) -> list[str]:
    """The pids a cgroup holds now; none once it is removed."""
    try:
        return (cgroup / "cgroup.procs").read_text().split()
    except FileNotFoundError:
        return []
    except OSError as exc:  # removed between the open and the read
        if exc.errno == errno.ENODEV:
            return []
        raise
