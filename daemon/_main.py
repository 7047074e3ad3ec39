"""`subagentd`: parse the command line, take the state dir and socket, serve until told to stop.

SIGTERM and SIGINT stop gracefully: no new connections, every worker stopped
and its journal and record on disk, the lock released, exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from subagentd.protocol import (
    Reply,
    default_config_path,
    default_socket_path,
    default_state_dir,
    package_version,
)
from subagentd.protocol.errors import Busy

from ._agents import ConfigError, load_agents
from ._checkpoint import READS_VERSIONS, Checkpoint, CheckpointUnreadable, read_checkpoint
from ._daemon import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS, Daemon
from ._listener import ControlSocket, SocketInUse, activated_socket, bind_control_socket
from ._logging import LogFormat, configure_logging
from ._notify import notify
from ._recovery import recover
from ._reload import NO_CARRY_ENV, RELOAD_SIGNALS, Reloader, adopt, reload_reply
from ._server import Server
from ._statedir import StateDir, StateDirLocked, ensure_private_dir

log = structlog.get_logger("subagentd")


@dataclass(frozen=True)
class Settings:
    socket: Path
    state_dir: Path
    config: Path
    finished_ttl: float = DEFAULT_FINISHED_TTL
    idle_exit: float | None = None
    keep_archives_days: float = DEFAULT_KEEP_ARCHIVES_DAYS
    log_format: LogFormat | None = None
    handoff: Path | None = None
    handoff_fds: tuple[int, int] | None = None

    def daemon_args(self) -> list[str]:
        """The command line that gives the next image these settings."""
        args = [
            "--socket", str(self.socket),
            "--state-dir", str(self.state_dir),
            "--config", str(self.config),
            "--finished-ttl", repr(self.finished_ttl),
            "--keep-archives", repr(self.keep_archives_days),
        ]  # fmt: skip
        if self.idle_exit is not None:
            args += ["--idle-exit", repr(self.idle_exit)]
        if self.log_format is not None:
            args += ["--log-format", self.log_format]
        return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="subagentd",
        description="The per-user supervisor of agent subprocesses. Runs in the foreground; "
        "talk to it with subagentctl.",
    )
    parser.add_argument(
        "--socket", type=Path, help="control socket (default: $SUBAGENTD_SOCKET or the runtime dir)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="archives, runs and checkpoint (default: $SUBAGENTD_STATE_DIR or the state dir)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="agent definitions (default: $SUBAGENTD_CONFIG or <config dir>/agents.toml)",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log lines on stderr: json (default when stderr is not a terminal) or console",
    )
    parser.add_argument(
        "--finished-ttl",
        type=_non_negative,
        default=DEFAULT_FINISHED_TTL,
        metavar="S",
        help="keep a finished worker's handle this long uncollected (default: %(default)s s)",
    )
    parser.add_argument(
        "--idle-exit",
        type=_non_negative,
        metavar="S",
        help="exit after S idle seconds when that loses nothing (for socket activation)",
    )
    parser.add_argument(
        "--keep-archives",
        type=_non_negative,
        default=DEFAULT_KEEP_ARCHIVES_DAYS,
        metavar="DAYS",
        help="delete an ended worker's archive after this many days (default: %(default)s)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the install, the config and the state dir, then exit (0: usable)",
    )
    parser.add_argument(
        "--handoff",
        type=Path,
        metavar="CHECKPOINT",
        help="(given by a reload to the next image) adopt what this checkpoint carries",
    )
    parser.add_argument(
        "--handoff-fds",
        type=_fd_pair,
        metavar="LISTEN,LOCK",
        help="(given by a reload) the inherited listening socket and state-dir lock",
    )
    parser.add_argument("--version", action="version", version=f"subagentd {package_version()}")
    return parser


def _fd_pair(text: str) -> tuple[int, int]:
    listen, _, lock = text.partition(",")
    return int(listen), int(lock)


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not zero or more")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log_format: LogFormat | None = args.log_format
    configure_logging(log_format)
    settings = Settings(
        socket=args.socket or default_socket_path(),
        state_dir=args.state_dir or default_state_dir(),
        config=args.config or default_config_path(),
        finished_ttl=args.finished_ttl,
        idle_exit=args.idle_exit,
        keep_archives_days=args.keep_archives,
        log_format=log_format,
        handoff=args.handoff,
        handoff_fds=args.handoff_fds,
    )
    if args.check:
        return check(settings)
    try:
        trio.run(serve, settings)
    except (StateDirLocked, SocketInUse, PermissionError) as exc:
        print(f"subagentd: {exc}", file=sys.stderr)
        return 1
    return 0


def check(settings: Settings) -> int:
    """What `subagentd --check` says: can this image serve with this config and state dir?"""
    problems = []
    try:
        agents = load_agents(settings.config)
    except ConfigError as exc:
        problems.append(str(exc))
        agents = {}
    try:
        ensure_private_dir(settings.state_dir)
    except OSError as exc:
        problems.append(f"state dir {settings.state_dir}: {exc}")
    print(f"subagentd {package_version()}")
    print(f"config: {settings.config} ({len(agents)} agents)")
    print(f"state dir: {settings.state_dir}")
    print(f"reads checkpoint versions: {', '.join(map(str, READS_VERSIONS))}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


async def _until_signal(
    signals: AsyncIterator[int], reloader: Reloader, nursery: trio.Nursery, done: trio.CancelScope
) -> None:
    """SIGTERM and SIGINT stop the daemon; SIGHUP reloads it, as `subagentctl reload` does."""
    async for signum in signals:
        if signum == signal.SIGHUP:
            log.info("daemon.reload_signal")
            nursery.start_soon(_reload_quietly, reloader)
            continue
        log.info("daemon.stopping", signal=signal.Signals(signum).name)
        done.cancel()
        return


async def _reload_quietly(reloader: Reloader) -> None:
    try:
        await reloader.reload(None, 0)
    except Busy as exc:
        log.warning("reload.refused", error=str(exc))


async def _until_idle(
    daemon: Daemon, server: Server, seconds: float, done: trio.CancelScope
) -> None:
    """Return once nothing has happened for `seconds` and stopping would cost nothing:
    no connection open, no worker running, no result waiting within its TTL."""
    while True:
        activity = daemon.activity
        if server.connections or daemon.registry.holds_park():
            await activity.wait()
            continue
        with trio.move_on_after(seconds) as quiet:
            await activity.wait()
        if quiet.cancelled_caught:
            log.info("daemon.idle_exit", idle_non_negative=seconds)
            done.cancel()
            return


async def serve(settings: Settings) -> None:
    handoff = _read_handoff(settings.handoff) if settings.handoff is not None else None
    inherited = settings.handoff_fds  # (listen, lock): the reload's descriptors, whatever else
    state_dir = StateDir(settings.state_dir)
    state_dir.acquire(lock_fd=inherited[1] if inherited is not None else None)
    try:
        if inherited is not None:
            control = ControlSocket.inherited(inherited[0], settings.socket)
        else:
            control = activated_socket(settings.socket) or bind_control_socket(settings.socket)
    except BaseException:
        state_dir.release()
        raise
    daemon = Daemon(
        state_dir,
        socket_path=settings.socket,
        config_path=settings.config,
        finished_ttl=settings.finished_ttl,
        keep_archives_days=settings.keep_archives_days,
    )
    adopted: list[tuple[int, Reply]] = []
    if handoff is not None:
        carried, stopped = await adopt(daemon, handoff)
        adopted = [
            (c.fd, reload_reply(daemon, c.request_id, carried, stopped)) for c in handoff.requesters
        ]
        assert settings.handoff is not None
        settings.handoff.unlink(missing_ok=True)
        log.info(
            "reload.adopted",
            image_generation=daemon.image_generation,
            carried_live=carried,
            stopped_by_reload=stopped,
        )
    else:
        await recover(daemon)
    server = Server(daemon)
    reloader = Reloader(
        daemon,
        server,
        checkpoint_path=settings.state_dir / "checkpoint",
        listen_fd=control.sock.fileno(),
        daemon_args=settings.daemon_args(),
        no_carry=frozenset(filter(None, os.environ.get(NO_CARRY_ENV, "").split(","))),
    )
    server.reloader = reloader
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(control.sock))
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            # Blocked by the image before us across the exec; ours to take now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOAD_SIGNALS)
            async with trio.open_nursery() as nursery:
                reloader.nursery = nursery
                await nursery.start(daemon.run)
                with trio.CancelScope() as serving:
                    await nursery.start(server.serve, listener, adopted)
                    notify("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving")
                    log.info(
                        "daemon.serving",
                        socket=str(settings.socket),
                        state_dir=str(settings.state_dir),
                        version=package_version(),
                        image_generation=daemon.image_generation,
                    )
                    async with trio.open_nursery() as until_stop:
                        until_stop.start_soon(
                            _until_signal, signals, reloader, nursery, until_stop.cancel_scope
                        )
                        if settings.idle_exit is not None:
                            until_stop.start_soon(
                                _until_idle,
                                daemon,
                                server,
                                settings.idle_exit,
                                until_stop.cancel_scope,
                            )
                    notify("STOPPING=1", "STATUS=stopping workers")
                serving.cancel()
                with trio.CancelScope(shield=True):
                    await daemon.shutdown()
                nursery.cancel_scope.cancel()
    finally:
        control.remove()
        await listener.aclose()
        state_dir.release()
        log.info("daemon.stopped")


def _read_handoff(path: Path) -> Checkpoint | None:
    try:
        return read_checkpoint(path)
    except CheckpointUnreadable as exc:
        # Never start clean over workers we were handed: recovery from the
        # archives ends each of them and archives it as interrupted.
        log.critical("reload.handoff_unreadable", error=str(exc), then="stopping every worker")
        return None
