"""Length-prefixed framing, sans-I/O: bytes in, frame bodies out.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
The decoder checks the length against its limit before buffering the body, so
a hostile length costs nothing.
"""

from __future__ import annotations

import struct

from ._version import DEFAULT_FRAME_LIMIT
from .errors import FrameTooLarge

HEADER = struct.Struct(">I")


def frame(body: bytes) -> bytes:
    """The frame carrying `body`."""
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Accumulates received bytes and yields complete frame bodies.

    Feed it whatever the socket returned, split anywhere; call `next_frame`
    until it answers None. An oversized length raises `FrameTooLarge`, after
    which the stream is unusable (the connection should be closed).
    """

    def __init__(self, limit: int = DEFAULT_FRAME_LIMIT) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos and self._pos >= len(self._buffer) // 2:
            del self._buffer[: self._pos]
            self._pos = 0
        self._buffer += data

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame (a torn frame at EOF, if nonzero)."""
        return len(self._buffer) - self._pos

    def unread(self) -> bytes:
        """The bytes received but not yet returned as a frame: for another decoder (the next
        image's, across a reload) to be fed first."""
        return bytes(self._buffer[self._pos :])

    @property
    def incomplete_length(self) -> int | None:
        """The body length of the frame being received, once its header is in and until
        its body is; None otherwise (a receiver may budget for it before reading on)."""
        available = len(self._buffer) - self._pos
        if available < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer, self._pos)
        return length if HEADER.size + length > available else None

    def next_frame(self) -> bytes | None:
        available = len(self._buffer) - self._pos
        if available < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer, self._pos)
        if length > self.limit:
            raise FrameTooLarge(length, self.limit)
        end = self._pos + HEADER.size + length
        if end > len(self._buffer):
            return None
        body = bytes(self._buffer[self._pos + HEADER.size : end])
        self._pos = end
        return body

    def frames(self) -> list[bytes]:
        """Every complete frame buffered so far."""
        out = []
        while (body := self.next_frame()) is not None:
            out.append(body)
        return out
