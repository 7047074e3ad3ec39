"""A client whose hello the daemon answers with a reload's notice (it began reloading
between the client's connect and its welcome) connects again, as a reload's clients do.

The window is made to happen: the client talks to the daemon through a socket of the
test's (`HelloHolder`) that keeps its first connection's hello from the daemon until
the daemon has said something on it, which, before any hello, only a reload's notice is.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from subagentd.client import AsyncClient, Client
from subagentd.protocol import Error, FrameDecoder, daemon_decoder

from .conftest import DaemonProcess


class HelloHolder:
    """Serves `path`, passing each connection through to the daemon's socket; on the first,
    the client's bytes (its hello) wait until the daemon has spoken there."""

    def __init__(self, path: Path, daemon_socket: Path) -> None:
        self.path = path
        self.daemon_socket = daemon_socket
        self.connections = 0
        self.first_open = trio.Event()  # the first connection's daemon side is connected
        self.first_words = b""  # what the daemon said first on it, before any hello

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(os.fspath(self.path))
        sock.listen()
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._pass_through, [listener])

    async def _pass_through(self, client: trio.SocketStream) -> None:
        first = self.connections == 0
        self.connections += 1
        async with client, await trio.open_unix_socket(os.fspath(self.daemon_socket)) as daemon:
            spoke = trio.Event()
            if first:
                self.first_open.set()
            else:
                spoke.set()

            async def to_client() -> None:
                # A side that resets (a client closing with the notice unread) hung up.
                with contextlib.suppress(trio.BrokenResourceError):
                    async for data in daemon:
                        if not spoke.is_set():
                            self.first_words = bytes(data)
                            spoke.set()
                        with contextlib.suppress(trio.BrokenResourceError):
                            await client.send_all(data)
                spoke.set()
                nursery.cancel_scope.cancel()  # the daemon hung up: so does the client's side

            async def to_daemon() -> None:
                await spoke.wait()  # the hello stays in the socket until then
                with contextlib.suppress(trio.BrokenResourceError):
                    async for data in client:
                        with contextlib.suppress(trio.BrokenResourceError):
                            await daemon.send_all(data)
                nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_client)
                nursery.start_soon(to_daemon)


@contextlib.asynccontextmanager
async def hello_holder(daemon: DaemonProcess) -> AsyncIterator[HelloHolder]:
    holder = HelloHolder(daemon.root / "held.sock", daemon.socket)
    async with trio.open_nursery() as nursery:
        await nursery.start(holder.serve)
        yield holder
        nursery.cancel_scope.cancel()


async def reload_once_the_hello_is_held(daemon: DaemonProcess, holder: HelloHolder) -> None:
    await holder.first_open.wait()
    async with AsyncClient(daemon.socket) as reloader:
        assert (await reloader.reload()).image_generation == 2


def assert_the_hello_met_a_reload(holder: HelloHolder) -> None:
    decoder = FrameDecoder()
    decoder.feed(holder.first_words)
    first = daemon_decoder.decode(decoder.frames()[0])
    assert isinstance(first, Error)
    assert (first.id, first.code) == (0, "reloading")
    assert holder.connections == 2  # the one cut off, and the one the client made again


async def test_an_async_client_whose_hello_meets_a_reload_connects_again(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with hello_holder(daemon) as holder, trio.open_nursery() as nursery:
            nursery.start_soon(reload_once_the_hello_is_held, daemon, holder)
            async with AsyncClient(holder.path) as client:
                info = await client.info()
            assert info.image_generation == 2  # welcomed by the new image
            assert_the_hello_met_a_reload(holder)


async def test_a_blocking_client_whose_hello_meets_a_reload_connects_again(
    daemon: DaemonProcess,
) -> None:
    def enter_and_ask() -> int:
        with Client(holder.path, timeout=30) as client:
            return client.info().image_generation

    with trio.fail_after(60):
        async with hello_holder(daemon) as holder, trio.open_nursery() as nursery:
            nursery.start_soon(reload_once_the_hello_is_held, daemon, holder)
            generation = await trio.to_thread.run_sync(enter_and_ask, abandon_on_cancel=True)
            assert generation == 2
            assert_the_hello_met_a_reload(holder)
