"""The relay program itself (daemon/processes/_relay_program.py), driven over its real
socket as the daemon drives it: credit per stream, and what it does with a message it
cannot act on (a stream it does not hold, garbage, descriptors past its own limit)."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import sys
from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.daemon.processes import _relay_program as wire


class _Relay:
    def __init__(self, sock: trio.socket.SocketType, proc: trio.Process) -> None:
        self.sock = sock
        self.proc = proc

    async def send(self, message: object, fds: list[int] | None = None) -> None:
        data = message if isinstance(message, bytes) else wire.encoder.encode(message)
        if fds:
            rights = array.array("i", fds).tobytes()
            await self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        else:
            await self.sock.send(data)

    async def receive(self) -> wire.FromRelay:
        data = await self.sock.recv(wire.MESSAGE_BYTES)
        assert data, "the relay closed its socket"
        return wire.from_relay.decode(data)


async def _start(env: dict[str, str] | None = None) -> AsyncIterator[_Relay]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-I", wire.__file__, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        env={**os.environ, **(env or {})},
    )
    theirs.close()
    relay = _Relay(trio.socket.from_stdlib_socket(ours), proc)
    try:
        yield relay
    finally:
        relay.sock.close()  # its socket's end: it exits
        with trio.fail_after(10):
            assert await proc.wait() == 0


@pytest.fixture
async def relay() -> AsyncIterator[_Relay]:
    async for started in _start():
        yield started


async def test_one_output_a_stream_until_its_credit(relay: _Relay) -> None:
    """A pipe with more than one chunk ready: one Output, nothing more until its Credit;
    its end of file is a message."""
    with trio.fail_after(20):
        ready = await relay.receive()
        assert isinstance(ready, wire.Ready)
        assert ready.capacity == ready.limit - wire.RESERVE
        r, w = os.pipe()
        await relay.send(wire.Hand("w1", ["stdout"]), [r])
        os.close(r)
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 2 * wire.MOST_CHUNK_BYTES)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            chunk = wire.chunk_bytes(probe)
        assert wire.CHUNK_BYTES <= chunk <= wire.MOST_CHUNK_BYTES
        os.write(w, b"x" * (chunk + 10))
        first = await relay.receive()
        assert isinstance(first, wire.Output)
        assert (first.worker, first.kind, len(first.data)) == ("w1", "stdout", chunk)
        with trio.move_on_after(0.3) as quiet:  # uncredited: it does not read the pipe again
            await relay.receive()
        assert quiet.cancelled_caught
        await relay.send(wire.Ask())
        inventory = await relay.receive()
        assert inventory == wire.Inventory(
            [wire.Held("w1", "stdout", True)], ready.capacity, relay.proc.pid
        )
        await relay.send(wire.Credit("w1", "stdout"))
        second = await relay.receive()
        assert isinstance(second, wire.Output)
        assert second.data == b"x" * 10
        os.close(w)
        await relay.send(wire.Credit("w1", "stdout"))
        assert await relay.receive() == wire.Eof("w1", "stdout")


async def test_what_the_relay_cannot_act_on_is_said_and_it_serves_on(relay: _Relay) -> None:
    """A credit for a worker it does not hold, garbage, a hand of streams it holds already
    or with too few descriptors: each answered, and the relay serves on."""
    with trio.fail_after(20):
        assert isinstance(await relay.receive(), wire.Ready)
        await relay.send(wire.Credit("nobody", "stdout"))
        unknown = await relay.receive()
        assert isinstance(unknown, wire.Unknown)
        assert "nobody" in unknown.what
        await relay.send(b"\xc1 not msgpack")
        garbage = await relay.receive()
        assert isinstance(garbage, wire.Unknown)
        assert "decode" in garbage.what
        await relay.send(wire.Drop("nobody"))  # nothing to drop: nothing said
        r, w = os.pipe()
        await relay.send(wire.Hand("w1", ["stdout", "stderr"]), [r])
        refused = await relay.receive()
        assert isinstance(refused, wire.Refused)
        assert "1 descriptors" in refused.why
        await relay.send(wire.Hand("w1", ["stdout"]), [r])
        await relay.send(wire.Hand("w1", ["stdout"]), [r])
        refused = await relay.receive()
        assert isinstance(refused, wire.Refused)
        assert "already" in refused.why
        os.close(r)
        os.write(w, b"still here\n")
        assert await relay.receive() == wire.Output("w1", "stdout", b"still here\n")
        os.close(w)


async def test_a_hand_past_the_relays_own_limit_is_refused_not_lost_silently() -> None:
    """A relay whose limit leaves room for 2 streams: a third is refused as full, and a
    hand whose descriptors the kernel could not give it whole (MSG_CTRUNC) is refused;
    the streams it holds still flow."""
    limit = wire.RESERVE + 2
    async for relay in _start({wire.NOFILE_ENV: str(limit)}):
        with trio.fail_after(20):
            ready = await relay.receive()
            assert ready == wire.Ready(2, limit)
            pipes = [os.pipe() for _ in range(3)]
            await relay.send(wire.Hand("a", ["stdout", "stderr"]), [pipes[0][0], pipes[1][0]])
            await relay.send(wire.Hand("b", ["stdout"]), [pipes[2][0]])
            full = await relay.receive()
            assert isinstance(full, wire.Refused)
            assert "full" in full.why
            # Descriptors the kernel could not hand it whole (MSG_CTRUNC): closed, said.
            extra = [os.pipe() for _ in range(6)]
            kinds = [f"s{n}" for n in range(len(extra))]
            await relay.send(wire.Hand("d", kinds), [r for r, _ in extra])
            cut = await relay.receive()
            assert isinstance(cut, wire.Refused)
            assert "MSG_CTRUNC" in cut.why
            os.write(pipes[0][1], b"a out\n")
            assert await relay.receive() == wire.Output("a", "stdout", b"a out\n")
            for r, w in [*pipes, *extra]:
                os.close(r)
                os.close(w)
