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
"""

from __future__ import annotations

import contextlib
import math
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
from subagentd.daemon.lifecycle._recovery import recover
from subagentd.daemon.lifecycle._reload import Reloader
from subagentd.daemon.processes._launcher import LocalLauncher
from subagentd.daemon.serving._listener import ControlSocket, bind_control_socket
from subagentd.daemon.serving._server import Server
from subagentd.daemon.store._statedir import StateDir

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
    """A daemon served inside the test's trio run."""

    root: Path
    socket: Path
    state_dir: Path
    daemon: Daemon
    server: Server
    reloader: Reloader
    wall: FollowingWall

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
    faults: frozenset[tuple[str, str]] = frozenset(),
    real_bound: float = REAL_BOUND,
) -> AsyncIterator[InProcess]:
    """Serve a daemon on `root`/s.sock with state in `root`/state until the body ends,
    then stop its workers as a SIGTERM would; TooSlowError after `real_bound` real s."""
    state_dir = StateDir(root / "state")
    state_dir.acquire()
    control: ControlSocket | None = None
    listener: trio.SocketListener | None = None
    daemon: Daemon | None = None
    try:
        control = bind_control_socket(root / "s.sock")
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(control.sock))
        wall = FollowingWall()
        daemon = Daemon(
            state_dir,
            socket_path=control.path,
            config_path=root / "agents.toml",
            finished_ttl=finished_ttl,
            keep_archives_days=keep_archives_days,
            clock=wall,
            faults=faults,
            launcher=LocalLauncher(None, "/proc scan (in-process test)"),
        )
        await recover(daemon)
        server = Server(daemon)
        reloader = _NoExecReloader(
            daemon,
            server,
            checkpoint_path=root / "state" / "checkpoint",
            control=control,
            settings=Settings(
                socket=control.path,
                state_dir=root / "state",
                config=root / "agents.toml",
                finished_ttl=finished_ttl,
                keep_archives_days=keep_archives_days,
                cgroups="off",
            ),
        )
        server.reloader = reloader
        async with trio.open_nursery() as nursery:
            reloader.nursery = nursery
            await nursery.start(daemon.run)
            await nursery.start(server.serve, listener)
            # Every task of the daemon has begun (its timers count from now).
            await trio.testing.wait_all_tasks_blocked()
            with _real_bound(nursery, real_bound) as bound:
                yield InProcess(root, control.path, state_dir.root, daemon, server, reloader, wall)
            with trio.CancelScope(shield=True):
                await daemon.shutdown()
            nursery.cancel_scope.cancel()
        if bound.cancelled_caught:
            raise trio.TooSlowError(f"the in-process test took over {real_bound} real seconds")
    finally:
        if daemon is not None:
            daemon.store.close()
        if control is not None:
            control.remove()
        if listener is not None:
            await listener.aclose()
        state_dir.release()


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
