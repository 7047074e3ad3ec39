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
    default_config_path,
    default_socket_path,
    default_state_dir,
    package_version,
)

from ._agents import ConfigError, load_agents
from ._daemon import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS, Daemon
from ._listener import SocketInUse, bind_control_socket
from ._logging import LogFormat, configure_logging
from ._notify import notify
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
    parser.add_argument("--version", action="version", version=f"subagentd {package_version()}")
    return parser


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
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


async def _until_signal(signals: AsyncIterator[int], done: trio.CancelScope) -> None:
    async for signum in signals:
        log.info("daemon.stopping", signal=signal.Signals(signum).name)
        done.cancel()
        return


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
    state_dir = StateDir(settings.state_dir)
    state_dir.acquire()
    try:
        control = bind_control_socket(settings.socket)
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
    server = Server(daemon)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(control.sock))
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.run)
                with trio.CancelScope() as serving:
                    await nursery.start(server.serve, listener)
                    notify("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving")
                    log.info(
                        "daemon.serving",
                        socket=str(settings.socket),
                        state_dir=str(settings.state_dir),
                        version=package_version(),
                    )
                    async with trio.open_nursery() as until_stop:
                        until_stop.start_soon(_until_signal, signals, until_stop.cancel_scope)
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
