"""The daemon's budgets: descriptors, frames, listings, memory and shutdown time.

Each test pushes a real daemon to one of its limits through the socket, as a
careless or hostile client would, and checks that it says so, serves on,
loses nothing, and that a bystander worker is still supervised.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import resource
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol.errors import Busy

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, sh, wait_output


def _fds(pid: int) -> list[int]:
    return [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")]


def _limit_descriptors(pid: int, spare: int) -> int:
    """Lower `pid`'s RLIMIT_NOFILE to leave it `spare` free descriptors; the new limit."""
    limit = max(_fds(pid)) + 1 + spare
    _soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    return limit


@contextlib.contextmanager
def _held_connections(path: os.PathLike[str], count: int) -> Iterator[list[socket.socket]]:
    """`count` connections that send nothing, closed on the way out."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            sock.settimeout(10)
            sock.connect(os.fspath(path))
        yield held
    finally:
        for sock in held:
            sock.close()


async def _wait_problem(client: AsyncClient, wanted: str) -> list[str]:
    """Poll `info` until one of its problems mentions `wanted`."""
    while True:
        problems = (await client.info()).problems
        if any(wanted in problem for problem in problems):
            return problems
        await trio.sleep(0.05)


def _welcomed(path: os.PathLike[str]) -> socket.socket:
    """A connection the daemon has accepted: it answered its hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(os.fspath(path))
    sock.sendall(p.encode(p.Hello(id=1)))
    decoder = p.FrameDecoder()
    while (body := decoder.next_frame()) is None:
        decoder.feed(sock.recv(4096))
    assert isinstance(p.daemon_decoder.decode(body), p.Welcome)
    return sock


def _leave_free(pid: int, limit: int, free: int, held: list[socket.socket], path: Path) -> None:
    """Hold connections until the daemon has just `free` descriptors left."""
    while limit - len(_fds(pid)) > free:
        held.append(_welcomed(path))


async def _serves_on(daemon: DaemonProcess, bystander_id: str, bystander_pid: int | None) -> None:
    """The daemon accepts, reloads, and still supervises the bystander."""
    async with AsyncClient(daemon.socket) as fresh:
        # A write that met EMFILE meanwhile is reported until writes go through again.
        probe = await fresh.spawn(["true"])
        await fresh.collect(probe.id, wait=True)
        assert (await fresh.info()).problems == []
        reply = await fresh.reload()
        assert reply.carried_live == 1
        view = await fresh.status(bystander_id)
        assert (view.state, view.pid) == ("running", bystander_pid)
        assert await fresh.stop(bystander_id)
        assert (await fresh.status(bystander_id)).state == "stopped"
        assert [w.state for w in await fresh.ls(all=True)].count("starting") == 0


async def test_out_of_descriptors_accept_waits_and_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    assert daemon.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as held:
            bystander = await held.spawn(["sleep", "600"])
            limit = _limit_descriptors(daemon.proc.pid, spare=24)
            # More connections than the daemon has descriptors: accept(2) fails with EMFILE.
            with _held_connections(daemon.socket, limit):
                await _wait_problem(held, "cannot accept connections: EMFILE")
                with pytest.raises(Busy, match="out of file descriptors"):
                    await held.spawn(["true"])
                assert "starting" not in {w.state for w in await held.ls(all=True)}
        await _serves_on(daemon, bystander.id, bystander.pid)


async def test_spawn_without_descriptors_for_its_pipes_is_refused_cleanly(
    daemon: DaemonProcess,
) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as held:
            bystander = await held.spawn(["sleep", "600"])
            limit = _limit_descriptors(pid, spare=40)
            # Left with three: the snapshot and the journal get theirs, the pipes none.
            with _held_connections(daemon.socket, 0) as held_sockets:
                _leave_free(pid, limit, 3, held_sockets, daemon.socket)
                with pytest.raises(Busy, match="could not get its pipes") as refused:
                    await held.spawn(["true"])
                (failed_id,) = re.findall(r"worker (w-\w+) ended failed", str(refused.value))
                problems = (await held.info()).problems
                assert any("out of file descriptors" in problem for problem in problems)
            failed = await held.status(failed_id)
            assert failed.state == "failed"
            page = await held.watch_page(failed_id)
            assert any(b"out of file descriptors" in e.data for e in page.entries)
            assert page.complete
            assert await held.stop(failed_id)  # ended: it answers at once
        await _serves_on(daemon, bystander.id, bystander.pid)


# Within the bounds a spawn keeps to (each argument under 128 KiB, all of them
# under 2 MiB), twenty of these come to 29 MB: more than one frame may carry.
BIG_ARGV = ["sh", "-c", "exec sleep 600", "sh", *[chr(ord("a") + i) * 100_000 for i in range(14)]]


async def test_listing_many_workers_with_large_argv_pages_within_the_frame_limit(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            spawned = [(await client.spawn(BIG_ARGV)).id for _ in range(20)]
            listed = await client.ls()
            assert [w.id for w in listed] == spawned
            for view in listed:
                assert view.argv_cut
                assert view.argv[:4] == BIG_ARGV[:4]
                assert len(view.argv) < len(BIG_ARGV)
                assert all(len(arg) < 1000 for arg in view.argv)
            assert (await client.status(spawned[0])).argv == BIG_ARGV  # status has the whole
            # Pages follow each other without a gap or a repeat.
            conn = await RawConnection.open(daemon.socket)
            async with conn.stream:
                after, paged, pages = None, [], 0
                while True:
                    await conn.send(p.ListWorkers(id=2, after=after, limit=7))
                    page = await conn.receive()
                    assert isinstance(page, p.WorkerList)
                    paged += [w.id for w in page.workers]
                    pages += 1
                    if page.complete:
                        assert page.next is None
                        break
                    after = page.next
                assert (paged, pages) == (spawned, 3)
        listing = await trio.to_thread.run_sync(daemon.ctl, "ls")
        assert listing.returncode == 0, listing.stderr
        assert sorted(line.split()[0] for line in listing.stdout.splitlines()[1:]) == sorted(
            spawned
        )


def _peak_rss(pid: int) -> int:
    """The most memory `pid` has held resident, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


async def test_frames_still_arriving_share_one_memory_budget(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    size = 15 * 1024 * 1024
    body = bytes(size)
    sent = [0]

    async def send_all_but_the_last_byte(stream: trio.SocketStream) -> None:
        await stream.send_all(p.HEADER.pack(size))
        for start in range(0, size - 1, 1024 * 1024):
            chunk = memoryview(body)[start : min(start + 1024 * 1024, size - 1)]
            await stream.send_all(chunk)
            sent[0] += len(chunk)

    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as bystander:
            worker = await bystander.spawn(["sleep", "600"])
            before = _peak_rss(daemon.proc.pid)
            streams = [await trio.open_unix_socket(os.fspath(daemon.socket)) for _ in range(40)]
            async with trio.open_nursery() as senders:
                for stream in streams:
                    senders.start_soon(send_all_but_the_last_byte, stream)
                # Until the daemon stops taking more (or, unbudgeted, has taken it all).
                while sent[0] < 40 * (size - 1):
                    progress = sent[0]
                    await trio.sleep(0.5)
                    if sent[0] == progress:
                        break
                grown = _peak_rss(daemon.proc.pid) - before
                assert grown < 160 * 1024 * 1024, f"{sent[0]} bytes sent took {grown} bytes"
                assert (await bystander.info()).workers == {"running": 1}
                assert (await bystander.status(worker.id)).state == "running"
                senders.cancel_scope.cancel()
            for stream in streams:
                await stream.aclose()
            # Their budget comes back: a large frame is read again.
            large = await bystander.spawn(BIG_ARGV)
            assert (await bystander.status(large.id)).argv == BIG_ARGV


async def test_a_large_frame_that_stalls_is_dropped_and_gives_its_budget_back(
    daemon: DaemonProcess,
) -> None:
    size = 1024 * 1024  # budgeted: allowed 5 s + 1 s to arrive whole
    with trio.fail_after(30):
        staller = await RawConnection.open(daemon.socket)
        async with staller.stream:
            await staller.stream.send_all(p.HEADER.pack(size) + bytes(1000))
            said = await staller.receive()  # ... and nothing more is sent
            assert isinstance(said, p.Error), said
            assert (said.id, said.code) == (0, "invalid")
            assert "did not arrive whole within 6 s" in said.message
            assert await staller.receive() is None  # closed
        async with AsyncClient(daemon.socket) as client:
            large = await client.spawn(BIG_ARGV)  # the budget is whole again
            assert (await client.status(large.id)).argv == BIG_ARGV


async def test_wakes_of_implicit_runs_go_with_their_last_worker(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            named = await client.new_run()
            kept = await client.spawn(["true"], run=named)
            await client.collect(kept.id, wait=True)
            lone_runs = []
            for _ in range(50):
                lone = await client.spawn(["true"])
                await client.collect(lone.id, wait=True)
                lone_runs.append(lone.run)
        # Gone from the store too: a restart does not bring them back.
        assert await trio.to_thread.run_sync(daemon.terminate) == 0
        await trio.to_thread.run_sync(daemon.start)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            for rid, run in enumerate(lone_runs, start=2):
                await conn.send(p.Subscribe(id=rid, run=run))
                reply = await conn.receive()
                assert isinstance(reply, p.Error), f"wakes left for run {run}: {reply}"
                assert reply.code == "not_found"
            # A run made by name stays, and so do its wakes until acknowledged.
            await conn.send(p.Subscribe(id=1000, run=named))
            reply = await conn.receive()
            assert isinstance(reply, p.Wakes)
            assert [w.id for w in reply.wakes] == [kept.id]


@pytest.mark.parametrize("tracking", [[], ["--cgroups", "off"]], ids=["default", "scan"])
async def test_second_sigterm_ends_the_grace_and_loses_nothing(
    daemon_dirs: DaemonProcess, tracking: list[str]
) -> None:
    daemon = daemon_dirs
    daemon.start(*tracking)
    assert daemon.proc is not None
    # Loops on wait: a KILL that reaches its child first must not let it exit 0 by itself.
    stubborn = sh('trap "" TERM; sleep 600 & echo "$$ $!"; while :; do wait; done')
    pids: list[int] = []
    try:
        with trio.fail_after(60):
            async with AsyncClient(daemon.socket) as client:
                worker = await client.spawn(stubborn, grace=3600)
                pids = [int(pid) for pid in (await wait_output(client, worker.id, b"\n")).split()]
            daemon.proc.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(daemon.wait_notify, "STOPPING=1")
            assert all(alive(pid) for pid in pids)  # TERM ignored: its grace runs
            daemon.proc.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(functools.partial(daemon.proc.wait, 15)) == 0
            assert not any(alive(pid) for pid in pids)
            # Its ending was written before the exit: stopped, with its wake.
            await trio.to_thread.run_sync(daemon.start, *tracking)
            async with AsyncClient(daemon.socket) as client:
                view = await client.status(worker.id)
                assert (view.state, view.exit_code) == ("stopped", -signal.SIGKILL)
            conn = await RawConnection.open(daemon.socket)
            async with conn.stream:
                await conn.send(p.Subscribe(id=2, run=worker.run))
                reply = await conn.receive()
                assert isinstance(reply, p.Wakes)
                assert [(w.id, w.state) for w in reply.wakes] == [(worker.id, "stopped")]
    finally:
        for pid in pids:  # an unhurried daemon would leave them running for an hour
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


#: A soft descriptor limit below what `LOW_LIMIT_WORKERS` live workers hold in the daemon
#: (pipes, a pidfd, a journal each), above what it needs to start.
LOW_SOFT_LIMIT = 128
LOW_LIMIT_WORKERS = 40


async def test_a_daemon_started_under_a_low_soft_limit_raises_it_to_the_hard_one(
    daemon_dirs: DaemonProcess,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= LOW_SOFT_LIMIT * 4:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))
    try:  # the daemon inherits the low soft limit, as from a login shell's 1024
        daemon_dirs.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert daemon_dirs.proc is not None
    assert resource.prlimit(daemon_dirs.proc.pid, resource.RLIMIT_NOFILE) == (hard, hard)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            for _ in range(LOW_LIMIT_WORKERS):
                await client.spawn(["sleep", "600"], run=run)
            assert len(_fds(daemon_dirs.proc.pid)) > LOW_SOFT_LIMIT
            assert len(await client.stop_run(run)) == LOW_LIMIT_WORKERS
