"""What both clients share, without I/O: requests built, replies checked, frames routed.

`Client` and `AsyncClient` only move bytes; everything they decide lives here
once (httpx's split). Reads the environment and the working directory for
defaults; opens no socket.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NoReturn, TypeVar

import msgspec

from subagentd.protocol import (
    Abort,
    Ack,
    BeginTurn,
    Cancel,
    CancelFence,
    Cancelled,
    ClearFence,
    Collect,
    DaemonInfo,
    Done,
    Entry,
    Error,
    FenceReply,
    FrameDecoder,
    Hello,
    Info,
    InfoReply,
    ListWorkers,
    NewRun,
    Page,
    Reply,
    Request,
    ResultReply,
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
    WorkerResult,
    WorkerView,
    daemon_decoder,
    default_socket_path,
    encode,
    package_version,
)
from subagentd.protocol.errors import (
    ConnectionLost,
    DaemonUnavailable,
    NotFound,
    ProtocolError,
    remote_error,
)

T = TypeVar("T")
R = TypeVar("R", bound=Reply)

#: The first request of every connection; later ids count up from here.
HELLO_ID = 1


# -- where the daemon is and who we are ----------------------------------------


def socket_path(
    explicit: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ
) -> Path:
    """The socket to connect to: the one given, else $SUBAGENTD_SOCKET, else the default."""
    if explicit is not None:
        return Path(explicit)
    return default_socket_path(environ)


def token(environ: Mapping[str, str] = os.environ) -> str | None:
    """A worker's token, set by the daemon in its environment: a client inside it acts as it."""
    return environ.get("SUBAGENTD_TOKEN") or None


def unavailable(path: Path, exc: OSError) -> DaemonUnavailable:
    """The error for a connect that failed, saying how to get a daemon where none listens."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return DaemonUnavailable(
            f"no daemon at {path} ({reason}); "
            "start one with `subagentd` or `systemctl --user start subagentd`"
        )
    return DaemonUnavailable(f"cannot connect to the daemon at {path}: {reason}")


def unknown_worker(worker_id: str) -> NotFound:
    return NotFound(
        f"no worker {worker_id!r} is known to the daemon; "
        "`subagentctl ls --all` lists the workers it holds"
    )


def unknown_run(run_id: str) -> NotFound:
    return NotFound(f"no run {run_id!r} is known to the daemon")


# -- replies -------------------------------------------------------------------


def checked(reply: Reply) -> Reply:
    """`reply` itself, unless it is an Error: then the `RemoteError` subclass for its code."""
    if isinstance(reply, Error):
        raise remote_error(reply.code, reply.message, reply.retry_after)
    return reply


def expect(reply: Reply, kind: type[R]) -> R:
    """`reply` as a `kind`, raising what an Error carries or `ProtocolError` for a wrong answer."""
    checked(reply)
    if not isinstance(reply, kind):
        raise ProtocolError(
            f"the daemon answered request {reply.id} with {type(reply).__name__}, "
            f"expected {kind.__name__}"
        )
    return reply


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request, and how its reply becomes the value a client method returns.

    The request's id is a placeholder: the connection stamps the real one on sending.
    """

    request: Request
    answer: Callable[[Reply], T]


def _welcome(reply: Reply) -> Welcome:
    return expect(reply, Welcome)


def _worker(reply: Reply) -> WorkerView:
    return expect(reply, WorkerReply).worker


def _workers(reply: Reply) -> list[WorkerView]:
    return expect(reply, WorkerList).workers


def _run(reply: Reply) -> str:
    return expect(reply, RunReply).run


def _found(reply: Reply) -> bool:
    return expect(reply, Stopped).found


def _page(reply: Reply) -> Page:
    return expect(reply, Page)


def _result(reply: Reply) -> WorkerResult:
    return expect(reply, ResultReply).result


def _info(reply: Reply) -> DaemonInfo:
    return expect(reply, InfoReply).info


def _turn(reply: Reply) -> int:
    return expect(reply, TurnReply).turn


def _cancelled(reply: Reply) -> list[str]:
    return expect(reply, Cancelled).cancelled


def _epoch(reply: Reply) -> int:
    return expect(reply, FenceReply).epoch


def _done(reply: Reply) -> None:
    expect(reply, Done)


def hello(worker_token: str | None) -> Call[Welcome]:
    return Call(
        Hello(id=0, token=worker_token, client=f"subagentd.client/{package_version()}"), _welcome
    )


def spawn(
    argv: Sequence[str],
    *,
    name: str = "",
    run: str | None = None,
    parent: str | None = None,
    agent: str | None = None,
    input: str | bytes | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    grace: float | None = None,
) -> Call[WorkerView]:
    request = Spawn(
        id=0,
        argv=list(argv),
        agent=agent,
        name=name,
        run=run,
        parent=parent,
        input=input.encode() if isinstance(input, str) else input,
        # The daemon's cwd means nothing to the caller: a worker starts where its spawner stands.
        cwd=os.fspath(cwd) if cwd is not None else os.getcwd(),
        env=dict(env or {}),
        timeout=timeout,
        grace=grace,
    )
    return Call(request, _worker)


def new_run(outer: str | None = None) -> Call[str]:
    return Call(NewRun(id=0, outer=outer), _run)


def ls(all: bool = False, run: str | None = None) -> Call[list[WorkerView]]:
    return Call(ListWorkers(id=0, all=all, run=run), _workers)


def status(worker_id: str) -> Call[WorkerView]:
    return Call(Status(id=0, worker=worker_id), _worker)


def stop(worker_id: str, wait: bool = True) -> Call[bool]:
    return Call(Stop(id=0, worker=worker_id, wait=wait), _found)


def stop_run(run_id: str, wait: bool = True) -> Call[list[str]]:
    def stopped(reply: Reply) -> list[str]:
        answer = expect(reply, Stopped)
        if not answer.found:
            raise unknown_run(run_id)
        return answer.stopped

    return Call(StopRun(id=0, run=run_id, wait=wait), stopped)


def watch_page(worker_id: str, since: int = 0, limit: int = 1000) -> Call[Page]:
    return Call(Watch(id=0, worker=worker_id, since=since, limit=limit), _page)


def collect(worker_id: str, wait: bool = False) -> Call[WorkerResult]:
    return Call(Collect(id=0, worker=worker_id, wait=wait), _result)


def wait(worker_id: str) -> Call[WorkerView]:
    return Call(Wait(id=0, worker=worker_id), _worker)


def info() -> Call[DaemonInfo]:
    return Call(Info(id=0), _info)


def wait_run_stopped(run_id: str) -> Call[None]:
    return Call(WaitRunStopped(id=0, run=run_id), _done)


def begin_turn() -> Call[int]:
    return Call(BeginTurn(id=0), _turn)


def cancel(scope: str) -> Call[list[str]]:
    return Call(Cancel(id=0, scope=scope), _cancelled)


def set_fence() -> Call[int]:
    return Call(SetFence(id=0), _epoch)


def cancel_fence(epoch: int) -> Call[list[str]]:
    return Call(CancelFence(id=0, epoch=epoch), _cancelled)


def clear_fence() -> Call[None]:
    return Call(ClearFence(id=0), _done)


def ack(seqs: Iterable[int]) -> Call[None]:
    return Call(Ack(id=0, wakes=list(seqs)), _done)


class JournalCursor:
    """Where one reading of a worker's journal stands: what to ask for next, and when it is over.

    Unfollowed, the reading is a snapshot: one Watch per page until a page comes
    back empty or complete. Followed, one Watch whose stream of pages ends with
    the complete one.
    """

    def __init__(self, worker_id: str, since: int = 0, *, follow: bool = False) -> None:
        self.worker_id = worker_id
        self.since = since
        self.follow = follow
        self.done = False

    def request(self) -> Watch:
        return Watch(id=0, worker=self.worker_id, since=self.since, follow=self.follow)

    def take(self, reply: Reply) -> list[Entry]:
        """The entries of the next page, advancing the cursor past them."""
        page = expect(reply, Page)
        self.since = page.next
        self.done = page.complete or (not self.follow and not page.entries)
        return page.entries


class WakeSubscription:
    """Where one subscription to a parent's wakes stands: what to subscribe with, and when
    it is over.

    The first page always comes, empty or not: it confirms the subscription.
    Unfollowed, that page is the whole answer; followed, pages come as wakes are
    posted until the caller aborts. Acknowledging is the caller's business: a
    wake is delivered again, to any subscriber, until it is acknowledged.
    """

    def __init__(
        self, run: str | None = None, worker: str | None = None, *, follow: bool = False
    ) -> None:
        self.run = run
        self.worker = worker
        self.follow = follow
        self.done = False

    def request(self) -> Subscribe:
        return Subscribe(id=0, run=self.run, worker=self.worker, follow=self.follow)

    def take(self, reply: Reply) -> list[Wake]:
        """The wakes of the next page; raises what an error reply carries, which ends it."""
        self.done = True  # an error ends the subscription as surely as a complete page
        page = expect(reply, Wakes)
        self.done = page.complete or not self.follow
        return page.wakes


# -- the conversation ----------------------------------------------------------


class _Envelope(msgspec.Struct):
    """Just the id of a message, to tell an event we do not know from a broken reply."""

    id: int = 0


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


class Connection:
    """The client's side of one connection, sans I/O: ids out, replies sorted by request id.

    Feed it what the socket returned with `receive_data` (b"" at end of file) and
    send what `send` and `abort` return. A reply is kept only while its request
    is open: replies to finished or aborted requests, and events (id 0) this
    client does not handle, are dropped.
    """

    def __init__(self) -> None:
        self._frames = FrameDecoder()
        self._next_id = HELLO_ID
        self._inboxes: dict[int, deque[Reply]] = {}
        self._closed = False
        # Why the connection ended: the daemon's parting Error (too_large,
        # reloading), or the transport or protocol failure that ended it.
        self._cause: Error | Exception | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, request: Request) -> tuple[int, bytes]:
        """Open `request` under a fresh id; answers (id, the frame to send)."""
        if self._closed:
            self._raise_closed()
        request_id = self._take_id()
        self._inboxes[request_id] = deque()
        return request_id, encode(msgspec.structs.replace(request, id=request_id))

    def finish(self, request_id: int) -> None:
        """Forget `request_id`; whatever still arrives for it is dropped."""
        self._inboxes.pop(request_id, None)

    def abort(self, request_id: int) -> bytes | None:
        """Finish `request_id` and answer the Abort frame that stops the daemon working on it
        (None: the connection is gone, and the work with it)."""
        self.finish(request_id)
        if self._closed:
            return None
        # The Abort's own id is never opened, so its Done is dropped with the request's stragglers.
        return encode(Abort(id=self._take_id(), request=request_id))

    def receive_data(self, data: bytes) -> None:
        """Take what the socket returned, split anywhere; b"" means the daemon closed."""
        if self._closed:
            return
        if not data:
            self._closed = True
            return
        self._frames.feed(data)
        try:
            while (body := self._frames.next_frame()) is not None:
                reply = _decode(body)
                if reply is None:
                    continue
                if (inbox := self._inboxes.get(reply.id)) is not None:
                    inbox.append(reply)
                elif reply.id == 0 and isinstance(reply, Error):
                    self._cause = reply
        except ProtocolError as exc:
            self._closed = True
            self._cause = exc

    def connection_lost(self, exc: Exception) -> None:
        """The transport failed with `exc`: every open request and later send raises."""
        if not self._closed:
            self._closed = True
            self._cause = exc

    def next_reply(self, request_id: int) -> Reply | None:
        """The next reply to `request_id`; None until one arrives; raises once none ever can."""
        inbox = self._inboxes[request_id]
        if inbox:
            return inbox.popleft()
        if self._closed:
            self._raise_closed()
        return None

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id += 1
        return request_id

    def _raise_closed(self) -> NoReturn:
        # A fresh exception on every call: several waiters may raise it, and a
        # shared instance would grow one traceback across all of them.
        match self._cause:
            case Error(code=code, message=message, retry_after=retry_after):
                raise remote_error(code, message, retry_after)
            case ProtocolError() as cause:
                raise ProtocolError(str(cause)) from cause
            case Exception() as cause:
                raise ConnectionLost(f"the connection to the daemon failed: {cause}") from cause
            case _:
                raise ConnectionLost("the daemon closed the connection before answering")


def _decode(body: bytes) -> Reply | None:
    """The message in `body`; None for an event of a kind this client does not know."""
    try:
        return daemon_decoder.decode(body)
    except msgspec.DecodeError as exc:
        try:
            envelope = _envelope_decoder.decode(body)
        except msgspec.DecodeError:
            raise ProtocolError(f"the daemon sent a frame that is not a message: {exc}") from exc
        if envelope.id == 0:
            return None
        raise ProtocolError(
            f"the daemon's reply to request {envelope.id} does not decode: {exc}"
        ) from exc
