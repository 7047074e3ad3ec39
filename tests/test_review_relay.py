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

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.processes import _relay_program as wire
from subagentd.daemon.processes._relay import ask_inventory
from subagentd.protocol import ReloadReply

from .conftest import DaemonProcess
from .helpers import paged_stdout, reload_on_own_connection, sh, wait_output
from .test_relay import _relays

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


@pytest.mark.xfail(
    strict=True,
    reason="a relayed worker's drain after its exit (PIPE_DRAIN_SECONDS of quiet) sees only "
    "what the relay forwarded: a relay behind (stalled, or busy with thousands of streams) "
    "makes output the worker wrote before it exited look like none, its stream is "
    "dropped, and the relay's late Output is thrown away (relay.output_dropped): the "
    "journal ends short, silently. A piped worker's drain reads the pipe itself. Needs "
    "the drop to be a drain at the relay (read what the pipe holds now, then an end)",
)
async def test_what_a_relayed_worker_wrote_before_it_exited_is_journaled_though_its_relay_lagged(
    daemon_dirs: DaemonProcess,
) -> None:
    """A relayed worker writes its last line and exits while its relay is stalled for
    until the worker has ended (PIPE_DRAIN_SECONDS at least): once the relay runs again, the line is in its journal, as
    a piped worker's last line always is."""
    daemon_dirs.start(*RELAY_ALL)
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            relay = await _one_relay(client, daemon_dirs)
            worker = await client.spawn(sh("read x; echo last words"), stdin_open=True)
            with _stopped(relay):
                await client.send(worker.id, "\n", eof=True)
                assert (await client.wait(worker.id)).state == "finished"
            assert await paged_stdout(client, worker.id) == b"last words\n"
