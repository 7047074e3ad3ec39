"""The blocking client: one stdlib AF_UNIX socket, one request answered at a time.

Only the socket calls live here; requests, replies and routing come from
`_core`. Replies of a followed watch that arrive while another request waits
are kept for the watch, so a stop can be issued from inside its loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

from subagentd.protocol import (
    DEFAULT_ANSWER_BYTES,
    DaemonInfo,
    Entry,
    Error,
    GrepResult,
    Limits,
    OutputKind,
    Page,
    Paused,
    ReloadReply,
    ReopenRun,
    Reply,
    Request,
    ResumableRun,
    Resumed,
    Unpaused,
    WaitForResult,
    Wake,
    WorkerResult,
    WorkerView,
)
from subagentd.protocol.errors import SubagentdError

from . import _core
from ._switch import BlockingStopSwitch

T = TypeVar("T")

_RECEIVE_SIZE = 64 * 1024
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class Client:
    """A blocking connection to the daemon; use it as a context manager.

    ``socket`` defaults to $SUBAGENTD_SOCKET, else the per-user default path.
    ``timeout`` bounds each wait of a send or a receive on the socket: one
    that waits longer raises `TimeoutError` (so keep it None for `wait` and
    followed watches of long workers). Inside a worker, the client acts as
    that worker ($SUBAGENTD_TOKEN).
    """

    _sock: socket.socket | None

    def __init__(
        self, socket: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        self.socket: Path = _core.socket_path(socket)
        self.timeout = timeout
        self._conn = _core.Connection(reconnect=True)
        self._sock = None
        # While a caller leaves a wake stream (`_ack_leaving`): when it stops waiting.
        self._leaving_by: float | None = None

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Connect and say hello. Raises `DaemonUnavailable` when nothing listens."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _set_timeout(sock, self.timeout)
        try:
            sock.connect(os.fspath(self.socket))
        except OSError as exc:
            sock.close()
            raise _core.unavailable(self.socket, exc) from exc
        self._sock = sock
        try:
            # A reload begun before the welcome: the hello is said again on the next connection.
            self._call(_core.hello(_core.token()))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- the daemon's operations (README.md, "From Python"; the wire: protocol/README.md) --

    def spawn(
        self,
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
    ) -> WorkerView:
        """Start a worker; ``cwd`` defaults to this process's working directory.

        ``key``: its idempotency key (default: a new random one). Sent again with the
        same key, a spawn answers the worker the first made (within the daemon's
        ``--request-key-ttl``): so a spawn whose answer a reload lost is sent again
        by itself, and a caller may send one again with its own key.

        ``stdin_open``: its stdin is a pipe the daemon keeps open for `send` (not with
        ``input``). ``limits``: what it and all it delegates may take together
        (`Limits`; `parse_limits` reads "2G", "1.5", "100"), over its agent's.
        ``priority``: over a cap, where it waits in the queue (higher first).
        ``retries``: attempts more it gets (same id, from its snapshot) when it ends
        failed, after ``backoff`` seconds doubling up to ``backoff_max``; ``retry_on``
        ``["timeout"]``: a timed-out one too. Its parent is woken once, by the last.
        ``ready``: a pattern (RE2); the worker is marked ready once a line of its output
        matches it (`wait` with ``ready`` waits for that). ``after``, ``after_ok``,
        ``after_ready``: it starts once those workers have ended, finished (exit 0; else it
        ends stopped, reason skipped) or are ready."""
        return self._call(
            _core.spawn(
                argv,
                name=name,
                run=run,
                parent=parent,
                agent=agent,
                input=input,
                cwd=cwd,
                env=env,
                timeout=timeout,
                grace=grace,
                key=key,
                stdin_open=stdin_open,
                limits=limits,
                priority=priority,
                retries=retries,
                backoff=backoff,
                backoff_max=backoff_max,
                retry_on=retry_on,
                ready=ready,
                after=after,
                after_ok=after_ok,
                after_ready=after_ready,
            )
        )

    def new_run(
        self,
        outer: str | None = None,
        *,
        limits: Limits | None = None,
        max_running: int | None = None,
    ) -> str:
        """A new run (nested in ``outer``); ``limits``: what its workers may take
        together; ``max_running``: how many of its workers may run at once (a spawn over
        it is queued, and starts in its turn)."""
        return self._call(_core.new_run(outer, limits=limits, max_running=max_running))

    def ls(
        self, all: bool = False, run: str | None = None, *, usage: bool = False
    ) -> list[WorkerView]:
        """Every worker (live ones, or with ``all`` ended ones too), page by page; each
        with a summary of its argv (`status` has the whole). ``usage``: each live one
        with what it takes now (`Usage`)."""
        cursor = _core.ListingCursor(all, run, usage)
        while not cursor.done:
            cursor.take(self.request(cursor.request()))
        return cursor.workers

    def status(self, worker_id: str) -> WorkerView:
        return self._call(_core.status(worker_id))

    def stop(self, worker_id: str, wait: bool = True) -> bool:
        """Stop a worker and its subtree; False for an id the daemon never saw."""
        return self._call(_core.stop(worker_id, wait))

    def stop_run(self, run_id: str, wait: bool = True) -> list[str]:
        """Stop a whole run; answers the ids stopped, sorted."""
        return self._call(_core.stop_run(run_id, wait))

    def pause(self, *, worker: str | None = None, run: str | None = None) -> Paused:
        """Pause a worker's subtree (``worker``) or a run's live workers (``run``): their
        processes held still by the kernel until `unpause`, their timeouts stopped.
        Answers the ids newly paused (``paused``) and those already (``already_paused``)."""
        return self._call(_core.pause(worker, run))

    def unpause(self, *, worker: str | None = None, run: str | None = None) -> Unpaused:
        """Let a paused worker's subtree, or a run's paused workers, go on."""
        return self._call(_core.unpause(worker, run))

    def watch_page(
        self,
        worker_id: str,
        since: int = 0,
        limit: int = 1000,
        *,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
        offset: int = 0,
    ) -> Page:
        """One page of the journal: the entries after ``since`` (``offset`` bytes into the
        first already read), at most ``limit`` of them in at most ``max_bytes`` (1 KiB to
        8 MiB); an entry alone over that comes in pieces. Go on from the page's ``next`` and
        ``next_offset``; its ``truncated`` says more is there already."""
        return self._call(
            _core.watch_page(worker_id, since, limit, max_bytes=max_bytes, offset=offset)
        )

    def watch(
        self,
        worker_id: str,
        since: int = 0,
        follow: bool = False,
        *,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
    ) -> Generator[Entry, None, None]:
        """The journal's entries after ``since``: those there now, or with ``follow`` all until
        the worker ends. Leaving a followed watch early aborts its stream. ``max_bytes``: of
        each page; an entry over it comes in pieces, one after the other under its seq."""
        cursor = _core.JournalCursor(worker_id, since, follow=follow, max_bytes=max_bytes)
        if not follow:
            while not cursor.done:
                yield from cursor.take(self.request(cursor.request()))
            return
        stream = self._send(cursor.request(), again=cursor.request)
        try:
            while not cursor.done:
                yield from cursor.take(self._next_reply(stream))
        finally:
            if cursor.done:
                self._conn.finish(stream)
            else:
                self._abort(stream)

    def reload(self) -> ReloadReply:
        """Re-exec the daemon in place, keeping every worker; answers once the new image
        serves (`Refused` with the reason when the new image or config would not do,
        `Busy` right after another reload)."""
        return self._call(_core.reload())

    def resume(
        self, worker_id: str, timeout: float | None = None, key: str | None = None
    ) -> Resumed:
        """Carry an ended (not finished) worker on from its snapshot: same id, next attempt.
        It runs what it was spawned with; only its ``timeout`` may be given again. The
        answer's ``changed`` says what changed on disk since its spawn (empty: nothing).
        ``key``: as for `spawn`, a repeat answers the attempt the first one started."""
        return self._call(_core.resume(worker_id, timeout, key))

    def resume_run(self, run_id: str) -> list[Resumed]:
        """A new live attempt of a run: its highest unfinished workers carry on; answers them
        (each with ``changed``, as `resume`)."""
        return self._call(_core.resume_run(run_id))

    def reopen_run(self, run_id: str) -> None:
        """Start a stopped run again: it and the runs nested in it take spawns once more.
        A resume never does (stopping is one-way); this is the explicit way back.
        `RunStopped` while a run it is nested in is stopped, `NotFound` for an unknown run."""
        self.request(ReopenRun(id=0, run=run_id))

    def latest_resumable(self, cwd: str | os.PathLike[str] | None = None) -> ResumableRun:
        """The newest run started in ``cwd`` (default: this process's; however named: it is
        taken as its real path) that a resume would take, and ``from_`` the workers it would
        carry on; or else the newest and why not (`NotFound`: no run with a snapshot was
        started there)."""
        return self._call(_core.latest_resumable(cwd))

    def collect(self, worker_id: str, wait: bool = False) -> WorkerResult:
        return self._call(_core.collect(worker_id, wait))

    def wait(self, worker_id: str, ready: bool = False) -> WorkerView:
        """Block until the worker has ended (with ``ready``: or is ready, its spawn's
        ready pattern matched); answers how it stands."""
        return self._call(_core.wait(worker_id, ready))

    def grep(
        self,
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
    ) -> GrepResult:
        """The lines of the worker's output matching ``pattern`` (RE2 syntax), searched in the
        daemon, each with ``before`` and ``after`` lines of context; at most ``limit``
        matches (up to 1000) in at most ``max_bytes`` (1 KiB to 8 MiB), only on lines
        after line ``since``; with ``written_since`` (seconds since the epoch), only lines
        written at or after it, with ``stream`` (``"stdout"``, ``"stderr"``) only its
        lines, both filtered in the daemon, so ``limit`` counts only what they keep.
        ``truncated`` in the answer: a bound was hit, there may be more; go on with
        ``since`` set to its ``next`` (None: nothing more to be had). `grep_all` does
        that up to any number of matches."""
        return self._call(
            _core.grep(
                worker_id,
                pattern,
                before=before,
                after=after,
                limit=limit,
                since=since,
                max_bytes=max_bytes,
                written_since=written_since,
                stream=stream,
            )
        )

    def grep_all(
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
    ) -> GrepResult:
        """As `grep`, going on answer by answer (each of at most ``max_bytes``) until
        ``limit`` matches in all (any number) or nothing more is to be had; one result
        with every match, ``truncated`` and ``next`` as the last answer said them."""
        cursor = _core.GrepCursor(
            worker_id,
            pattern,
            before=before,
            after=after,
            limit=limit,
            max_bytes=max_bytes,
            written_since=written_since,
            stream=stream,
        )
        while not cursor.done:
            cursor.take(self.request(cursor.request()))
        return cursor.result()

    def wait_for(
        self,
        worker_id: str,
        pattern: str,
        *,
        timeout: float,
    ) -> WaitForResult:
        """Return once a line of the worker's output matches ``pattern`` (what it wrote
        before the call too), once it ends, or after ``timeout`` seconds on the daemon's
        clock, whichever is first: the answer's ``outcome`` says which."""
        return self._call(_core.wait_for(worker_id, pattern, timeout=timeout))

    def send(self, worker_id: str, data: str | bytes, *, eof: bool = False) -> int:
        """Write ``data`` to the stdin of a worker spawned with ``stdin_open``; answers the
        bytes its pipe took (fewer when it was nearly full: send the rest again later;
        `Busy` when it took none). ``eof``: close its stdin once all of it is written."""
        return self._call(_core.send(worker_id, data, eof=eof))

    def info(self, *, usage: bool = False) -> DaemonInfo:
        """The daemon's state; ``usage``: with what its live workers take together."""
        return self._call(_core.info(usage))

    @contextlib.contextmanager
    def stop_switch(
        self, outer: str | None = None, *, stop_on_exit: bool = True
    ) -> Iterator[BlockingStopSwitch]:
        """A new run, nested in ``outer`` if given, and the `BlockingStopSwitch` that spawns
        into it and stops it: `AsyncClient.stop_switch`, blocking. With ``stop_on_exit``
        (the default) the run is stopped however the block is left (Ctrl-C included),
        once its processes are gone; with ``stop_on_exit=False`` nothing is."""
        switch = BlockingStopSwitch(self, self.new_run(outer))
        try:
            yield switch
        finally:
            if stop_on_exit:
                self.stop_run(switch.run)

    def wait_run_stopped(self, run_id: str) -> None:
        """Block until the run is stopped, however: `stop_run` from any client, or an outer
        run's. Bounded by the client's ``timeout`` (`TimeoutError`, the wait abandoned)."""
        self._call(_core.wait_run_stopped(run_id))

    def begin_turn(self) -> int:
        """Advance the turn generation; workers registered from now on carry the new one."""
        return self._call(_core.begin_turn())

    def cancel(self, scope: str) -> list[str]:
        """Stop every worker in ``scope`` (``all``, ``turn:G``, ``run:R``, ``worker:W``);
        answers the ids newly cancelled, sorted."""
        return self._call(_core.cancel(scope))

    def set_fence(self) -> int:
        """Set a launch fence, replacing any other; answers its epoch."""
        return self._call(_core.set_fence())

    def cancel_fence(self, epoch: int) -> list[str]:
        """Stop what registered under fence ``epoch`` and, until another fence replaces it,
        every later spawn at birth; answers the ids stopped (none for a stale epoch)."""
        return self._call(_core.cancel_fence(epoch))

    def clear_fence(self) -> None:
        """Remove the launch fence: later spawns belong to none."""
        self._call(_core.clear_fence())

    def events(
        self,
        run: str | None = None,
        worker: str | None = None,
        follow: bool = False,
        *,
        ack: bool = True,
    ) -> Generator[Wake, None, None]:
        """The wakes of one parent (a ``run``'s top-level workers, or a ``worker``'s children)
        not yet acknowledged, each acknowledged once handed over: when the caller asks for
        the next one, or leaves the loop having got it. A wake never handed over stays
        for the next subscriber. With ``follow``, then each new wake until the caller
        leaves, which aborts the stream (``contextlib.closing`` makes that prompt).

        With ``ack=False`` nothing is acknowledged: call `ack` once a wake is safely
        dealt with, so that a crash in between gets it again.
        """
        subscription = _core.WakeSubscription(run, worker, follow=follow)
        stream = self._send(subscription.request(), again=subscription.request)
        try:
            while not subscription.done:
                for wake in subscription.take(self._next_reply(stream)):
                    try:
                        yield wake
                    except BaseException:
                        # Left with the wake in hand (a break, most likely): it was handed over.
                        if ack:
                            self._ack_leaving(wake)
                        raise
                    if ack:
                        self.ack([wake.seq])
        finally:
            if subscription.done:
                self._conn.finish(stream)
            else:
                self._abort(stream)

    def ack(self, seqs: Iterable[int]) -> None:
        """Acknowledge wakes by seq: no subscriber gets them again. Each must have been
        delivered to this client (else `Invalid`); one delivered before a reconnect is
        acknowledged once the daemon delivered it again (or found it acknowledged)."""
        self._call(_core.ack(seqs))

    def request(self, message: Request[Reply]) -> Reply:
        """Send any request under a fresh id and answer its reply, or raise the error it carries.

        A spawn or resume refused because a reload is under way is sent again once it is over;
        any request a restart answers `recovering` (it did nothing), after its `retry_after`,
        until it is answered, for at most `RECONNECT_WINDOW` within the client's ``timeout``.
        """
        started = time.monotonic()
        while True:
            request_id = self._send(message)
            try:
                reply = self._next_reply(request_id)
            except BaseException:
                # A timeout or Ctrl-C: the daemon need not go on waiting (a `wait`) for nobody.
                self._abort(request_id)
                raise
            self._conn.finish(request_id)
            if not isinstance(reply, Error):
                return reply  # nothing to raise, nothing to send again
            delay = _core.retry_delay(message, reply)
            if delay is None or time.monotonic() + delay > _core.give_up_at(
                reply, started, self.timeout
            ):
                return _core.checked(reply)
            time.sleep(delay)

    # -- I/O --------------------------------------------------------------------

    def _call(self, call: _core.Call[T]) -> T:
        return call.answer(self.request(call.request))

    def _connected(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError("not connected: use `with Client() as daemon:`")
        return self._sock

    def _send(
        self, request: Request[Reply], *, again: Callable[[], Request[Reply]] | None = None
    ) -> int:
        """Open `request`; a transport failure comes out of `_next_reply`, where a request
        sent again on a new connection has its answer."""
        sock = self._connected()
        if self._conn.reconnecting:
            self._reconnect()
            sock = self._connected()
        request_id, frame = self._conn.send(request, again=again, now=time.monotonic())
        if frame is not None:
            try:
                _sendall(sock, frame)
            except TimeoutError as exc:
                # Part of the frame may be out: nothing after it would parse.
                self._conn.connection_lost(exc)
                self._conn.finish(request_id)
                raise
            except OSError as exc:
                self._conn.connection_lost(exc)
        return request_id

    def _next_reply(self, request_id: int) -> Reply:
        conn = self._conn
        while (reply := conn.next_reply(request_id)) is None:
            if conn.reconnecting:
                self._reconnect()
                continue
            try:
                data = _recv(self._connected())
            except TimeoutError:
                raise  # nothing was consumed: the connection stays usable
            except OSError as exc:
                conn.connection_lost(exc)
            else:
                conn.receive_data(data, now=time.monotonic())
                for frame in conn.outgoing():
                    try:
                        self._connected().sendall(frame)
                    except OSError as exc:
                        conn.connection_lost(exc)
        return reply

    def _reconnect(self) -> None:
        """The daemon went away under open requests, or is reloading: connect again (a
        reload's connects wait in the backlog), say hello, and send what the conversation
        still needs answered."""
        if self._sock is not None:
            self._sock.close()  # hanging up at once lets a reloading daemon stop waiting for us
        deadline = time.monotonic() + _core.RECONNECT_WINDOW
        pause = _core.RECONNECT_PAUSE
        while True:
            leaving_by = self._leaving_by
            try:
                sock, handshake = self._handshake(min(deadline, leaving_by or deadline))
            except (OSError, SubagentdError) as exc:
                if leaving_by is not None and (
                    isinstance(exc, (ConnectionRefusedError, FileNotFoundError))
                    or not _core.retry_reconnect(exc)
                    or time.monotonic() + pause > leaving_by
                ):
                    # Nothing serves (or not in time) for a caller on its way out: the
                    # conversation goes on, the next call connecting again.
                    raise _LeftWaiting from exc
                if not _core.retry_reconnect(exc) or time.monotonic() + pause > deadline:
                    self._conn.reconnect_failed(exc)
                    return
                time.sleep(pause)
                pause = min(pause * 2, _core.RECONNECT_PAUSE_MAX)
                continue
            self._sock = sock
            try:
                frames = self._conn.reconnected(
                    handshake.rest, now=time.monotonic(), welcome=handshake.welcome
                )
                for frame in frames:
                    sock.sendall(frame)
            except OSError as exc:
                self._conn.connection_lost(exc)
            return

    def _handshake(self, deadline: float) -> tuple[socket.socket, _core.Handshake]:
        """A new connection past its hello, and the hello's welcome and what came after it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # A connect during a reload waits in the backlog until the new image serves.
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            sock.connect(os.fspath(self.socket))
            handshake = _core.Handshake(_core.token())
            sock.sendall(handshake.frame)
            while handshake.receive_data(sock.recv(_RECEIVE_SIZE)) is None:
                pass
            _set_timeout(sock, self.timeout)
        except BaseException:
            sock.close()
            raise
        return sock, handshake

    def _ack_leaving(self, wake: Wake) -> None:
        """Acknowledge the wake a caller leaves with (a break), never waiting for a daemon
        that is not there: its answer is awaited for `LEAVING_ACK_WAIT` at most, and not at
        all once a connect is refused; then the acknowledgement is left to the connection
        (`Connection.detach`), which sends it at this client's next call, on the connection
        that call makes. Else the wake stays pending for the next subscriber."""
        if self._sock is None:
            return  # closed under the caller: the wake stays pending, for the next subscriber
        self._leaving_by = time.monotonic() + _core.LEAVING_ACK_WAIT
        sock = self._sock
        _set_timeout(sock, _core.LEAVING_ACK_WAIT)
        request_id = None
        try:
            ack = _core.ack([wake.seq]).request
            if self._conn.reconnecting:  # opened in the core alone: `_next_reply` reconnects
                request_id = self._conn.send(ack, now=time.monotonic())[0]
            else:
                request_id = self._send(ack)
            self._next_reply(request_id)
        except (_LeftWaiting, TimeoutError):
            if request_id is not None:
                self._conn.detach(request_id)
                request_id = None
        except (SubagentdError, OSError):
            pass  # a failure must not hide why the caller left; the wake then stays pending
        finally:
            self._leaving_by = None
            if request_id is not None:
                self._conn.finish(request_id)
            if sock is self._sock and sock.fileno() >= 0:  # not closed by a reconnect
                _set_timeout(sock, self.timeout)

    def _abort(self, request_id: int) -> None:
        frame = self._conn.abort(request_id)  # None while reconnecting: nothing to abort
        if frame is None or self._sock is None:
            return
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            # Nothing left to abort on a dead connection; the caller's own exception matters more.
            self._conn.connection_lost(exc)


class _LeftWaiting(Exception):
    """A caller leaving a wake stream stops waiting for a daemon that is away."""


def _set_timeout(sock: socket.socket, timeout: float | None) -> None:
    """Bound each send and receive on `sock` by `timeout`, kept by the kernel (SO_SNDTIMEO,
    SO_RCVTIMEO) on a blocking socket: `settimeout` would have Python poll(2) before each
    call, two system calls more per request. Out of time, a call fails with EAGAIN, which
    `_sendall` and `_recv` raise as TimeoutError. None: no bound; 0: non-blocking."""
    if timeout is None or timeout <= 0:
        sock.settimeout(timeout)  # and a negative one raises ValueError, as there
        return
    sock.settimeout(None)
    seconds = min(int(timeout), 2**31 - 1)
    # At least a microsecond: a zero timeval would mean no bound at all.
    micro = max(int((timeout - int(timeout)) * 1_000_000), 0 if seconds else 1)
    for option in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(seconds, micro))


def _sendall(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.sendall(frame)
    except BlockingIOError as exc:  # SO_SNDTIMEO ran out (a part may be out)
        raise TimeoutError(errno.ETIMEDOUT, "timed out") from exc


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(_RECEIVE_SIZE)
    except BlockingIOError as exc:  # SO_RCVTIMEO ran out: nothing was taken
        raise TimeoutError(errno.ETIMEDOUT, "timed out") from exc
