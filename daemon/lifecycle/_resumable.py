"""What a resume may take: resumable states, the frozen snapshot, the git branch.

A resume runs what the snapshot froze at spawn, never today's agents.toml. It
checks, and never changes, the git branch the worker started on: HEAD
elsewhere, or the branch gone, refuses the resume with what to do instead.
A worker can plant anything in its work tree's git files and its archive (a
symlink loop, a name too long, a NUL byte, a file it may not read): that
refuses the resume, saying why, and is never an internal error.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from subagentd.protocol.errors import Refused

from ..store._archive import RECORD_READ_LIMIT, SNAPSHOT_VERSION, Archive, Snapshot, decode_written
from ..store._files import NotRegularFile, read_regular

#: Bigger than any HEAD, .git file or commondir; a bigger one is no git file.
GIT_FILE_LIMIT = 4096
#: packed-refs of very large repositories; past this the branch is looked for no further.
PACKED_REFS_LIMIT = 64 * 1024 * 1024

#: What a path planted in git files or an archive may raise when looked up: a symlink
#: loop, a name too long, no permission (OSError), a NUL byte (ValueError).
UNREADABLE = (OSError, ValueError)

#: The states a resume carries on from; `finished` ended well and is left alone.
RESUMABLE = frozenset({"stopped", "failed", "timed_out", "interrupted", "stopped_by_reload"})


def read_snapshot(archive: Archive, worker_id: str) -> Snapshot:
    path = archive.file(Archive.SNAPSHOT)
    try:
        raw = archive.read(Archive.SNAPSHOT, RECORD_READ_LIMIT)
    except FileNotFoundError:
        raise Refused(
            f"worker {worker_id} cannot be resumed: its snapshot {path} is missing; start it afresh"
        ) from None
    except NotRegularFile:
        raise Refused(
            f"worker {worker_id} cannot be resumed: its snapshot {path} is not a regular file "
            "(the daemon does not follow a symlink or read a FIFO there); start it afresh"
        ) from None
    except UNREADABLE as exc:
        raise Refused(
            f"worker {worker_id} cannot be resumed: its snapshot {path} cannot be read "
            f"({_why(exc)}); start it afresh"
        ) from None
    try:
        snapshot = decode_written(raw, Snapshot)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise Refused(
            f"worker {worker_id} cannot be resumed: its snapshot no longer reads ({exc}); "
            "start it afresh"
        ) from exc
    if snapshot.version != SNAPSHOT_VERSION:
        raise Refused(
            f"worker {worker_id} cannot be resumed: snapshot version {snapshot.version} "
            f"is not {SNAPSHOT_VERSION}, which this daemon reads"
        )
    return snapshot


def _read_git_file(path: Path, limit: int = GIT_FILE_LIMIT) -> str:
    """A small file of a work tree's git dir, never blocking on a FIFO nor following a
    symlink (a worker may have planted one where a later spawn or resume looks)."""
    return read_regular(path, limit).decode(errors="replace")


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _git_dir(cwd: str) -> Path | None:
    """The git directory of the work tree holding `cwd`, if any (worktrees included).
    Raises what a planted path may (UNREADABLE)."""
    for folder in (Path(cwd), *Path(cwd).parents):
        dotgit = folder / ".git"
        if dotgit.is_dir():
            return dotgit
        if dotgit.is_file():  # a linked worktree: "gitdir: <path>"
            text = _read_git_file(dotgit).strip()
            if text.startswith("gitdir:"):
                target = Path(text.removeprefix("gitdir:").strip())
                return target if target.is_absolute() else folder / target
    return None


def _git_branch(cwd: str) -> str | None:
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return None
    head = _read_git_file(gitdir / "HEAD").strip()
    prefix = "ref: refs/heads/"
    return head.removeprefix(prefix) if head.startswith(prefix) else None


def git_branch(cwd: str) -> str | None:
    """The branch HEAD is on in `cwd`'s work tree; None outside one, when detached, or
    when its git files cannot be read."""
    try:
        return _git_branch(cwd)
    except UNREADABLE:
        return None


def _branch_exists(cwd: str, branch: str) -> bool:
    """Raises what a planted path may (UNREADABLE), but for a missing packed-refs."""
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return False
    common = gitdir
    if (gitdir / "commondir").is_file():  # a worktree's refs live in the main repository
        # Not resolved: the kernel follows its symlinks and `..` as git does, and a symlink
        # loop there is ELOOP (Path.resolve would raise RuntimeError).
        common = gitdir / _read_git_file(gitdir / "commondir").strip()
    if (common / "refs" / "heads" / branch).is_file():
        return True
    try:
        packed = _read_git_file(common / "packed-refs", PACKED_REFS_LIMIT)
    except FileNotFoundError:
        return False
    return any(line.endswith(f" refs/heads/{branch}") for line in packed.splitlines())


def check_branch(snapshot: Snapshot, worker_id: str) -> None:
    """Refuse unless HEAD is still on the branch the worker started on."""
    if snapshot.branch is None:
        return
    try:
        exists = _branch_exists(snapshot.cwd, snapshot.branch)
        now = _git_branch(snapshot.cwd) if exists else None
    except UNREADABLE as exc:
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} in {snapshot.cwd}, "
            f"whose git files cannot be read ({_why(exc)}); mend them to resume, or start "
            "afresh"
        ) from None
    if not exists:
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} in {snapshot.cwd}, "
            "which no longer exists; start afresh"
        )
    if now != snapshot.branch:
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} but HEAD in "
            f"{snapshot.cwd} is on {now or 'a detached commit'!r}; check out "
            f"{snapshot.branch!r} to resume (a resume never switches branches)"
        )
