"""A review of the output relay (issue 24, item 8) with fresh eyes: what a relay that is
slow, stalled, killed or asked for a large inventory does to the workers it serves.
Real daemons, real relays, real pipes."""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.processes import _relay_program as wire
from subagentd.daemon.processes._relay import ask_inventory
from subagentd.protocol import ReloadReply
from subagentd.protocol.errors import RemoteError

from .conftest import DaemonProcess
from .helpers import (
    alive,
    descriptors,
    paged_stdout,
    pending_wakes,
    reload_on_own_connection,
    sh,
    wait_output,
)
from .test_relay import _relays, reload_on_own_connection_lost

#: Streams a relay holds for 7,000 workers: far inside its capacity (this machine's
#: hard limit of 20,000 less its reserve), and an inventory larger than one message.
WORKERS = 7_000


async def test_a_rebuilt_handoff_gets_the_whole_inventory_of_a_relay_of_thousands() -> None:
    """The inventory a rebuilt handoff asks of a relay holding 7,000 workers' streams (by
    keys as the daemon makes them, `w-<10 hex>/<ns>`): every one comes back. One message
    of it would be ~600 KB, past the MESSAGE_BYTES the daemon reads (cut: not a relay, so
    closed, and every relayed worker lost), or past a default socket's send buffer (the
    relay dies of EMSGSIZE)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-I", wire.__file__, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    r, w = os.pipe()
    try:
        with trio.fail_after(120):
            sock = trio.socket.from_stdlib_socket(ours)
            ready = wire.from_relay.decode(await sock.recv(wire.MESSAGE_BYTES))
            assert isinstance(ready, wire.Ready)
            assert ready.capacity >= 2 * WORKERS, "this machine's limit is too low for it"
            rights = array.array("i", [r, r]).tobytes()
            keys = [f"w-{i:010x}/{1764646962000000000 + i}" for i in range(WORKERS)]
            for key in keys:
                hand = wire.encoder.encode(wire.Hand(key, ["stdout", "stderr"]))
                await sock.sendmsg([hand], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            carried = await trio.to_thread.run_sync(ask_inventory, ours.fileno())
            assert carried is not None, "the relay's socket was not taken for a relay's"
            assert carried.pid == proc.pid
            assert len(carried.streams) == WORKERS
            assert all(sorted(kinds) == ["stderr", "stdout"] for kinds in carried.streams.values())
            assert sorted(carried.streams) == sorted(keys)
    finally:
        os.close(r)
        os.close(w)  # 14,000 ends of file, their Eofs sent as the daemon's end closes:
        ours.close()
        with trio.fail_after(30):  # it ends as at its socket's end, not of ECONNRESET
            assert await proc.wait() == 0


RELAY_ALL = ("--relay-above", "0")


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The relay `pid` stalled (SIGSTOP) for the block's time."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _logged(daemon: DaemonProcess, event: str, worker_id: str) -> None:
    """Until the daemon's log has `event` for `worker_id` (a window of the daemon's own
    passing, which nothing outside it can await: the log is read again every 50 ms)."""
    asked = f'"worker":"{worker_id}"'
    while True:
        if any(event in line and asked in line for line in daemon.log().splitlines()):
            return
        await trio.sleep(0.05)


async def _one_relay(client: AsyncClient, daemon: DaemonProcess) -> int:
    """Start a relayed worker and answer the pid of the relay that serves it."""
    assert daemon.proc is not None
    first = await client.spawn(sh("echo up; exec sleep 600"))
    await wait_output(client, first.id, b"up\n")
    (relay,) = _relays(daemon.proc.pid)
    return relay


async def test_a_stalled_relay_hangs_no_request_and_serves_on_once_it_runs(
    daemon_dirs: DaemonProcess,
) -> None:
    """A relay stopped (SIGSTOP): `info`, a spawn, a stop and a reload each answer (the
    daemon awaits nothing of it but its socket); once it runs again, a worker spawned
    meanwhile has all its output, and a worker stopped meanwhile is over."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            with _stopped(relay):
                assert (await client.info()).relays is not None
                later = await client.spawn(sh("seq 1 5000; read x"), stdin_open=True)
                victim = await client.spawn(["sleep", "600"])
                await client.stop(victim.id)
                assert (await client.wait(victim.id)).state == "stopped"
                reply = await reload_on_own_connection(daemon_dirs)
                assert isinstance(reply, ReloadReply), reply
            want = "".join(f"{i}\n" for i in range(1, 5001)).encode()
            assert await wait_output(client, later.id, b"\n5000\n") == want
            await client.send(later.id, "\n", eof=True)
            assert (await client.wait(later.id)).state == "finished"
            assert await paged_stdout(client, later.id) == want


async def test_what_a_relayed_worker_wrote_before_it_exited_is_journaled_though_its_relay_lagged(
    daemon_dirs: DaemonProcess,
) -> None:
    """A relayed worker writes its last line and exits while its relay is stalled, past
    the drain's quiet (PIPE_DRAIN_SECONDS): only the relay, which holds the pipe, can tell
    quiet from behind, so the drain asks it, and the worker does not end until it has
    answered. Once the relay runs again the line is in its journal, as a piped worker's
    last line always is, and then the worker ends."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            worker = await client.spawn(sh("read x; echo last words"), stdin_open=True)
            with _stopped(relay):
                await client.send(worker.id, "\n", eof=True)
                await _logged(daemon_dirs, "worker.drain_asks_relay", worker.id)
                assert (await client.status(worker.id)).state == "running"
            assert (await client.wait(worker.id)).state == "finished"
            assert await paged_stdout(client, worker.id) == b"last words\n"


async def test_a_relay_that_never_answers_the_drain_costs_a_note_not_the_ending(
    daemon_dirs: DaemonProcess,
) -> None:
    """The hostile side of the drain's question: a relay stalled for good (stopped past
    PROBE_SECONDS) does not hold the worker's ending for ever; the worker ends, and its
    journal says that the last of its output may be missing, never silently."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            worker = await client.spawn(sh("read x; echo last words"), stdin_open=True)
            with _stopped(relay):
                await client.send(worker.id, "\n", eof=True)
                assert (await client.wait(worker.id)).state == "finished"
                page = await client.watch_page(worker.id)
                notes = [e.data for e in page.entries if e.kind == "note"]
                assert any(b"output relay did not say" in note for note in notes), notes


def _targets(pid: int) -> list[str]:
    """What each descriptor of `pid` is (a path, `pipe:[..]`, `socket:[..]`)."""
    return [target for target, _ in descriptors(pid).values()]


async def test_the_relay_holds_nothing_of_the_daemons_but_its_socket_and_the_pipes(
    daemon_dirs: DaemonProcess,
) -> None:
    """The relay's descriptors, before and after a reload: its std streams, its socket,
    its epoll and the relayed pipes; never the listening socket, the store, the state
    dir's lock, a journal, another worker's stdin (kept in the daemon). A spawn that
    fails (no such program) leaves no descriptor behind in the daemon or the relay."""
    daemon_dirs.start(*RELAY_ALL)
    assert daemon_dirs.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            fed = await client.spawn(sh("echo fed; cat"), stdin_open=True)
            await wait_output(client, fed.id, b"fed\n")
            stdin = os.readlink(f"/proc/{(await client.status(fed.id)).pid}/fd/0")
            for _ in range(2):
                held = _targets(relay)
                sockets = [t for t in held if t.startswith("socket:")]
                others = [t for t in held if not t.startswith(("pipe:", "socket:"))]
                assert len(sockets) == 1, held
                assert set(others) <= {"/dev/null", "anon_inode:[eventpoll]"} | {
                    str(daemon_dirs.log_path)
                }, held
                assert len([t for t in held if t.startswith("pipe:")]) == 4  # 2 workers
                assert stdin.startswith("pipe:")
                assert stdin not in held
                reply = await reload_on_own_connection(daemon_dirs)
                assert isinstance(reply, ReloadReply), reply
            daemon_before = len(descriptors(daemon_dirs.proc.pid))
            relay_before = len(descriptors(relay))
            for _ in range(20):
                with pytest.raises(RemoteError):
                    await client.spawn(["/nonexistent/program"])
            assert len(descriptors(daemon_dirs.proc.pid)) <= daemon_before
            assert len(descriptors(relay)) == relay_before


async def test_a_relayed_worker_that_closes_stdout_and_one_whose_grandchild_holds_it(
    daemon_dirs: DaemonProcess,
) -> None:
    """A relayed worker that closes its stdout and writes on stderr: its stderr comes
    whole after stdout's end; one that exits leaving a grandchild holding its pipes ends
    as a piped one does (its tree ended with it, its output whole, in bounded time)."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            half = await client.spawn(
                sh("echo out; exec 1>&-; read x; seq 1 3000 >&2"), stdin_open=True
            )
            await wait_output(client, half.id, b"out\n")
            await client.send(half.id, "\n", eof=True)
            assert (await client.wait(half.id)).state == "finished"
            page = await client.watch_page(half.id, since=0, limit=100_000)
            err = b"".join(e.data for e in page.entries if e.kind == "stderr")
            assert err == "".join(f"{i}\n" for i in range(1, 3001)).encode()
            assert await paged_stdout(client, half.id) == b"out\n"
            left = await client.spawn(sh('sleep 600 & echo "child $!"; seq 1 2000'))
            assert (await client.wait(left.id)).state == "finished"
            out = await paged_stdout(client, left.id)
            child = int(out.split(b"\n", 1)[0].split()[1])
            assert out.split(b"\n", 1)[1] == "".join(f"{i}\n" for i in range(1, 2001)).encode()
            assert not alive(child)


async def test_stop_run_of_many_relayed_workers_writing_as_they_end(
    daemon_dirs: DaemonProcess,
) -> None:
    """300 relayed workers, each writing a line as its stop comes: one stop_run ends them
    all, every last line is in its journal, and every wake comes once."""
    daemon_dirs.start(*RELAY_ALL)
    script = "trap 'echo bye; exit 0' TERM; echo up; sleep 600 & wait"
    with trio.fail_after(180):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(sh(script), run=run)).id for _ in range(300)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            assert sorted(await client.stop_run(run)) == sorted(ids)
            short = [w for w in ids if await paged_stdout(client, w) != b"up\nbye\n"]
            assert not short, f"{len(short)} of {len(ids)} lost their last line"
        woken = [w.id for w in await pending_wakes(daemon_dirs, run)]
        assert sorted(woken) == sorted(ids)


async def _gone(pid: int) -> None:
    """Until `pid` (not our child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_sigterm_shutdown_with_relayed_workers_leaves_nothing_running(
    daemon_dirs: DaemonProcess,
) -> None:
    """SIGTERM with 30 relayed workers live: the daemon exits 0, no worker nor relay is
    left running, and the next start has each worker ended once, with its wake."""
    daemon_dirs.start(*RELAY_ALL)
    assert daemon_dirs.proc is not None
    with trio.fail_after(120):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(sh("echo up; sleep 600"), run=run)).id for _ in range(30)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
            relays = _relays(daemon_dirs.proc.pid)
            assert relays
        assert await trio.to_thread.run_sync(daemon_dirs.terminate) == 0
        for pid in relays:
            await _gone(pid)
        assert not [pid for pid in pids if pid is not None and alive(pid)]
        daemon_dirs.start(*RELAY_ALL)
        async with AsyncClient(daemon_dirs.socket) as client:
            states = {(await client.status(w)).state for w in ids}
            assert states <= {"stopped", "interrupted"}, states
        woken = [w.id for w in await pending_wakes(daemon_dirs, run)]
        assert sorted(woken) == sorted(ids)


async def test_reloads_while_floods_fill_the_relays_socket_lose_and_double_nothing(
    daemon_dirs: DaemonProcess,
) -> None:
    """Six relayed workers flooding at once (a chunk of each in flight: more than the
    socket's buffer holds, so the relay keeps one unsent) through four reloads: each
    worker's stdout, counted byte by byte, is what it wrote, once."""
    daemon_dirs.start(*RELAY_ALL)
    lines = 400_000
    want = "".join(f"{i}\n" for i in range(1, lines + 1)).encode()
    with trio.fail_after(240):
        async with AsyncClient(daemon_dirs.socket) as client:
            ids = [
                (await client.spawn(sh(f"read x; seq 1 {lines}; read y"), stdin_open=True)).id
                for _ in range(6)
            ]
            for worker_id in ids:
                await client.send(worker_id, "\n")
            for _ in range(4):
                reply = await reload_on_own_connection(daemon_dirs)
                assert isinstance(reply, ReloadReply), reply
        async with AsyncClient(daemon_dirs.socket) as client:
            for worker_id in ids:
                assert await wait_output(client, worker_id, f"\n{lines}\n".encode()) == want
                await client.send(worker_id, "\n", eof=True)
                assert (await client.wait(worker_id)).state == "finished"
                assert await paged_stdout(client, worker_id) == want


async def test_the_relay_killed_as_a_reload_begins_ends_its_workers_interrupted(
    daemon_dirs: DaemonProcess,
) -> None:
    """The relay SIGKILLed as a reload is asked: the reload answers (or the new image
    serves), each relayed worker ends `interrupted` with a note, none is left running,
    and the next relayed spawn gets a new relay whose output comes whole."""
    daemon_dirs.start(*RELAY_ALL)
    assert daemon_dirs.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            ids = [(await client.spawn(sh("echo up; sleep 600"))).id for _ in range(5)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reload_on_own_connection_lost, daemon_dirs)
            await trio.lowlevel.checkpoint()  # the reload asked
            os.kill(relay, signal.SIGKILL)
        async with AsyncClient(daemon_dirs.socket) as client:
            for worker_id in ids:
                assert (await client.wait(worker_id)).state == "interrupted"
            assert not [pid for pid in pids if pid is not None and alive(pid)]
            fresh = await client.spawn(sh("seq 1 1000"))
            assert (await client.wait(fresh.id)).state == "finished"
            assert (
                await paged_stdout(client, fresh.id)
                == "".join(f"{i}\n" for i in range(1, 1001)).encode()
            )
            assert relay not in _relays(daemon_dirs.proc.pid)


async def test_endings_during_a_reload_that_waits_for_relayed_chunks_are_not_lost(
    daemon_dirs: DaemonProcess,
) -> None:
    """Relayed floods (a chunk received and not yet journaled at most freezes) while
    workers end around each of ten reloads: every one of those ends `failed` with its
    exit code 7, none `stopped_by_reload` (an ending in hand when the exec came)."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(240):
        async with AsyncClient(daemon_dirs.socket) as client:
            floods = [
                (
                    await client.spawn(sh("read x; yes flood | head -c 400000000"), stdin_open=True)
                ).id
                for _ in range(3)
            ]
            enders = [
                (
                    await client.spawn(
                        sh(f"read x; sleep 0.{n % 10}{n % 7}; seq 1 {n * 50}; exit 7"),
                        stdin_open=True,
                    )
                ).id
                for n in range(120)
            ]
            for worker_id in floods + enders:
                await client.send(worker_id, "\n")
        for _ in range(10):
            reply = await reload_on_own_connection(daemon_dirs)
            assert isinstance(reply, ReloadReply), reply
        async with AsyncClient(daemon_dirs.socket) as client:
            states = [(await client.wait(w)).state for w in enders]
            assert states == ["failed"] * len(enders), states
            for worker_id in floods:
                await client.stop(worker_id)


async def test_a_burst_of_spawns_past_every_small_relays_limit_loses_no_worker(
    daemon_dirs: DaemonProcess,
) -> None:
    """40 spawns at once, each relay holding 3 workers (8 relays at most: 24 relayed, the
    rest keep their pipes): no hand is refused, no worker is interrupted, every worker's
    output comes whole, and `info` counts what the relays hold."""
    daemon_dirs.start(*RELAY_ALL, env={wire.NOFILE_ENV: str(wire.RESERVE + 6)})
    assert daemon_dirs.proc is not None
    want = "".join(f"{i}\n" for i in range(1, 2001)).encode()
    with trio.fail_after(120):
        async with AsyncClient(daemon_dirs.socket) as client:
            ids: list[str] = []

            async def spawn() -> None:
                worker = await client.spawn(sh("seq 1 2000; read x"), stdin_open=True)
                ids.append(worker.id)

            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    nursery.start_soon(spawn)
            for worker_id in ids:
                assert await wait_output(client, worker_id, b"\n2000\n") == want
            said = (await client.info()).relays
            assert said is not None
            assert len(said.pids) == len(_relays(daemon_dirs.proc.pid)) <= 8
            assert said.streams <= said.capacity == 6 * len(said.pids)
            for worker_id in ids:
                await client.send(worker_id, "\n", eof=True)
                assert (await client.wait(worker_id)).state == "finished"
                assert await paged_stdout(client, worker_id) == want
    assert "relay.refused" not in daemon_dirs.log()


@pytest.mark.xfail(
    strict=True,
    reason="a rebuilt handoff whose relay does not answer its Ask within the second "
    "(stalled, busy) closes the relay's socket as nothing's: the relay exits with every "
    "pipe it held, and its workers are adopted as if they had no output at all (their "
    "next write is EPIPE: the worker ends `failed`, blamed on it); not `interrupted` "
    "with a note as at a relay's death. A pipe not inherited cannot tell a relayed "
    "stream from one already at its end: the store would have to say which workers "
    "were relayed, or the relay be waited for as long as it takes",
)
async def test_a_rebuilt_handoff_with_a_stalled_relay_ends_its_workers_interrupted(
    daemon_dirs: DaemonProcess,
) -> None:
    """A reload whose checkpoint does not decode while the relay is stalled: the new
    image cannot ask it what it holds; the workers it served end `interrupted`, with a
    note in the journal, as at the relay's death, not on unsupervised with output lost."""
    daemon_dirs.start(*RELAY_ALL, env={"SUBAGENTD_FAULT": "handoff:garbage"})
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            worker = await client.spawn(sh("echo up; read x; echo after"), stdin_open=True)
            await wait_output(client, worker.id, b"up\n")
        with _stopped(relay):
            assert await reload_on_own_connection_lost(daemon_dirs)
        async with AsyncClient(daemon_dirs.socket) as client:
            await _gone(relay)
            await client.send(worker.id, "\n", eof=True)
            assert (await client.wait(worker.id)).state == "interrupted"


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


async def test_the_relay_is_no_workers_to_a_stops_search_nor_to_a_stop_run(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    """A stop whose worker left an orphan behind (a double fork: found by its marker) and
    a stop_run of the rest: the relay carries no worker's marker, outlives them, and the
    next worker's output still comes through it."""
    daemon_dirs.start(*RELAY_ALL)
    assert daemon_dirs.proc is not None
    orphan_file = tmp_path / "orphan"
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            assert not [v for v in _environ(relay) if v.startswith(b"SUBAGENTD_WORKER")]
            run = await client.new_run()
            escaper = await client.spawn(
                sh(f"(sh -c 'echo $$ > {orphan_file}; exec sleep 600' &); echo up; sleep 600"),
                run=run,
            )
            await wait_output(client, escaper.id, b"up\n")
            others = [(await client.spawn(sh("echo up; sleep 600"), run=run)).id for _ in range(5)]
            for worker_id in others:
                await wait_output(client, worker_id, b"up\n")
            orphan = int(orphan_file.read_text())
            await client.stop(escaper.id)
            assert (await client.wait(escaper.id)).state == "stopped"
            assert not alive(orphan)
            await client.stop_run(run)
            assert alive(relay)
            assert _relays(daemon_dirs.proc.pid) == [relay]
            after = await client.spawn(sh("seq 1 500"))
            assert (await client.wait(after.id)).state == "finished"
            assert (
                await paged_stdout(client, after.id)
                == "".join(f"{i}\n" for i in range(1, 501)).encode()
            )


async def test_a_sigterm_shutdown_with_a_stalled_relay_ends_and_the_relay_after_it(
    daemon_dirs: DaemonProcess,
) -> None:
    """SIGTERM while the relay is stalled, 10 relayed workers live: the daemon still
    exits 0 with its workers ended (it waits for nothing of the relay's but its pipes'
    quiet), and the relay, run again, finds its socket's end and exits."""
    daemon_dirs.start(*RELAY_ALL)
    assert daemon_dirs.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            ids = [(await client.spawn(sh("echo up; sleep 600"))).id for _ in range(10)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
        with _stopped(relay):
            assert await trio.to_thread.run_sync(daemon_dirs.terminate) == 0
            assert not [pid for pid in pids if pid is not None and alive(pid)]
        await _gone(relay)
