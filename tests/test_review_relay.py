"""A review of the output relay (issue 24, item 8) with fresh eyes: what a relay that is
slow, stalled, killed or asked for a large inventory does to the workers it serves.
Real daemons, real relays, real pipes."""

from __future__ import annotations

import array
import os
import socket
import sys

import trio

from subagentd.daemon.processes import _relay_program as wire
from subagentd.daemon.processes._relay import ask_inventory

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
