"""`subagentd`: parse the command line, take the state dir and socket, serve until told to stop.

SIGTERM and SIGINT stop gracefully: no new connections, every worker stopped
and its journal and record on disk, the lock released, exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from subagentd.protocol import (
    default_config_path,
    default_socket_path,
    default_state_dir,
    package_version,
)

from ._agents import ConfigError, load_agents
from ._checkpoint import READS_VERSIONS
from ._logging import LogFormat, configure_logging
from ._registry import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS
from ._statedir import StateDirLocked, ensure_private_dir
from ._store import READS_VERSIONS as STORE_READS_VERSIONS
from ._store import StoreUnusable

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
    cgroups: Literal["auto", "off"] = "auto"

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
        if self.cgroups != "auto":
            args += ["--cgroups", self.cgroups]
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
        "--cgroups",
        choices=["auto", "off"],
        default="auto",
        help="auto (default): give each worker its own cgroup where the daemon's cgroup is "
        "delegated to it (Delegate=yes, or root), so a stop finds every process however it "
        "forked; off: always find trees by scanning /proc. `subagentctl info` says which is used",
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
        cgroups=args.cgroups,
    )
    if args.check:
        return check(settings)
    import trio  # only a serving daemon needs it: --check stays quick for reloads

    from ._listener import SocketInUse
    from ._serve import serve

    try:
        trio.run(serve, settings)
    except (StateDirLocked, SocketInUse, PermissionError, StoreUnusable) as exc:
        print(f"subagentd: {exc}", file=sys.stderr)
        return 1
    return 0


def check(settings: Settings) -> int:
    """What `subagentd --check` says: can this image serve with this config and state dir?"""
    problems = []
    try:
        # Everything the serving image imports, so a broken install fails here,
        # before a reload execs into it, not after.
        importlib.import_module("subagentd.daemon._serve")
    except Exception as exc:
        problems.append(f"the install does not import: {exc!r}")
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
    print(f"reads store schema versions: {', '.join(map(str, STORE_READS_VERSIONS))}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0
