"""What the control socket answers while the daemon waits for its store
(`lifecycle/_store_wait.py`: another process holds a lock on it): nothing it knows can
be told before the store is open but `info`, which says what it waits for and since
when (`store_wait`, and in `problems`); every other request is answered `busy`, with
`retry_after`, naming the wait. A hello with a worker's token is told `reloading` (no
token can be checked before the store is open), so its client connects again later.
When the wait is over each connection still open is told `reloading` and closed: its
client connects again, to the daemon serving in full.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable

import msgspec
import trio

from subagentd.protocol import (
    DEFAULT_FRAME_LIMIT,
    PROTOCOL_VERSION,
    DaemonInfo,
    Error,
    Hello,
    Info,
    InfoReply,
    Reply,
    Welcome,
    client_decoder,
    encode,
    package_version,
)
from subagentd.protocol._framing import FrameDecoder
from subagentd.protocol.errors import ErrorCode, FrameTooLarge

from .._logging import get_logger

log = get_logger()

#: How soon a request answered `busy` while the daemon waits may be sent again.
RETRY_AFTER = 1.0
#: How long a closing connection is given to take the last word.
LAST_WORD_SECONDS = 0.1
_PEERCRED = struct.Struct("3i")


class WaitingServer:
    """Answers connections with what `told()` says the daemon waits for."""

    def __init__(
        self, told: Callable[[], str], *, socket_path: str, state_dir: str, image_generation: int
    ) -> None:
        self._told = told
        self._socket_path = socket_path
        self._state_dir = state_dir
        self._image_generation = image_generation

    async def serve(self, sock: socket.socket) -> None:
        """Accept and answer until cancelled; the listening socket stays open (its owner's)."""
        # A duplicate, closed after: the daemon's own socket object stays as it was.
        with trio.socket.from_stdlib_socket(sock.dup()) as listener:
            async with trio.open_nursery() as nursery:
                while True:
                    conn, _ = await listener.accept()
                    nursery.start_soon(self._handle, trio.SocketStream(conn))

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await self._converse(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            except trio.Cancelled:
                with trio.CancelScope(shield=True), trio.move_on_after(LAST_WORD_SECONDS):
                    await self._send(stream, self._reloading("it is open now: nothing to wait for"))
                raise

    async def _converse(self, stream: trio.SocketStream) -> None:
        _pid, uid, _gid = _PEERCRED.unpack(
            stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid != os.getuid():
            await self._send(stream, _error(0, ErrorCode.FORBIDDEN, "only the daemon's own user"))
            return
        frames = FrameDecoder(DEFAULT_FRAME_LIMIT)
        welcomed = False
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            try:
                frames.feed(data)
                bodies = list(iter(frames.next_frame, None))
            except FrameTooLarge as exc:  # the stream cannot go on
                await self._send(stream, _error(0, ErrorCode.TOO_LARGE, str(exc)))
                return
            for body in bodies:
                try:
                    request = client_decoder.decode(body)
                except msgspec.DecodeError as exc:
                    await self._send(stream, _error(0, ErrorCode.INVALID, f"not a request: {exc}"))
                    return
                if not welcomed:
                    if not isinstance(request, Hello) or request.version != PROTOCOL_VERSION:
                        await self._send(stream, _error(0, ErrorCode.INVALID, "no hello"))
                        return
                    if request.token is not None:
                        await self._send(stream, self._reloading("no worker's token can be told"))
                        return
                    welcomed = True
                    await self._send(stream, self._welcome(request.id))
                elif isinstance(request, Info):
                    await self._send(stream, InfoReply(id=request.id, info=self._info()))
                else:
                    told = self._told()
                    await self._send(
                        stream,
                        Error(
                            id=request.id,
                            code=ErrorCode.BUSY,
                            message=f"the daemon cannot answer this yet: {told}",
                            retry_after=RETRY_AFTER,
                        ),
                    )

    def _welcome(self, rid: int) -> Welcome:
        return Welcome(
            id=rid, version=PROTOCOL_VERSION, daemon_version=package_version(), pid=os.getpid()
        )

    def _info(self) -> DaemonInfo:
        told = self._told()
        return DaemonInfo(
            version=package_version(),
            protocol=PROTOCOL_VERSION,
            pid=os.getpid(),
            image_generation=self._image_generation,
            reloads=0,
            workers={},
            holds_park=True,  # what it holds is not known yet: stopping it may lose it
            socket=self._socket_path,
            state_dir=self._state_dir,
            problems=[told],
            store_wait=told,
        )

    def _reloading(self, why: str) -> Error:
        return Error(
            id=0,
            code=ErrorCode.RELOADING,
            message=f"the daemon waits for its store ({why} meanwhile): connect again",
            retry_after=RETRY_AFTER,
        )

    @staticmethod
    async def _send(stream: trio.SocketStream, reply: Reply) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(encode(reply))


def _error(rid: int, code: ErrorCode, message: str) -> Error:
    return Error(id=rid, code=code, message=message)
