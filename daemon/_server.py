"""The control socket's server: connections, the hello, and request dispatch.

Each connection is checked with SO_PEERCRED (only the daemon's own uid gets
in), must open with a hello, and then may have many requests in flight, each
answered by its own task. A bad frame or message costs its sender an error
and, where the stream is unreadable, the connection; never anyone else's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import math
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import structlog
import trio

from subagentd.protocol import (
    DEFAULT_FRAME_LIMIT,
    PROTOCOL_VERSION,
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
    FrameDecoder,
    Hello,
    Info,
    InfoReply,
    Latest,
    LatestResumable,
    ListWorkers,
    NewRun,
    Page,
    Reload,
    Reply,
    ResultReply,
    Resume,
    ResumeRun,
    RunReply,
    SetFence,
    Spawn,
    Status,
    Stop,
    Stopped,
    StopRun,
    Subscribe,
    TurnReply,
    Wait,
    WaitRunStopped,
    Wake,
    Wakes,
    Watch,
    Welcome,
    WorkerList,
    WorkerReply,
    client_decoder,
    encode,
    op,
    package_version,
)
from subagentd.protocol.errors import (
    ErrorCode,
    FrameTooLarge,
    Frozen,
    Invalid,
    Refused,
    RemoteError,
)

from ._authority import Authority
from ._daemon import RELOAD_RETRY, Daemon
from ._registry import listing_page
from ._reload import Handover, Reloader, owed_by_connection
from ._resumer import Resumer

log = structlog.get_logger("subagentd")

#: Requests one connection may have in flight; more are answered `busy`. Aborts have
#: as many again of their own, so that a connection at the limit can still abort.
MAX_IN_FLIGHT = 256
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
#: Bytes of frames still arriving that all connections together may hold. A frame
#: longer than BUDGETED_FROM is read only once its length is reserved here;
#: until then its connection is not read (its client's sends block).
FRAME_BUDGET = 64 * 1024 * 1024
BUDGETED_FROM = 64 * 1024
#: A budgeted frame must then arrive whole within FRAME_SECONDS plus a second per
#: FRAME_MIN_RATE bytes, or its connection is closed: a client that sends the header
#: of a large frame and stalls must not hold the budget (and every large request) for good.
FRAME_SECONDS = 5.0
FRAME_MIN_RATE = 1024 * 1024
_PEERCRED = struct.Struct("3i")
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
    stream: trio.SocketStream
    conn_id: int
    caller: str | None = None  # the worker this connection acts as, if it gave a token
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    streams: dict[int, tuple[trio.CancelScope, trio.Event]] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)  # wake seqs sent here, not yet acked
    reserved: int = 0  # of the server's frame budget, for the large frame arriving here
    #: A reload keeps this connection: nothing more is read of it, or sent on it, here.
    kept: bool = False
    sealed: bool = False
    receiving: trio.CancelScope = field(default_factory=trio.CancelScope)  # each read's
    stopped_reading: trio.Event = field(default_factory=trio.Event)
    unread: bytes = b""  # read, not taken as requests, once it stopped reading
    unsent: dict[int, Reply] = field(default_factory=dict)  # answers the seal cut off

    async def seal(self, reloads: set[int]) -> None:
        """Stop reading here, then answer each request in flight but `reloads`: with its
        answer if it has one, else `reloading` under its own id: its client sends it again,
        and the image that reads on (the next one, or this one if the reload fails)
        answers it. Nothing is sent here after."""
        self.kept = True
        self.receiving.cancel()
        await self.stopped_reading.wait()
        async with self.send_lock:  # no frame is half sent now, and none can begin
            in_flight = [
                (rid, stream) for rid, stream in self.streams.items() if rid not in reloads
            ]
            for _rid, (scope, _done) in in_flight:
                scope.cancel()
            for _rid, (_scope, done) in in_flight:
                await done.wait()
            for rid, _stream in in_flight:
                again = Error(
                    id=rid,
                    code=ErrorCode.RELOADING,
                    message="the daemon is reloading; send this request again (this "
                    "connection is kept: the new image answers it)",
                    retry_after=RELOAD_RETRY,
                )
                await self.stream.send_all(encode(self.unsent.pop(rid, again)))
            self.sealed = True

    @contextlib.contextmanager
    def answers_if_sealed(self, reply: Reply) -> Iterator[None]:
        """For the body, a wait after its request took effect (a stop waiting for processes
        to exit): cut short by the seal, the request is answered `reply`, not `reloading`,
        whose re-send would find it done and answer otherwise (a stop: nothing stopped)."""
        try:
            yield
        except trio.Cancelled:
            if self.kept:
                self.unsent[reply.id] = reply
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
            await self.stream.send_all(data)
        finally:
            self.send_lock.release()

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


class Server:
    def __init__(self, daemon: Daemon, frame_limit: int = DEFAULT_FRAME_LIMIT) -> None:
        self.daemon = daemon
        self.frame_limit = frame_limit
        self.budget = FrameBudget(FRAME_BUDGET)
        self.connections = 0  # open now
        self.reloader: Reloader | None = None
        self.resumer = Resumer(daemon)
        self.authority = Authority(lambda worker_id: daemon.lookup(worker_id).parent)
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
                if self.daemon.descriptor_problem != problem:
                    log.error("conn.accept_failed", error=problem)
                self.daemon.descriptor_problem = problem
                await trio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            self.daemon.descriptor_problem = None
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
            conn: Handover(fd, unread=conn.unread, delivered=frozenset(conn.delivered))
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
                        owed=[
                            Error(id=rid, code=error.code, message=error.message) for rid in rids
                        ],
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
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=handover.fd))
        os.set_inheritable(handover.fd, False)
        stream = trio.SocketStream(sock)
        await self.handle(stream, handover)

    async def handle(self, stream: trio.SocketStream, adopted: Handover | None = None) -> None:
        """Serve one connection; ``adopted``: one handed over by a reload (past its hello)."""
        conn = Connection(stream=stream, conn_id=next(_conn_ids))
        structlog.contextvars.bind_contextvars(conn=conn.conn_id)
        self.connections += 1
        self._open.add(conn)
        self.daemon.touch()
        # One connection's failure ends that connection, never the server.
        try:
            async with stream:
                if adopted is not None:
                    conn.delivered = set(adopted.delivered)
                    for reply in adopted.owed:
                        await conn.send(reply)
                    await self._serve_requests(conn, hello_seen=True, unread=adopted.unread)
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
        return True

    async def _serve_requests(
        self, conn: Connection, hello_seen: bool = False, unread: bytes = b""
    ) -> None:
        try:
            await self._serve_frames(conn, hello_seen, unread)
        finally:
            conn.stopped_reading.set()
            self.budget.release(conn.reserved)
            conn.reserved = 0

    async def _serve_frames(self, conn: Connection, hello_seen: bool, unread: bytes) -> None:
        decoder = FrameDecoder(self.frame_limit)
        decoder.feed(unread)  # what the image before this one read of it (a reload's)
        fatal: Error | None = None
        allowed = due = math.inf  # for the budgeted frame arriving, if one is
        async with trio.open_nursery() as requests:
            while True:
                # Frame by frame: what came before a bad frame is answered first.
                while not conn.kept:
                    try:
                        body = decoder.next_frame()
                    except FrameTooLarge as exc:
                        # The stream cannot be resynchronised: this connection ends here.
                        fatal = Error(id=0, code=ErrorCode.TOO_LARGE, message=str(exc))
                        break
                    if body is None:
                        break
                    if conn.reserved:  # what it held is a whole frame now
                        self.budget.release(conn.reserved)
                        conn.reserved = 0
                    message = _decode(body)
                    if not hello_seen:
                        if not await self._hello(conn, message):
                            requests.cancel_scope.cancel()
                            return
                        hello_seen = True
                    elif isinstance(message, Error):
                        await conn.send(message)  # the connection carries on
                    elif refusal := self._admission(conn, message):
                        await conn.send(refusal)
                    elif message.at_once:
                        # Nothing to wait for: answered here, without a task of its own.
                        if (reply := await self._reply(conn, message)) is not None:
                            await conn.send(reply)
                    else:
                        cancel_scope, done = trio.CancelScope(), trio.Event()
                        conn.streams[message.id] = (cancel_scope, done)
                        requests.start_soon(self._answer, conn, message, cancel_scope, done)
                if fatal is not None:
                    requests.cancel_scope.cancel()
                    break
                if conn.kept:
                    # A reload keeps this connection: the rest is for the image after it.
                    conn.unread = decoder.unread()
                    conn.stopped_reading.set()
                    await trio.sleep_forever()  # until the reload ends this connection here
                length = decoder.incomplete_length
                with trio.CancelScope() as conn.receiving:
                    if length is not None and length > BUDGETED_FROM and not conn.reserved:
                        conn.reserved = await self.budget.reserve(length)
                        allowed = FRAME_SECONDS + length / FRAME_MIN_RATE
                        due = trio.current_time() + allowed
                    with trio.move_on_at(due if conn.reserved else math.inf) as stalled:
                        data = await conn.stream.receive_some(65536)
                if conn.receiving.cancelled_caught:
                    continue  # kept by a reload: see above
                if stalled.cancelled_caught:
                    requests.cancel_scope.cancel()
                    fatal = Error(
                        id=0,
                        code=ErrorCode.INVALID,
                        message=f"a frame of {length} bytes did not arrive whole within "
                        f"{allowed:.0f} s; send each frame at once",
                    )
                    break
                if not data:
                    requests.cancel_scope.cancel()
                    return
                decoder.feed(data)
        await conn.refuse(fatal)

    @staticmethod
    def _admission(conn: Connection, message: ClientMessage) -> Error | None:
        """Why a request cannot be taken on this connection now, if it cannot."""
        if message.id in conn.streams:
            return Error(
                id=message.id,
                code=ErrorCode.INVALID,
                message=f"request id {message.id} is already in flight",
            )
        limit = 2 * MAX_IN_FLIGHT if isinstance(message, Abort) else MAX_IN_FLIGHT
        if len(conn.streams) >= limit:
            return Error(
                id=message.id,
                code=ErrorCode.BUSY,
                message=f"more than {MAX_IN_FLIGHT} requests in flight on one "
                "connection; wait for answers or open another connection",
            )
        return None

    async def _hello(self, conn: Connection, message: ClientMessage | Error) -> bool:
        if isinstance(message, Error):  # a first message that does not decode: no hello
            await conn.refuse(message)
            return False
        if not isinstance(message, Hello):
            await conn.refuse(
                Error(
                    id=message.id, code=ErrorCode.INVALID, message="a connection opens with hello"
                )
            )
            return False
        if message.version != PROTOCOL_VERSION:
            await conn.refuse(
                Error(
                    id=message.id,
                    code=ErrorCode.UNSUPPORTED_VERSION,
                    message=f"this daemon speaks protocol {PROTOCOL_VERSION}, "
                    f"not {message.version}; upgrade the client or the daemon",
                )
            )
            return False
        if message.token is not None:
            caller = self.daemon.registry.worker_for_token(message.token)
            if caller is None:
                await conn.refuse(
                    Error(
                        id=message.id,
                        code=ErrorCode.FORBIDDEN,
                        message="this worker token is not known (its worker has been reaped?)",
                    )
                )
                return False
            conn.caller = caller
            structlog.contextvars.bind_contextvars(as_worker=caller)
        await conn.send(
            Welcome(
                id=message.id,
                version=PROTOCOL_VERSION,
                daemon_version=package_version(),
                pid=os.getpid(),
                worker=conn.caller,
            )
        )
        return True

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
            if reply is not None and conn.kept:  # cut off by a reload's seal, which sends it
                conn.unsent[request.id] = reply
            del conn.streams[request.id]
            done.set()

    async def _reply(self, conn: Connection, request: ClientMessage) -> Reply | None:
        """What answers `request`: its reply, or the error it met."""
        try:
            self.authority.check(conn.caller, request)
            return await self._dispatch(conn, request)
        except RemoteError as exc:
            return Error(
                id=request.id, code=exc.code, message=exc.message, retry_after=exc.retry_after
            )
        except Exception as exc:
            log.exception("request.failed", op=op(request))
            return Error(
                id=request.id,
                code=ErrorCode.INTERNAL,
                message=f"internal error ({type(exc).__name__}: {exc}); the daemon log "
                "has the details",
            )

    async def _dispatch(self, conn: Connection, request: ClientMessage) -> Reply | None:
        daemon, registry, caller = self.daemon, self.daemon.registry, conn.caller
        rid = request.id
        match request:
            case Spawn():
                return WorkerReply(id=rid, worker=await daemon.spawn(request, caller))
            case ListWorkers(all=include_ended, run=run, after=after, limit=limit):
                records = registry.listing(include_ended=include_ended, run=run)
                if caller is not None:
                    records = [r for r in records if self.authority.sees(caller, r.id)]
                views, cursor, complete = listing_page(records, after, limit)
                return WorkerList(id=rid, workers=views, next=cursor, complete=complete)
            case Status(worker=worker):
                return WorkerReply(id=rid, worker=daemon.lookup(worker).view())
            case Stop(worker=worker, wait=wait):
                found, stopped = daemon.stop(worker)
                reply = Stopped(id=rid, found=found, stopped=stopped)
                if wait:
                    with conn.answers_if_sealed(reply):
                        await daemon.wait_stopped(worker)
                return reply
            case Watch(worker=worker, since=since, limit=limit, follow=follow):
                if follow:
                    await daemon.follow(worker, since, limit, _sender(conn, rid))
                    return None
                page = await daemon.watch_page(worker, since, limit)
                page.id = rid
                return page
            case Collect(worker=worker, wait=wait):
                return ResultReply(id=rid, result=await daemon.collect(worker, wait=wait))
            case Wait(worker=worker):
                return WorkerReply(id=rid, worker=await daemon.wait(worker))
            case Subscribe(run=run, worker=worker, follow=follow):
                key = daemon.wake_key(run, worker)
                await daemon.subscribe(key, follow, _wake_sender(conn, rid))
                return None
            case Ack(wakes=seqs):
                never = sorted(set(seqs) - conn.delivered)
                if never:
                    raise Invalid(
                        f"wakes {never} were never delivered on this connection; "
                        "acknowledge only wakes you received"
                    )
                daemon.ack(seqs)
                conn.delivered.difference_update(seqs)
                return Done(id=rid)
            case Resume(worker=worker, timeout=timeout):
                given = [
                    name
                    for name, value in (
                        ("input", request.input),
                        ("command", request.argv),
                        ("model", request.model),
                    )
                    if value is not None
                ]
                if given:
                    raise Frozen(
                        f"a resume runs what worker {worker}'s snapshot froze at spawn: "
                        f"{', '.join(given)} cannot be given again (only --timeout can)"
                    )
                return WorkerReply(id=rid, worker=await self.resumer.resume(worker, timeout))
            case Cancel(scope=scope):
                return Cancelled(id=rid, cancelled=daemon.cancel(scope))
            case Info():
                return InfoReply(id=rid, info=daemon.info())
            case Abort(request=target):
                stream = conn.streams.get(target)
                if stream is not None and target != rid:
                    stream[0].cancel()
                    await stream[1].wait()
                return Done(id=rid)
            case Hello():
                raise Invalid("hello was already exchanged on this connection")
            case NewRun(outer=outer):
                return RunReply(id=rid, run=daemon.new_run(outer))
            case StopRun(run=run, wait=wait):
                found, stopped = daemon.stop_run(run)
                reply = Stopped(id=rid, found=found, stopped=stopped)
                if wait:
                    with conn.answers_if_sealed(reply):
                        await daemon.wait_run_ended(run)
                return reply
            case WaitRunStopped(run=run):
                await daemon.wait_run_stopped(run)
                return Done(id=rid)
            case BeginTurn():
                return TurnReply(id=rid, turn=daemon.begin_turn())
            case SetFence():
                return FenceReply(id=rid, epoch=daemon.set_fence())
            case Reload():
                assert self.reloader is not None
                return await self.reloader.reload(conn, rid)
            case ResumeRun(run=run):
                return WorkerList(id=rid, workers=await self.resumer.resume_run(run))
            case LatestResumable(cwd=cwd):
                run, resumable, reason = self.resumer.latest_resumable(cwd)
                return Latest(id=rid, run=run, resumable=resumable, reason=reason)
            case CancelFence(epoch=epoch):
                return Cancelled(id=rid, cancelled=daemon.cancel_fence(epoch))
            case ClearFence():
                daemon.clear_fence()
                return Done(id=rid)
        raise Invalid(f"unknown request {op(request)}")


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


def _wake_sender(conn: Connection, rid: int) -> Callable[[list[Wake], bool], Awaitable[None]]:
    async def send(wakes: list[Wake], complete: bool) -> None:
        await conn.send(Wakes(id=rid, wakes=wakes, complete=complete))
        conn.delivered.update(w.seq for w in wakes)
        await trio.lowlevel.checkpoint()  # see _sender

    return send


def _sender(conn: Connection, rid: int) -> Callable[[Page], Awaitable[None]]:
    async def send(page: Page) -> None:
        page.id = rid
        await conn.send(page)
        # A send that the socket took whole does not yield: a stream of pages
        # to a client that keeps up must still let every other task run.
        await trio.lowlevel.checkpoint()

    return send


def _decode(body: bytes) -> ClientMessage | Error:
    try:
        return client_decoder.decode(body)
    except msgspec.ValidationError as exc:
        # msgpack, but a field missing, of the wrong type or out of range: msgspec
        # names it ("... - at `$.grace`").
        return Error(
            id=_salvage_id(body), code=ErrorCode.INVALID, message=f"invalid request: {exc}"
        )
    except msgspec.DecodeError as exc:
        return Error(
            id=_salvage_id(body), code=ErrorCode.INVALID, message=f"malformed message: {exc}"
        )


def _salvage_id(body: bytes) -> int:
    """The id of a message that failed to decode, if it has a readable one, so the
    client can match the error to its request. An id of 0 or less is answered as
    given: 0 is also what a message without a readable id gets."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return 0
    if isinstance(raw, dict) and isinstance(raw.get("id"), int):
        return int(raw["id"])
    return 0
