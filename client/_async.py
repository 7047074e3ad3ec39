"""The trio client: one connection, many requests in flight on it at once.

A reader task feeds every received byte to the sans-I/O `_core.Connection`,
which sorts replies by request id; each caller waits for its own. So a
followed watch and a stop can share the connection, from different tasks.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import trio

from subagentd.protocol import (
    DEFAULT_ANSWER_BYTES,
    DaemonInfo,
    Entry,
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
from ._switch import StopSwitch
from ._tasks import running

T = TypeVar("T")


class AsyncClient:
    """A trio connection to the daemon: ``async with AsyncClient() as daemon:``.

    ``socket`` defaults to $SUBAGENTD_SOCKET, else the per-user default path.
    No method takes a timeout: wrap calls in `trio.fail_after`. Inside a
    worker, the client acts as that worker ($SUBAGENTD_TOKEN).
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None) -> None:
        self.socket: Path = _core.socket_path(socket)
        self._conn = _core.Connection(reconnect=True)
        self._stream: trio.SocketStream | None = None
        # Concurrent send_all calls on one stream are an error, and frames must not interleave.
        self._sending = trio.StrictFIFOLock()
        self._arrivals = trio.lowlevel.ParkingLot()
        # Once the reader task is gone (cancelled by a scope around the whole client), a
        # waiter shielded from that cancel (a switch stopping its run) reads for itself.
        self._reader_running = True
        self._receiving = trio.Lock()
        # Callers leaving a wake stream, waiting (bounded) for their last acknowledgement's
        # answer: cancelled once a connect is refused, nothing serving (`_ack_leaving`).
        self._leaving: set[trio.CancelScope] = set()
        self._refused = False
        self._exit_stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        try:
            stream = await _open(self.socket)
        except OSError as exc:
            raise _core.unavailable(self.socket, exc) from exc
        async with contextlib.AsyncExitStack() as stack:
            self._stream = stream
            # Whichever stream is current then: a reconnect replaces it.
            stack.push_async_callback(self._close_stream)
            await stack.enter_async_context(running(self._receive_replies))
            await self._call(_core.hello(_core.token()))
            self._exit_stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._exit_stack.__aexit__(exc_type, exc, tb)

    # -- the daemon's operations (README.md, "From Python"; the wire: protocol/README.md) --

    async def spawn(
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
        timeout: float | None = None,  # noqa: ASYNC109  the worker's time limit, not this call's
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
        return await self._call(
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

    async def new_run(
        self,
        outer: str | None = None,
        *,
        limits: Limits | None = None,
        max_running: int | None = None,
    ) -> str:
        """A new run (nested in ``outer``); ``limits``: what its workers may take
        together; ``max_running``: how many of its workers may run at once (a spawn over
        it is queued, and starts in its turn)."""
        return await self._call(_core.new_run(outer, limits=limits, max_running=max_running))

    async def ls(
        self, all: bool = False, run: str | None = None, *, usage: bool = False
    ) -> list[WorkerView]:
        """Every worker (live ones, or with ``all`` ended ones too), page by page; each
        with a summary of its argv (`status` has the whole). ``usage``: each live one
        with what it takes now (`Usage`)."""
        cursor = _core.ListingCursor(all, run, usage)
        while not cursor.done:
            cursor.take(await self.request(cursor.request()))
        return cursor.workers

    async def status(self, worker_id: str) -> WorkerView:
        return await self._call(_core.status(worker_id))

    async def stop(self, worker_id: str, wait: bool = True) -> bool:
        """Stop a worker and its subtree; False for an id the daemon never saw."""
        return await self._call(_core.stop(worker_id, wait))

    async def stop_run(self, run_id: str, wait: bool = True) -> list[str]:
        """Stop a whole run; answers the ids stopped, sorted."""
        return await self._call(_core.stop_run(run_id, wait))

    async def pause(self, *, worker: str | None = None, run: str | None = None) -> Paused:
        """Pause a worker's subtree (``worker``) or a run's live workers (``run``): their
        processes held still by the kernel until `unpause`, their timeouts stopped.
        Answers the ids newly paused (``paused``) and those already (``already_paused``)."""
        return await self._call(_core.pause(worker, run))

    async def unpause(self, *, worker: str | None = None, run: str | None = None) -> Unpaused:
        """Let a paused worker's subtree, or a run's paused workers, go on."""
        return await self._call(_core.unpause(worker, run))

    async def watch_page(
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
        return await self._call(
            _core.watch_page(worker_id, since, limit, max_bytes=max_bytes, offset=offset)
        )

    async def watch(
        self,
        worker_id: str,
        since: int = 0,
        follow: bool = False,
        *,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
    ) -> AsyncGenerator[Entry, None]:
        """The journal's entries after ``since``: those there now, or with ``follow`` all until
        the worker ends. To leave a followed watch early and have its stream aborted at once,
        iterate inside ``contextlib.aclosing(daemon.watch(...))``. ``max_bytes``: of each
        page; an entry over it comes in pieces, one after the other under its seq."""
        cursor = _core.JournalCursor(worker_id, since, follow=follow, max_bytes=max_bytes)
        if not follow:
            while not cursor.done:
                for entry in cursor.take(await self.request(cursor.request())):
                    yield entry
            return
        stream = await self._send(cursor.request(), again=cursor.request)
        try:
            while not cursor.done:
                for entry in cursor.take(await self._next_reply(stream)):
                    yield entry
        finally:
            if cursor.done:
                self._conn.finish(stream)
            else:
                await self._abort(stream)

    async def events(
        self,
        run: str | None = None,
        worker: str | None = None,
        follow: bool = False,
        *,
        ack: bool = True,
    ) -> AsyncGenerator[Wake, None]:
        """The wakes of one parent (a ``run``'s top-level workers, or a ``worker``'s children)
        not yet acknowledged, each acknowledged once handed over: when the caller asks for
        the next one, or leaves the loop having got it (even cancelled: at once if the
        daemon is gone, the wake then pending for the next subscriber unless this client
        gets back to a daemon while open). A wake never handed over stays for the next
        subscriber. With ``follow``, then each new wake
        until the caller leaves; iterate inside ``contextlib.aclosing(daemon.events(...))``
        to have the stream aborted, and the last wake acknowledged, at once.

        With ``ack=False`` nothing is acknowledged: call `ack` once a wake is safely
        dealt with, so that a crash in between gets it again.
        """
        subscription = _core.WakeSubscription(run, worker, follow=follow)
        stream = await self._send(subscription.request(), again=subscription.request)
        try:
            while not subscription.done:
                for wake in subscription.take(await self._next_reply(stream)):
                    try:
                        yield wake
                    except BaseException:
                        # Left with the wake in hand (a break, a cancel): it was handed over.
                        if ack:
                            await self._ack_leaving(wake)
                        raise
                    if ack:
                        await self._acknowledge(wake)
        finally:
            if subscription.done:
                self._conn.finish(stream)
            else:
                await self._abort(stream)

    async def ack(self, seqs: Iterable[int]) -> None:
        """Acknowledge wakes by seq: no subscriber gets them again. Each must have been
        delivered to this client (else `Invalid`); one delivered before a reconnect is
        acknowledged once the daemon delivered it again (or found it acknowledged)."""
        await self._call(_core.ack(seqs))

    async def reload(self) -> ReloadReply:
        """Re-exec the daemon in place, keeping every worker; answers once the new image
        serves (`Refused` with the reason when the new image or config would not do,
        `Busy` right after another reload)."""
        return await self._call(_core.reload())

    async def resume(
        self,
        worker_id: str,
        timeout: float | None = None,  # noqa: ASYNC109  the worker's time limit, not this call's
        key: str | None = None,
    ) -> Resumed:
        """Carry an ended (not finished) worker on from its snapshot: same id, next attempt.
        It runs what it was spawned with; only its ``timeout`` may be given again. The
        answer's ``changed`` says what changed on disk since its spawn (empty: nothing).
        ``key``: as for `spawn`, a repeat answers the attempt the first one started."""
        return await self._call(_core.resume(worker_id, timeout, key))

    async def resume_run(self, run_id: str) -> list[Resumed]:
        """A new live attempt of a run: its highest unfinished workers carry on; answers them
        (each with ``changed``, as `resume`)."""
        return await self._call(_core.resume_run(run_id))

    async def reopen_run(self, run_id: str) -> None:
        """Start a stopped run again: it and the runs nested in it take spawns once more.
        A resume never does (stopping is one-way); this is the explicit way back.
        `RunStopped` while a run it is nested in is stopped, `NotFound` for an unknown run."""
        await self.request(ReopenRun(id=0, run=run_id))

    async def latest_resumable(self, cwd: str | os.PathLike[str] | None = None) -> ResumableRun:
        """The newest run started in ``cwd`` (default: this process's; however named: it is
        taken as its real path) that a resume would take, and ``from_`` the workers it would
        carry on; or else the newest and why not (`NotFound`: no run with a snapshot was
        started there)."""
        return await self._call(_core.latest_resumable(cwd))

    async def collect(self, worker_id: str, wait: bool = False) -> WorkerResult:
        return await self._call(_core.collect(worker_id, wait))

    async def wait(self, worker_id: str, ready: bool = False) -> WorkerView:
        """Return once the worker has ended (with ``ready``: or is ready, its spawn's
        ready pattern matched), with how it stands."""
        return await self._call(_core.wait(worker_id, ready))

    async def grep(
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
        return await self._call(
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

    async def grep_all(
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
            cursor.take(await self.request(cursor.request()))
        return cursor.result()

    async def wait_for(
        self,
        worker_id: str,
        pattern: str,
        *,
        timeout: float,  # noqa: ASYNC109  the daemon's bound, not this call's
    ) -> WaitForResult:
        """Return once a line of the worker's output matches ``pattern`` (what it wrote
        before the call too), once it ends, or after ``timeout`` seconds on the daemon's
        clock, whichever is first: the answer's ``outcome`` says which."""
        return await self._call(_core.wait_for(worker_id, pattern, timeout=timeout))

    async def send(self, worker_id: str, data: str | bytes, *, eof: bool = False) -> int:
        """Write ``data`` to the stdin of a worker spawned with ``stdin_open``; answers the
        bytes its pipe took (fewer when it was nearly full: send the rest again later;
        `Busy` when it took none). ``eof``: close its stdin once all of it is written."""
        return await self._call(_core.send(worker_id, data, eof=eof))

    async def info(self, *, usage: bool = False) -> DaemonInfo:
        """The daemon's state; ``usage``: with what its live workers take together."""
        return await self._call(_core.info(usage))

    @contextlib.asynccontextmanager
    async def stop_switch(
        self, outer: str | None = None, *, stop_on_exit: bool = True
    ) -> AsyncIterator[StopSwitch]:
        """A new run, nested in ``outer`` if given (stopping that stops this one), and the
        `StopSwitch` that spawns into it and stops it.

        With ``stop_on_exit`` (the default), the block leaves nothing behind, as no task
        outlives a trio nursery: however it is left (done, raising, or cancelled), the run
        is stopped on the way out, with whatever is still in flight in it, and the block
        ends once those processes are gone (TERM, then KILL after each worker's grace
        period). A run already stopped is left as it is. With ``stop_on_exit=False`` the
        switch stops nothing by itself: the run and its workers outlive the block, for
        ``stop_run(switch.run)`` (or another switch's stop, or the outer run's) to end
        later. The client stays open either way.
        """
        switch = StopSwitch(self, await self.new_run(outer))
        try:
            yield switch
        finally:
            if stop_on_exit:
                # Shielded: a block left because it was cancelled must still stop its run.
                with trio.CancelScope(shield=True):
                    await self.stop_run(switch.run)

    async def wait_run_stopped(self, run_id: str) -> None:
        """Return once the run is stopped, however: `stop_run` from any client, or an outer
        run's."""
        await self._call(_core.wait_run_stopped(run_id))

    async def begin_turn(self) -> int:
        """Advance the turn generation; workers registered from now on carry the new one."""
        return await self._call(_core.begin_turn())

    async def cancel(self, scope: str) -> list[str]:
        """Stop every worker in ``scope`` (``all``, ``turn:G``, ``run:R``, ``worker:W``);
        answers the ids newly cancelled, sorted."""
        return await self._call(_core.cancel(scope))

    async def set_fence(self) -> int:
        """Set a launch fence, replacing any other; answers its epoch."""
        return await self._call(_core.set_fence())

    async def cancel_fence(self, epoch: int) -> list[str]:
        """Stop what registered under fence ``epoch`` and, until another fence replaces it,
        every later spawn at birth; answers the ids stopped (none for a stale epoch)."""
        return await self._call(_core.cancel_fence(epoch))

    async def clear_fence(self) -> None:
        """Remove the launch fence: later spawns belong to none."""
        await self._call(_core.clear_fence())

    async def request(self, message: Request[Reply]) -> Reply:
        """Send any request under a fresh id and answer its reply, or raise the error it carries.

        A spawn or resume refused because a reload is under way is sent again once it is over;
        any request a restart answers `recovering` (it did nothing), after its `retry_after`,
        until it is answered, for at most `RECONNECT_WINDOW` (bound it with `trio.fail_after`).
        """
        started = trio.current_time()
        while True:
            request_id = await self._send(message)
            try:
                reply = await self._next_reply(request_id)
            except BaseException:
                # Cancelled, most likely: the daemon need not go on waiting (a `wait`) for nobody.
                await self._abort(request_id)
                raise
            self._conn.finish(request_id)
            delay = _core.retry_delay(message, reply)
            if delay is None or trio.current_time() + delay > _core.give_up_at(
                reply, started, None
            ):
                return _core.checked(reply)
            await trio.sleep(delay)

    # -- I/O --------------------------------------------------------------------

    async def _call(self, call: _core.Call[T]) -> T:
        return call.answer(await self.request(call.request))

    async def _close_stream(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()

    def _connected(self) -> trio.SocketStream:
        if self._stream is None:
            raise RuntimeError("not connected: use `async with AsyncClient() as daemon:`")
        return self._stream

    async def _send(
        self, request: Request[Reply], *, again: Callable[[], Request[Reply]] | None = None
    ) -> int:
        """Open `request`; a transport failure comes out of `_next_reply`, where a request
        sent again on a new connection has its answer."""
        self._connected()
        if self._conn.reconnecting:
            # Nothing goes out before the new connection, whose frames the core makes with
            # it: no need to wait for the lock a reconnect holds while it tries (up to its
            # window, with nothing serving).
            return self._conn.send(request, again=again, now=trio.current_time())[0]
        # Under the lock: the frame goes out on the socket the conversation stood on when it
        # was opened, and a reconnect sends again exactly what was opened before it.
        async with self._sending:
            request_id, frame = self._conn.send(request, again=again, now=trio.current_time())
            if frame is not None:
                await self._send_locked(frame)
        return request_id

    async def _send_frame(self, frame: bytes) -> None:
        async with self._sending:
            await self._send_locked(frame)

    async def _send_locked(self, frame: bytes) -> None:
        stream = self._connected()
        try:
            # Shielded: a frame cancelled halfway out would garble every frame after it.
            # The daemon always reads, so this waits only for the frame's own bytes.
            with trio.CancelScope(shield=True):
                await stream.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._conn.connection_lost(exc)
            self._arrivals.unpark_all()

    async def _next_reply(self, request_id: int) -> Reply:
        while (reply := self._conn.next_reply(request_id)) is None:
            if self._reader_running:
                await self._arrivals.park()
                continue
            async with self._receiving:
                # Another waiter may have read this request's reply while we queued.
                if (reply := self._conn.next_reply(request_id)) is not None:
                    return reply
                await self._receive_once()
        return reply

    async def _acknowledge(self, wake: Wake) -> None:
        # Shielded: a caller cancelled once it asked for more had still got this wake.
        with trio.CancelScope(shield=True):
            await self.ack([wake.seq])

    async def _ack_leaving(self, wake: Wake) -> None:
        """Acknowledge the wake a caller leaves with (a break, a cancel): shielded, as any
        wake handed over, but never waiting for a daemon that is not there. Its answer is
        awaited for `LEAVING_ACK_WAIT` at most, and not at all once a connect is refused;
        then the acknowledgement is left to the connection (`Connection.detach`), which
        sends it if it gets back to the daemon while this client is open. Else the wake
        stays pending for the next subscriber, as one whose ack failed does."""
        with trio.CancelScope(shield=True):
            try:
                request_id = await self._send(_core.ack([wake.seq]).request)
            except SubagentdError:
                return  # a failure must not hide why the caller left
            with trio.CancelScope(deadline=trio.current_time() + _core.LEAVING_ACK_WAIT) as waiting:
                self._leaving.add(waiting)
                if self._refused:
                    waiting.cancel()
                try:
                    await self._next_reply(request_id)
                except SubagentdError:
                    pass
                finally:
                    self._leaving.discard(waiting)
            if waiting.cancelled_caught:
                self._conn.detach(request_id)
            else:
                self._conn.finish(request_id)

    async def _abort(self, request_id: int) -> None:
        # The caller is likely leaving because it was cancelled; the daemon must still hear of it.
        with trio.CancelScope(shield=True):
            if self._conn.reconnecting:
                self._conn.abort(request_id)  # the work went with the connection
                return
            async with self._sending:
                frame = self._conn.abort(request_id)
                if frame is not None:
                    await self._send_locked(frame)

    async def _receive_replies(self) -> None:
        try:
            while not self._conn.closed:
                await self._receive_once()
        finally:
            self._reader_running = False
            self._arrivals.unpark_all()  # the waiters left read for themselves

    async def _receive_once(self) -> None:
        if self._conn.reconnecting:
            await self._reconnect()
            return
        stream = self._connected()
        try:
            data = await stream.receive_some()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._conn.connection_lost(exc)
        else:
            self._conn.receive_data(data, now=trio.current_time())
            for frame in self._conn.outgoing():
                await self._send_frame(frame)
        self._arrivals.unpark_all()

    async def _reconnect(self) -> None:
        """The daemon went away under open requests, or is reloading: connect again (a
        reload's connects wait in the backlog), say hello, and send what the conversation
        still needs answered; no frame goes out meanwhile."""
        async with self._sending:
            if self._stream is not None:
                # Hanging up at once lets a reloading daemon stop waiting for us.
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()
            deadline = trio.current_time() + _core.RECONNECT_WINDOW
            pause = _core.RECONNECT_PAUSE
            while True:
                try:
                    stream, handshake = await self._handshake(deadline)
                except (OSError, SubagentdError, trio.BrokenResourceError) as exc:
                    if isinstance(exc, (ConnectionRefusedError, FileNotFoundError)):
                        self._nothing_serves()
                    if not _core.retry_reconnect(exc) or trio.current_time() + pause > deadline:
                        self._conn.reconnect_failed(exc)
                        break
                    await trio.sleep(pause)
                    pause = min(pause * 2, _core.RECONNECT_PAUSE_MAX)
                    continue
                self._stream = stream
                self._refused = False
                frames = self._conn.reconnected(
                    handshake.rest, now=trio.current_time(), welcome=handshake.welcome
                )
                for frame in frames:
                    await self._send_locked(frame)
                break
        self._arrivals.unpark_all()

    def _nothing_serves(self) -> None:
        """A connect was refused: nothing serves the socket now (the daemon is gone, or
        not yet back). Callers leaving a wake stream stop waiting for their ack's answer."""
        self._refused = True
        for waiting in self._leaving:
            waiting.cancel()

    async def _handshake(self, deadline: float) -> tuple[trio.SocketStream, _core.Handshake]:
        """A new connection past its hello, and the hello's welcome and what came after it.
        A socket that takes the connection and never answers by `deadline` (a daemon
        stopped, a new image stuck before it serves) is TimeoutError, as in `Client`."""
        stream = await _open(self.socket)
        try:
            handshake = _core.Handshake(_core.token())
            # At least a moment, as `Client` gives its socket: a try begun at the end still asks.
            with trio.move_on_at(max(deadline, trio.current_time() + 0.1)) as waited:
                await stream.send_all(handshake.frame)
                while handshake.receive_data(await stream.receive_some()) is None:
                    pass
            if waited.cancelled_caught:
                raise TimeoutError(errno.ETIMEDOUT, "no welcome within the reconnect window")
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return stream, handshake


async def _open(path: Path) -> trio.SocketStream:
    """A connection to `path`. A full backlog (a reload under load) is EAGAIN for a
    non-blocking connect: it means "shortly", so it is tried again for a moment."""
    deadline = trio.current_time() + 1.0
    while True:
        try:
            return await trio.open_unix_socket(os.fspath(path))
        except BlockingIOError:
            if trio.current_time() > deadline:
                raise
            await trio.sleep(_core.RECONNECT_PAUSE)
