"""What both clients share, without I/O: requests built, replies checked, frames routed.

`Client` and `AsyncClient` only move bytes; everything they decide lives here
once (httpx's split). Reads the environment and the working directory for
defaults; opens no socket.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NoReturn, TypeVar

import msgspec

from subagentd.protocol import (
    DEFAULT_ANSWER_BYTES,
    MAX_GREP_MATCHES,
    Abort,
    Ack,
    BeginTurn,
    Cancel,
    CancelFence,
    ClearFence,
    Collect,
    DaemonInfo,
    Done,
    Entry,
    Error,
    FrameDecoder,
    Grep,
    GrepMatch,
    GrepResult,
    Hello,
    Info,
    Latest,
    LatestResumable,
    Limits,
    ListWorkers,
    NewRun,
    OutputKind,
    Page,
    Pause,
    Paused,
    Reload,
    ReloadReply,
    Reply,
    Request,
    ResumableRun,
    Resume,
    Resumed,
    ResumeRun,
    Send,
    SetFence,
    Spawn,
    Status,
    Stop,
    Stopped,
    StopRun,
    Subscribe,
    Unpause,
    Unpaused,
    Wait,
    WaitFor,
    WaitForResult,
    WaitRunStopped,
    Wake,
    Wakes,
    Watch,
    Welcome,
    WorkerResult,
    WorkerView,
    check_integers,
    daemon_decoder,
    default_socket_path,
    encode,
    frame,
    package_version,
)
from subagentd.protocol.errors import (
    ConnectionLost,
    DaemonUnavailable,
    NotFound,
    ProtocolError,
    Recovering,
    Reloading,
    RemoteError,
    remote_error,
)

from ._acks import KEPT as ACKS_KEPT
from ._acks import AckLedger, Parent, recall

T = TypeVar("T")
R = TypeVar("R", bound=Reply)

#: The first request of every connection; later ids count up from here.
HELLO_ID = 1

#: How long a client keeps trying to get back to a daemon that went away under it
#: (a reload: the new image serves again within a few seconds).
RECONNECT_WINDOW = 30.0
#: The first pause between connect attempts, doubled up to `RECONNECT_PAUSE_MAX`.
RECONNECT_PAUSE = 0.02
RECONNECT_PAUSE_MAX = 0.5
#: How long a caller leaving a wake stream (a break, a cancel) waits for the answer to
#: the acknowledgement of the wake in its hand while the daemon is away but may answer
#: (a reload's new image still starting): past it, or at once where a connect is refused
#: (nothing serves), the acknowledgement is left to the connection (`detach`).
LEAVING_ACK_WAIT = 2.0
#: A connect failing so is "not serving yet": the socket is being re-bound, or its backlog is full.
RETRY_CONNECT_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN})
#: A request answered `recovering` (a restart taking its workers back) is sent again after
#: the daemon's `retry_after`, kept within these bounds (`recovery_pause`).
RECOVERY_PAUSE = 0.2
RECOVERY_PAUSE_MIN = 0.01
RECOVERY_PAUSE_MAX = 1.0


# -- where the daemon is and who we are ----------------------------------------


def socket_path(
    explicit: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ
) -> Path:
    """The socket to connect to: the one given, else $SUBAGENTD_SOCKET, else the default
    (`DaemonUnavailable` if the default's directory is one no daemon of ours would use)."""
    if explicit is not None:
        return Path(explicit)
    try:
        return default_socket_path(environ)
    except PermissionError as exc:  # platformdirs' fallback: a symlink, or not ours alone
        raise DaemonUnavailable(
            f"no safe place for the daemon's socket: {exc} (or name the socket: "
            "SUBAGENTD_SOCKET or --socket)"
        ) from exc


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
        "listing its workers (`ls`, all of them) shows what it holds"
    )


def unknown_run(run_id: str) -> NotFound:
    return NotFound(f"no run {run_id!r} is known to the daemon")


# -- replies -------------------------------------------------------------------


def checked(reply: Reply) -> Reply:
    """`reply` itself, unless it is an Error: then the `RemoteError` subclass for its code."""
    if isinstance(reply, Error):
        raise remote_error(
            reply.code, reply.message, reply.retry_after, stopped_by_reload=reply.stopped_by_reload
        )
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


def answer(request: Request[R], reply: Reply) -> R:
    """`reply` as what answers `request`, whose class declares it (`Request[TheReply]`)."""
    kind = request.answered_by()
    return reply if isinstance(reply, kind) else expect(reply, kind)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request, and how its reply becomes the value a client method returns.

    The request's id is a placeholder: the connection stamps the real one on sending.
    """

    request: Request[Reply]
    answer: Callable[[Reply], T]


def _call(request: Request[R], value: Callable[[R], T]) -> Call[T]:
    """A call of `request` whose method returns `value` of the reply its class declares."""
    return Call(request, lambda reply: value(answer(request, reply)))


def _itself(reply: R) -> R:
    return reply


def _nothing(reply: Reply) -> None:
    return None


def hello(worker_token: str | None) -> Call[Welcome]:
    return _call(
        Hello(id=0, token=worker_token, client=f"subagentd.client/{package_version()}"), _itself
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
    key: str | None = None,
    stdin_open: bool = False,
    limits: Limits | None = None,
    priority: int = 0,
    retries: int = 0,
    backoff: float = 1.0,
    backoff_max: float | None = None,
    retry_on: Sequence[str] = (),
    ready: str | None = None,
    after: Sequence[str] = (),
    after_ok: Sequence[str] = (),
    after_ready: Sequence[str] = (),
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
        key=new_key() if key is None else key,
        stdin_open=stdin_open,
        limits=limits or None,
        priority=priority,
        retries=retries,
        backoff=backoff,
        backoff_max=backoff_max,
        retry_on=list(retry_on),  # type: ignore[arg-type]  # checked by the daemon
        ready=ready,
        after=list(after),
        after_ok=list(after_ok),
        after_ready=list(after_ready),
    )
    return _call(request, lambda reply: reply.worker)


def new_key() -> str:
    """An idempotency key for one spawn or resume: 128 random bits, in hex. With it the
    request may be sent again when its answer is lost (a reload): the daemon answers the
    worker the first one made."""
    return secrets.token_hex(16)


def new_run(
    outer: str | None = None, *, limits: Limits | None = None, max_running: int | None = None
) -> Call[str]:
    request = NewRun(id=0, outer=outer, limits=limits or None, max_running=max_running)
    return _call(request, lambda reply: reply.run)


def ls(all: bool = False, run: str | None = None, usage: bool = False) -> Call[list[WorkerView]]:
    """The first page of a listing; `ListingCursor` follows every page."""
    return _call(ListWorkers(id=0, all=all, run=run, usage=usage), lambda reply: reply.workers)


def status(worker_id: str) -> Call[WorkerView]:
    return _call(Status(id=0, worker=worker_id), lambda reply: reply.worker)


def stop(worker_id: str, wait: bool = True) -> Call[bool]:
    return _call(Stop(id=0, worker=worker_id, wait=wait), lambda reply: reply.found)


def stop_run(run_id: str, wait: bool = True) -> Call[list[str]]:
    def stopped(reply: Stopped) -> list[str]:
        if not reply.found:
            raise unknown_run(run_id)
        return reply.stopped

    return _call(StopRun(id=0, run=run_id, wait=wait), stopped)


def pause(worker: str | None = None, run: str | None = None) -> Call[Paused]:
    """Pause a worker's subtree or a run's live workers: exactly one of the two."""
    return _call(Pause(id=0, worker=worker, run=run), lambda reply: reply)


def unpause(worker: str | None = None, run: str | None = None) -> Call[Unpaused]:
    """Let a paused worker's subtree, or a run's paused workers, go on."""
    return _call(Unpause(id=0, worker=worker, run=run), lambda reply: reply)


def watch_page(
    worker_id: str,
    since: int = 0,
    limit: int = 1000,
    *,
    max_bytes: int = DEFAULT_ANSWER_BYTES,
    offset: int = 0,
) -> Call[Page]:
    request = Watch(
        id=0, worker=worker_id, since=since, limit=limit, max_bytes=max_bytes, offset=offset
    )
    return _call(request, _itself)


def collect(worker_id: str, wait: bool = False) -> Call[WorkerResult]:
    return _call(Collect(id=0, worker=worker_id, wait=wait), lambda reply: reply.result)


def wait(worker_id: str, ready: bool = False) -> Call[WorkerView]:
    return _call(Wait(id=0, worker=worker_id, ready=ready), lambda reply: reply.worker)


def grep(
    worker_id: str,
    pattern: str,
    *,
    before: int = 0,
    after: int = 0,
    limit: int = 100,
    since: int = 0,
    max_bytes: int = DEFAULT_ANSWER_BYTES,
    written_since: float | None = None,
    stream: OutputKind | None = None,
) -> Call[GrepResult]:
    request = Grep(
        id=0,
        worker=worker_id,
        pattern=pattern,
        before=before,
        after=after,
        limit=limit,
        since=since,
        max_bytes=max_bytes,
        written_since=written_since,
        stream=stream,
    )
    return _call(request, lambda reply: reply.result)


def wait_for(worker_id: str, pattern: str, *, timeout: float) -> Call[WaitForResult]:
    request = WaitFor(id=0, worker=worker_id, pattern=pattern, timeout=timeout)
    return _call(request, lambda reply: reply.result)


def send(worker_id: str, data: str | bytes, *, eof: bool = False) -> Call[int]:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return _call(Send(id=0, worker=worker_id, data=raw, eof=eof), lambda reply: reply.written)


def info(usage: bool = False) -> Call[DaemonInfo]:
    """`usage`: with what the live workers take together (`DaemonInfo.usage`)."""
    return _INFO_USAGE if usage else _INFO


#: The same for every call (nothing in it varies, and the id is stamped on a copy): the
#: round trip made most often, spared building it each time.
_INFO = _call(Info(id=0), lambda reply: reply.info)
_INFO_USAGE = _call(Info(id=0, usage=True), lambda reply: reply.info)


def wait_run_stopped(run_id: str) -> Call[None]:
    return _call(WaitRunStopped(id=0, run=run_id), _nothing)


def begin_turn() -> Call[int]:
    return _call(BeginTurn(id=0), lambda reply: reply.turn)


def cancel(scope: str) -> Call[list[str]]:
    return _call(Cancel(id=0, scope=scope), lambda reply: reply.cancelled)


def set_fence() -> Call[int]:
    return _call(SetFence(id=0), lambda reply: reply.epoch)


def cancel_fence(epoch: int) -> Call[list[str]]:
    return _call(CancelFence(id=0, epoch=epoch), lambda reply: reply.cancelled)


def clear_fence() -> Call[None]:
    return _call(ClearFence(id=0), _nothing)


def ack(seqs: Iterable[int]) -> Call[None]:
    return _call(Ack(id=0, wakes=list(seqs)), _nothing)


def reload() -> Call[ReloadReply]:
    return _call(Reload(id=0), _itself)


def resume(worker_id: str, timeout: float | None = None, key: str | None = None) -> Call[Resumed]:
    request = Resume(id=0, worker=worker_id, timeout=timeout, key=new_key() if key is None else key)
    return _call(request, lambda reply: _resumed(reply.worker, reply.changed))


def resume_run(run_id: str) -> Call[list[Resumed]]:
    return _call(
        ResumeRun(id=0, run=run_id),
        lambda reply: [_resumed(view, reply.changed.get(view.id, "")) for view in reply.workers],
    )


def _resumed(view: WorkerView, changed: str) -> Resumed:
    return Resumed(**msgspec.structs.asdict(view), changed=changed)


def latest_resumable(cwd: str | os.PathLike[str] | None = None) -> Call[ResumableRun]:
    # As for spawn: "here" is where the caller stands, not where the daemon runs.
    return _call(
        LatestResumable(id=0, cwd=os.fspath(cwd) if cwd is not None else os.getcwd()),
        _resumable_run,
    )


def _resumable_run(reply: Latest) -> ResumableRun:
    """The answer without the protocol's request id: what a caller keeps."""
    return ResumableRun(
        run=reply.run, resumable=reply.resumable, reason=reply.reason, from_=reply.from_
    )


def retry_delay(request: Request[Reply], reply: Reply) -> float | None:
    """How long to wait before sending `request` again, for a `reloading` answer to it: a
    spawn or resume refused while the launch fence of a reload is up, or a request that
    only asks, cut short on the connection that asked for a reload; None: no retry. No
    other request is sent twice: the daemon answers one that took effect (a stop that
    was waiting) with what it did, and a second stop would say it stopped nothing."""
    if isinstance(reply, Error) and reply.code == Recovering.code and reply.id != 0:
        return recovery_pause(reply.retry_after)
    if not (isinstance(reply, Error) and reply.code == Reloading.code and reply.id != 0):
        return None
    if not (request.again_after_reloading or request.resendable()):
        return None
    return reply.retry_after if reply.retry_after is not None else 0.2


def recovery_pause(retry_after: float | None) -> float:
    """How long to wait before asking again a daemon that answered `recovering` (any
    request: it did nothing): its `retry_after`, within `RECOVERY_PAUSE_MIN` and
    `RECOVERY_PAUSE_MAX` whatever it says (a nan, an hour), else `RECOVERY_PAUSE`."""
    if retry_after is None or not math.isfinite(retry_after):
        return RECOVERY_PAUSE
    return min(max(retry_after, RECOVERY_PAUSE_MIN), RECOVERY_PAUSE_MAX)


def give_up_at(reply: Reply, started: float, timeout: float | None) -> float:
    """Until when a shell sends again a request first sent at `started` and answered
    `reply`: within `RECONNECT_WINDOW`, and a `recovering` answer within the client's own
    `timeout` too: a recovery that never ends is an error then, not a hang."""
    window = RECONNECT_WINDOW
    if timeout is not None and isinstance(reply, Error) and reply.code == Recovering.code:
        window = min(window, max(timeout, 0.0))
    return started + window


class ListingCursor:
    """Where one listing of workers stands: a ListWorkers per page, each after the page
    before, until a page says it completes the listing; `workers` gathers them all."""

    def __init__(self, all: bool = False, run: str | None = None, usage: bool = False) -> None:
        self.all = all
        self.run = run
        self.usage = usage
        self.after: str | None = None
        self.done = False
        self.workers: list[WorkerView] = []

    def request(self) -> ListWorkers:
        return ListWorkers(id=0, all=self.all, run=self.run, after=self.after, usage=self.usage)

    def take(self, reply: Reply) -> None:
        page = expect(reply, ListWorkers.answered_by())
        self.workers += page.workers
        self.after = page.next
        self.done = page.complete or page.next is None


class JournalCursor:
    """Where one reading of a worker's journal stands: what to ask for next, and when it is over.

    Unfollowed, the reading is a snapshot: one Watch per page until a page comes
    back empty or complete. Followed, one Watch whose stream of pages ends with
    the complete one. Each page holds at most ``max_bytes``; an entry alone over it
    comes in pieces, each under the entry's seq (``offset``: the bytes of entry
    ``since + 1`` already taken).
    """

    def __init__(
        self,
        worker_id: str,
        since: int = 0,
        *,
        follow: bool = False,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
    ) -> None:
        self.worker_id = worker_id
        self.since = since
        self.offset = 0
        self.follow = follow
        self.max_bytes = max_bytes
        self.done = False

    def request(self) -> Watch:
        return Watch(
            id=0,
            worker=self.worker_id,
            since=self.since,
            follow=self.follow,
            max_bytes=self.max_bytes,
            offset=self.offset,
        )

    def take(self, reply: Reply) -> list[Entry]:
        """The entries of the next page, advancing the cursor past them."""
        page = expect(reply, Watch.answered_by())
        self.since, self.offset = page.next, page.next_offset
        self.done = page.complete or (not self.follow and not page.entries)
        return page.entries


class GrepCursor:
    """Where one grep going on page by page stands: a Grep per answer, each from the
    ``next`` of the one before, until ``limit`` matches in all (any number: each answer
    asks for at most `MAX_GREP_MATCHES`) or an answer with nothing after it; `matches`
    gathers them, ``truncated`` whether more may be there."""

    def __init__(
        self,
        worker_id: str,
        pattern: str,
        *,
        before: int = 0,
        after: int = 0,
        limit: int = 100,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
        written_since: float | None = None,
        stream: OutputKind | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.pattern = pattern
        self.written_since = written_since
        self.stream = stream
        self.before = before
        self.after = after
        self.limit = limit
        self.max_bytes = max_bytes
        self.since = 0
        self.matches: list[GrepMatch] = []
        self.truncated = False
        self.next: int | None = None
        self.stopped_in_line = False
        self.done = False

    def request(self) -> Grep:
        return Grep(
            id=0,
            worker=self.worker_id,
            pattern=self.pattern,
            before=self.before,
            after=self.after,
            limit=min(self.limit - len(self.matches), MAX_GREP_MATCHES),
            since=self.since,
            max_bytes=self.max_bytes,
            written_since=self.written_since,
            stream=self.stream,
        )

    def take(self, reply: Reply) -> list[GrepMatch]:
        """The matches of the next answer, advancing the cursor past them."""
        found = expect(reply, Grep.answered_by()).result
        self.matches += found.matches
        self.truncated, self.next = found.truncated, found.next
        self.stopped_in_line = found.stopped_in_line
        if found.next is None or len(self.matches) >= self.limit:
            self.done = True
        else:
            self.since = found.next
        return found.matches

    def result(self) -> GrepResult:
        """Every match taken, as one answer: ``next`` to go on past them, if there is more."""
        return GrepResult(
            matches=self.matches,
            truncated=self.truncated,
            next=self.next,
            stopped_in_line=self.stopped_in_line,
        )


class WakeSubscription:
    """Where one subscription to a parent's wakes stands: what to subscribe with, and when
    it is over.

    The first page always comes, empty or not: it confirms the subscription.
    Unfollowed, that page is the whole answer; followed, pages come as wakes are
    posted until the caller aborts. Acknowledging is the caller's business: a
    wake is delivered again, to any subscriber, until it is acknowledged.

    Subscribed again on a new connection (after a reload), the daemon delivers
    again what was not acknowledged, which may include a wake already handed
    over (its acknowledgement still to come, or lost with the old connection:
    the `Connection` sees to that one): `take` hands each wake over once.
    """

    def __init__(
        self, run: str | None = None, worker: str | None = None, *, follow: bool = False
    ) -> None:
        self.run = run
        self.worker = worker
        self.follow = follow
        self.done = False
        self._handed: set[int] = set()

    def request(self) -> Subscribe:
        return Subscribe(id=0, run=self.run, worker=self.worker, follow=self.follow)

    def take(self, reply: Reply) -> list[Wake]:
        """The wakes of the next page not handed over before; raises what an error reply
        carries, which ends it."""
        self.done = True  # an error ends the subscription as surely as a complete page
        page = expect(reply, Subscribe.answered_by())
        # Not followed, the pending wakes may come in several pages: the last is complete
        # (a daemon before paging sent one page, complete).
        self.done = page.complete
        fresh = [w for w in page.wakes if w.seq not in self._handed]
        self._handed.update(wake.seq for wake in fresh)
        return fresh


# -- the conversation ----------------------------------------------------------


class _Envelope(msgspec.Struct):
    """Just the id of a message, to tell an event we do not know from a broken reply."""

    id: int = 0


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


@dataclass(slots=True)
class _Open:
    """A request still waiting for (more of) its answer."""

    request: Request[Reply]
    # What to send instead on a new connection (None: it must not be sent twice).
    again: Callable[[], Request[Reply]] | None
    stream: bool
    sent: bool
    # When a wait-for's time runs out, on the shell's clock: sent again, it asks for what
    # is left of it (`time_left`), not the whole time again.
    deadline: float | None = None


def time_left(deadline: float, now: float) -> float:
    """The seconds from `now` to `deadline`, never below 0 (a wait-for's 0: look once)."""
    return max(0.0, deadline - now)


def deadline_of(request: Request[Reply], now: float | None) -> float | None:
    """When `request`'s own time runs out, if it has one (a wait-for's `timeout`), from
    `now`, the moment it is first sent on the shell's clock."""
    if not isinstance(request, WaitFor) or request.timeout <= 0:
        return None
    return _now(now) + request.timeout


def _now(now: float | None) -> float:
    if now is None:
        raise TypeError("a wait-for keeps its deadline: pass the shell's clock as now=")
    return now


@dataclass(frozen=True, slots=True)
class _Lost:
    """Put in a request's inbox when its answer went with the connection: raises on reading."""

    cause: Error | Exception | None


class Connection:
    """The client's side of one conversation, sans I/O: ids out, replies sorted by request id.

    Feed it what the socket returned with `receive_data` (b"" at end of file) and
    send what `send` and `abort` return. A reply is kept only while its request
    is open: replies to finished or aborted requests, and events (id 0) this
    client does not handle, are dropped.

    With ``reconnect``, the conversation outlives its socket across a reload: once
    the daemon says `reloading`, or the socket ends while requests are open,
    `reconnecting` turns true and the shell connects again, says hello (a
    `Handshake`) and sends what `reconnected` returns: every open request that
    asks without changing anything (streams from their cursors), and those made
    meanwhile. A spawn or resume is sent again too when it carries a key (the
    clients give each one), which the daemon remembers: a repeat answers the
    worker the first made; and a reload, which, lost so, was not read (another
    reload's pause came first). One that changes something (a stop, a keyless spawn)
    and whose answer was lost raises `ConnectionLost`: whether it was done is
    unknown. Request ids carry over, so a caller waiting for its answer never
    notices. The first hello, cut off so, is answered by the new connection's
    welcome.

    An `ack` names wakes by the connection they came on (`AckLedger`): one naming
    a wake delivered on an earlier connection is held, not sent, until that wake
    came again on this one (a recall: an unfollowed subscribe to its parent,
    which the connection makes itself), then sent for the wakes that came again;
    it is answered done at once for those that did not: someone acknowledged
    them (the ack cut off with its connection, most often).
    """

    def __init__(self, *, reconnect: bool = False, acks_kept: int = ACKS_KEPT) -> None:
        """``acks_kept``: how many wakes the ack ledger keeps each by its seq (`AckLedger`)."""
        self._frames = FrameDecoder()
        self._next_id = HELLO_ID
        self._inboxes: dict[int, deque[Reply | _Lost]] = {}
        self._open: dict[int, _Open] = {}
        self._reconnect = reconnect
        self._reconnecting = False
        self._closed = False
        # Requests the daemon asked to have sent again on this connection (`outgoing`).
        self._outgoing: list[bytes] = []
        self._acks = AckLedger(acks_kept)
        # Requests whose caller left without their answer (`detach`).
        self._detached: set[int] = set()
        # Why the connection ended: the daemon's parting Error (too_large,
        # reloading), or the transport or protocol failure that ended it.
        self._cause: Error | Exception | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reconnecting(self) -> bool:
        """The socket is gone and the conversation goes on on a new one: connect again."""
        return self._reconnecting

    def send(
        self,
        request: Request[Reply],
        *,
        again: Callable[[], Request[Reply]] | None = None,
        now: float | None = None,
    ) -> tuple[int, bytes | None]:
        """Open `request` under a fresh id; answers (id, the frame to send). The frame is
        None while reconnecting: the request goes out on the new connection.

        ``again``: the request to send instead on a new connection, for a stream
        that must carry on from its cursor rather than start over. ``now``: the shell's
        clock, which a request with a time of its own (a wait-for) needs: its deadline
        is fixed here, and a repeat asks only for the time left (`receive_data`,
        `reconnected`, given ``now`` then).
        """
        if self._closed:
            self._raise_closed()
        check_integers(request)  # Invalid before it is opened: msgpack could not carry it
        request_id = self._next_id
        self._next_id = request_id + 1
        self._inboxes[request_id] = deque()
        if isinstance(request, Ack) and request.wakes:
            # A recall (for another ack) found some of them acknowledged already: done for those.
            if not (wakes := self._acks.settle(request.wakes)):
                self._inboxes[request_id].append(Done(id=request_id))
                return request_id, None
            request = msgspec.structs.replace(request, wakes=wakes)
        if again is None and request.resendable():
            again = functools.partial(_same, request)
        if isinstance(request, Ack) and (self._reconnecting or self._acks.stale(request.wakes)):
            # Wakes delivered on an earlier connection: acknowledged once delivered here again.
            recalls = self._acks.hold(request_id, request.wakes)
            if self._reconnecting:
                return request_id, None
            return request_id, b"".join(self._recall(parent) for parent in recalls) or None
        self._open[request_id] = _Open(
            request, again, request.streams(), not self._reconnecting, deadline_of(request, now)
        )
        if self._reconnecting:
            return request_id, None
        return request_id, encode(msgspec.structs.replace(request, id=request_id))

    def finish(self, request_id: int) -> None:
        """Forget `request_id`; whatever still arrives for it is dropped."""
        self._inboxes.pop(request_id, None)
        self._open.pop(request_id, None)
        self._acks.drop(request_id)
        self._detached.discard(request_id)

    def detach(self, request_id: int) -> None:
        """The caller leaves without the answer to `request_id` (an ack made on the way out
        of a wake stream while the daemon is away): it still goes out as it would have
        (held for its wakes' redelivery, sent on the next connection) while the
        conversation goes on, and its answer is taken in (the ledger told) and dropped."""
        if self._inboxes.get(request_id):
            self.finish(request_id)  # answered already
        elif request_id in self._inboxes:
            self._detached.add(request_id)

    def _answer(self, request_id: int, inbox: deque[Reply | _Lost], reply: Reply) -> None:
        """`reply` to its caller, or, the caller gone (`detach`), the request finished."""
        if request_id in self._detached:
            self.finish(request_id)
        else:
            inbox.append(reply)

    def abort(self, request_id: int) -> bytes | None:
        """Finish `request_id` and answer the Abort frame that stops the daemon working on it
        (None: the connection is gone, and the work with it)."""
        self.finish(request_id)
        if self._closed or self._reconnecting:
            return None
        # The Abort's own id is never opened, so its Done is dropped with the request's stragglers.
        return encode(Abort(id=self._take_id(), request=request_id))

    def receive_data(self, data: bytes, *, now: float | None = None) -> None:
        """Take what the socket returned, split anywhere; b"" means the daemon closed.
        ``now``: the shell's clock (see `send`)."""
        if self._closed or self._reconnecting:
            return
        if not data:
            self._ended(None)
            return
        self._frames.feed(data)
        try:
            while (body := self._frames.next_frame()) is not None:
                reply = _decode(body)
                if reply is None:
                    continue
                if isinstance(reply, Error) and self._sent_again(reply, now):
                    continue
                if self._acks.is_recall(reply.id):
                    self._recalled(reply)
                    continue
                if (inbox := self._inboxes.get(reply.id)) is not None:
                    self._noted(reply)
                    self._answer(reply.id, inbox, reply)
                elif reply.id == 0 and isinstance(reply, Error):
                    self._cause = reply
                    if reply.code == Reloading.code:
                        # Nothing more comes on this socket: hang up and reconnect now.
                        self._ended(reply)
                        return
        except ProtocolError as exc:
            self._closed = True
            self._cause = exc

    def outgoing(self) -> list[bytes]:
        """Frames to send now, after `receive_data`: requests the daemon answered `reloading`
        on the connection that asked for the reload (kept across it), sent again on it."""
        frames, self._outgoing = self._outgoing, []
        return frames

    def _noted(self, reply: Reply) -> None:
        """Keep what `reply` says of wakes: delivered here (a page), or acknowledged."""
        entry = self._open.get(reply.id)
        if isinstance(reply, Wakes):
            self._acks.delivered(reply.wakes)
        elif isinstance(reply, Done) and entry is not None and isinstance(entry.request, Ack):
            self._acks.acknowledged(entry.request.wakes)

    def _recall(self, parent: Parent) -> bytes:
        """The frame of a recall of `parent`'s wakes, under an id of its own."""
        request_id = self._take_id()
        self._acks.recall_sent(request_id, parent)
        return encode(msgspec.structs.replace(recall(parent), id=request_id))

    def _recalled(self, reply: Reply) -> None:
        """An answer to a recall: held acknowledgements go out, or are answered, or fail."""
        match reply:
            case Wakes():
                released = self._acks.recalled(reply.id, reply)
            case Error(code=NotFound.code):  # a parent gone, with nothing pending
                released = self._acks.recalled(reply.id, None)
            case Error(code=Reloading.code):  # the connection a reload keeps: ask it again
                parent = self._acks.recalled_parent(reply.id)
                self._outgoing.append(encode(msgspec.structs.replace(recall(parent), id=reply.id)))
                return
            case _:
                for request_id in self._acks.recall_refused(reply.id):
                    if (inbox := self._inboxes.get(request_id)) is not None:
                        self._answer(
                            request_id, inbox, msgspec.structs.replace(reply, id=request_id)
                        )
                return
        for release in released:
            inbox = self._inboxes.get(release.request_id)
            if inbox is None:
                continue  # given up on meanwhile
            if not release.seqs:
                self._answer(release.request_id, inbox, Done(id=release.request_id))
                continue
            request = Ack(id=release.request_id, wakes=release.seqs)
            self._open[release.request_id] = _Open(request, None, False, True)
            self._outgoing.append(encode(request))

    def _sent_again(self, reply: Reply, now: float | None) -> bool:
        """Whether `reply` is a `reloading` answer to an open request that may be sent again,
        and was (queued in `outgoing`, under the same id: the caller never notices)."""
        if not (isinstance(reply, Error) and reply.code == Reloading.code and reply.id != 0):
            return False
        entry = self._open.get(reply.id)
        if entry is None or entry.again is None:
            return False  # not to be sent twice without asking the caller: retry_delay
        if entry.request.again_after_reloading:
            # Perhaps refused by a reload's launch fence (a spawn), which sent again at once
            # would refuse again at once: sent again after `retry_after`, by `retry_delay`.
            return False
        if entry.stream:
            # Pages not yet taken come again from the cursor, which has not passed them.
            self._inboxes[reply.id].clear()
        again = _again(entry, now)
        self._outgoing.append(encode(msgspec.structs.replace(again, id=reply.id)))
        return True

    def connection_lost(self, exc: Exception) -> None:
        """The transport failed with `exc`: every open request and later send raises, unless
        the conversation goes on on a new connection."""
        if not self._closed and not self._reconnecting:
            self._ended(exc)

    def reconnected(
        self, rest: bytes = b"", *, now: float | None = None, welcome: Welcome | None = None
    ) -> list[bytes]:
        """A new connection said welcome (`rest`: what came after it; `welcome`: the welcome,
        for a first hello cut off): the frames to send on it, in order, before anything
        else. ``now``: the shell's clock (see `send`)."""
        self._frames = FrameDecoder()
        self._reconnecting = False
        self._cause = None
        frames = []
        for request_id, entry in list(self._open.items()):
            if isinstance(entry.request, Hello):
                # Cut off before its welcome: the new connection's hello said it again.
                answer: Reply | _Lost = _Lost(None)
                if welcome is not None:
                    answer = msgspec.structs.replace(welcome, id=request_id)
                self._inboxes[request_id].append(answer)
                del self._open[request_id]
                continue
            if entry.sent and (
                entry.again is None or (self._inboxes[request_id] and not entry.stream)
            ):
                continue  # answered already (or failed with the old connection)
            # Made while reconnecting, a request goes out now for the first time; its time
            # has been running since it was made all the same.
            request = _again(entry, now) if entry.sent else _in_time(entry, entry.request, now)
            if entry.sent and entry.stream:
                # Pages not yet taken come again from the cursor, which has not passed them.
                self._inboxes[request_id].clear()
            entry.sent = True
            frames.append(encode(msgspec.structs.replace(request, id=request_id)))
        recalls, released = self._acks.new_connection()
        frames += [self._recall(parent) for parent in recalls]
        for release in released:  # naming no wake delivered before: the daemon judges it
            request = Ack(id=release.request_id, wakes=release.seqs)
            self._open[release.request_id] = _Open(request, None, False, True)
            frames.append(encode(request))
        if rest:
            self.receive_data(rest, now=now)
        return frames + self.outgoing()

    def reconnect_failed(self, exc: Exception) -> None:
        """No new connection within the window: the conversation is over, with `exc` as why."""
        self._reconnecting = False
        self._closed = True
        lost = ConnectionLost(
            f"the daemon went away and did not serve again within {RECONNECT_WINDOW:g} s: {exc}"
        )
        lost.__cause__ = exc
        self._cause = lost

    def next_reply(self, request_id: int) -> Reply | None:
        """The next reply to `request_id`; None until one arrives; raises once none ever can."""
        inbox = self._inboxes[request_id]
        if inbox:
            reply = inbox.popleft()
            if isinstance(reply, _Lost):
                inbox.appendleft(reply)  # every later read raises the same
                self._raise_lost(reply.cause)
            return reply
        if self._closed:
            self._raise_closed()
        return None

    def _ended(self, cause: Error | Exception | None) -> None:
        """The socket is over, because of `cause` (None: the daemon closed it)."""
        if cause is not None:
            self._cause = cause
        told_reloading = isinstance(self._cause, Error) and self._cause.code == Reloading.code
        # A parting error of another kind (too_large) says why, and that is final.
        parted = isinstance(self._cause, Error) and not told_reloading
        if (
            not self._reconnect
            or parted
            or not (told_reloading or self._open or self._acks.holding)
        ):
            self._closed = True
            return
        self._reconnecting = True
        for request_id, entry in list(self._open.items()):
            inbox = self._inboxes[request_id]
            if isinstance(entry.request, Ack):
                if not inbox:
                    # Whether it was done is unknown: held until its wakes came again (or not).
                    self._acks.hold(request_id, entry.request.wakes)
                del self._open[request_id]
            elif isinstance(entry.request, Hello) and not inbox:
                pass  # the next connection's hello says it again (`reconnected`)
            elif entry.again is None and entry.sent:
                # Its answer is lost and whether it was done unknown: that is the caller's call.
                inbox.append(_Lost(self._cause))
                del self._open[request_id]

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id += 1
        return request_id

    def _raise_closed(self) -> NoReturn:
        self._raise_lost(self._cause)

    @staticmethod
    def _raise_lost(cause: Error | Exception | None) -> NoReturn:
        # A fresh exception on every call: several waiters may raise it, and a
        # shared instance would grow one traceback across all of them.
        match cause:
            case Error(code=Reloading.code):
                raise ConnectionLost(
                    "the daemon reloaded before answering; whether the request was done is "
                    "unknown: list its workers (`ls`) before asking again"
                )
            case Error(code=code, message=message, retry_after=retry_after):
                raise remote_error(code, message, retry_after)
            case ProtocolError():
                raise ProtocolError(str(cause)) from cause
            case ConnectionLost():
                raise ConnectionLost(str(cause)) from cause.__cause__
            case Exception():
                raise ConnectionLost(f"the connection to the daemon failed: {cause}") from cause
            case _:
                raise ConnectionLost("the daemon closed the connection before answering")


def _same(request: Request[Reply]) -> Request[Reply]:
    return request


def _again(entry: _Open, now: float | None) -> Request[Reply]:
    """What to send again for `entry`: its `again`, asking for the time left of its own
    (a wait-for's), never the whole time a second time."""
    assert entry.again is not None
    return _in_time(entry, entry.again(), now)


def _in_time(entry: _Open, request: Request[Reply], now: float | None) -> Request[Reply]:
    """`request` asking, if it has a time of its own, only for what is left of `entry`'s."""
    if entry.deadline is None or not isinstance(request, WaitFor):
        return request
    return msgspec.structs.replace(request, timeout=time_left(entry.deadline, _now(now)))


class Handshake:
    """The hello of a new connection, sans I/O: `frame` to send, then `receive_data` until
    it answers the daemon's Welcome; `rest` is what came after it."""

    def __init__(self, worker_token: str | None) -> None:
        self.frame = encode(msgspec.structs.replace(hello(worker_token).request, id=HELLO_ID))
        self._frames = FrameDecoder()
        self.rest = b""
        self.welcome: Welcome | None = None

    def receive_data(self, data: bytes) -> Welcome | None:
        """The Welcome once it came; raises `ConnectionLost` for an end before it, and what
        an Error says (`Reloading` again: another reload)."""
        if not data:
            raise ConnectionLost("the daemon closed the connection before its welcome")
        self._frames.feed(data)
        body = self._frames.next_frame()
        if body is None:
            return None
        reply = _decode(body)
        if reply is None:
            return None
        welcome = expect(reply, Hello.answered_by())
        frames = self._frames.frames()
        self.rest = b"".join(frame(body) for body in frames)
        self.welcome = welcome
        return welcome


def retry_reconnect(exc: BaseException) -> bool:
    """Whether a failed reconnect is worth another try: the daemon is not serving yet."""
    if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
        return exc.errno in RETRY_CONNECT_ERRNOS or isinstance(exc, ConnectionError)
    if isinstance(exc, RemoteError):
        return exc.code in (Reloading.code, Recovering.code, "busy")
    return isinstance(exc, ConnectionLost)


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
