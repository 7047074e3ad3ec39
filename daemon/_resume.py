"""What a resume may take: resumable states, the frozen snapshot, the git branch.

A resume runs what the snapshot froze at spawn, never today's agents.toml. It
checks, and never changes, the git branch the worker started on: HEAD
elsewhere, or the branch gone, refuses the resume with what to do instead.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from subagentd.protocol.errors import Refused

from ._archive import RECORD_READ_LIMIT, SNAPSHOT_VERSION, Archive, Snapshot, decode_written
from ._files import NotRegularFile, read_regular

#: Bigger than any HEAD, .git file or commondir; a bigger one is no git file.
GIT_FILE_LIMIT = 4096
#: packed-refs of very large repositories; past this the branch is looked for no further.
PACKED_REFS_LIMIT = 64 * 1024 * 1024

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
    try:
        snapshot = decode_written(raw, Snapshot)
    except msgspec.DecodeError as exc:
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


def git_dir(cwd: str) -> Path | None:
    """The git directory of the work tree holding `cwd`, if any (worktrees included)."""
    for folder in (Path(cwd), *Path(cwd).parents):
        dotgit = folder / ".git"
        if dotgit.is_dir():
            return dotgit
        if dotgit.is_file():  # a linked worktree: "gitdir: <path>"
            try:
                text = _read_git_file(dotgit).strip()
            except OSError:
                return None
            if text.startswith("gitdir:"):
                target = Path(text.removeprefix("gitdir:").strip())
                return target if target.is_absolute() else folder / target
    return None


def git_branch(cwd: str) -> str | None:
    """The branch HEAD is on in `cwd`'s work tree; None outside one or when detached."""
    gitdir = git_dir(cwd)
    if gitdir is None:
        return None
    try:
        head = _read_git_file(gitdir / "HEAD").strip()
    except OSError:
        return None
    prefix = "ref: refs/heads/"
    return head.removeprefix(prefix) if head.startswith(prefix) else None


def branch_exists(cwd: str, branch: str) -> bool:
    gitdir = git_dir(cwd)
    if gitdir is None:
        return False
    common = gitdir
    if (gitdir / "commondir").is_file():  # a worktree's refs live in the main repository
        try:
            common = (gitdir / _read_git_file(gitdir / "commondir").strip()).resolve()
        except OSError:
            return False
    if (common / "refs" / "heads" / branch).is_file():
        return True
    try:
        packed = _read_git_file(common / "packed-refs", PACKED_REFS_LIMIT)
    except OSError:
        return False
    return any(line.endswith(f" refs/heads/{branch}") for line in packed.splitlines())


def check_branch(snapshot: Snapshot, worker_id: str) -> None:
    """Refuse unless HEAD is still on the branch the worker started on."""
    if snapshot.branch is None:
        return
    if not branch_exists(snapshot.cwd, snapshot.branch):
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} in {snapshot.cwd}, "
            "which no longer exists; start afresh"
        )
    now = git_branch(snapshot.cwd)
    if now != snapshot.branch:
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} but HEAD in "
            f"{snapshot.cwd} is on {now or 'a detached commit'!r}; check out "
            f"{snapshot.branch!r} to resume (a resume never switches branches)"
        )
