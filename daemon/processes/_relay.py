"""The daemon's side of its output relays (`_relay_program`): starting one when the first
worker past the descriptor threshold is spawned, handing it the worker's pipes, pumping
what it forwards into the worker's journal with a credit per stream, carrying it across
a reload, and noticing at once when it dies (docs/design.md, "The output relay").

A relayed worker costs the daemon no descriptor: its pipes' read ends are the relay's,
and what they carry comes on the one socket the daemon holds for each relay.
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import trio

from subagentd.protocol import OutputRelays

from .._logging import get_logger
from . import _relay_program as wire
from ._reaper import REAPER, Watched
from ._tree import read_stat

log = get_logger()

#: How long a new relay may take to say it is ready.
START_SECONDS = 10.0
#: After a relay that would not start, spawns keep their pipes this long before the next try.
RETRY_SECONDS = 5.0
#: A relay is started for the next relayed spawns this many descriptors before the
#: threshold: by the time a spawn's pipes come above it, the relay is there.
START_MARGIN = 64
#: How long a drain waits for a relay to say what a worker's streams still hold (`Probe`):
#: a relay stalled past it (stopped, or starved) is taken at its silence, and the worker's
#: journal says that its last output may be missing.
PROBE_SECONDS = 10.0
#: Relays at most (each holding up to its limit's worth of streams): past them, a
#: worker past the threshold keeps its pipes in the daemon, as below it.
MAX_RELAYS = 8
#: The relay's own file, run by path (`python -I`): importing the daemon's package
#: would import trio and the whole daemon.
PROGRAM = Path(wire.__file__)

Deliver = Callable[[bytes], Awaitable[None]]


class RelayLost(Exception):
    """The relay holding a stream is gone (killed, or it refused the stream): what the
    stream would still have carried is lost; the message says why."""


def stream_key(worker: str, n: int) -> str:
    """What the wire names an attempt's streams by: its worker's id, and which hand it was
    (counted from the monotonic clock's ns at each image's start: an image after a reload
    counts on from past the last one's, so no key comes twice)."""
    return f"{worker}/{n}"


def worker_of(key: str) -> str:
    """The worker id a stream key names."""
    return key.rpartition("/")[0] or key


def default_relay_above(soft_limit: int) -> int:
    """The descriptor number past which a new worker's pipes go to a relay: a quarter
    of the limit (at least 1,024) is kept for connections, journals and stops."""
    return max(0, soft_limit - max(1024, soft_limit // 4))


class RelayStream:
    """One relayed pipe as the daemon sees it: what the relay forwarded and the daemon has
    not journaled yet (one chunk at most, by its credit), its end of file, or its loss."""

    def __init__(self, relay: Relay | None, worker: str, kind: str) -> None:
        #: None: a stream whose relay a reload could not adopt (lost from the start).
        self.relay = relay
        self.worker = worker
        self.kind = kind
        self.chunks: deque[bytes] = deque()
        self.eof = False
        #: Set when the relay refused it: why (its pipe is closed).
        self.refused: str | None = None
        self._arrived = trio.Event()

    def arrived(self) -> None:
        self._arrived.set()

    async def pending(self) -> int | None:
        """What is still to come on this stream: chunks here not yet journaled, else what
        its relay holds of it (`Relay.pending`); 0 at its end of file or loss."""
        if self.chunks:
            return len(self.chunks)
        if self.eof or self.refused is not None or self.relay is None:
            return 0
        if self.relay.lost is not None:
            return 0  # its pump says so: RelayLost
        return await self.relay.pending(self.worker)

    async def pump(self, deliver: Deliver) -> None:
        """Journal what the relay forwards until the stream's end of file, as `pump` does
        a pipe: each chunk delivered, then credited (the relay reads the pipe again).
        Raises RelayLost once the relay is gone with the stream still open."""
        relay = self.relay
        if relay is None:
            raise RelayLost(self.refused or "its output relay was not carried")
        while True:
            if self.chunks:
                chunk = self.chunks[0]
                try:
                    await deliver(chunk)
                finally:
                    if self.chunks and self.chunks[0] is chunk:  # not let go by a `drop`
                        self.chunks.popleft()
                        relay.delivered(self)
                await trio.lowlevel.checkpoint()
            elif self.eof:
                relay.forget(self)
                return
            elif self.refused is not None or relay.lost is not None:
                relay.forget(self)
                raise RelayLost(self.refused or relay.lost or "")
            else:
                self._arrived = trio.Event()
                await self._arrived.wait()


class Relay:
    """One relay process and the socket the daemon holds for it."""

    def __init__(
        self, sock: socket.socket, pid: int, starttime: int, watched: Watched, capacity: int
    ) -> None:
        self.sock = sock
        self.pid = pid
        self.starttime = starttime
        self.watched = watched
        self.capacity = capacity
        self.streams: dict[tuple[str, str], RelayStream] = {}
        #: Why it is gone (None: it serves), and how many workers' streams it held then.
        self.lost: str | None = None
        self.lost_workers = 0
        #: Chunks received and not yet journaled and credited: what an exec would lose.
        self.held = 0
        self._put_down = trio.Event()
        #: Messages (and the descriptors they hand) the socket would not take yet.
        self.unsent: deque[tuple[bytes, list[int]]] = deque()
        self._unsent_added = trio.Event()
        self._drained = trio.Event()  # set (and renewed) each time `unsent` empties
        self._reading = trio.Event()
        self._reading.set()
        #: Messages read before this port ran (a rebuilt handoff's inventory): first.
        self.unread: deque[bytes] = deque()
        self._buffer = bytearray(wire.MESSAGE_BYTES)
        #: Drains waiting for a `Pending`, by stream key: where each answer goes.
        self._probes: dict[str, list[list[int | None]]] = {}
        self._answered = trio.Event()

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    def room(self, streams: int) -> bool:
        return self.lost is None and len(self.streams) + streams <= self.capacity

    def hand(self, worker: str, fds: dict[str, int]) -> dict[str, RelayStream]:
        """Hand `fds` (the read ends of `worker`'s pipes, by kind) to the relay; they are
        closed here once the socket has them (in flight, the kernel holds them)."""
        streams = {kind: RelayStream(self, worker, kind) for kind in fds}
        for kind, stream in streams.items():
            self.streams[worker, kind] = stream
        self._send(wire.encoder.encode(wire.Hand(worker, list(fds))), list(fds.values()))
        return streams

    def adopt(self, worker: str, kinds: list[str]) -> dict[str, RelayStream]:
        """The streams of `worker` a reload carried: the relay holds them still."""
        streams = {kind: RelayStream(self, worker, kind) for kind in kinds}
        for kind, stream in streams.items():
            self.streams[worker, kind] = stream
        return streams

    def delivered(self, stream: RelayStream) -> None:
        """`stream`'s chunk is journaled: credit it, and put it down."""
        if self.lost is None and stream.refused is None:
            self._send(wire.encoder.encode(wire.Credit(stream.worker, stream.kind)), [])
        self.held -= 1
        put_down, self._put_down = self._put_down, trio.Event()
        put_down.set()

    def forget(self, stream: RelayStream) -> None:
        if self.streams.get((stream.worker, stream.kind)) is stream:
            del self.streams[stream.worker, stream.kind]

    def drop(self, worker: str) -> None:
        """`worker`'s supervision is over: the relay lets go of what it holds of it (what
        came and was not journaled is let go too, as a pipe closed unread would be)."""
        dropped = [self.streams.pop((worker, kind), None) for kind in ("stdout", "stderr")]
        for stream in dropped:
            if stream is not None and stream.chunks:
                self.held -= len(stream.chunks)
                stream.chunks.clear()
                put_down, self._put_down = self._put_down, trio.Event()
                put_down.set()
        if any(dropped) and self.lost is None:
            self._send(wire.encoder.encode(wire.Drop(worker)), [])

    async def pending(self, worker: str) -> int | None:
        """What the relay still holds of `worker`'s streams (by their key), in bytes its
        pipes have ready and chunks not yet credited: 0 once they are quiet for sure. None:
        no answer within PROBE_SECONDS (a relay stalled), or the relay is gone."""
        if self.lost is not None:
            return None
        answer: list[int | None] = [None]
        self._probes.setdefault(worker, []).append(answer)
        self._send(wire.encoder.encode(wire.Probe(worker)), [])
        with trio.move_on_after(PROBE_SECONDS):
            while self._probes.get(worker) and answer in self._probes[worker]:
                if self.lost is not None:
                    break
                answered, self._answered = self._answered, trio.Event()
                await answered.wait()
        waiting = self._probes.get(worker, [])
        if answer in waiting:
            waiting.remove(answer)
            if not waiting:
                del self._probes[worker]
        return answer[0]

    def _send(self, message: bytes, fds: list[int]) -> None:
        if not self.unsent and self._send_now(message, fds):
            return
        self.unsent.append((message, fds))
        self._unsent_added.set()

    def _send_now(self, message: bytes, fds: list[int]) -> bool:
        """Send one message; False if the socket has no room yet (a relay busy)."""
        try:
            if fds:
                rights = array.array("i", fds).tobytes()
                self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            else:
                self.sock.send(message)
        except BlockingIOError:
            return False
        except OSError as exc:  # EPIPE, ECONNRESET: it died; its reader says so
            self._lose(f"its socket failed ({exc.strerror or exc})")
        for fd in fds:
            os.close(fd)
        return True

    async def _write(self) -> None:
        while True:
            while self.unsent and self.lost is None:
                message, fds = self.unsent[0]
                if self._send_now(message, fds):
                    self.unsent.popleft()
                else:
                    await trio.lowlevel.wait_writable(self.sock)
            for _, fds in self.unsent:  # lost: what was never sent goes with it
                for fd in fds:
                    os.close(fd)
            self.unsent.clear()
            drained, self._drained = self._drained, trio.Event()
            drained.set()
            if self.lost is not None:
                return
            self._unsent_added = trio.Event()
            await self._unsent_added.wait()

    async def run(self, on_lost: Callable[[Relay], None]) -> None:
        """Pump the relay's messages to their streams until it is gone; then say so.
        Cancelled (the daemon stops), it leaves the relay be: `Relays.close` closes its
        socket, and the relay exits at its end."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write)
            await self._read()
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await self._bury()
        on_lost(self)

    async def _read(self) -> None:
        while self.lost is None:
            await self._reading.wait()
            try:
                if self.unread:
                    data = self.unread.popleft()
                else:  # into one buffer: a recv's own would be half a MiB each, mostly unused
                    data = bytes(self._buffer[: self.sock.recv_into(self._buffer)])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except OSError as exc:
                self._lose(f"its socket failed ({exc.strerror or exc})")
                return
            if not data:
                self._lose("it exited")
                return
            try:
                message = wire.from_relay.decode(data)
            except msgspec.DecodeError as exc:
                self._lose(f"it sent what does not decode ({exc})")
                return
            self._take(message)

    def _take(self, message: wire.FromRelay) -> None:
        match message:
            case wire.Output(worker, kind, data):
                stream = self.streams.get((worker, kind))
                if stream is None:  # dropped meanwhile (its supervision ended)
                    log.info("relay.output_dropped", worker=worker, kind=kind, bytes=len(data))
                    return
                self.held += 1
                stream.chunks.append(data)
                stream.arrived()
            case wire.Eof(worker, kind):
                if (stream := self.streams.get((worker, kind))) is not None:
                    stream.eof = True
                    stream.arrived()
            case wire.Refused(worker, kinds, why):
                log.error("relay.refused", relay=self.pid, worker=worker, why=why)
                for kind in kinds:
                    if (stream := self.streams.get((worker, kind))) is not None:
                        stream.refused = f"the output relay refused its {kind}: {why}"
                        stream.arrived()
            case wire.Pending(worker, pending):
                for answer in self._probes.pop(worker, []):
                    answer[0] = pending
                self._answered.set()
            case wire.Unknown(what):
                log.warning("relay.unknown", relay=self.pid, what=what)
            case wire.Ready() | wire.Inventory():
                pass

    def _lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = f"the output relay (pid {self.pid}) is gone: {why}"
        self.lost_workers = len({worker for worker, _ in self.streams})
        log.error("relay.lost", relay=self.pid, why=why, streams=len(self.streams))
        for stream in list(self.streams.values()):
            stream.arrived()
        self._answered.set()
        self._unsent_added.set()

    async def _bury(self) -> None:
        """Make sure the relay is gone, and reap it (the reaper reaps only what it is told)."""
        if not self.watched.exited.is_set():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)  # still there: it spoke nonsense
            with trio.move_on_after(5.0):
                await self.watched.exited.wait()
        if self.watched.exited.is_set():
            code = REAPER.reap(self.watched)
            log.info("relay.reaped", relay=self.pid, returncode=code)
        else:
            REAPER.abandon(self.watched)
        with contextlib.suppress(OSError):
            trio.lowlevel.notify_closing(self.sock)
        self.sock.close()

    # -- a reload --

    @contextlib.contextmanager
    def reading_paused(self) -> Iterator[None]:
        self._reading = trio.Event()
        try:
            yield
        finally:
            self._reading.set()

    async def wait_nothing_in_hand(self) -> None:
        """Return once every chunk received is journaled and credited, and every message
        sent (descriptors handed with it): what is left is in the socket, for the next
        image. With reading paused, no new chunk comes meanwhile."""
        while self.held or (self.unsent and self.lost is None):
            if self.held:
                await self._put_down.wait()
            else:
                await self._drained.wait()  # a relay busy: its socket takes the rest soon


class CarriedRelay(msgspec.Struct, kw_only=True):
    """A relay as a reload's checkpoint carries it: its socket (a descriptor the exec
    keeps), its pid (still our child) and capacity."""

    fd: int
    pid: int
    pid_start: int
    capacity: int
    #: Found by a rebuilt handoff (`ask_inventory`), never encoded: the streams it holds
    #: by worker, and the messages read from its socket before its inventory came.
    streams: dict[str, list[str]] = {}
    unread: list[bytes] = []


class Relays:
    """The daemon's output relays: started as needed, each holding up to its capacity."""

    def __init__(self, relay_above: int) -> None:
        #: A worker whose pipes' descriptors come at or above this is relayed.
        self.relay_above = relay_above
        self.relays: list[Relay] = []
        #: Told of a relay that died with streams: the daemon reports it.
        self.on_lost: Callable[[Relay, int], None] = lambda relay, n: None
        self._nursery: trio.Nursery | None = None
        self._starting = trio.Lock()
        self._last_fd = 0  # the highest of the last spawn's pipes
        self._handed = time.monotonic_ns()  # counts each attempt handed: its streams' key
        self._failed_at: float | None = None  # the last relay that would not start
        self.started = 0  # relays started by this image

    def __len__(self) -> int:
        return len(self.relays)

    def streams(self) -> int:
        return sum(len(r.streams) for r in self.relays)

    def info(self) -> OutputRelays:
        """What `info` says of the relays (a sum over at most MAX_RELAYS)."""
        return OutputRelays(
            relay_above=self.relay_above,
            pids=[r.pid for r in self.relays],
            streams=self.streams(),
            capacity=sum(r.capacity for r in self.relays),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for relay in self.relays:  # adopted
                nursery.start_soon(relay.run, self._lost)
            task_status.started()
            await trio.sleep_forever()

    def _lost(self, relay: Relay) -> None:
        if relay in self.relays:
            self.relays.remove(relay)
        self.on_lost(relay, relay.lost_workers)

    def soon_wanted(self) -> bool:
        """Whether the next spawn's pipes are likely to come above the threshold."""
        return self._last_fd + START_MARGIN >= self.relay_above

    async def make_room(self, streams: int) -> None:
        """Before a spawn likely relayed: a relay with room, started if need be. A relay
        that cannot be started is logged; the spawn keeps its pipes in the daemon."""
        if any(r.room(streams) for r in self.relays) or len(self.relays) >= MAX_RELAYS:
            return
        if self._failed_at is not None and trio.current_time() < self._failed_at + RETRY_SECONDS:
            return  # the last would not start: spawns meanwhile keep their pipes
        async with self._starting:  # asked again: others started relays while we waited
            if any(r.room(streams) for r in self.relays) or len(self.relays) >= MAX_RELAYS:
                return
            try:
                relay = await _start()
            except (OSError, RuntimeError, trio.TooSlowError, msgspec.DecodeError) as exc:
                log.error("relay.not_started", error=str(exc), retry_after=RETRY_SECONDS)
                self._failed_at = trio.current_time()
                return
            self._failed_at = None
            self.relays.append(relay)
            self.started += 1
            assert self._nursery is not None, "Relays.run is not running"
            self._nursery.start_soon(relay.run, self._lost)
            log.info("relay.started", relay=relay.pid, capacity=relay.capacity)

    def relay(self, worker: str, fds: dict[str, int]) -> dict[str, RelayStream] | None:
        """Hand `fds` to a relay with room, if they came above the threshold (None: kept
        in the daemon). No await: the spawn is supervised right after. The streams are
        named for this attempt (`stream_key`): an `Eof` of a resumed worker's last attempt
        crossing its `Drop` is never taken for the new attempt's."""
        if not fds:
            return None
        self._last_fd = top = max(fds.values())
        if top < self.relay_above:
            return None
        for relay in self.relays:
            if relay.room(len(fds)):
                self._handed += 1
                return relay.hand(stream_key(worker, self._handed), fds)
        return None

    def by_pid(self, pid: int) -> Relay | None:
        return next((r for r in self.relays if r.pid == pid), None)

    @staticmethod
    def lost_streams(worker: str, kinds: list[str], relay_pid: int) -> dict[str, RelayStream]:
        """Streams a reload carried whose relay (`relay_pid`) it could not adopt: lost."""
        streams = {kind: RelayStream(None, worker, kind) for kind in kinds}
        for stream in streams.values():
            stream.refused = f"its output relay (pid {relay_pid}) did not survive the reload"
        return streams

    # -- a reload --

    def carry(self, carry: Callable[[int, str], int]) -> list[CarriedRelay]:
        return [
            CarriedRelay(
                fd=carry(r.fd, f"output relay pid {r.pid}'s socket"),
                pid=r.pid,
                pid_start=r.starttime,
                capacity=r.capacity,
            )
            for r in self.relays
            if r.lost is None
        ]

    def adopt(self, carried: list[CarriedRelay]) -> None:
        """Take over the relays a reload carried (before any worker's streams)."""
        for c in carried:
            try:
                os.waitid(os.P_PID, c.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                log.error("relay.not_adopted", relay=c.pid, why="not this daemon's child")
                with contextlib.suppress(OSError):
                    os.close(c.fd)
                continue
            sock = socket.socket(fileno=c.fd)
            sock.setblocking(False)
            watched = REAPER.watch(c.pid, c.pid_start)
            relay = Relay(sock, c.pid, c.pid_start, watched, c.capacity)
            relay.unread.extend(c.unread)
            self.relays.append(relay)
            if self._nursery is not None:
                self._nursery.start_soon(relay.run, self._lost)

    @contextlib.contextmanager
    def reading_paused(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for relay in self.relays:
                stack.enter_context(relay.reading_paused())
            yield

    def nothing_in_hand(self) -> bool:
        """Whether every relay's port has journaled and credited what it received, and
        sent every message (what `wait_nothing_in_hand` waits for)."""
        return not any(r.held or (r.unsent and r.lost is None) for r in self.relays)

    async def wait_nothing_in_hand(self) -> None:
        for relay in list(self.relays):
            await relay.wait_nothing_in_hand()

    def close(self) -> None:
        """The daemon stops: each relay sees its socket's end and exits."""
        for relay in self.relays:
            with contextlib.suppress(OSError):
                relay.sock.close()


async def _start() -> Relay:
    """Start a relay: the daemon's child, in the daemon's cgroup, told its end of a
    SOCK_SEQPACKET socketpair; ready once it says its capacity."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        popen = subprocess.Popen(  # noqa: ASYNC220 - a fork and exec, as a worker's spawn
            [sys.executable, "-I", str(PROGRAM), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            close_fds=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    popen.returncode = 0  # reaped by the reaper, by its pid (see _process._start)
    stat = read_stat(popen.pid)
    assert stat is not None, "an unreaped child always has a /proc entry"
    watched = REAPER.watch(popen.pid, stat.starttime)
    ours.setblocking(False)
    try:
        with trio.fail_after(START_SECONDS):
            while True:
                try:
                    data = ours.recv(wire.MESSAGE_BYTES)
                    break
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(ours)
        ready = wire.from_relay.decode(data) if data else None
        if not isinstance(ready, wire.Ready) or ready.capacity < 2:
            raise RuntimeError(f"the output relay did not start ({ready!r})")
    except BaseException:
        with contextlib.suppress(OSError):
            os.kill(popen.pid, signal.SIGKILL)
        REAPER.abandon(watched)
        ours.close()
        raise
    return Relay(ours, popen.pid, stat.starttime, watched, ready.capacity)


def ask_inventory(fd: int) -> CarriedRelay | None:
    """For a rebuilt handoff (an unreadable checkpoint): if the inherited socket `fd` is an
    output relay's (a SOCK_SEQPACKET socket whose peer is this process's child), what it
    holds, asked of it (`Ask`); None if it is not one, or does not answer within a second.
    What the relay sent before its answer is kept, to be read first (`unread`)."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            return None
        sock.settimeout(1.0)
        sock.send(wire.encoder.encode(wire.Ask()))
        unread = []
        streams: dict[str, list[str]] = {}
        while True:
            data = sock.recv(wire.MESSAGE_BYTES)
            if not data:
                return None
            message = wire.from_relay.decode(data)
            if not isinstance(message, wire.Inventory):
                unread.append(data)
                continue
            for held in message.streams:  # a page of it: the last says no `more`
                streams.setdefault(held.worker, []).append(held.kind)
            if not message.more:
                break
        stat = read_stat(message.pid) if message.pid > 0 else None
        if stat is None or stat.ppid != os.getpid():
            return None  # not a relay of this daemon's: closed as what nothing claims
        return CarriedRelay(
            fd=fd,
            pid=message.pid,
            pid_start=stat.starttime,
            capacity=message.capacity,
            streams=streams,
            unread=unread,
        )
    except (OSError, msgspec.DecodeError):
        return None
    finally:
        sock.setblocking(True)
        sock.detach()
