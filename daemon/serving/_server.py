"""The control socket's server: the trio shell around each connection's `Session`.

Each connection is checked with SO_PEERCRED (only the daemon's own uid gets in) and,
where workers have cgroups, placed: the kernel says which worker's cgroup its peer is in,
if any, and the hello then makes it that worker (`_authority.caller_at_hello`). Its
bytes go to its `Session` (`_session.py`: the hello, ids in flight and their limit,
aborts, wakes delivered, its share of the frame budget, what a reload is owed), and
this shell does what the session answers: send, close, or run a request, inline or in
a task of its own, dispatched to the daemon. It shares the frame budget out and pauses
for a reload. A bad frame or message costs its sender an error and, where the stream
is unreadable, the connection; never anyone else's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import trio

from subagentd.protocol import (
    DEFAULT_FRAME_LIMIT,
    Abort,
    Ack,
    BeginTurn,
    Cancel,
    CancelFence,
    Cancelled,
    ClearFence,
    ClientMessage,
    Collect,
    Done,
    Error,
    FenceReply,
    Grep,
    GrepReply,
    Info,
    InfoReply,
    Latest,
    LatestResumable,
    ListWorkers,
    NewRun,
    Page,
    Pause,
    Paused,
    Reload,
    ReopenRun,
    Reply,
    ResultReply,
    ResumableRun,
    Resume,
    ResumeRun,
    RunReply,
    Send,
    Sent,
    SetFence,
    Spawn,
    Status,
    Stop,
    Stopped,
    StopRun,
    Subscribe,
    TurnReply,
    Unpause,
    Unpaused,
    Wait,
    WaitFor,
    WaitForReply,
    WaitRunStopped,
    Wake,
    Wakes,
    Watch,
    Welcome,
    WorkerList,
    WorkerReply,
    encode,
    op,
    package_version,
)
from subagentd.protocol.errors import (
    ErrorCode,
    Frozen,
    Invalid,
    Refused,
    RemoteError,
)

from .._daemon import Daemon
from .._logging import bind_contextvars, get_logger
from ..core._authority import Authority
from ..core._registry import cursor_place, listing_page
from ..core._request_keys import AskedKey, asked_key
from ..core._session import Close, Release, Session
from ..processes._cgroup import SO_PEERPIDFD, PeerUnplaced
from ..processes._tree import patiently
from ..store._store import StoreWriteFailed
from ..workers._reader import PageInHand
from ..workers._resumable import Resumption
from ..workers._spawner import RELOAD_RETRY
from ..workers._stops import Stopping
from ._handover import Handover, owed_by_connection
from ._outgoing import PAGE_BUDGET, PageBudget, Reservation, queued, room, send_buffer

log = get_logger()

#: How long a reload waits to tell each client `reloading` (all told at once).
NOTICE_SECONDS = 0.1
#: How long a reload waits for a connection it keeps to stop being read here and to
#: finish the frame being sent on it; one that takes longer is closed like any other.
KEEP_SECONDS = 1.0
#: How long, and how much, a refused peer may still send before the close.
REFUSAL_DRAIN_SECONDS = 1.0
REFUSAL_DRAIN_BYTES = 1024 * 1024
#: accept(2) failures that mean the daemon or the system is out of capacity, not that the
#: socket is broken: wait and accept again (as trio.serve_listeners does).
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_SECONDS = 0.1
#: How long the rest of a followed page its socket took part of is kept while the socket
#: takes no more (see `Connection.send_page`).
HOLD_SECONDS = 0.5
#: Bytes of frames still arriving that all connections together may hold (a frame
#: longer than `_session.BUDGETED_FROM` is read only once its length is reserved here).
FRAME_BUDGET = 64 * 1024 * 1024
#: The most one read takes off a connection.
RECEIVE_SIZE = 65536
_PEERCRED = struct.Struct("3i")
#: What a restart answers while it recovers (`Server._until_recovered`): nothing else
#: can be answered without the registry it is rebuilding.
ANSWERED_WHILE_RECOVERING = (Info, Abort)
_conn_ids = itertools.count(1)


class FrameBudget:
    """The memory all connections may spend on frames not yet whole, shared out frame
    by frame: a large frame waits for its reservation, so 40 clients sending 15 MiB
    each cost at most the budget, not 600 MiB."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._released = trio.Event()

    async def reserve(self, size: int) -> int:
        """Wait until `size` bytes (at most the whole budget) are free; take them."""
        size = min(size, self.total)
        while size > self.free:
            await self._released.wait()
        self.free -= size
        return size

    def release(self, size: int) -> None:
        self.free += size
        released, self._released = self._released, trio.Event()
        released.set()


@dataclass(eq=False)
class Connection:
    """One connection's I/O: its socket, its sends, and the tasks answering its requests;
    what the protocol says of it is its `session`'s."""

    stream: trio.SocketStream
    conn_id: int
    session: Session
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    #: The requests answered by a task of their own, by id: how to end each, and its end.
    tasks: dict[int, tuple[trio.CancelScope, trio.Event]] = field(default_factory=dict)
    #: A reload keeps this connection: nothing more is sent on it here.
    sealed: bool = False
    #: Around the whole conversation, entered once (a scope per read would cost more than
    #: the read); `seal` cancels it only while `reading`, never a request being answered.
    receiving: trio.CancelScope = field(default_factory=trio.CancelScope)
    reading: bool = False  # waiting for bytes (or for the frame budget), nothing else
    stopped_reading: trio.Event = field(default_factory=trio.Event)
    #: Set once the socket takes bytes again, for those waiting on it (`wait_writable`).
    _writable: trio.Event | None = None
    _send_buffer: int = 0  # SO_SNDBUF, once asked

    async def seal(self, reloads: set[int]) -> None:
        """Stop reading here, then answer each request in flight but `reloads`: with its
        answer if it has one, else `reloading` under its own id: its client sends it again,
        and the image that reads on (the next one, or this one if the reload fails)
        answers it. Nothing is sent here after."""
        self.session.keep()
        if self.reading:
            self.receiving.cancel()
        await self.stopped_reading.wait()
        async with self.send_lock:  # no frame is half sent now, and none can begin
            cut = self.session.cut_off(reloads)
            ending = [self.tasks[rid] for rid in cut]
            for scope, _done in ending:
                scope.cancel()
            for _scope, done in ending:
                await done.wait()
            for reply in self.session.owed(cut, RELOAD_RETRY):
                await self._write(memoryview(encode(reply)))
            self.sealed = True

    @contextlib.contextmanager
    def answers_if_sealed(self, reply: Reply) -> Iterator[None]:
        """For the body, a wait after its request took effect (a stop waiting for processes
        to exit): cut short by the seal, the request is answered `reply`, not `reloading`,
        whose re-send would find it done and answer otherwise (a stop: nothing stopped)."""
        try:
            yield
        except trio.Cancelled:
            self.session.answer_if_kept(reply)
            raise

    async def send(self, reply: Reply) -> None:
        if self.sealed:
            return  # its request was answered `reloading`, to be sent again
        data = memoryview(encode(reply))
        if not self.send_lock.locked():
            # Nobody is mid-frame: write at once what the socket takes (a reply
            # usually fits), without a trip through the scheduler.
            try:
                data = data[os.write(self.stream.socket.fileno(), data) :]
            except BlockingIOError:
                pass
            except OSError as exc:  # EPIPE, ECONNRESET: the client is gone
                raise trio.BrokenResourceError(str(exc)) from exc
            if not data:
                return
            # The rest of a frame begun here must follow before any other: take
            # the lock now, with no checkpoint between (acquire could be one).
            self.send_lock.acquire_nowait()
        else:
            await self.send_lock.acquire()
            if self.sealed:
                self.send_lock.release()
                return
        try:
            await self._write(data)
        finally:
            self.send_lock.release()

    async def _write(self, data: memoryview) -> None:
        """Write all of `data`, waiting (`wait_writable`) while the socket is full."""
        while data:
            try:
                data = data[os.write(self.stream.socket.fileno(), data) :]
            except BlockingIOError:
                await self.wait_writable()
            except OSError as exc:  # EPIPE, ECONNRESET: the client is gone
                raise trio.BrokenResourceError(str(exc)) from exc

    async def wait_writable(self) -> None:
        """Until the socket takes bytes again. trio lets one task wait on a socket at a
        time: the first waits on it, the others (a reply and pages of two followed
        watches, say) on its word, and try again."""
        if self._writable is not None:
            await self._writable.wait()
            return
        self._writable = trio.Event()
        try:
            await trio.lowlevel.wait_writable(self.stream.socket)
        finally:
            writable, self._writable = self._writable, None
            writable.set()

    @contextlib.asynccontextmanager
    async def page_room(self, held: Reservation, most: int) -> AsyncIterator[int]:
        """For the body, which reads a followed page and sends it (`send_page`), the bytes
        it may take (at most `most`): what the socket takes at once, `held` in the page
        budget meanwhile, and the connection's sending its alone. While the socket is more
        than half full it waits (its client is not reading) holding no budget: a page is
        read only when it can be sent."""
        sock = self.stream.socket
        if not self._send_buffer:
            self._send_buffer = send_buffer(sock)
        if room(self._send_buffer, queued(sock.fileno())) < self._send_buffer // 2:
            # Waited without the send lock: nothing is half sent meanwhile, so a reload's
            # seal goes ahead (and keeps the connection) while its client does not read.
            await self.wait_writable()
        async with self.send_lock:
            free = room(self._send_buffer, queued(sock.fileno()))
            await held.take(min(most, free))
            try:
                yield held.size
            finally:
                held.release()

    async def send_page(self, in_hand: PageInHand, rid: int, held: Reservation) -> None:
        """Send a followed page under `rid`, within `page_room`. What the socket does not
        take at once is kept (the budget grown to hold it, if it can be now) while the
        socket takes more within HOLD_SECONDS; else it is let go, and read again
        (`PageInHand.again`) once the socket takes more, to send the rest: a follower
        that stops reading mid-page holds no page, and no budget."""
        if self.sealed:
            return  # its request was answered `reloading`, to be sent again
        frame = _page_frame(in_hand.take(), rid)
        length, sent = len(frame), 0
        try:
            while True:
                sent += self._write_some(frame[sent:])
                if sent == length:
                    return
                if held.grow_nowait(length):
                    with trio.move_on_after(HOLD_SECONDS):
                        await self.wait_writable()
                        continue
                frame = memoryview(b"")  # let go while the socket takes nothing
                held.release()
                await self.wait_writable()
                await held.take(length)
                frame = await self._page_again(in_hand, rid, length)
        except BaseException:
            if 0 < sent < length:
                # Half a frame sent: nothing can follow it on this stream.
                with contextlib.suppress(OSError):
                    self.stream.socket.shutdown(socket.SHUT_RDWR)
            raise

    async def _page_again(self, in_hand: PageInHand, rid: int, length: int) -> memoryview:
        """The page being sent, read again: the same frame, or the connection is broken."""
        try:
            frame = _page_frame(await in_hand.again(), rid)
        except Exception as exc:
            log.warning("conn.page_not_read_again", error=str(exc))
            raise trio.BrokenResourceError(f"a page half sent cannot be read again: {exc}") from exc
        if len(frame) != length:
            log.warning("conn.page_changed", was=length, now=len(frame))
            raise trio.BrokenResourceError("a page half sent reads otherwise now")
        return frame

    def _write_some(self, data: memoryview) -> int:
        """What of `data` the socket takes now."""
        try:
            return os.write(self.stream.socket.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError as exc:  # EPIPE, ECONNRESET: the client is gone
            raise trio.BrokenResourceError(str(exc)) from exc

    async def refuse(self, error: Error) -> None:
        """Send `error` as the last word, then let the peer read it before the close.

        Closing with the peer's bytes unread would reset the connection and
        could destroy the error before the peer reads it: drain a little first.
        """
        await self.send(error)
        await self.stream.send_eof()
        with trio.move_on_after(REFUSAL_DRAIN_SECONDS):
            drained = 0
            while drained < REFUSAL_DRAIN_BYTES and (data := await self.stream.receive_some()):
                drained += len(data)


class Reloads(Protocol):
    """What the server asks of a reload (lifecycle's `Reloader`, which stands above it and
    is set once built): reload, or join the reload under way; None once the exec has
    happened, else the error that stopped it."""

    async def reload(self, requester: object | None, request_id: int) -> Reply | None: ...


class Resumes(Protocol):
    """What the server asks of a resume (lifecycle's `Resumer`)."""

    async def resume(
        self, worker_id: str, worker_timeout: float | None, asked: AskedKey | None = None
    ) -> Resumption: ...

    async def resume_run(self, run_id: str) -> list[Resumption]: ...

    def latest_resumable(self, cwd: str) -> ResumableRun: ...


class Server:
    def __init__(
        self, daemon: Daemon, resumer: Resumes, frame_limit: int = DEFAULT_FRAME_LIMIT
    ) -> None:
        self.daemon = daemon
        self.frame_limit = frame_limit
        self.budget = FrameBudget(FRAME_BUDGET)
        self.pages = PageBudget(PAGE_BUDGET)
        self.connections = 0  # open now
        self.reloader: Reloads | None = None
        self.resumer = resumer
        self.authority = Authority(lambda worker_id: daemon.reader.lookup(worker_id).parent)
        self._open: set[Connection] = set()
        self._scope = trio.CancelScope()
        self._accepting = trio.CancelScope()
        self._keep: set[Connection] = set()
        self._closed = trio.Event()  # set and replaced each time a connection closes
        self._paused = trio.Event()
        self._resumed: list[Handover] | None = None
        self._resume = trio.Event()

    async def serve(
        self,
        listener: trio.SocketListener,
        adopted: list[Handover] | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until cancelled. ``adopted``: connections handed over by a
        reload, served first.

        While paused (a reload under way) nothing is accepted: connects wait in
        the listening socket's backlog, which survives the exec.
        """
        pending = adopted or []
        task_status.started()
        while True:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    for handover in pending:
                        nursery.start_soon(self._handle_adopted, handover)
                    with trio.CancelScope() as self._accepting:
                        while True:
                            stream = await self._accept(listener)
                            nursery.start_soon(self.handle, stream)
                    await trio.sleep_forever()  # not accepting: pause() ends the handlers
            self._paused.set()
            await self._resume.wait()
            self._resume = trio.Event()
            self._paused = trio.Event()
            pending, self._resumed = self._resumed or [], None

    async def _accept(self, listener: trio.SocketListener) -> trio.SocketStream:
        """The next connection; out of descriptors, wait for some (connects wait in the
        backlog), and say so in `info` meanwhile."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                problem = (
                    f"cannot accept connections: {errno.errorcode[exc.errno]} "
                    f"({exc.strerror}); connects wait until connections or workers close"
                )
                if self.daemon.problems.descriptors != problem:
                    log.error("conn.accept_failed", error=problem)
                self.daemon.problems.descriptors = problem
                await trio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            self.daemon.problems.descriptors = None
            return stream

    async def pause(self, requesters: list[tuple[object, int]]) -> dict[object, Handover]:
        """Tell every client `reloading` and stop serving. The requesters' connections are
        kept as duplicated descriptors (the caller owns them), each other request in flight
        on them answered `reloading` (see `Connection.seal`); refused if they cannot be."""
        reloads: dict[Connection, set[int]] = {}
        for conn, rid in requesters:
            if conn in self._open:
                assert isinstance(conn, Connection)
                reloads.setdefault(conn, set()).add(rid)
        fds = _duplicates(list(reloads))
        try:
            return await self._pause(reloads, fds)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise

    async def _pause(
        self, reloads: dict[Connection, set[int]], fds: dict[Connection, int]
    ) -> dict[object, Handover]:
        notice = Error(
            id=0,
            code=ErrorCode.RELOADING,
            message="the daemon is reloading; reconnect",
            retry_after=RELOAD_RETRY,
        )
        self._accepting.cancel()  # from now on, connects wait in the backlog
        self._keep = set(reloads)
        sealed: set[Connection] = set()
        async with trio.open_nursery() as notices:
            for conn in self._open:
                if conn in reloads:
                    notices.start_soon(self._seal, conn, reloads[conn], sealed)
                else:
                    notices.start_soon(self._notify_reloading, conn, notice)
        # Clients that read the notice hang up; closing on them first would reset
        # their connections (our unread bytes) before they could read it.
        with trio.move_on_after(NOTICE_SECONDS):
            while self._open - self._keep:
                await self._closed.wait()
        self._scope.cancel()
        await self._paused.wait()
        self._keep = set()
        for conn in set(fds) - sealed:  # would not stop in time: closed, not kept
            os.close(fds.pop(conn))
        return {
            conn: Handover(
                fd,
                unread=conn.session.unread(),
                delivered=frozenset(conn.session.delivered),
                caller=conn.session.caller,
            )
            for conn, fd in fds.items()
        }

    @staticmethod
    async def _seal(conn: Connection, reloads: set[int], sealed: set[Connection]) -> None:
        with trio.move_on_after(KEEP_SECONDS):
            # A client gone meanwhile cannot be kept: its connection closes with the rest.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await conn.seal(reloads)
                sealed.add(conn)
        if conn not in sealed:
            log.warning("reload.connection_not_kept", conn=conn.conn_id)

    @contextlib.asynccontextmanager
    async def paused(
        self, requesters: list[tuple[object, int]], failure: Callable[[BaseException], Error]
    ) -> AsyncIterator[dict[object, Handover]]:
        """`pause` for the body, which may carry the kept connections across an exec;
        `resume` after it, each kept connection first answered `failure(exc)` for each
        of its requests if the body raised."""
        kept = await self.pause(requesters)
        try:
            yield kept
        except BaseException as exc:
            error = failure(exc)
            self.resume(
                [
                    dataclasses.replace(
                        held,
                        owed=[msgspec.structs.replace(error, id=rid) for rid in rids],
                    )
                    for held, rids in owed_by_connection(requesters, kept)
                ]
            )
            raise
        self.resume(list(kept.values()))

    @staticmethod
    async def _notify_reloading(conn: Connection, notice: Error) -> None:
        with trio.move_on_after(NOTICE_SECONDS):  # a client that does not read is not waited for
            # A client already gone has nothing to be told.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await conn.send(notice)

    def resume(self, adopted: list[Handover]) -> None:
        self._resumed = adopted
        self._resume.set()

    async def _handle_adopted(self, handover: Handover) -> None:
        # Close-on-exec already: given back by `Carried`, or taken back by `take_back`.
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=handover.fd))
        stream = trio.SocketStream(sock)
        await self.handle(stream, handover)

    async def handle(self, stream: trio.SocketStream, adopted: Handover | None = None) -> None:
        """Serve one connection; ``adopted``: one handed over by a reload (past its hello)."""
        session = Session(
            self._worker_for_token,
            pid=os.getpid(),
            daemon_version=package_version(),
            frame_limit=self.frame_limit,
            welcomed=adopted is not None,
            caller=adopted.caller if adopted is not None else None,
            unread=adopted.unread if adopted is not None else b"",
            delivered=adopted.delivered if adopted is not None else (),
        )
        conn = Connection(stream=stream, conn_id=next(_conn_ids), session=session)
        bind_contextvars(conn=conn.conn_id)
        self.connections += 1
        self._open.add(conn)
        self.daemon.touch()
        # One connection's failure ends that connection, never the server.
        try:
            async with stream:
                if adopted is not None:
                    for reply in adopted.owed:
                        await conn.send(reply)
                    await self._serve_requests(conn)
                elif await self._admit(conn):
                    await self._serve_requests(conn)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; its requests died with it
        except* Exception:
            log.exception("conn.failed")
        finally:
            self.connections -= 1
            self._open.discard(conn)
            closed, self._closed = self._closed, trio.Event()
            closed.set()
            self.daemon.touch()
        log.debug("conn.closed")

    async def _admit(self, conn: Connection) -> bool:
        pid, uid, _gid = _PEERCRED.unpack(
            conn.stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid != os.getuid():
            log.warning("conn.refused", peer_uid=uid, peer_pid=pid)
            await conn.refuse(
                Error(
                    id=0, code=ErrorCode.FORBIDDEN, message="only the daemon's own user may connect"
                )
            )
            return False
        return await self._place(conn, pid)

    async def _place(self, conn: Connection, pid: int) -> bool:
        """Where workers have cgroups, find which worker's (if any) the peer `pid` is in, for
        the hello to make the connection that worker; False if refused: where it cannot
        be told, the connection is not let in as the user (it fails closed)."""
        launcher = self.daemon.launcher
        if launcher.authority == "token":
            return True
        sock = conn.stream.socket

        async def place() -> str | None:
            pidfd = _peer_pidfd(sock)
            try:
                return launcher.worker_of_process(pid, pidfd)
            finally:
                if pidfd is not None:
                    os.close(pidfd)

        try:
            # Out of descriptors (for the pidfd, the read of /proc), waited for a moment.
            conn.session.within = await patiently(place)
        except PeerUnplaced as exc:
            return await self._unplaced(conn, pid, f"{exc}; connect from the process that talks")
        except OSError as exc:
            why = f"where its peer runs could not be read: {exc.strerror or exc}; try again"
            return await self._unplaced(conn, pid, why)
        if conn.session.within is not None:
            bind_contextvars(peer_within=conn.session.within)
        return True

    @staticmethod
    async def _unplaced(conn: Connection, pid: int, why: str) -> bool:
        log.warning("conn.unplaced", peer_pid=pid, error=why)
        await conn.refuse(
            Error(
                id=0,
                code=ErrorCode.FORBIDDEN,
                message=f"cannot tell whether this connection comes from inside a worker, "
                f"so it may act for no one ({why})",
            )
        )
        return False

    async def _serve_requests(self, conn: Connection) -> None:
        try:
            await self._serve_frames(conn)
        finally:
            conn.stopped_reading.set()
            self.budget.release(conn.session.give_back())

    async def _serve_frames(self, conn: Connection) -> None:
        async with trio.open_nursery() as requests:
            with conn.receiving:
                fatal = await self._converse(conn, requests)
            if conn.session.kept:
                # The rest is for the image after this one (`Session.unread`).
                conn.stopped_reading.set()
                await trio.sleep_forever()
            requests.cancel_scope.cancel()
        if fatal is not None:
            await conn.refuse(fatal)

    async def _converse(self, conn: Connection, requests: trio.Nursery) -> Error | None:
        """Answer what arrives until the client hangs up, a reload keeps the connection, or
        the stream cannot go on: then the last word to close with."""
        session = conn.session
        while True:
            while (event := session.next_event()) is not None:
                if isinstance(event, Close):
                    return event.error
                if isinstance(event, Release):
                    self.budget.release(event.size)
                elif isinstance(event, Reply):
                    if isinstance(event, Welcome) and event.worker is not None:
                        bind_contextvars(as_worker=event.worker)
                    await conn.send(event)
                elif event.at_once:
                    # Nothing to wait for: answered here, without a task of its own.
                    try:
                        reply = await self._reply(conn, event)
                    finally:
                        session.finished(event.id)
                    if reply is not None:
                        await conn.send(reply)
                else:
                    cancel_scope, done = trio.CancelScope(), trio.Event()
                    conn.tasks[event.id] = (cancel_scope, done)
                    requests.start_soon(self._answer, conn, event, cancel_scope, done)
            received = await self._receive(conn)
            if received is None or received == b"":  # kept by a reload; the client hung up
                return None
            if isinstance(received, Error):
                return received
            session.receive(received)

    async def _receive(self, conn: Connection) -> bytes | Error | None:
        """What arrives next (b"": the client hung up); None once a reload keeps the
        connection (`seal` cancels a wait here); or the last word if a budgeted frame did
        not arrive whole in time."""
        session = conn.session
        if session.kept:
            return None
        conn.reading = True
        try:
            if (length := session.wanted_reservation()) is not None:
                session.reserve(await self.budget.reserve(length), trio.current_time())
            if not session.reserved:
                return await _read(conn.stream)
            with trio.move_on_at(session.deadline):
                return await _read(conn.stream)
        finally:
            conn.reading = False
        return None if session.kept else session.overdue().error

    async def _answer(
        self,
        conn: Connection,
        request: ClientMessage,
        cancel_scope: trio.CancelScope,
        done: trio.Event,
    ) -> None:
        reply: Reply | None = None
        try:
            with cancel_scope:
                reply = await self._reply(conn, request)
                if reply is not None:
                    await conn.send(reply)
                    reply = None
        finally:
            # An answer in hand when a reload's seal cut its sending off: the seal sends it.
            conn.session.finished(request.id, unsent=reply)
            del conn.tasks[request.id]
            done.set()

    async def _reply(self, conn: Connection, request: ClientMessage) -> Reply | None:
        """What answers `request`: its reply, or the error it met."""
        try:
            if self.daemon.recovering is not None:
                await self._until_recovered(request)
            self.authority.check(conn.session.caller, request)
            return await self._dispatch(conn, request)
        except RemoteError as exc:
            return Error(
                id=request.id, code=exc.code, message=exc.message, retry_after=exc.retry_after
            )
        except StoreWriteFailed as exc:
            # A full disk is the user's to fix, not a bug: say so, in the reply and in info.
            self.daemon.problems.disk_failed(f"store ({op(request)})", exc)
            return Error(
                id=request.id,
                code=ErrorCode.REFUSED,
                message=f"{exc.strerror}; free some space and try again",
            )
        except Exception as exc:
            log.exception("request.failed", op=op(request))
            return Error(
                id=request.id,
                code=ErrorCode.INTERNAL,
                message=f"internal error ({type(exc).__name__}: {exc}); the daemon log "
                "has the details",
            )

    async def _until_recovered(self, request: ClientMessage) -> None:
        """While a restart recovers: return for a request it can answer now (`info`, an
        `abort`), or, for a stream (a followed watch, a subscribe: they wait anyway), once
        recovery is over; raise `Recovering` for every other, which needs the registry
        recovery is rebuilding. Nothing is done for it, so any request (a stop, a keyless
        spawn) may be sent again: a stop is never lost, nor a spawn let past one."""
        if isinstance(request, ANSWERED_WHILE_RECOVERING):
            return
        if request.streams():
            while self.daemon.recovering is not None:
                await self.daemon.activity.wait()
            return
        assert self.daemon.recovering is not None
        raise self.daemon.recovering.refusal(request, trio.current_time())

    def _worker_for_token(self, token: str) -> str | None:
        """The registry's `worker_for_token`, which while a restart recovers knows no token
        yet: its hello is answered `recovering` (and may be said again), not `forbidden`."""
        if self.daemon.recovering is not None:
            raise self.daemon.recovering.refusal(None, trio.current_time())
        return self.daemon.registry.worker_for_token(token)

    async def _dispatch(self, conn: Connection, request: ClientMessage) -> Reply | None:
        daemon, registry, caller = self.daemon, self.daemon.registry, conn.session.caller
        rid = request.id
        match request:
            case Info(usage=usage):  # first: the round trip a client makes most
                return InfoReply(id=rid, info=daemon.info(caller, usage=usage))
            case Spawn():
                return WorkerReply(id=rid, worker=await daemon.spawner.spawn(request, caller))
            case ListWorkers(all=include_ended, run=run, after=after, limit=limit):
                sees = None if caller is None else lambda w: self.authority.sees(caller, w)
                records = registry.listed_after(
                    cursor_place(after), include_ended=include_ended, run=run, sees=sees
                )
                views, cursor, complete = listing_page(records, after, limit)
                if request.usage:
                    daemon.with_usage(views)
                return WorkerList(id=rid, workers=views, next=cursor, complete=complete)
            case Status(worker=worker):
                view = daemon.reader.lookup(worker).view()
                daemon.with_usage([view])  # always, for a live worker: one is cheap
                return WorkerReply(id=rid, worker=view)
            case Stop(worker=worker, wait=wait):
                reply = _stopped(rid, daemon.stops.stop(worker))
                if wait:
                    with conn.answers_if_sealed(reply):
                        await daemon.stops.wait_stopped(worker)
                return reply
            case Pause(worker=worker, run=run):
                paused = await daemon.pauses.pause(worker, run)
                return Paused(
                    id=rid,
                    paused=paused.changed,
                    already_paused=paused.already,
                    held_outside=paused.held_outside,
                )
            case Unpause(worker=worker, run=run):
                unpaused = await daemon.pauses.unpause(worker, run)
                return Unpaused(
                    id=rid, unpaused=unpaused.changed, already_unpaused=unpaused.already
                )
            case Watch(worker=worker, since=since, limit=limit, follow=follow):
                bounds = (request.max_bytes, request.offset)
                if follow:
                    outlet = _PageOutlet(conn, rid, self.pages)
                    await daemon.reader.follow(worker, since, limit, outlet, *bounds)
                    return None
                page = await daemon.reader.watch_page(worker, since, limit, *bounds)
                page.id = rid
                return page
            case Collect(worker=worker, wait=wait):
                return ResultReply(id=rid, result=await daemon.reader.collect(worker, wait=wait))
            case Wait(worker=worker, ready=True):
                if getattr(daemon.reader.lookup(worker), "ready_pattern", None) is None:
                    raise Invalid(
                        f"ready: worker {worker} was spawned without a ready pattern; "
                        "wait for it without ready"
                    )
                await daemon.spawner.readiness.wait_ready(worker)
                return WorkerReply(id=rid, worker=daemon.reader.lookup(worker).view())
            case Wait(worker=worker):
                return WorkerReply(id=rid, worker=await daemon.reader.wait(worker))
            case Grep(worker=worker, pattern=pattern, before=before, after=after, limit=limit):
                found = await daemon.reader.grep(
                    worker,
                    pattern,
                    before=before,
                    after=after,
                    limit=limit,
                    since=request.since,
                    max_bytes=request.max_bytes,
                    written_since=request.written_since,
                    stream=request.stream,
                )
                return GrepReply(id=rid, result=found)
            case Send(worker=worker, data=data, eof=eof):
                return Sent(id=rid, written=daemon.send(worker, data, eof=eof))
            case WaitFor(worker=worker, pattern=pattern, timeout=timeout):
                waited = await daemon.reader.wait_for(worker, pattern, timeout)
                return WaitForReply(id=rid, result=waited)
            case Subscribe(run=run, worker=worker, follow=follow):
                key = daemon.mailbox.key(run, worker)
                await daemon.mailbox.subscribe(key, follow, _wake_sender(conn, rid))
                return None
            case Ack(wakes=seqs):
                conn.session.check_ack(seqs)
                daemon.mailbox.ack(seqs)
                conn.session.acked(seqs)
                return Done(id=rid)
            case Resume(worker=worker, timeout=timeout):
                if given := request.given_again():
                    raise Frozen(
                        f"a resume runs what worker {worker}'s snapshot froze at spawn: "
                        f"{', '.join(given)} cannot be given again (only timeout can)"
                    )
                resumed = await self.resumer.resume(worker, timeout, asked_key(request, caller))
                return WorkerReply(id=rid, worker=resumed.view, changed=resumed.changed)
            case Cancel(scope=scope):
                return _cancelled(rid, daemon.stops.cancel(scope))
            case Abort(request=target):
                # In flight when the abort came (the session answers one that is not).
                task = conn.tasks.get(target)
                if task is not None:
                    task[0].cancel()
                    await task[1].wait()
                return Done(id=rid)
            case NewRun(outer=outer, limits=limits, max_running=max_running):
                daemon.launcher.controllers.refuse_unenforced(limits, "the new run")
                return RunReply(id=rid, run=daemon.runs.new_run(outer, limits or None, max_running))
            case StopRun(run=run, wait=wait):
                reply = _stopped(rid, daemon.stops.stop_run(run))
                if wait:
                    with conn.answers_if_sealed(reply):
                        await daemon.stops.wait_run_ended(run)
                return reply
            case WaitRunStopped(run=run):
                await daemon.runs.wait_run_stopped(run)
                return Done(id=rid)
            case BeginTurn():
                return TurnReply(id=rid, turn=daemon.runs.begin_turn())
            case SetFence():
                return FenceReply(id=rid, epoch=daemon.runs.set_fence())
            case Reload():
                assert self.reloader is not None
                return await self.reloader.reload(conn, rid)
            case ReopenRun(run=run):
                daemon.runs.reopen_run(run)
                return Done(id=rid)
            case ResumeRun(run=run):
                every = await self.resumer.resume_run(run)
                return WorkerList(
                    id=rid,
                    workers=[r.view for r in every],
                    changed={r.view.id: r.changed for r in every if r.changed},
                )
            case LatestResumable(cwd=cwd):
                latest = self.resumer.latest_resumable(cwd)
                return Latest(
                    id=rid,
                    run=latest.run,
                    resumable=latest.resumable,
                    reason=latest.reason,
                    from_=latest.from_,
                )
            case CancelFence(epoch=epoch):
                return _cancelled(rid, daemon.stops.cancel_fence(epoch))
            case ClearFence():
                daemon.runs.clear_fence()
                return Done(id=rid)
        raise Invalid(f"unknown request {op(request)}")


def _stopped(rid: int, done: Stopping) -> Stopped:
    return Stopped(id=rid, found=done.found, stopped=done.stopped, already_stopping=done.already)


def _cancelled(rid: int, done: Stopping) -> Cancelled:
    return Cancelled(id=rid, cancelled=done.stopped, already_stopping=done.already)


async def _read(stream: trio.SocketStream) -> bytes:
    """What the socket has, once it has something (b"": the peer hung up).

    `stream.receive_some` without its layers: it tries a read first, which between a
    client's requests always finds nothing; this waits first, so a request costs one
    read(2) and no exception (the wait is the checkpoint).
    """
    while True:
        await trio.lowlevel.wait_readable(stream.socket)
        try:
            return os.read(stream.socket.fileno(), RECEIVE_SIZE)
        except BlockingIOError:
            continue  # woken for nothing: wait again
        except OSError as exc:  # ECONNRESET: the client is gone
            raise trio.BrokenResourceError(str(exc)) from exc


def _peer_pidfd(sock: trio.socket.SocketType) -> int | None:
    """A pidfd of the socket's peer (SO_PEERPIDFD), None where the kernel gives none (before
    Linux 6.5): the peer is then known by its pid alone. Raises PeerUnplaced if the peer
    is gone, OSError (EMFILE) if no descriptor is left for it."""
    try:
        pidfd: int = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
            return None
        if exc.errno == errno.ESRCH:
            raise PeerUnplaced("the process that connected has exited") from exc
        raise
    return pidfd


def _duplicates(conns: list[Connection]) -> dict[Connection, int]:
    """A duplicate of each connection's descriptor, to outlive its stream (all or none)."""
    fds: dict[Connection, int] = {}
    try:
        for conn in conns:
            fds[conn] = os.dup(conn.stream.socket.fileno())
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise Refused(
            f"cannot keep the connection that asked across the reload ({exc.strerror}); "
            "the old image serves on"
        ) from exc
    return fds


def _page_frame(page: Page, rid: int) -> memoryview:
    page.id = rid
    return memoryview(encode(page))


def _wake_sender(conn: Connection, rid: int) -> Callable[[list[Wake], bool], Awaitable[None]]:
    async def send(wakes: list[Wake], complete: bool) -> None:
        await conn.send(Wakes(id=rid, wakes=wakes, complete=complete))
        conn.session.delivered_wakes(w.seq for w in wakes)
        await trio.lowlevel.checkpoint()  # see _PageOutlet.send

    return send


class _PageOutlet:
    """Where a followed watch's pages go: room for each in the connection's socket and
    the server's page budget, then the connection."""

    def __init__(self, conn: Connection, rid: int, budget: PageBudget) -> None:
        self.conn = conn
        self.rid = rid
        self.held = Reservation(budget)

    def room(self, most: int) -> contextlib.AbstractAsyncContextManager[int]:
        return self.conn.page_room(self.held, most)

    async def send(self, page: PageInHand) -> None:
        await self.conn.send_page(page, self.rid, self.held)
