"""The blocking client's ``timeout``: each send and each receive that waits longer raises
TimeoutError, whichever way the socket keeps the bound (a receive's: test_stop_switch)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from subagentd.client import Client
from subagentd.protocol import (
    MAX_INPUT_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    Welcome,
    client_decoder,
    encode,
)


async def _welcome_then_read_nothing(listener: trio.socket.SocketType) -> None:
    """A daemon that says welcome to the first client and then reads nothing it sends."""
    conn, _ = await listener.accept()
    async with trio.SocketStream(conn) as stream:
        decoder = FrameDecoder()
        while (body := decoder.next_frame()) is None:
            decoder.feed(await stream.receive_some())
        hello = client_decoder.decode(body)
        await stream.send_all(
            encode(Welcome(id=hello.id, version=PROTOCOL_VERSION, daemon_version="test", pid=1))
        )
        await trio.sleep_forever()


async def test_a_send_the_daemon_does_not_take_ends_with_a_timeout(short_tmp: Path) -> None:
    path = short_tmp / "s.sock"
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen()

    def spawn_more_than_the_socket_holds() -> None:
        with Client(path, timeout=0.5) as client, pytest.raises(TimeoutError):
            client.spawn(["true"], input=b"x" * MAX_INPUT_BYTES)

    with trio.fail_after(20), listener:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_welcome_then_read_nothing, listener)
            await trio.to_thread.run_sync(spawn_more_than_the_socket_holds)
            nursery.cancel_scope.cancel()
