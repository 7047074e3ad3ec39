"""Workers' exits told by SIGCHLD, with no pidfd a worker (daemon/processes/_reaper.py):
every exit handed once, none starved behind a zombie the peek cannot see past, and no
child that is not a worker's ever reaped by the loop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.processes import _reaper
from subagentd.daemon.processes._reaper import Reaper, Watched
from subagentd.daemon.processes._tree import read_stat

from .conftest import DaemonProcess
from .helpers import RawConnection, reload_on_own_connection, wait_output

#: Workers ending at once.
AT_ONCE = 200
#: A worker that exits while its daemon execs a reload's new image: once it has seen the
#: daemon catch SIGCHLD (the reaper runs), it exits as soon as the daemon no longer does
#: (an exec resets every handler; the new image's reaper has not begun yet).
EXITS_IN_THE_EXEC = """
import os, sys, time
def catches_sigchld():
    with open(f"/proc/{os.getppid()}/status") as f:
        mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) & (1 << (17 - 1)))
while not catches_sigchld():
    time.sleep(0.001)
print("watching", flush=True)
while catches_sigchld():
    time.sleep(0.0005)
sys.exit(3)
"""


def _child(code: str, keep: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=keep)


def _watch(reaper: Reaper, child: subprocess.Popen[bytes]) -> Watched:
    stat = read_stat(child.pid)
    assert stat is not None
    return reaper.watch(child.pid, stat.starttime)


async def _until_zombie(pid: int) -> None:
    pidfd = os.pidfd_open(pid)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


def _zombie(pid: int) -> bool:
    """Whether `pid` is our child, exited and unreaped (one look, reaping nothing)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


async def test_a_strangers_zombie_is_never_reaped_and_hides_no_workers_exit() -> None:
    """A child that is no worker's (as trio's `--check` child) exits first and lingers a
    zombie: the peek sees it first and no further, yet the workers that exit behind it
    are handed their exits (asked one by one), the stranger is left to its own reaper
    (which reads its real status, not the 0 a stolen one gives), and the loop, waiting
    meanwhile, does not spin."""
    reaper = Reaper()
    collects = 0
    real_collect = reaper.collect

    def counted() -> _reaper.Blocked:
        nonlocal collects
        collects += 1
        return real_collect()

    reaper.collect = counted  # type: ignore[method-assign]
    stranger = _child("raise SystemExit(7)")
    await _until_zombie(stranger.pid)
    workers = [_child("import time; time.sleep(0.3); raise SystemExit(3)") for _ in range(5)]
    watched = [_watch(reaper, child) for child in workers]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(reaper.run)
            for each in watched:
                await each.exited.wait()
            assert [reaper.reap(each) for each in watched] == [3] * len(watched)
            for child in workers:
                child.returncode = 3  # reaped here: its Popen must not look for it
            before = collects
            await trio.sleep(0.5)  # the stranger lingers: the loop waits, it does not spin
            assert collects - before <= 10, collects - before
            # Still a zombie, for its own reaper alone.
            assert _zombie(stranger.pid)
            assert stranger.wait() == 7
            nursery.cancel_scope.cancel()


async def test_many_exits_at_once_behind_a_zombie_handed_are_each_handed_once() -> None:
    """AT_ONCE workers exit together while an older one's zombie is handed and not yet
    reaped (its supervision still ending its tree): each is handed once, none waits for
    that reap."""
    reaper = Reaper()
    hands: dict[int, int] = {}
    real_hand = reaper._hand

    def counted(watched: Watched) -> None:
        hands[watched.pid] = hands.get(watched.pid, 0) + 1
        real_hand(watched)

    reaper._hand = counted  # type: ignore[method-assign]
    held = _child("raise SystemExit(1)")
    first = _watch(reaper, held)
    read, write = os.pipe()
    go = f"import os; os.read({read}, 1); raise SystemExit(5)"
    workers = [_child(go, keep=(read,)) for _ in range(AT_ONCE)]
    os.close(read)
    watched = [_watch(reaper, child) for child in workers]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(reaper.run)
            await first.exited.wait()  # handed, left unreaped: it blocks the peek
            os.close(write)  # every worker exits now
            for each in watched:
                await each.exited.wait()
            assert all(hands[each.pid] == 1 for each in watched), hands
            assert {reaper.reap(each) for each in watched} == {5}
            assert reaper.reap(first) == 1
            for child in [held, *workers]:
                child.returncode = 0  # reaped here: its Popen must not look for it
            assert hands[first.pid] == 1
            assert len(reaper) == 0
            nursery.cancel_scope.cancel()


async def test_a_child_of_another_thread_is_handed_behind_an_own_zombie() -> None:
    """The peek walks the event loop thread's children first, then each other thread's: a
    worker the forker's thread forked (one with limits), older than a zombie of the event
    loop's that blocks the peek, is still handed when it exits (it is watched
    `elsewhere`). Without, it waited for a SIGCHLD that told of no one else."""
    reaper = Reaper()
    read, write = os.pipe()
    forked: list[subprocess.Popen[bytes]] = []
    go = f"import os; os.read({read}, 1); raise SystemExit(4)"
    spawned, done = threading.Event(), threading.Event()

    def fork_and_stay() -> None:  # a thread that lives on, as the forker's does
        forked.append(_child(go, keep=(read,)))
        spawned.set()
        done.wait()

    thread = threading.Thread(target=fork_and_stay, daemon=True)
    thread.start()
    spawned.wait()
    (other,) = forked
    os.close(read)
    stat = read_stat(other.pid)
    assert stat is not None
    elsewhere = reaper.watch(other.pid, stat.starttime, elsewhere=True)
    await trio.sleep(2 / os.sysconf("SC_CLK_TCK"))  # the zombie's start a tick later: younger
    held = _child("raise SystemExit(1)")
    first = _watch(reaper, held)
    assert first.starttime > elsewhere.starttime
    with contextlib.ExitStack() as cleanup, trio.fail_after(30):
        cleanup.callback(done.set)
        async with trio.open_nursery() as nursery:
            await nursery.start(reaper.run)
            await first.exited.wait()  # handed, left unreaped: it blocks the peek
            os.close(write)
            await elsewhere.exited.wait()
            assert reaper.reap(elsewhere) == 4
            assert reaper.reap(first) == 1
            held.returncode = other.returncode = 0
            nursery.cancel_scope.cancel()
    done.set()
    thread.join()


async def test_a_zombie_held_through_a_long_grace_does_not_delay_another_workers_end(
    daemon: DaemonProcess,
) -> None:
    """A worker whose leader exits while its tree ignores TERM is held (unreaped) for its
    grace; a worker spawned after it, ending meanwhile, ends at once: its exit is not
    hidden behind the held zombie."""
    lingering = 'trap "" TERM; sleep 600 & exit 0'
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            held = await client.spawn(["sh", "-c", lingering], grace=30)
            later = await client.spawn(["sh", "-c", "sleep 1; exit 4"])
            ended = await client.wait(later.id)
            assert ended.exit_code == 4
            assert (await client.status(held.id)).state == "running"  # still in its grace
            await client.stop(held.id)


async def test_workers_ending_at_once_each_end_with_one_wake(daemon: DaemonProcess) -> None:
    """AT_ONCE live workers killed together (by no stop: each ends by itself): every one
    ends with its real exit and is woken for exactly once."""
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            spawned = [await client.spawn(["sleep", "600"], run=run) for _ in range(AT_ONCE)]
            for worker in spawned:
                assert worker.pid is not None
                os.kill(worker.pid, signal.SIGKILL)
            for worker in spawned:
                assert (await client.wait(worker.id)).exit_code == -signal.SIGKILL
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=1, run=run))
            woken: list[str] = []
            while len(woken) < AT_ONCE:
                page = await conn.receive()
                assert isinstance(page, p.Wakes), page
                woken += [w.id for w in page.wakes]
            assert sorted(woken) == sorted(w.id for w in spawned)  # each once


async def test_a_worker_exiting_during_a_reloads_exec_ends_once(daemon: DaemonProcess) -> None:
    """A worker exits in the exec, its SIGCHLD sent to an image that no longer catches
    it: the new image's reaper finds it at its first look, and it ends with its exit
    code and one wake."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn([sys.executable, "-c", EXITS_IN_THE_EXEC], run=run)
            await wait_output(client, worker.id, b"watching\n")
        await reload_on_own_connection(daemon)
        async with AsyncClient(daemon.socket) as client:
            ended = await client.wait(worker.id)
            assert ended.exit_code == 3
            assert ended.state not in ("interrupted", "stopped_by_reload"), ended.state
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=1, run=run))
            page = await conn.receive()
            assert isinstance(page, p.Wakes), page
            assert [w.id for w in page.wakes] == [worker.id]  # once
