"""What a resume may take: resumable states, the frozen snapshot, the git branch.

A resume runs what the snapshot froze at spawn, never today's agents.toml. It
checks, and never changes, the git branch the worker started on: HEAD
elsewhere, or the branch gone, refuses the resume with what to do instead.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from subagentd.protocol.errors import Refused

from ._archive import SNAPSHOT_VERSION, Archive, Snapshot, decode_written

#: The states a resume carries on from; `finished` ended well and is left alone.
RESUMABLE = frozenset({"stopped", "failed", "timed_out", "interrupted", "stopped_by_reload"})


def read_snapshot(archive: Archive, worker_id: str) -> Snapshot:
    path = archive.file(Archive.SNAPSHOT)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise Refused(
            f"worker {worker_id} cannot be resumed: its snapshot {path} is missing; start it afresh"
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


def git_dir(cwd: str) -> Path | None:
    """The git directory of the work tree holding `cwd`, if any (worktrees included)."""
    for folder in (Path(cwd), *Path(cwd).parents):
        dotgit = folder / ".git"
        if dotgit.is_dir():
            return dotgit
        if dotgit.is_file():  # a linked worktree: "gitdir: <path>"
            text = dotgit.read_text(errors="replace").strip()
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
        head = (gitdir / "HEAD").read_text().strip()
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
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    if (common / "refs" / "heads" / branch).is_file():
        return True
    try:
        packed = (common / "packed-refs").read_text()
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
