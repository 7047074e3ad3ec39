"""A work tree's branch and HEAD, read from its git files by the daemon itself (no git
process on a spawn's path), never followed into a FIFO or a symlink loop: a worker can
plant anything in its work tree's git files, and what it plants is said, never followed.
`git_state` freezes them in a spawn's snapshot; a resume checks them again.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..store._files import read_regular

#: Bigger than any HEAD, .git file or commondir; a bigger one is no git file.
GIT_FILE_LIMIT = 4096
#: packed-refs of very large repositories; past this the branch is looked for no further.
PACKED_REFS_LIMIT = 64 * 1024 * 1024

#: What a path planted in git files or an archive may raise when looked up: a symlink
#: loop, a name too long, no permission (OSError), a NUL byte (ValueError).
UNREADABLE = (OSError, ValueError)

#: What a commit id looks like (SHA-1 or SHA-256): nothing else read from git files is said.
COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _read_git_file(path: Path, limit: int = GIT_FILE_LIMIT) -> str:
    """A small file of a work tree's git dir, never blocking on a FIFO nor following a
    symlink (a worker may have planted one where a later spawn or resume looks)."""
    return read_regular(path, limit).decode(errors="replace")


def why(exc: Exception) -> str:
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


def branch_of(cwd: str) -> str | None:
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return None
    head = _read_git_file(gitdir / "HEAD").strip()
    prefix = "ref: refs/heads/"
    return head.removeprefix(prefix) if head.startswith(prefix) else None


def _common_dir(gitdir: Path) -> Path:
    """Where a work tree's refs live. Raises what a planted path may (UNREADABLE)."""
    if (gitdir / "commondir").is_file():  # a worktree's refs live in the main repository
        # Not resolved: the kernel follows its symlinks and `..` as git does, and a symlink
        # loop there is ELOOP (Path.resolve would raise RuntimeError).
        return gitdir / _read_git_file(gitdir / "commondir").strip()
    return gitdir


def _packed_refs(common: Path) -> list[str]:
    try:
        return _read_git_file(common / "packed-refs", PACKED_REFS_LIMIT).splitlines()
    except FileNotFoundError:
        return []


def branch_exists(cwd: str, branch: str) -> bool:
    """Raises what a planted path may (UNREADABLE), but for a missing packed-refs."""
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return False
    common = _common_dir(gitdir)
    if (common / "refs" / "heads" / branch).is_file():
        return True
    return any(line.endswith(f" refs/heads/{branch}") for line in _packed_refs(common))


def head_of(cwd: str) -> str | None:
    """The commit HEAD is at in `cwd`'s work tree: None outside one, or before the first
    commit. Only a commit id is taken from what is read (HEAD may name anything).
    Raises what a planted path may (UNREADABLE)."""
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return None
    return _commit_at(gitdir, _read_git_file(gitdir / "HEAD").strip())


def _commit_at(gitdir: Path, head: str) -> str | None:
    """The commit `head` (HEAD's text) names in `gitdir`. Raises as `head_of`."""
    if not head.startswith("ref:"):
        return head if COMMIT.fullmatch(head) else None  # detached
    ref = head.removeprefix("ref:").strip()
    if not ref.startswith("refs/") or ".." in ref.split("/"):
        return None  # no ref git would follow; and nothing outside the git dir is read
    common = _common_dir(gitdir)
    try:
        commit = _read_git_file(common / ref).strip()
    except FileNotFoundError:  # packed, or a branch yet to get its first commit
        packed = (line.split(" ", 1) for line in _packed_refs(common))
        commit = next((line[0] for line in packed if line[1:] == [ref]), "")
    return commit if COMMIT.fullmatch(commit) else None


def git_state(cwd: str) -> tuple[str | None, str | None]:
    """The branch HEAD is on and the commit it is at in `cwd`'s work tree, frozen in a
    spawn's snapshot; None for what cannot be told (outside one, detached, unreadable)."""
    # One walk up to the git dir and one read of HEAD for both: this is on a spawn's path.
    try:
        gitdir = _git_dir(cwd)
        if gitdir is None:
            return None, None
        head_text = _read_git_file(gitdir / "HEAD").strip()
    except UNREADABLE:
        return None, None
    prefix = "ref: refs/heads/"
    branch = head_text.removeprefix(prefix) if head_text.startswith(prefix) else None
    try:
        head = _commit_at(gitdir, head_text)
    except UNREADABLE:
        head = None
    return branch, head
