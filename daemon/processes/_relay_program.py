"""The output relay: a small program of the daemon's own that holds the read ends of
relayed workers' stdout and stderr pipes for it, once the daemon's own descriptors run
short, and forwards what they carry over one SOCK_SEQPACKET socket (docs/design.md,
"The output relay"). It is the daemon's child, started in the daemon's cgroup, never a
worker's; it imports neither trio nor anything of the daemon, so it starts in tens of ms,
and the daemon imports its wire (the message Structs below) from here.

Credit, per stream: the relay reads a pipe once (at most `chunk_bytes`), sends one `Output`,
and reads that pipe again only once the daemon has sent its `Credit` (it journaled the
chunk): the pump's read, journal, read again, across two processes. A flood from one
worker neither starves another nor piles up memory in either process. While the daemon
does not read (a reload's exec), the relay keeps at most one message of its own unsent
and reads no pipe meanwhile. It ends when its socket does: the daemon's death, or its
close at shutdown; SIGTERM, SIGINT and SIGHUP it ignores (a service manager stopping
the daemon's cgroup must not cut the workers' output before the daemon has drained it).

Run as `python -I _relay_program.py FD` (FD: its end of the socketpair).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import resource
import select
import signal
import socket
import sys
import termios
from collections import deque

import msgspec

#: One read of a relayed pipe takes at most this, and makes one message and one journal
#: entry: the pump's ENTRY_BYTES, where the socket takes a message that long.
MOST_CHUNK_BYTES = 512 * 1024
#: ...and at least this: a default pipe's whole capacity, inside any seqpacket message's
#: limit (the socket's send buffer less 32 bytes: 2 x net.core.wmem_max at most, ~416 KiB
#: by default, which an unprivileged process cannot raise).
CHUNK_BYTES = 64 * 1024
#: A read this long found the pipe full at the kernel's default size: its worker writes
#: faster than it is relayed, and its pipe is grown to PIPE_BYTES, once (as the pump's).
FULL_PIPE_BYTES = 64 * 1024
PIPE_BYTES = 1024 * 1024
#: The largest message either side sends, with room for its header.
MESSAGE_BYTES = MOST_CHUNK_BYTES + 4096
#: Descriptors the relay keeps for itself (its std streams, socket, epoll, what Python
#: opens): what its limit holds beyond this is its capacity, counted in streams.
RESERVE = 16
#: Set in tests: the relay's soft RLIMIT_NOFILE, instead of its hard one (a full relay).
NOFILE_ENV = "SUBAGENTD_RELAY_NOFILE"


# -- the wire: daemon -> relay ------------------------------------------------------


class Hand(msgspec.Struct, tag="hand", array_like=True):
    """Hold these streams of `worker`: one descriptor per kind, in order, in SCM_RIGHTS."""

    worker: str
    kinds: list[str]


class Credit(msgspec.Struct, tag="credit", array_like=True):
    """The stream's last `Output` is journaled: read its pipe again."""

    worker: str
    kind: str


class Drop(msgspec.Struct, tag="drop", array_like=True):
    """Let go of every stream of `worker` (its supervision ended before their eof)."""

    worker: str


class Ask(msgspec.Struct, tag="ask", array_like=True):
    """Answer an `Inventory`."""


class Probe(msgspec.Struct, tag="probe", array_like=True):
    """Answer `Pending` for `worker`'s streams: its process has exited and the daemon's
    drain found them quiet, which only the relay, holding the pipes, can tell for sure."""

    worker: str


# -- the wire: relay -> daemon ------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The relay's first message: how many streams it holds at most, and its limit."""

    capacity: int
    limit: int


class Output(msgspec.Struct, tag="out", array_like=True):
    worker: str
    kind: str
    data: bytes


class Eof(msgspec.Struct, tag="eof", array_like=True):
    """The stream's pipe reached its end of file (the relay has closed it)."""

    worker: str
    kind: str


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """A `Hand` the relay could not take (its descriptors are closed): why."""

    worker: str
    kinds: list[str]
    why: str


class Held(msgspec.Struct, array_like=True):
    worker: str
    kind: str
    #: An `Output` of it was sent and not yet credited.
    unacknowledged: bool


class Inventory(msgspec.Struct, tag="inventory", array_like=True):
    """What the relay holds, in pages: each a message the socket takes whole (thousands
    of streams would not fit one), the last with `more` False."""

    streams: list[Held]
    capacity: int
    #: The relay's own pid (a socketpair's SO_PEERCRED names its maker, not its peer).
    pid: int = 0
    #: Another page follows (a relay before pages sends one, without it: the last).
    more: bool = False


class Pending(msgspec.Struct, tag="pending", array_like=True):
    """The answer to a `Probe`: what `worker`'s streams still hold, in bytes the pipes have
    ready (FIONREAD) and one for each `Output` not yet credited; 0: quiet for sure."""

    worker: str
    pending: int


class Unknown(msgspec.Struct, tag="unknown", array_like=True):
    """A message the relay could not act on (a stream it does not hold, garbage)."""

    what: str


ToRelay = Hand | Credit | Drop | Ask | Probe
FromRelay = Ready | Output | Eof | Refused | Inventory | Pending | Unknown

encoder = msgspec.msgpack.Encoder()
to_relay = msgspec.msgpack.Decoder(ToRelay)
from_relay = msgspec.msgpack.Decoder(FromRelay)


# -- the program ----------------------------------------------------------------

_READ = select.EPOLLIN | select.EPOLLONESHOT


class DaemonGone(Exception):
    """A send found the daemon's end closed (its shutdown, or its death): the relay ends,
    as at its socket's end of file, not with a traceback in the daemon's log."""


class _Stream:
    __slots__ = ("fd", "grown", "kind", "state", "worker")

    def __init__(self, fd: int, worker: str, kind: str) -> None:
        self.fd = fd
        self.worker = worker
        self.kind = kind
        #: "armed" (in epoll), "ready" (readable, waiting for the socket to take a
        #: message), "sent" (an Output unacknowledged), "closed".
        self.state = "armed"
        self.grown = False


class _Relay:
    def __init__(self, sock: socket.socket, capacity: int) -> None:
        self.sock = sock
        self.capacity = capacity
        self.chunk = chunk_bytes(sock)
        self.epoll = select.epoll()
        self.by_fd: dict[int, _Stream] = {}
        self.by_key: dict[tuple[str, str], _Stream] = {}
        #: Messages the socket would not take yet; while any waits, no pipe is read.
        self.unsent: deque[bytes] = deque()
        #: Streams found readable while a message waited: read once the socket has room.
        self.ready: deque[_Stream] = deque()
        self.epoll.register(sock.fileno(), select.EPOLLIN)

    def run(self) -> None:
        sock_fd = self.sock.fileno()
        while True:
            try:
                events = self.epoll.poll()
            except InterruptedError:
                continue
            for fd, mask in events:
                if fd == sock_fd:
                    if mask & select.EPOLLOUT:
                        self._flush()
                    if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and (
                        not self._receive()
                    ):
                        return
                elif (stream := self.by_fd.get(fd)) is not None and stream.state == "armed":
                    stream.state = "ready"
                    self.ready.append(stream)
            self._read_ready()

    # -- the socket --

    def _send(self, message: bytes) -> None:
        if not self.unsent:
            try:
                self.sock.send(message)
                return
            except BlockingIOError:
                pass
            except ConnectionError as exc:  # EPIPE, ECONNRESET: the daemon closed its end
                raise DaemonGone from exc
        self.unsent.append(message)
        self.epoll.modify(self.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _flush(self) -> None:
        while self.unsent:
            try:
                self.sock.send(self.unsent[0])
            except BlockingIOError:
                return
            except ConnectionError as exc:
                raise DaemonGone from exc
            self.unsent.popleft()
        self.epoll.modify(self.sock.fileno(), select.EPOLLIN)

    def _receive(self) -> bool:
        """Act on every message waiting; False once the daemon's end is gone."""
        fd_bytes = array.array("i").itemsize
        while True:
            try:
                data, ancillary, flags, _ = self.sock.recvmsg(
                    MESSAGE_BYTES, socket.CMSG_SPACE(4 * fd_bytes), socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError:
                return False  # ECONNRESET: the daemon died
            fds = array.array("i")
            for level, kind, cdata in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(cdata[: len(cdata) - len(cdata) % fd_bytes])
            if not data and not fds:
                return False  # end of file: the daemon closed its end, or died
            self._act(data, list(fds), cut=bool(flags & socket.MSG_CTRUNC))

    def _act(self, data: bytes, fds: list[int], *, cut: bool) -> None:
        try:
            message = to_relay.decode(data)
        except msgspec.DecodeError as exc:
            _close(fds)
            self._send(encoder.encode(Unknown(f"a message that does not decode: {exc}")))
            return
        match message:
            case Hand(worker, kinds):
                self._hand(worker, kinds, fds, cut=cut)
                return
            case Credit(worker, kind):
                stream = self.by_key.get((worker, kind))
                if stream is None:
                    self._send(encoder.encode(Unknown(f"credit for {worker} {kind}: not held")))
                elif stream.state == "sent":
                    stream.state = "armed"
                    self.epoll.modify(stream.fd, _READ)
            case Drop(worker):
                for kind in ("stdout", "stderr"):
                    if (stream := self.by_key.get((worker, kind))) is not None:
                        self._close(stream)
            case Ask():
                self._inventory()
            case Probe(worker):
                self._send(encoder.encode(Pending(worker, self._pending(worker))))
        _close(fds)  # descriptors only a Hand brings

    def _pending(self, worker: str) -> int:
        """What `worker`'s streams still hold: the bytes their pipes have ready, and one for
        each chunk read and not yet credited (or waiting for the socket to take it)."""
        pending = 0
        for kind in ("stdout", "stderr"):
            stream = self.by_key.get((worker, kind))
            if stream is None:
                continue
            if stream.state in ("sent", "ready"):
                pending += 1
            with contextlib.suppress(OSError):
                ready = array.array("i", [0])
                fcntl.ioctl(stream.fd, termios.FIONREAD, ready)
                pending += ready[0]
        return pending

    def _inventory(self) -> None:
        """Answer an `Ask`: what it holds, in pages of at most a chunk's length each."""
        pages: list[list[Held]] = [[]]
        room = self.chunk - 1024  # the page's own header, with room to spare
        for s in self.by_key.values():
            cost = len(s.worker.encode()) + len(s.kind) + 16  # a Held's encoding, at most
            if pages[-1] and room < cost:
                pages.append([])
                room = self.chunk - 1024
            room -= cost
            pages[-1].append(Held(s.worker, s.kind, s.state == "sent"))
        for n, page in enumerate(pages, 1):
            self._send(encoder.encode(Inventory(page, self.capacity, os.getpid(), n < len(pages))))

    def _hand(self, worker: str, kinds: list[str], fds: list[int], *, cut: bool) -> None:
        why = None
        if cut:
            why = (
                f"the relay (pid {os.getpid()}) could not take every descriptor handed "
                "(MSG_CTRUNC: past its limit, or more than one hand carries)"
            )
        elif len(fds) != len(kinds) or len(set(kinds)) != len(kinds):
            why = f"{len(fds)} descriptors came for the streams {kinds}"
        elif any((worker, kind) in self.by_key for kind in kinds):
            why = f"the relay holds {worker}'s streams already"
        elif len(self.by_key) + len(kinds) > self.capacity:
            why = f"the relay is full ({len(self.by_key)} of {self.capacity} streams)"
        if why is not None:
            _close(fds)
            self._send(encoder.encode(Refused(worker, kinds, why)))
            return
        for fd, kind in zip(fds, kinds, strict=True):
            os.set_blocking(fd, False)
            stream = _Stream(fd, worker, kind)
            self.by_fd[fd] = stream
            self.by_key[worker, kind] = stream
            self.epoll.register(fd, _READ)

    # -- the pipes --

    def _read_ready(self) -> None:
        while self.ready and not self.unsent:
            stream = self.ready.popleft()
            if stream.state != "ready":
                continue  # dropped meanwhile
            try:
                chunk = os.read(stream.fd, self.chunk)
            except BlockingIOError:
                stream.state = "armed"
                self.epoll.modify(stream.fd, _READ)
                continue
            except OSError:
                chunk = b""  # EIO: as good as its end
            if chunk:
                if not stream.grown and len(chunk) >= FULL_PIPE_BYTES:
                    stream.grown = True  # refused (past pipe-user-pages-soft): as it was
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(stream.fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
                stream.state = "sent"
                self._send(encoder.encode(Output(stream.worker, stream.kind, chunk)))
            else:
                self._close(stream)
                self._send(encoder.encode(Eof(stream.worker, stream.kind)))

    def _close(self, stream: _Stream) -> None:
        stream.state = "closed"
        del self.by_fd[stream.fd]
        del self.by_key[stream.worker, stream.kind]
        os.close(stream.fd)  # its last reference: epoll forgets it


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def chunk_bytes(sock: socket.socket) -> int:
    """The longest read this relay sends whole: the largest power of two, from CHUNK_BYTES
    to MOST_CHUNK_BYTES, that a message of the socket's send buffer holds with its header
    (asked as large as MOST_CHUNK_BYTES' messages need; the kernel caps it)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MESSAGE_BYTES)
    room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32 - 4096
    chunk = CHUNK_BYTES
    while chunk * 2 <= min(room, MOST_CHUNK_BYTES):
        chunk *= 2
    return chunk


def _limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (or to NOFILE_ENV's, in tests)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    asked = os.environ.get(NOFILE_ENV)
    if asked is not None and asked.isdigit():
        wanted = min(int(asked), wanted)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError):
        return soft
    return wanted


def main(argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    sock.setblocking(False)
    limit = _limit()
    relay = _Relay(sock, max(0, limit - RESERVE))
    with contextlib.suppress(DaemonGone):
        relay._send(encoder.encode(Ready(relay.capacity, limit)))
        relay.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
