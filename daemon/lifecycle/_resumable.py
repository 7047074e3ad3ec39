"""What a resume may take: resumable states, the frozen snapshot, the git branch; and
what changed on disk since the spawn, which a resume says but does not follow.

A resume runs what the snapshot froze at spawn, never today's agents.toml. It
checks, and never changes, the git branch the worker started on: HEAD
elsewhere, or the branch gone, refuses the resume with what to do instead.
An agent's definition edited since, or HEAD moved on the same branch, does not
refuse it: the resume's answer names them (`changes_since_spawn`).
A worker can plant anything in its work tree's git files and its archive (a
symlink loop, a name too long, a NUL byte, a file it may not read, a FIFO):
that refuses the resume, or is said in what changed, and never freezes the
daemon nor is an internal error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import msgspec

from subagentd.protocol.errors import Refused

from ..store._archive import (
    RECORD_READ_LIMIT,
    SNAPSHOT_VERSION,
    Archive,
    FrozenAgent,
    Snapshot,
    decode_written,
)
from ..store._files import NotRegularFile, read_regular
from ..workers._agents import AgentDef

#: Bigger than any HEAD, .git file or commondir; a bigger one is no git file.
GIT_FILE_LIMIT = 4096
#: packed-refs of very large repositories; past this the branch is looked for no further.
PACKED_REFS_LIMIT = 64 * 1024 * 1024

#: What a path planted in git files or an archive may raise when looked up: a symlink
#: loop, a name too long, no permission (OSError), a NUL byte (ValueError).
UNREADABLE = (OSError, ValueError)

#: The states a resume carries on from; `finished` ended well and is left alone.
RESUMABLE = frozenset({"stopped", "failed", "timed_out", "interrupted", "stopped_by_reload"})

#: What a commit id looks like (SHA-1 or SHA-256): nothing else read from git files is said.
COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
#: The fields of an agent's definition a resume compares with the frozen one.
AGENT_FIELDS = ("command", "model", "env", "timeout", "grace")


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


def _branch_exists(cwd: str, branch: str) -> bool:
    """Raises what a planted path may (UNREADABLE), but for a missing packed-refs."""
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return False
    common = _common_dir(gitdir)
    if (common / "refs" / "heads" / branch).is_file():
        return True
    return any(line.endswith(f" refs/heads/{branch}") for line in _packed_refs(common))


def _git_head(cwd: str) -> str | None:
    """The commit HEAD is at in `cwd`'s work tree: None outside one, or before the first
    commit. Only a commit id is taken from what is read (HEAD may name anything).
    Raises what a planted path may (UNREADABLE)."""
    gitdir = _git_dir(cwd)
    if gitdir is None:
        return None
    return _commit_at(gitdir, _read_git_file(gitdir / "HEAD").strip())


def _commit_at(gitdir: Path, head: str) -> str | None:
    """The commit `head` (HEAD's text) names in `gitdir`. Raises as `_git_head`."""
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


def frozen_agent(agent: AgentDef) -> FrozenAgent:
    return FrozenAgent(
        command=list(agent.command),
        model=agent.model,
        timeout=agent.timeout,
        grace=agent.grace,
        env=dict(agent.env),
    )


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


def changes_since_spawn(
    snapshot: Snapshot, agents: Mapping[str, AgentDef] | None, config_error: str | None
) -> str:
    """What changed on disk since the worker's spawn, in one line ("" for nothing): its
    agent's definition in agents.toml as it reads now (`agents`; None with `config_error`
    when it does not load), and its work tree's HEAD. The resume runs the snapshot anyway."""
    changes = []
    if snapshot.agent is not None:
        changes += _agent_changes(snapshot, snapshot.agent, agents, config_error)
    if (moved := _head_change(snapshot)) is not None:
        changes.append(moved)
    return "; ".join(changes)


def _agent_changes(
    snapshot: Snapshot,
    name: str,
    agents: Mapping[str, AgentDef] | None,
    config_error: str | None,
) -> list[str]:
    if agents is None:
        return [f"agents.toml no longer loads ({config_error}): agent {name!r} not compared"]
    now = agents.get(name)
    if now is None:
        return [f"agent {name!r} is no longer in agents.toml"]
    frozen = snapshot.agent_def
    if frozen is None:
        # A snapshot from before the definition was frozen whole: only its rendered command
        # and its model tell the definition from the spawn's own env, timeout and grace.
        differ = [
            field
            for field, same in (("command", now.render() == snapshot.argv),
                                ("model", now.model == (snapshot.model or "")))
            if not same
        ]  # fmt: skip
    else:
        differ = [f for f in AGENT_FIELDS if getattr(now, f) != getattr(frozen, f)]
    if not differ:
        return []
    return [f"agent {name!r} in agents.toml now differs in {', '.join(differ)}"]


def _head_change(snapshot: Snapshot) -> str | None:
    """HEAD moved since the spawn (on the same branch: another one refuses the resume), or
    can no longer be read; None when it is where it was, or was not known at the spawn."""
    if snapshot.head is None:
        return None
    try:
        now = _git_head(snapshot.cwd)
    except UNREADABLE as exc:
        return f"HEAD in {snapshot.cwd} cannot be read now ({_why(exc)}); it was {snapshot.head}"
    if now == snapshot.head:
        return None
    return f"HEAD moved: {snapshot.head} -> {now or 'no commit'}"
