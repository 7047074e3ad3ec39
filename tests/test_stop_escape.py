"""A process that moves itself out of its worker's cgroup does not escape a stop, nor a
pause.

Where workers have cgroups, any of them may write `cgroup.procs` where it can (a delegated
user service anywhere in its subtree, root anywhere): into the daemon's own cgroup, a
sibling worker's, or one it makes beside its own. It keeps the worker id it inherited in
its environment, and by that a stop, a stop_run and the daemon's shutdown still end it.

Real daemon, real cgroups: each worker forks a child that moves itself, prints its pid and
where it went; the test checks in /proc that nothing of it is left once the stop answers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient, Client
from subagentd.daemon.processes._cgroup import Cgroups, CgroupsUnavailable
from subagentd.daemon.processes._escapes import PROBE_MAX
from subagentd.daemon.processes._launcher import LocalLauncher
from subagentd.daemon.processes._reaper import REAPER

from .conftest import DaemonProcess
from .helpers import alive, sh, wait_output
from .pausing import proc_state

PYTHON = sys.executable

#: A child that writes its own pid into the cgroup named first (making it if it is not
#: there; "@W@" is its worker's id), prints "escaped <pid>", and sleeps on (through the
#: command named second: `env -i` clears its environment); the worker itself waits.
ESCAPE = r"""
dest=$(echo "$1" | sed "s/@W@/$SUBAGENTD_WORKER_ID/")
mkdir -p "$dest"
sh -c 'echo $$ > "$1/cgroup.procs" && exec $2 sh -c "echo escaped \$\$; exec sleep 60"' \
  sh "$dest" "$2" &
exec sleep 60
"""


@pytest.fixture
def cgrouped(daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A daemon whose workers have cgroups (skipped where this machine gives it none)."""
    daemon_dirs.start()
    with Client(daemon_dirs.socket, timeout=30) as client:
        how = client.info().tree_tracking
    if not how.startswith("cgroup "):
        pytest.skip(f"this machine gives the daemon no cgroup: {how}")
    return daemon_dirs


@pytest.fixture
async def user(cgrouped: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cgrouped.socket) as client:
        yield client


@contextlib.contextmanager
def reaped_after(made: list[Path], pids: list[int]) -> Iterator[None]:
    """Kill what a failed test left alive, and remove the cgroups it made."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for path in reversed(made):
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    trio_free_sleep()


def trio_free_sleep() -> None:
    """A moment for a killed process to leave its cgroup (cleanup only, outside trio)."""
    subprocess.run(["sleep", "0.01"], check=False)


def base_of(client_info_tracking: str) -> Path:
    return Path(client_info_tracking.removeprefix("cgroup "))


def carries_an_id(pid: int) -> bool:
    return b"SUBAGENTD_WORKER_ID=" in Path(f"/proc/{pid}/environ").read_bytes()


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"process {pid} names no cgroup v2")


async def _escaped_pid(client: AsyncClient, worker_id: str) -> int:
    out = await wait_output(client, worker_id, b"\n")
    return int(out.split()[1])


async def _escaping_worker(
    client: AsyncClient, move: str, *, run: str | None = None
) -> tuple[str, int, Path, list[Path]]:
    """A worker whose child moved itself `move`: ("daemon": into the daemon's own cgroup,
    "sibling": into another worker's, "new": into one it made beside its own, "inside":
    into one it made inside its own); its id,
    the child's pid, where it went, and the cgroups made for it (to clean up)."""
    base = base_of((await client.info()).tree_tracking)
    made: list[Path] = []
    if move == "daemon":
        dest = base.parent
    elif move == "sibling":
        sibling = await client.spawn(["sleep", "60"], grace=0)
        dest = base / sibling.id
    elif move == "inside":
        dest = base / "@W@" / "inner"
    else:
        dest = base / f"escape-{secrets.token_hex(4)}"
        made.append(dest)
    worker = await client.spawn([*sh(ESCAPE), "sh", str(dest)], run=run, grace=0.5)
    dest = Path(str(dest).replace("@W@", worker.id))
    pid = await _escaped_pid(client, worker.id)
    assert alive(pid)
    assert str(pid) in (dest / "cgroup.procs").read_text().split(), (
        f"the child did not move into {dest}: it is in {cgroup_of(pid)}"
    )
    return worker.id, pid, dest, made


MOVES = ["daemon", "sibling", "new", "inside"]


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_its_stop(
    user: AsyncClient, move: str
) -> None:
    with trio.fail_after(30):
        worker_id, pid, _, made = await _escaping_worker(user, move)
        with reaped_after(made, [pid]):
            assert await user.stop(worker_id)
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"
            assert (await user.status(worker_id)).state == "stopped"
            # A sibling whose cgroup it moved into runs on: only what carries the
            # stopped worker's id was ended.
            live = [w for w in await user.ls() if w.state == "running"]
            assert len(live) == (1 if move == "sibling" else 0)


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_is_held_by_its_pause(
    user: AsyncClient, move: str
) -> None:
    # Out of the frozen cgroup, it is stopped (SIGSTOP), and continued by the unpause;
    # moved into a cgroup inside its own, the kernel freezes it with the rest.
    with trio.fail_after(30):
        worker_id, pid, dest, made = await _escaping_worker(user, move)
        with reaped_after(made, [pid]):
            paused = await user.pause(worker=worker_id)
            assert paused.paused == [worker_id]
            if move == "inside":
                assert "frozen 1" in (dest / "cgroup.events").read_text()
                assert proc_state(pid) != "T"
                assert paused.held_outside == {}  # frozen with its cgroup: none outside
            else:
                assert proc_state(pid) == "T", f"the child in {move}'s cgroup was not held"
                # The answer says what it held outside, the journal names it.
                assert paused.held_outside == {worker_id: 1}
                page = await user.watch_page(worker_id, 0, 10_000)
                notes = [e.data.decode() for e in page.entries if e.kind == "note"]
                held = f"paused: 1 process outside its cgroup held by SIGSTOP (pid {pid})"
                assert held in notes, notes
            assert (await user.unpause(worker=worker_id)).unpaused == [worker_id]
            assert proc_state(pid) != "T"
            if move == "inside":
                assert "frozen 0" in (dest / "cgroup.events").read_text()
            # Paused again, a stop ends it at once (continued with its TERM).
            await user.pause(worker=worker_id)
            assert await user.stop(worker_id)
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_its_run(
    user: AsyncClient, move: str
) -> None:
    with trio.fail_after(30):
        run = await user.new_run()
        worker_id, pid, _, made = await _escaping_worker(user, move, run=run)
        with reaped_after(made, [pid]):
            assert await user.stop_run(run) == [worker_id]
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"


@pytest.mark.parametrize("move", MOVES)
async def test_a_child_that_moved_itself_out_of_its_workers_cgroup_ends_with_the_daemon(
    cgrouped: DaemonProcess, move: str
) -> None:
    with trio.fail_after(30):
        async with AsyncClient(cgrouped.socket) as client:
            _, pid, _, made = await _escaping_worker(client, move)
        with reaped_after(made, [pid]):
            assert cgrouped.terminate() == 0
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"


#: A child that ignores TERM and moves itself round and round, as fast as it can, through
#: the cgroups named (its own worker's among them), printing "hopper <pid>" once started.
HOPPER = r"""
sh -c 'trap "" TERM; echo hopper $$
while :; do for d in "$@"; do echo $$ > "$d/cgroup.procs"; done 2>/dev/null; done' sh "$@" &
exec sleep 60
"""


async def test_a_child_that_moves_itself_round_and_round_during_the_stop_ends_with_it(
    user: AsyncClient,
) -> None:
    """Through its own cgroup, the daemon's, a sibling's and one it made, ignoring TERM:
    wherever it is when the grace runs out, it is killed, and the sibling runs on."""
    with trio.fail_after(30):
        base = base_of((await user.info()).tree_tracking)
        sibling = await user.spawn(["sleep", "60"], grace=0)
        made = base / f"hop-{secrets.token_hex(4)}"
        made.mkdir()
        # Its own cgroup is known once it is spawned: it moves in there by the worker's id.
        worker = await user.spawn(
            [
                *sh(f'set -- "{base}/$SUBAGENTD_WORKER_ID" "$@"{HOPPER}'),
                "sh",
                str(base.parent),
                str(base / sibling.id),
                str(made),
            ],
            grace=0.3,
        )
        out = await wait_output(user, worker.id, b"\n")
        pid = int(out.split()[1])
        with reaped_after([made], [pid]):
            assert alive(pid)
            assert await user.stop(worker.id)
            assert not alive(pid), "the child moving round and round survived its stop"
            assert (await user.status(sibling.id)).state == "running"


#: A forger: it claims the worker id it reads from its stdin by writing it over a
#: placeholder in its own environment (as /proc/PID/environ shows it), then says "claimed".
FORGER = r"""
import ctypes, os, select, sys, time
parent = os.getpid()
if pid := os.fork():  # orphaned at once, as a worker's child that moved out would be
    print("pid", pid, flush=True)
    sys.exit(0)
try:  # until the parent has exited (left unreaped by the test), so the forger is adopted
    select.select([os.pidfd_open(parent)], [], [])
except ProcessLookupError:
    pass
fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
env_start = int(fields[47])  # field 50 of /proc/PID/stat, counted from its third
environ = open("/proc/self/environ", "rb").read()
at = environ.index(b"SUBAGENTD_WORKER_ID=") + len(b"SUBAGENTD_WORKER_ID=")
claimed = sys.stdin.readline().strip().encode()
ctypes.memmove(env_start + at, claimed, len(claimed))
print("claimed", flush=True)
time.sleep(60)
"""
PLACEHOLDER = "w-0000000000"  # as long as any worker id


@dataclass
class Forger:
    """A process of the same user, orphaned (where a worker's child that moved out would
    be), in a cgroup of its own outside the daemon's."""

    pid: int
    proc: subprocess.Popen[str]  # its parent, gone at once; its pipes are the forger's


@contextlib.contextmanager
def forger_in(cgroup: Path) -> Iterator[Forger]:
    """A forger ready to claim a worker's id in its environment (`_claim`); killed on
    the way out."""
    env = {**os.environ, "SUBAGENTD_WORKER_ID": PLACEHOLDER}
    with subprocess.Popen(
        [PYTHON, "-c", FORGER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline().split()[1])
        try:
            (cgroup / "cgroup.procs").write_text(str(pid))
            yield Forger(pid, proc)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _claim(forger: Forger, worker_id: str) -> None:
    assert len(worker_id) == len(PLACEHOLDER)
    stdin, stdout = forger.proc.stdin, forger.proc.stdout
    assert stdin is not None
    assert stdout is not None
    stdin.write(worker_id + "\n")
    stdin.flush()
    assert stdout.readline() == "claimed\n"
    marker = f"SUBAGENTD_WORKER_ID={worker_id}".encode()
    assert marker in Path(f"/proc/{forger.pid}/environ").read_bytes().split(b"\0")


@contextlib.contextmanager
def forger_cgroup(base: Path) -> Iterator[Path]:
    """A cgroup beside the daemon's, not one of its own: the forger's."""
    cgroup = base.parent / f"forger-{secrets.token_hex(4)}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        with contextlib.suppress(OSError):
            cgroup.rmdir()


async def test_a_process_older_than_the_worker_that_claims_its_id_is_spared(
    cgrouped: DaemonProcess,
) -> None:
    """A process that merely claims a worker's id, started before that worker (so it cannot
    be its), is no process of its: neither its stop nor the daemon's shutdown ends it."""
    with trio.fail_after(30):
        async with AsyncClient(cgrouped.socket) as client:
            base = base_of((await client.info()).tree_tracking)
            with forger_cgroup(base) as cgroup, forger_in(cgroup) as forger:
                worker = await client.spawn(["sleep", "60"], grace=0)
                await trio.to_thread.run_sync(_claim, forger, worker.id)
                assert await client.stop(worker.id)
                assert alive(forger.pid), "a stop ended an older process claiming its id"
                assert cgrouped.terminate() == 0
                assert alive(forger.pid), "the shutdown ended an older one claiming an id"


async def test_a_younger_process_that_claims_a_workers_id_outside_its_cgroups_ends_with_it(
    user: AsyncClient,
) -> None:
    """One started after the worker, outside every cgroup of the daemon's, that claims its
    id cannot be told from a child of the worker that moved out: a stop ends it (a process
    of the same user gains nothing by it that it could not do itself: README.md, "Security
    and limits")."""
    with trio.fail_after(30):
        base = base_of((await user.info()).tree_tracking)
        worker = await user.spawn(["sleep", "60"], grace=0)
        with forger_cgroup(base) as cgroup, forger_in(cgroup) as forger:
            await trio.to_thread.run_sync(_claim, forger, worker.id)
            assert await user.stop(worker.id)
            assert not alive(forger.pid)


@pytest.fixture
def launcher(short_tmp: Path) -> Iterator[LocalLauncher]:
    """A launcher whose workers have cgroups of their own, in this process (root, or a
    delegated cgroup, is needed: skipped where there is none)."""
    state_dir = short_tmp / "state"
    state_dir.mkdir()
    try:
        cgroups = Cgroups.find(state_dir)
    except CgroupsUnavailable as exc:
        pytest.skip(f"no cgroup for workers here: {exc}")
    try:
        yield LocalLauncher(cgroups, f"cgroup {cgroups.base}")
    finally:
        cgroups.remove()


async def _stopped_together(launcher: LocalLauncher, count: int) -> None:
    """Start `count` workers, then stop them as one request does: each one's leader TERMed
    in turn, then their trees ended at once. (Their exits told by the daemon's reaper,
    run here as the supervisor runs it.)"""
    async with trio.open_nursery() as reaping:
        await reaping.start(REAPER.run)
        processes = [
            await launcher.start(
                f"w-batch{i:05d}", ["sleep", "60"], cwd="/", env={}, stdin_path=None
            )
            for i in range(count)
        ]
        try:
            for process in processes:
                assert launcher.term_leader(process)
            async with trio.open_nursery() as nursery:
                for i, process in enumerate(processes):
                    nursery.start_soon(
                        functools.partial(
                            launcher.end_tree, f"w-batch{i:05d}", process, 5.0, leader_termed=True
                        )
                    )
        finally:
            for process in processes:
                await process.wait_exited()
                process.reap()
                process.close()
                launcher.released(process)
        reaping.cancel_scope.cancel()


@pytest.mark.parametrize("count", [1, 50])
async def test_the_stops_asked_together_share_one_search_for_what_left_their_cgroups(
    launcher: LocalLauncher, count: int
) -> None:
    """A stop_run's workers do not search /proc one by one as each tree ends (at 10,000
    workers that was 10,000 reads of every process): one search, once all are empty."""
    with trio.fail_after(30):
        await _stopped_together(launcher, count)
        assert launcher.markers.made == 1
        await _stopped_together(launcher, count)  # the next request's: a search of its own
        assert launcher.markers.made == 2


#: As ESCAPE, but the worker exits (0) once its child has moved, leaving it running.
ESCAPE_THEN_EXIT = r"""
dest=$1
own=$(sed -n 's/^0:://p' /proc/$$/cgroup)
mkdir -p "$dest"
sh -c 'echo escaped $$ && echo $$ > "$1/cgroup.procs" && exec sleep 60' sh "$dest" &
child=$!
while [ "$(sed -n 's/^0:://p' /proc/$child/cgroup)" = "$own" ]; do :; done
exit 0
"""


@pytest.mark.parametrize("move", ["daemon", "new"])
async def test_what_moved_out_of_a_worker_that_ended_by_itself_ends_with_the_daemon(
    cgrouped: DaemonProcess, move: str
) -> None:
    """A worker's own ending searches nothing (that would tax every ending): its child that
    moved out runs on, until the daemon's shutdown ends it by the worker's id (or by the
    cgroup it made under the daemon's)."""
    with trio.fail_after(30):
        async with AsyncClient(cgrouped.socket) as client:
            base = base_of((await client.info()).tree_tracking)
            dest = base.parent if move == "daemon" else base / f"escape-{secrets.token_hex(4)}"
            worker = await client.spawn([*sh(ESCAPE_THEN_EXIT), "sh", str(dest)], grace=0.5)
            pid = await _escaped_pid(client, worker.id)
            assert (await client.wait(worker.id)).state == "finished"
        with reaped_after([dest] if move == "new" else [], [pid]):
            assert alive(pid), "the child was ended with its worker: nothing to test"
            assert cgrouped.terminate() == 0
            assert not alive(pid), f"the child that moved into {move}'s cgroup survived"


async def test_a_child_that_moved_into_a_cgroup_inside_its_own_and_dropped_its_id_ends(
    user: AsyncClient,
) -> None:
    """A cgroup the worker made inside its own is still the worker's: its stop ends what
    is in there by the cgroup, not by the id (cleared here), and removes both cgroups."""
    with trio.fail_after(30):
        base = base_of((await user.info()).tree_tracking)
        dest = base / "@W@" / "inner"
        worker = await user.spawn([*sh(ESCAPE), "sh", str(dest), "env -i"], grace=0.5)
        own = base / worker.id
        pid = await _escaped_pid(user, worker.id)
        with reaped_after([own / "inner", own], [pid]):
            assert str(pid) in (own / "inner" / "cgroup.procs").read_text().split()
            assert not carries_an_id(pid)
            assert await user.stop(worker.id)
            assert not alive(pid), "the child in a cgroup inside its worker's survived"
            while own.exists():  # removed right after the answer, nested cgroup and all
                await user.info()


async def test_a_child_read_by_an_earlier_stops_search_is_found_once_orphaned(
    user: AsyncClient,
) -> None:
    """A search takes again what the last one read where nothing can have changed; a
    child that moved out, read while its parent (the worker) ran, is orphaned by its
    worker's stop, and that stop reads it again and ends it. (More pids than PROBE_MAX
    are handed out between, so both searches list /proc, where they take again.)"""
    with trio.fail_after(30):
        other = await user.spawn(["sleep", "60"], grace=0)
        worker_id, pid, _, made = await _escaping_worker(user, "new")
        with reaped_after(made, [pid]):
            forks = f"for i in $(seq {PROBE_MAX + 50}); do /bin/true; done"
            await trio.run_process(["sh", "-c", forks])
            assert await user.stop(other.id)  # a search that reads the child, not orphaned
            assert alive(pid)
            assert await user.stop(worker_id)
            assert not alive(pid), "the child read by the earlier search survived its stop"
