"""`subagentd`: parse the command line, take the state dir and socket, serve until told to stop.

SIGTERM and SIGINT stop gracefully: no new connections, every worker stopped
and its journal and record on disk, the lock released, exit 0. An image that a
reload execs is given `--handoff-fd FD` (a sealed memfd holding the checkpoint) and
the settings, as options: its settings are its command line's. (An image before
checkpoint version 4 is given only `--handoff CHECKPOINT`, a file: its settings
are the checkpoint's.)

A serving daemon first raises its soft RLIMIT_NOFILE to the hard limit (and the
hard one where it may): each live worker holds two descriptors here (stdout
and stderr pipes; its journal only while among the 256 used last), so a
login shell's soft 1024 would refuse spawns past about 380.
"""

from __future__ import annotations

import importlib
import os
import resource
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from subagentd.protocol import (
    MAX_RUNNING,
    default_config_path,
    default_socket_path,
    default_state_dir,
    one_line_warnings,
    package_version,
)

from ._faults import FAULT_ENV, read_faults
from ._logging import configure_logging, get_logger
from ._settings import DEFAULT_RELOAD_INTERVAL, MAX_RELAY_ABOVE, Settings
from .core._registry import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS
from .core._request_keys import DEFAULT_REQUEST_KEY_TTL
from .lifecycle._checkpoint import (
    KEEP_HANDED_FAULT,
    READS_VERSIONS,
    Checkpoint,
    CheckpointUnreadable,
    keep_handed,
    read_checkpoint,
    read_handed,
)
from .serving._listener import bound_for
from .store._statedir import StateDirLocked, ensure_private_dir
from .store._store import READS_VERSIONS as STORE_READS_VERSIONS
from .store._store import StoreUnusable
from .workers._agents import AgentDef, ConfigError, load_agents

if TYPE_CHECKING:
    import argparse

log = get_logger()


def _parser() -> argparse.ArgumentParser:
    import argparse  # not for a reload's exec: see `main`

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
        "--reload-interval",
        type=_non_negative,
        default=DEFAULT_RELOAD_INTERVAL,
        metavar="S",
        help="refuse a reload (busy, saying when to retry) until S seconds after the last "
        "one ended: a loop of reloads cannot keep the daemon from serving (default: "
        "%(default)s s; 0 for none)",
    )
    parser.add_argument(
        "--request-key-ttl",
        type=_non_negative,
        default=DEFAULT_REQUEST_KEY_TTL,
        metavar="S",
        help="remember a spawn's or resume's idempotency key this long, so a client that "
        "sends it again (its answer lost in a reload) gets the same worker "
        "(default: %(default)s s)",
    )
    parser.add_argument(
        "--relay-above",
        type=_descriptor_number,
        default=None,
        metavar="FD",
        help="hand a new worker's stdout and stderr pipes to an output relay process once "
        "their descriptor numbers come at or above FD, so the worker costs the daemon no "
        "descriptor (default: the descriptor limit less a quarter of it, at least 1,024 "
        "kept; 0 relays every worker)",
    )
    parser.add_argument(
        "--max-running",
        type=_max_running,
        default=None,
        metavar="N",
        help="run at most N workers at once across every run; a spawn over it is "
        "answered at once, queued, and starts in its turn as a worker ends "
        "(default: no cap; runs and agents may have caps of their own)",
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
        "--cgroup-v1-root",
        type=_v1_root,
        default=None,
        metavar="DIR",
        help="look for the cgroup v1 hierarchies (memory, cpu, pids) as directories named "
        "after their controllers in DIR, not where the mounts are (a host mounting them "
        "elsewhere; a kind missing there is enforced by cgroup v2 where it can be, else "
        "refused)",
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
        help="(given by a reload to the next image) adopt what this checkpoint carries, "
        "and serve with the settings it carries",
    )
    parser.add_argument(
        "--handoff-fd",
        type=int,
        metavar="FD",
        help="(given by a reload to the next image) adopt what the checkpoint in this "
        "inherited, sealed memfd carries; the settings are this command line's",
    )
    # Given by images before the checkpoint carried everything; the descriptors it
    # names are the checkpoint's too, so it is accepted and not read.
    parser.add_argument("--handoff-fds", help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"subagentd {package_version()}")
    return parser


def _non_negative(text: str) -> float:
    import argparse

    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not zero or more")
    return value


def _descriptor_number(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= MAX_RELAY_ABOVE:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and {MAX_RELAY_ABOVE}")
    return value


def _v1_root(text: str) -> Path:
    """`--cgroup-v1-root`: an absolute path to a directory (the next image is given it as
    it is, from another working directory)."""
    import argparse

    path = Path(text)
    if not text or "\0" in text or not path.is_absolute():
        raise argparse.ArgumentTypeError(f"{text!r} is not an absolute path")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path


def _max_running(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_RUNNING:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 1 and {MAX_RUNNING}")
    return value


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = one_line_warnings("subagentd")
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--handoff":
        # How a reload runs this image: its settings are the checkpoint's, so neither the
        # parser nor the default paths (argparse, platformdirs) are imported on the way.
        return _take_over(Path(argv[1]), lambda: _settings(_parser().parse_args(argv)))
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args)
    except PermissionError as exc:  # platformdirs' fallback runtime dir: not ours alone
        print(
            f"error: no safe place for the socket: {exc} (or name it: --socket or "
            "SUBAGENTD_SOCKET)",
            file=sys.stderr,
        )
        return 2
    if args.handoff_fd is not None:
        return _take_over_handed(args.handoff_fd, settings)
    if args.handoff is not None:
        return _take_over(args.handoff, lambda: settings, check_only=args.check)
    configure_logging(settings.log_format)
    if args.check:
        return check(settings)
    return _serve(settings)


def _take_over(path: Path, given: Callable[[], Settings], *, check_only: bool = False) -> int:
    """Serve with the checkpoint at `path` a reload's exec handed this image; `given`: the
    settings of the command line, for a checkpoint that carries none."""
    try:
        handoff = read_checkpoint(path)
        _check_its_place(handoff, path)
        for worker in handoff.live:
            # In the state dir, within a worker's reach: a parked journal's identity said
            # there is not believed (the journal is opened from its path, verified whole).
            worker.parked = None
        handoff = _its_socket(handoff)
    except CheckpointUnreadable as exc:
        configure_logging(given().log_format)
        # Without it this image knows neither its settings nor its descriptors: it
        # exits as if it had crashed, and the next start recovers every worker (each
        # is ended and archived as interrupted, resumable), as after kill -9.
        log.critical("reload.handoff_unreadable", error=str(exc), then="exiting")
        return 1
    # The carried settings win over this image's defaults: a reload changes the
    # code, not how the daemon was started (agents.toml is read afresh, though).
    settings = handoff.settings or given()  # None: an older image gave them in argv
    configure_logging(settings.log_format)
    if check_only:
        return check(settings)
    return _serve(settings, path, handoff)


def _take_over_handed(fd: int, settings: Settings) -> int:
    """Serve with the checkpoint a reload handed this image in the sealed memfd `fd`,
    with the settings of this command line (which the old image wrote, and no other
    process can change): what the checkpoint says of them is checked, never taken.

    A checkpoint that cannot be read costs no worker: what it would have said is
    rebuilt from what the kernel shows (`_rebuilt`), and the daemon serves on, saying why.
    """
    configure_logging(settings.log_format)
    problems: list[str] = []
    try:
        handoff = read_handed(fd)
    except CheckpointUnreadable as exc:
        from .lifecycle._rebuilt import rebuilt_handoff

        problem = (
            f"{exc}: this image took over from what the kernel shows instead (the state "
            "dir's and the store's locks, the socket, each live worker's pipes); requests "
            "that asked for the reload were not answered"
        )
        log.critical("reload.handoff_unreadable", error=str(exc), then="rebuilt from the kernel")
        problems.append(problem)
        handoff, pipes = rebuilt_handoff(settings)
        return _serve(settings, None, handoff, problems, pipes)
    else:
        problems += handoff.problems
        problems += _settings_differing(handoff.settings, settings)
        handoff = _its_socket(msgspec.structs.replace(handoff, settings=settings))
        if KEEP_HANDED_FAULT in read_faults(os.environ.get(FAULT_ENV, "")):
            keep_handed(settings.state_dir, handoff)
    return _serve(handoff.settings or settings, None, handoff, problems)


def _settings_differing(carried: Settings | None, given: Settings) -> list[str]:
    """What the checkpoint says of the settings that differs from the command line's,
    each logged and kept for `info`: a bug of the image before, never taken."""
    if carried is None:
        return []
    problems = []
    for name in given.__struct_fields__:
        said, used = getattr(carried, name), getattr(given, name)
        if said != used:
            log.error("reload.setting_differs", setting=name, checkpoint=str(said), used=str(used))
            problems.append(
                f"the checkpoint the last reload handed over says {name}={said}, not the "
                f"command line's {used}: {used} is used"
            )
    return problems


def _serve(
    settings: Settings,
    handoff_path: Path | None = None,
    handoff: Checkpoint | None = None,
    problems: list[str] | None = None,
    rebuilt_pipes: dict[int, int] | None = None,
) -> int:
    _raise_descriptor_limit()
    import trio  # only a serving daemon needs it: --check stays quick for reloads

    from .lifecycle._serve import serve
    from .lifecycle._store_wait import WaitStopped
    from .serving._listener import SocketInUse

    try:
        trio.run(serve, settings, handoff_path, handoff, problems or [], rebuilt_pipes)
    except WaitStopped:
        return 0  # told to stop before it served: the socket and the lock given back
    except (StateDirLocked, SocketInUse, PermissionError, StoreUnusable) as exc:
        print(f"subagentd: {exc}", file=sys.stderr)
        return 1
    return 0


#: What the daemon raises its hard RLIMIT_NOFILE to where it may: 3 descriptors a live
#: worker, so ~170,000 of them (systemd's default hard limit for services).
DESCRIPTOR_LIMIT = 524288


def _raise_descriptor_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one: each live worker holds descriptors
    here (its pipes; its journal only while it is among those used last),
    so a login shell's soft 1024 would refuse spawns past about 380 live workers where
    the hard limit allows many more. Where the daemon may (CAP_SYS_RESOURCE), the hard
    one is raised first, to DESCRIPTOR_LIMIT (or the kernel's fs.nr_open, if lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open", "rb") as f:
            most = min(DESCRIPTOR_LIMIT, int(f.read()))
    except (OSError, ValueError):
        most = hard
    if hard < most:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
            return
        except (ValueError, OSError):  # not privileged: the hard limit stays as it is
            pass
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a hard limit above what setrlimit takes here
        log.warning("daemon.descriptor_limit", soft=soft, hard=hard, error=str(exc))


def _check_its_place(handoff: Checkpoint, path: Path) -> None:
    """A reload writes its checkpoint into the state dir it names: one that names
    another lies (a worker can write there between the write and the exec), and
    following it would take and write a state dir that is not this daemon's."""
    if handoff.settings is None:
        return
    named = handoff.settings.state_dir
    try:
        same = os.path.samefile(named, path.parent)
    except OSError:
        same = False
    if not same:
        raise CheckpointUnreadable(
            f"{path} names the state dir {named}, not the one it lies in ({path.parent})"
        )


def _its_socket(handoff: Checkpoint) -> Checkpoint:
    """The checkpoint with the socket path the listening socket it hands over was made
    for. A checkpoint rewritten in a worker's reach may name another file: serving it as
    ours would tell workers a wrong path and, at exit, unlink that file. The socket
    serves on either way; a path it cannot tell is kept, but never unlinked."""
    if handoff.settings is None or not handoff.listen_owned:
        return handoff  # activation: the service manager's file, never unlinked
    named = handoff.settings.socket
    try:
        bound = bound_for(handoff.listen_fd)
    except (OSError, ValueError):  # ValueError: a negative descriptor
        return handoff  # no socket there: serve() says so
    if bound == named:
        return handoff
    if bound is None:
        log.error("reload.socket_unverified", socket=str(named), then="never unlinked")
        return msgspec.structs.replace(handoff, listen_owned=False)
    log.error("reload.socket_misnamed", named=str(named), bound_for=str(bound), then="serving it")
    settings = msgspec.structs.replace(handoff.settings, socket=bound)
    return msgspec.structs.replace(handoff, settings=settings)


def _settings(args: argparse.Namespace) -> Settings:
    """The settings the command line and the environment give."""
    return Settings(
        socket=args.socket or default_socket_path(),
        state_dir=args.state_dir or default_state_dir(),
        config=args.config or default_config_path(),
        finished_ttl=args.finished_ttl,
        idle_exit=args.idle_exit,
        keep_archives_days=args.keep_archives,
        log_format=args.log_format,
        cgroups=args.cgroups,
        reload_interval=args.reload_interval,
        request_key_ttl=args.request_key_ttl,
        relay_above=args.relay_above,
        max_running=args.max_running,
        cgroup_v1_root=args.cgroup_v1_root,
    )


def check(settings: Settings) -> int:
    """What `subagentd --check` says: can this image serve with this config and state dir?"""
    problems = []
    try:
        # Everything the serving image imports, so a broken install fails here,
        # before a reload execs into it, not after.
        importlib.import_module("subagentd.daemon.lifecycle._serve")
    except Exception as exc:
        problems.append(f"the install does not import: {exc!r}")
    agents: dict[str, AgentDef] | None
    try:
        agents = load_agents(settings.config)
    except ConfigError as exc:
        problems.append(str(exc))
        agents = None
    try:
        ensure_private_dir(settings.state_dir)
    except OSError as exc:
        problems.append(f"state dir {settings.state_dir}: {exc}")
    if ("check", "hold") in read_faults(os.environ.get(FAULT_ENV, "")):
        with open(settings.state_dir / "hold-check", "rb") as fifo:  # until its writer closes
            fifo.read()
    print(f"subagentd {package_version()}")
    print(
        f"config: {settings.config} ({'unusable' if agents is None else f'{len(agents)} agents'})"
    )
    print(f"state dir: {settings.state_dir}")
    reads: tuple[int, ...] = READS_VERSIONS
    if ("check", "reads-before-4") in read_faults(os.environ.get(FAULT_ENV, "")):
        reads = tuple(v for v in reads if v < 4)  # as an image before the memfd says
    print(f"reads checkpoint versions: {', '.join(map(str, reads))}")
    print(f"reads store schema versions: {', '.join(map(str, STORE_READS_VERSIONS))}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0
