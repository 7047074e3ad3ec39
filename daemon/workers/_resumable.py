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

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from subagentd.protocol import WorkerView
from subagentd.protocol.errors import Refused

from ..store._archive import (
    RECORD_READ_LIMIT,
    SNAPSHOT_VERSION,
    Archive,
    Snapshot,
    decode_written,
)
from ..store._files import NotRegularFile
from ._agents import AgentDef
from ._git import UNREADABLE, branch_exists, branch_of, head_of, why

#: The states a resume carries on from; `finished` ended well and is left alone.
RESUMABLE = frozenset({"stopped", "failed", "timed_out", "interrupted", "stopped_by_reload"})

#: The fields of an agent's definition a resume compares with the frozen one.
AGENT_FIELDS = ("command", "model", "env", "timeout", "grace")


@dataclass(frozen=True)
class Resumption:
    """A worker resumed, and what changed on disk since its spawn ("" for nothing)."""

    view: WorkerView
    changed: str


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
            f"({why(exc)}); start it afresh"
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


def check_branch(snapshot: Snapshot, worker_id: str) -> None:
    """Refuse unless HEAD is still on the branch the worker started on."""
    if snapshot.branch is None:
        return
    try:
        exists = branch_exists(snapshot.cwd, snapshot.branch)
        now = branch_of(snapshot.cwd) if exists else None
    except UNREADABLE as exc:
        raise Refused(
            f"worker {worker_id} started on branch {snapshot.branch!r} in {snapshot.cwd}, "
            f"whose git files cannot be read ({why(exc)}); mend them to resume, or start "
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
        now = head_of(snapshot.cwd)
    except UNREADABLE as exc:
        return f"HEAD in {snapshot.cwd} cannot be read now ({why(exc)}); it was {snapshot.head}"
    if now == snapshot.head:
        return None
    return f"HEAD moved: {snapshot.head} -> {now or 'no commit'}"
