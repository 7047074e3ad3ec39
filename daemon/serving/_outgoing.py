"""What followed pages may cost the daemon: a shared budget, and a socket's room.

A followed watch sends its journal page after page for as long as its worker
writes. Were each page read at the size its client asked (2 MiB by default)
and held until sent, a follower that stops reading would keep one in memory for
as long as it stays connected: 200 of them, 400 MiB. So a follower's next page
is read only once its socket can take one, at the size the socket takes at once
(`room`: its send buffer less what is queued in it, about 200 KiB), and while it
is read and sent its bytes are reserved in a `PageBudget` all connections share:
a follower that does not read holds nothing but its place in the stream, and
readers together hold at most the budget (each page about twice over: the
entries read, and their encoding).
"""

from __future__ import annotations

import collections
import fcntl
import socket
import struct
import termios

import trio

#: Bytes of followed pages being read and sent that all connections together may hold.
PAGE_BUDGET = 16 * 1024 * 1024
#: The smallest page a follower is sent, whatever its socket's room: one that always
#: makes progress (an entry's piece, at the least), however small a send buffer.
MIN_PAGE_BYTES = 4096
#: A page's frame besides the body its `max_bytes` counts (the length), with room to spare.
FRAME_SLACK = 64
_INT = struct.Struct("i")


class PageBudget:
    """The memory all connections may spend on followed pages in hand, shared page by
    page in the order asked: a page waits for its reservation, so 500 followers reading
    at once cost at most the budget, never 500 pages. (FrameBudget's twin for what goes
    out; first come, first served, so a waiter is woken only when it is its turn.)"""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: collections.deque[tuple[int, trio.Event]] = collections.deque()

    async def reserve(self, size: int) -> int:
        """Wait until `size` bytes (at most the whole budget) are free and every earlier
        waiter served; take them."""
        size = min(size, self.total)
        if not self._waiting and size <= self.free:
            await trio.lowlevel.checkpoint_if_cancelled()  # (yields only to raise)
            self.free -= size
            await trio.lowlevel.cancel_shielded_checkpoint()  # taken: not lost to a cancel
            return size
        turn = (size, trio.Event())
        self._waiting.append(turn)
        try:
            await turn[1].wait()
        except BaseException:
            if turn[1].is_set():
                self.release(size)  # granted as it was cancelled
            else:
                self._waiting.remove(turn)
                self._grant()  # it may have kept those after it waiting
            raise
        return size

    def reserve_nowait(self, size: int) -> bool:
        """Take `size` bytes if they are free now and nobody waits; whether taken."""
        if self._waiting or size > self.free:
            return False
        self.free -= size
        return True

    def release(self, size: int) -> None:
        self.free += size
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            size, granted = self._waiting.popleft()
            self.free -= size
            granted.set()


class Reservation:
    """What one follower holds of a `PageBudget`: taken for a page, grown to keep the page
    longer than its room, given back when it is sent or let go."""

    def __init__(self, budget: PageBudget) -> None:
        self.budget = budget
        self.size = 0

    async def take(self, size: int) -> None:
        """Hold `size` bytes (at most the whole budget), once they are free."""
        self.release()
        self.size = await self.budget.reserve(size)

    def grow_nowait(self, size: int) -> bool:
        """Hold `size` bytes if they are free now (the more than held); whether held."""
        more = min(size, self.budget.total) - self.size
        if more <= 0:
            return True
        if not self.budget.reserve_nowait(more):
            return False
        self.size += more
        return True

    def release(self) -> None:
        if self.size:
            size, self.size = self.size, 0
            self.budget.release(size)


def send_buffer(sock: socket.socket | trio.socket.SocketType) -> int:
    """The bytes the socket's send buffer holds at most (SO_SNDBUF)."""
    size: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return size


def queued(fd: int) -> int:
    """The bytes of the socket's send buffer in use now (SIOCOUTQ: for a Unix socket, what
    its peer has not read yet, with the kernel's own cost of holding it)."""
    return int(_INT.unpack(fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * _INT.size))[0])


def room(buffer: int, in_use: int) -> int:
    """The body of a page the socket takes at once: a Unix socket takes a write whole
    while its buffer is not yet full, so what is free of it, less the frame's slack."""
    return max(MIN_PAGE_BYTES, buffer - in_use - FRAME_SLACK)
