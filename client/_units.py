"""`subagentctl install-units`: the systemd user units, written for the install that runs it.

A unit names its daemon by absolute path, and where pip, pipx or a checkout's venv puts
`subagentd` differs; so the units are rendered here with this install's bin directory
(the one the running `subagentctl` came from) and written into systemd's user unit
directory. Rendering is pure (`render`); `plan` reads what is there, and nothing is
written unless every unit may be: a unit file that differs is replaced only with
`--force`, a symlink is replaced (never written through) only with `--force`, and
anything but a regular file or a symlink (a FIFO, a directory) is never touched.
Needs no daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import stat
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SERVICE = "subagentd.service"
SOCKET = "subagentd.socket"

#: The units as systemd reads them, but for the two paths `render` fills in.
_SERVICE_TEMPLATE = """\
# subagentd as a systemd user service, written by `subagentctl install-units` for the
# install in this directory (run it again, with --force, after moving that install):
#   {bin_dir}
#   start:   systemctl --user daemon-reload && systemctl --user enable --now subagentd.socket
#   reload:  systemctl --user reload subagentd   (re-exec in place; every worker kept)
# Local changes belong in a drop-in (`systemctl --user edit subagentd`), which a later
# install-units leaves alone; `--idle-exit S` there lets an idle socket-activated daemon exit.
[Unit]
Description=subagentd, the supervisor of agent subprocesses
# With subagentd.socket enabled the socket starts us on first connect.
Wants=subagentd.socket
After=subagentd.socket

[Service]
Type=notify
# READY=1, RELOADING=1 and STOPPING=1 come from the daemon's own pid only.
NotifyAccess=main
ExecStart={subagentd} --log-format json
# Returns only once the new image serves (or with the reason it refused).
ExecReload={subagentctl} reload
# SIGTERM to the daemon alone: it stops its workers' trees itself, within
# their grace periods, and exits; whatever is left after TimeoutStopSec is killed.
KillMode=mixed
TimeoutStopSec=60
Restart=on-failure
RestartSec=1
# A cgroup subtree of its own, so each worker can get a cgroup (and cgroup.kill).
Delegate=yes
# The worker processes are ours to supervise, never the OOM killer's first pick.
OOMPolicy=continue
# Each live worker holds 2 descriptors (its stdout and stderr pipes: in the daemon, or
# past --relay-above in an output relay, the daemon's child, which then holds them; its
# journal only while among the 256 used last): 524288, systemd's own hard limit for
# user services, holds ~260,000 live. The daemon and its relays raise their soft limit
# to this.
LimitNOFILE=524288

[Install]
WantedBy=default.target
"""

_SOCKET_TEMPLATE = """\
# Socket activation for subagentd, written by `subagentctl install-units`: the control
# socket exists before the daemon does, and the first connect starts it. It is where
# subagentd and subagentctl look by default ($XDG_RUNTIME_DIR/subagentd/subagentd.sock).
[Unit]
Description=subagentd control socket

[Socket]
ListenStream=%t/subagentd/subagentd.sock
SocketMode=0600
DirectoryMode=0700
Backlog=4096

[Install]
WantedBy=sockets.target
"""

#: What is printed for the user to run once the units are in place.
THEN = (
    "systemctl --user daemon-reload",
    "systemctl --user enable --now subagentd.socket   # socket-activated: starts on first use",
    "# or: systemctl --user enable --now subagentd.service",
)
#: A unit file larger than this is not one we wrote: it differs, unread.
_READ_LIMIT = 1024 * 1024

Action = Literal["write", "unchanged", "replace"]


class UnitsRefused(Exception):
    """The units cannot be written as asked; the message says which file and why."""


@dataclass(frozen=True)
class Planned:
    """What install-units will do with one unit file."""

    path: Path
    text: str
    action: Action


def exec_word(path: Path) -> str:
    """`path` as the program of a unit's command line: quoted (a space stays in the word)
    with systemd's specifiers escaped (`%h` is not the home directory here; `$` is not
    expanded in a program's name). systemd refuses a program whose name holds a quote, a
    backslash or a control character, so such a path is refused here, saying so."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnitsRefused(f"{text!r} is not UTF-8: systemd cannot name it") from None
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        raise UnitsRefused(f"{text!r} holds a control character: a unit file cannot name it")
    if any(char in text for char in "\"'\\"):
        raise UnitsRefused(
            f"{text!r} holds a quote or a backslash: systemd will not start a program named so"
        )
    return '"' + text.replace("%", "%%") + '"'


def render(bin_dir: Path) -> dict[str, str]:
    """The unit files (by name) that run the daemon in `bin_dir`, an absolute directory."""
    if not bin_dir.is_absolute():
        raise UnitsRefused(f"{bin_dir} is not an absolute path")
    exec_word(bin_dir)  # the comment names it too: refused here if no unit line can
    service = _SERVICE_TEMPLATE.format(
        bin_dir=os.fspath(bin_dir),
        subagentd=exec_word(bin_dir / "subagentd"),
        subagentctl=exec_word(bin_dir / "subagentctl"),
    )
    return {SERVICE: service, SOCKET: _SOCKET_TEMPLATE}


def this_install(argv0: str | None = None) -> Path:
    """The bin directory of the running install: where the `subagentctl` that runs came
    from (a venv's bin, ~/.local/bin, pipx's link), else this Python's scripts directory."""
    ran = os.path.abspath(sys.argv[0] if argv0 is None else argv0)
    for candidate in (Path(ran).parent, Path(sysconfig.get_path("scripts"))):
        if all(os.access(candidate / name, os.X_OK) for name in ("subagentd", "subagentctl")):
            return candidate
    raise UnitsRefused(
        f"found no subagentd and subagentctl next to {ran} or in "
        f"{sysconfig.get_path('scripts')}: run the subagentctl of the install the units "
        "should start"
    )


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where systemd --user looks first for a user's own units."""
    config = environ.get("XDG_CONFIG_HOME", "")
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "systemd" / "user"


def plan(directory: Path, units: Mapping[str, str], *, force: bool) -> list[Planned]:
    """What to do with each unit in `directory`; raises UnitsRefused, writing nothing, if
    any one may not be written."""
    planned = []
    for name, text in units.items():
        path = directory / name
        planned.append(Planned(path, text, _action(path, text, force=force)))
    return planned


def _action(path: Path, text: str, *, force: bool) -> Action:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return "write"
    except NotADirectoryError:
        raise UnitsRefused(f"{_not_a_directory(path.parent)} is not a directory") from None
    except OSError as exc:
        raise UnitsRefused(f"{path}: {exc.strerror}") from exc
    if stat.S_ISLNK(found.st_mode):
        if force:
            return "replace"  # by a rename: the link goes, what it points at is untouched
        raise UnitsRefused(
            f"{path} is a symlink (to {os.readlink(path)}): --force replaces the link with "
            "this install's unit, leaving its target as it is"
        )
    if not stat.S_ISREG(found.st_mode):
        raise UnitsRefused(
            f"{path} is {_kind(found.st_mode)}, not a unit file: remove it and run again"
        )
    if _reads(path) == text.encode():
        return "unchanged"
    if force:
        return "replace"
    raise UnitsRefused(
        f"{path} differs from the unit this install writes (edited, or another install's): "
        "--force replaces it; keep local changes in a drop-in (systemctl --user edit)"
    )


def _not_a_directory(directory: Path) -> Path:
    """The part of `directory` that is there but is not a directory (a file in the way)."""
    for part in (directory, *directory.parents):
        if os.path.lexists(part):
            return part
    return directory


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _reads(path: Path) -> bytes | None:
    """The regular file at `path`, up to the limit; None for one that is not (it changed
    under us) or larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UnitsRefused(f"{path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = file.read(_READ_LIMIT + 1)
    return None if len(data) > _READ_LIMIT else data


def write(planned: Sequence[Planned]) -> None:
    """Put each planned unit in place: a new file renamed over the old one, so a reader
    never sees half a unit and a symlink there is replaced, not followed."""
    for unit in planned:
        if unit.action == "unchanged":
            continue
        try:
            unit.path.parent.mkdir(parents=True, exist_ok=True)
            _replace(unit.path, unit.text)
        except OSError as exc:
            done = [str(u.path) for u in planned[: planned.index(unit)] if u.action != "unchanged"]
            also = f" (written before it: {', '.join(done)})" if done else ""
            where = exc.filename or unit.path
            raise UnitsRefused(f"cannot write {where}: {exc.strerror}{also}") from exc


def _replace(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(text.encode())
            file.flush()
            os.fsync(file.fileno())
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `install-units` with subagentctl's commands."""
    sub = commands.add_parser(
        "install-units",
        help="Write the systemd user units for this install and say how to enable them.",
        description="Write subagentd.service and subagentd.socket, with ExecStart naming this "
        "install's subagentd, into ~/.config/systemd/user (or --dir), and print what was "
        "written and the systemctl --user commands that enable them. Needs no daemon. A unit "
        "file there that differs (or a symlink) is replaced only with --force; a FIFO or a "
        "directory in its place never is. Exit 0 when both are in place, 1 when refused.",
    )
    sub.add_argument(
        "--dir",
        metavar="D",
        type=_directory,
        help="write them here (default: $XDG_CONFIG_HOME/systemd/user, else "
        "~/.config/systemd/user)",
    )
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace unit files (or symlinks) there that differ from this install's",
    )
    sub.set_defaults(command=install_units, parser=sub)


def _directory(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("give a directory (an empty one would be this one)")
    return Path(text)


def install_units(args: argparse.Namespace) -> int:
    """The command: render, plan, write, say what was done (as JSON with --json)."""
    as_json = bool(getattr(args, "json", False))
    try:
        bin_dir = this_install()
        directory = Path(os.path.abspath(args.dir)) if args.dir is not None else default_dir()
        planned = plan(directory, render(bin_dir), force=args.force)
        write(planned)
    except UnitsRefused as exc:
        if as_json:
            print(json.dumps({"error": {"code": "refused", "message": str(exc)}}))
        else:
            print(f"subagentctl: refused: {exc}", file=sys.stderr)
        return 1
    done = {"write": "wrote", "unchanged": "unchanged", "replace": "replaced"}
    if as_json:
        units = [{"path": str(u.path), "action": done[u.action]} for u in planned]
        print(json.dumps({"units": units, "bin_dir": str(bin_dir), "then": list(THEN)}))
        return 0
    for unit in planned:
        print(f"{done[unit.action]} {unit.path}")
    print(f"ExecStart: {bin_dir / 'subagentd'} --log-format json")
    if directory != default_dir():
        print(f"{directory} is not where systemd --user looks: link them there first:")
        print(f"  systemctl --user link {directory / SERVICE} {directory / SOCKET}")
    print("then:")
    for line in THEN:
        print(f"  {line}")
    return 0
