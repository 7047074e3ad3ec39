"""The daemon's parts run inside the test's own trio run, on trio's MockClock.

`in_process` builds what `_serve.serve` builds (state dir, control socket,
`Daemon`, `Server`, `Reloader`) and serves on a real Unix socket in a short
temp dir, with real worker processes. Under pytest-trio's `autojump_clock`
(a `MockClock(autojump_threshold=0)`) time jumps to the next deadline whenever
every task is blocked, so a TTL of an hour, a grace or a timeout of minutes, a
day between prunings pass in milliseconds; the daemon's wall clock
(`FollowingWall`) moves with it, so what it writes down (ended_at) agrees.

Two consequences shape the tests that use it:
- A real wait (a process exiting, a thread) lets the clock jump too, so a test
  holds the clock (`held`) while it waits for a real event that must happen
  before a deadline, and asserts spans of trio time rather than trusting order.
- `trio.fail_after` is on the mock clock, so it would fire at the first real
  wait: the bound of such a test is `in_process`'s own, in real seconds.

The daemon can also be reloaded in place (`InProcess.reload_in_place`: the old
image's real checkpoint, carried descriptors and all, adopted by a new `Daemon`,
with only the exec itself left out) or crash and start again
(`InProcess.crash_and_restart`: its tasks cancelled, its descriptors closed and its
store left as a kill leaves them, then a new `Daemon` recovers from the state dir).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio
import trio.testing

from subagentd.client import AsyncClient
from subagentd.daemon._daemon import Daemon
from subagentd.daemon._settings import Settings
from subagentd.daemon.core._registry import (
    DEFAULT_FINISHED_TTL,
    DEFAULT_KEEP_ARCHIVES_DAYS,
    WorkerRecord,
)
from subagentd.daemon.core._request_keys import DEFAULT_REQUEST_KEY_TTL
from subagentd.daemon.lifecycle._carried import Carried, take_back
from subagentd.daemon.lifecycle._checkpoint import (
    Checkpoint,
    carries_store_lock,
    read_checkpoint,
    read_handed,
)
from subagentd.daemon.lifecycle._recovery import recover
from subagentd.daemon.lifecycle._reload import Reloader, adopt
from subagentd.daemon.lifecycle._resume import Resumer
from subagentd.daemon.processes._launcher import LocalLauncher
from subagentd.daemon.serving._listener import ControlSocket, bind_control_socket
from subagentd.daemon.serving._server import Server
from subagentd.daemon.store._statedir import StateDir
from subagentd.daemon.store._store import STORE_NAME, Store

#: What an in-process test may take, in real seconds, whatever its mock clock says.
REAL_BOUND = 20.0


class FollowingWall:
    """A wall clock that moves as trio's clock does: the daemon's `clock` in these tests."""

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._trio0 = trio.current_time()

    def __call__(self) -> float:
        return self._wall0 + trio.current_time() - self._trio0

    def trio_time(self, wall: float) -> float:
        """The trio time at which this clock read `wall`: a written-down time, to wait for."""
        return wall - self._wall0 + self._trio0


class _NoExecReloader(Reloader):
    """A reloader that never execs: the exec would replace the test run with a daemon.
    It fails as a failed execv does, so the reload is undone and refused."""

    def _exec(self, *args: object, **kwargs: object) -> None:
        raise OSError("an in-process daemon does not exec")


@dataclass
class InProcess:
    """A daemon served inside the test's trio run. A reload or a crash puts the next
    image's parts (`daemon`, `server`, `reloader`, `control`) in place of the old, here."""

    root: Path
    socket: Path
    state_dir: Path
    wall: FollowingWall
    settings: Settings
    faults: frozenset[tuple[str, str]]
    # The image in place:
    daemon: Daemon
    state: StateDir
    control: ControlSocket
    server: Server
    reloader: Reloader
    listener: trio.SocketListener
    _image: _Image

    def client(self) -> AsyncClient:
        return AsyncClient(self.socket)

    def record(self, worker_id: str) -> WorkerRecord:
        """The daemon's record of a worker whose handle it holds (not a tombstone)."""
        found = self.daemon.reader.lookup(worker_id)
        assert isinstance(found, WorkerRecord), found
        return found

    def ended(self, worker_id: str) -> float:
        """When a worker ended, on trio's clock (its record says when on the wall clock)."""
        ended_at = self.daemon.reader.lookup(worker_id).ended_at
        assert ended_at is not None
        return self.wall.trio_time(ended_at)

    async def settle_threads(self) -> None:
        """Return once every thread the daemon has under way (pruning, say) is done: a
        thread of ours, asked through the limiter they share made one token wide, is let
        run only after them. What a thread does takes real time, over which the clock
        would jump; so a test holds the clock, and settles, before it looks."""
        limiter = trio.to_thread.current_default_thread_limiter()
        total, limiter.total_tokens = limiter.total_tokens, 1
        try:
            await trio.to_thread.run_sync(lambda: None)
        finally:
            limiter.total_tokens = total

    async def settle(self) -> None:
        """Return once any scan of /proc the daemon has under way is done (a scan asked
        now waits for it): a signal it decided to send before now has been sent. A
        deadline's consequences may take real time, over which the clock would jump."""
        launcher = self.daemon.launcher
        assert isinstance(launcher, LocalLauncher)
        await launcher.processes.scan()

    async def reload_in_place(self) -> InProcess:
        """Reload as `Reloader._reload` does, on both sides, but for the exec; this, with
        the next image's parts in place.

        The old image settles its launches, pauses the server (every client told
        `reloading`), waits until supervision holds nothing an exec would lose and
        builds the real checkpoint with its inventory of carried descriptors
        (`Reloader.checkpoint`, `Carried`), handed over in its sealed memfd (or written
        to its file, for an image that reads only an older version). In place of the exec:
        its tasks (supervision's with them) end where they stand, none of its
        undoing runs (a working exec never returns), what an exec closes is closed,
        and its objects let go of the carried descriptors, whose numbers stay valid
        (one process). The new image does what `_serve.serve` does with a handoff: it
        reads the checkpoint, takes the descriptors back, takes its settings, adopts
        (`_reload.adopt`) and serves. Not exercised: the `--check` child (a real
        process, tested end to end), the exec and signals blocked across it.
        """
        old, reloader = self.daemon, self.reloader
        await old.supervisor.launches_settled()
        old.spawner.reloading = True
        kept = await self.server.pause([])
        await old.supervisor.wait_nothing_in_hand()
        carried = Carried()  # never left: what it would give back, an exec keeps
        checkpoint = reloader.checkpoint(carried, kept, [], stopped_by_reload=[])
        handed = carries_store_lock(checkpoint.version)  # else a file, as for an older image
        if handed:
            memfd = carried.hand_over(checkpoint)
        else:
            carried.write(reloader.checkpoint_path, checkpoint)
        await self._image.end()
        self._close_on_exec(checkpoint)
        if handed:
            handoff = read_handed(memfd)
        else:
            handoff = read_checkpoint(reloader.checkpoint_path)
            reloader.checkpoint_path.unlink()  # spent, as `_serve` removes it
        missing = take_back(handoff)
        assert not missing, f"carried descriptors not open after the exec: {missing}"
        assert handoff.settings is not None
        settings = handoff.settings
        state = StateDir(settings.state_dir)
        state.acquire(lock_fd=handoff.lock_fd, lock_file_fd=handoff.lock_file_fd)
        control = ControlSocket.inherited(
            handoff.listen_fd, settings.socket, owned=handoff.listen_owned
        )
        daemon = _daemon(state, settings, self.wall, self.faults, handoff.store_lock_fd)
        await adopt(daemon, handoff)
        await self._serve(daemon, settings, state, control)
        return self

    async def crash_and_restart(self) -> InProcess:
        """Crash as a kill -9 would, then start again from the state dir alone; this,
        with the new image's parts in place.

        The old image's tasks are cancelled where they stand (no shutdown, no
        checkpoint), every descriptor it held is closed (its workers' pipes, the lock,
        the listening socket, whose file stays) and its store is left as its files
        were (closing a connection writes the WAL back: undone). The workers are not
        touched: a new `Daemon` on the same state dir recovers (`_recovery.recover`),
        ending what is left of them, as `_serve.serve` does at a start.
        """
        old = self.daemon
        pids = [live.process.pid for live in old.supervisor.workers() if live.process]
        await self._image.end()
        self._close_as_a_kill_would()
        state = StateDir(self.settings.state_dir)
        state.acquire()
        control = bind_control_socket(self.settings.socket)
        daemon = _daemon(state, self.settings, self.wall, self.faults)
        await recover(daemon)
        await daemon.launcher.sweep(daemon.supervisor)
        for pid in pids:  # what init does for a dead daemon's children: recovery ended them
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG: no wait
        await self._serve(daemon, self.settings, state, control)
        return self

    def _close_on_exec(self, checkpoint: Checkpoint) -> None:
        """What the exec closes of the old image (its store, its reaper's watches, journals
        not carried), and its objects' hold on the descriptors carried, which the new image
        owns now."""
        daemon = self.daemon
        if checkpoint.store_lock_fd is not None and daemon.store.lock is not None:
            daemon.store.lock.detach()  # carried: the new image's now, still held
        daemon.store.close()
        carried = {w.id for w in checkpoint.live if w.journal is not None}
        for live in daemon.supervisor.workers():
            assert live.process is not None
            live.process.unwatch()  # the new image watches it anew; the pipes go on
            if live.record.id in carried:
                live.journal.detach()  # its descriptor is the new image's now
            else:
                live.journal.release()
        for live in daemon.supervisor.queued():  # no process; the next image opens them again
            live.journal.release()
        # (The ended journals its reader kept open close as the old image is collected.)
        assert self.control.sock.fileno() == checkpoint.listen_fd
        self.control.sock.detach()

    def _close_as_a_kill_would(self) -> None:
        """What the kernel closes of a killed image; its store's files left as they were."""
        daemon = self.daemon
        with _as_a_kill_leaves(self.state_dir):
            daemon.store.close()
        for live in daemon.supervisor.workers():
            if live.process is not None:
                live.process.unwatch()  # init reaps them (here: the harness, below)
                live.process.close()  # its pipes: the workers write into the void
            live.journal.release()
        for live in daemon.supervisor.queued():
            live.journal.release()
        self.control.sock.close()  # the socket file stays, as after a kill
        # The lock goes with the process; the file naming the holder stays. (Forgotten by
        # the old StateDir too, whose numbers the next image may be given.)
        for name in ("lock_fd", "_file_lock_fd"):
            fd = getattr(self.state, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self.state, name, None)

    async def _serve(
        self, daemon: Daemon, settings: Settings, state: StateDir, control: ControlSocket
    ) -> None:
        """Serve `daemon` as the image in place, from now on."""
        served = await _serve(self._image.nursery, daemon, settings, control)
        self.daemon, self.state, self.control, self.settings = daemon, state, control, settings
        self.server, self.reloader, self.listener, self._image = served


async def _serve(
    nursery: trio.Nursery, daemon: Daemon, settings: Settings, control: ControlSocket
) -> tuple[Server, Reloader, trio.SocketListener, _Image]:
    """What `_serve.serve` builds around a daemon, serving in `nursery`."""
    server = Server(daemon, Resumer(daemon))
    reloader = _NoExecReloader(
        daemon,
        server,
        checkpoint_path=settings.state_dir / "checkpoint",
        control=control,
        settings=settings,
    )
    server.reloader = reloader
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(control.sock))
    return (
        server,
        reloader,
        listener,
        await _Image.start(nursery, daemon, server, reloader, listener),
    )


@dataclass
class _Image:
    """One image's tasks (the daemon's and the server's), which end together."""

    nursery: trio.Nursery  # where they run: the test's
    scope: trio.CancelScope
    done: trio.Event

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        daemon: Daemon,
        server: Server,
        reloader: Reloader,
        listener: trio.SocketListener,
    ) -> _Image:
        done = trio.Event()

        async def run(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            try:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as tasks:
                        reloader.nursery = tasks
                        await tasks.start(daemon.run)
                        await tasks.start(server.serve, listener)
                        daemon.supervisor.serving()  # as `_serve.serve` does after READY=1
                        task_status.started(scope)
            finally:
                done.set()

        scope = await nursery.start(run)
        # Every task of the daemon has begun (its timers count from now).
        await trio.testing.wait_all_tasks_blocked()
        return cls(nursery, scope, done)

    async def end(self) -> None:
        """Cancel its tasks where they stand (nothing shut down) and wait for them."""
        self.scope.cancel()
        await self.done.wait()


@contextlib.contextmanager
def _as_a_kill_leaves(state_dir: Path) -> Iterator[None]:
    """The store's files as they were before the body (a connection closing writes its
    WAL back into the database: a killed daemon leaves both as they stood)."""
    files = {path: path.read_bytes() for path in state_dir.glob(f"{STORE_NAME}*")}
    yield
    for path in state_dir.glob(f"{STORE_NAME}*"):
        if path not in files:
            path.unlink()
    for path, content in files.items():
        path.write_bytes(content)


def _daemon(
    state: StateDir,
    settings: Settings,
    wall: FollowingWall,
    faults: frozenset[tuple[str, str]],
    store_lock_fd: int | None = None,
) -> Daemon:
    return Daemon(
        state,
        socket_path=settings.socket,
        config_path=settings.config,
        finished_ttl=settings.finished_ttl,
        keep_archives_days=settings.keep_archives_days,
        request_key_ttl=settings.request_key_ttl,
        clock=wall,
        faults=faults,
        launcher=LocalLauncher(None, "/proc scan (in-process test)"),
        store=Store.open(settings.state_dir / STORE_NAME, store_lock_fd),
    )


@contextlib.contextmanager
def short_root() -> Iterator[Path]:
    """A temp dir short enough for a Unix socket path (108 bytes), removed after."""
    root = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def in_process(
    root: Path,
    *,
    finished_ttl: float = DEFAULT_FINISHED_TTL,
    keep_archives_days: float = DEFAULT_KEEP_ARCHIVES_DAYS,
    request_key_ttl: float = DEFAULT_REQUEST_KEY_TTL,
    faults: frozenset[tuple[str, str]] = frozenset(),
    real_bound: float = REAL_BOUND,
) -> AsyncIterator[InProcess]:
    """Serve a daemon on `root`/s.sock with state in `root`/state until the body ends,
    then stop its workers as a SIGTERM would; TooSlowError after `real_bound` real s."""
    settings = Settings(
        socket=root / "s.sock",
        state_dir=root / "state",
        config=root / "agents.toml",
        finished_ttl=finished_ttl,
        keep_archives_days=keep_archives_days,
        request_key_ttl=request_key_ttl,
        cgroups="off",
    )
    state = StateDir(settings.state_dir)
    state.acquire()
    control: ControlSocket | None = None
    served: InProcess | None = None
    try:
        control = bind_control_socket(settings.socket)
        wall = FollowingWall()
        daemon = _daemon(state, settings, wall, faults)
        async with trio.open_nursery() as nursery:
            try:
                await recover(daemon)
                served = InProcess(
                    root,
                    control.path,
                    state.root,
                    wall,
                    settings,
                    faults,
                    daemon,
                    state,
                    control,
                    *await _serve(nursery, daemon, settings, control),
                )
            except BaseException:
                daemon.store.close()
                raise
            with _real_bound(nursery, real_bound) as bound:
                yield served
            with trio.CancelScope(shield=True):
                await served.daemon.shutdown()
            nursery.cancel_scope.cancel()
        if bound.cancelled_caught:
            raise trio.TooSlowError(f"the in-process test took over {real_bound} real seconds")
    finally:
        if served is not None:  # the image in place: the last reload's or restart's
            served.daemon.store.close()
            control, state = served.control, served.state
            await served.listener.aclose()
        if control is not None:
            control.remove()
            control.sock.close()
        state.release()


@contextlib.contextmanager
def _real_bound(nursery: trio.Nursery, seconds: float) -> Iterator[trio.CancelScope]:
    """Cancel the body after `seconds` of real time (the mock clock cannot bound it)."""
    done = threading.Event()

    async def watch() -> None:
        # A limiter of its own: this thread holds no token of those the daemon's threads
        # share (see InProcess.settle_threads).
        ran_out = not await trio.to_thread.run_sync(
            done.wait, seconds, abandon_on_cancel=True, limiter=trio.CapacityLimiter(1)
        )
        if ran_out:
            scope.cancel()

    with trio.CancelScope() as scope:
        nursery.start_soon(watch)
        try:
            yield scope
        finally:
            done.set()


@contextlib.contextmanager
def held(clock: trio.testing.MockClock) -> Iterator[None]:
    """No autojump inside: for a real event that must come before the next deadline."""
    threshold, clock.autojump_threshold = clock.autojump_threshold, math.inf
    try:
        yield
    finally:
        clock.autojump_threshold = threshold


@contextlib.asynccontextmanager
async def at(clock: trio.testing.MockClock, when: float) -> AsyncIterator[None]:
    """Let the clock run to `when`, then hold it for the body: what falls due at `when`
    happens, and nothing later does while the body waits for what follows from it."""
    await trio.sleep_until(when)
    with held(clock):
        yield
