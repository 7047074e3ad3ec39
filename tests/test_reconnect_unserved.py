"""A reconnect to a socket that takes connections and never says welcome gives up within the
client's reconnect window, in the trio client as in the blocking one.

A daemon stopped (SIGSTOP) or a new image stuck before it serves keeps its listening
socket: a connect succeeds (the backlog) and the hello is never answered. The test's
`Unserved` socket stands for one: it passes the client's first connection through to the
real daemon, cuts it once the client's `wait` went out on it, and from then on takes every
connection and says nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient, _core
from subagentd.protocol import FrameDecoder, Wait, client_decoder
from subagentd.protocol.errors import ConnectionLost

from .conftest import DaemonProcess
from .helpers import sh


class Unserved:
    """Serves `path`: the first connection passed through to the daemon until the client
    sent a `wait` on it, then cut; every later one taken and left unanswered."""

    def __init__(self, path: Path, daemon_socket: Path) -> None:
        self.path = path
        self.daemon_socket = daemon_socket
        self.connections = 0
        self.cut = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(os.fspath(self.path))
        sock.listen()
        task_status.started()
        await trio.serve_listeners(self._take, [trio.SocketListener(sock)])

    async def _take(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client:
            if self.connections > 1:
                await trio.sleep_forever()  # taken, never welcomed
            async with (
                await trio.open_unix_socket(os.fspath(self.daemon_socket)) as daemon,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(_pass, daemon, client)
                await _pass_until_wait(client, daemon)
                self.cut.set()
                nursery.cancel_scope.cancel()


async def _pass(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        async for data in source:
            await sink.send_all(data)


async def _pass_until_wait(client: trio.SocketStream, daemon: trio.SocketStream) -> None:
    frames = FrameDecoder()
    async for data in client:
        await daemon.send_all(data)
        frames.feed(bytes(data))
        if any(isinstance(client_decoder.decode(body), Wait) for body in frames.frames()):
            return


@contextlib.asynccontextmanager
async def unserved(daemon: DaemonProcess) -> AsyncIterator[Unserved]:
    proxy = Unserved(daemon.root / "unserved.sock", daemon.socket)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


async def test_an_async_reconnect_to_a_daemon_that_never_welcomes_gives_up_in_its_window(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(_core.RECONNECT_WINDOW + 30):
        async with unserved(daemon) as proxy, AsyncClient(proxy.path) as client:
            worker = await client.spawn(sh("sleep 600"))
            started = trio.current_time()
            with pytest.raises(ConnectionLost, match="did not serve again"):
                await client.wait(worker.id)
            assert proxy.cut.is_set()
            assert proxy.connections >= 2  # it connected again, and was never welcomed
            assert trio.current_time() - started < _core.RECONNECT_WINDOW + 10
        async with AsyncClient(daemon.socket) as cleanup:
            await cleanup.stop(worker.id)
