"""What a spawn request runs: its command (an agent's rendered from agents.toml), its
working directory (by its real path) and environment, checked for what exec would refuse
before anything is registered. Pure but for looking at the file system (the cwd, the
program)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from subagentd.protocol import Spawn, op
from subagentd.protocol.errors import Invalid

from ._agents import AgentDef, command_problem

#: Variables of the daemon's own environment that no worker inherits: they
#: belong to the service manager's conversation with the daemon, not theirs.
_PRIVATE_ENV_PREFIXES = ("NOTIFY_SOCKET", "LISTEN_", "WATCHDOG_", "SUBAGENTD_")


@dataclass(frozen=True)
class Launch:
    """What a spawn request resolved to: the command, and where and how it runs."""

    argv: list[str]
    env: dict[str, str]  # what the spawn (and its agent) asked for
    cwd: str
    worker_env: dict[str, str]  # the daemon's environment, less its private variables, plus env
    timeout: float | None
    grace: float | None
    model: str | None
    agent: AgentDef | None = None  # its definition, as agents.toml had it


def resolve(
    request: Spawn,
    *,
    agents: Mapping[str, AgentDef],
    config_path: Path,
    config_error: str | None,
    inherited: Mapping[str, str],
) -> Launch:
    """What a spawn request runs, with its agent's definition rendered in."""
    agent: AgentDef | None = None
    if request.agent is None:
        argv, env = request.argv, dict(request.env)
        timeout, grace, model = request.timeout, request.grace, None
    else:
        if request.argv:
            raise Invalid(f"{op(Spawn)} takes argv or agent, not both")
        agent = agents.get(request.agent)
        if agent is None:
            known = ", ".join(sorted(agents)) or "none"
            why = f" ({config_error})" if config_error else ""
            raise Invalid(
                f"no agent {request.agent!r} in {config_path}{why}; agents defined: {known}"
            )
        argv, env, model = agent.render(), agent.env | request.env, agent.model
        timeout = request.timeout if request.timeout is not None else agent.timeout
        grace = request.grace if request.grace is not None else agent.grace
    cwd = request.cwd or os.getcwd()
    if not os.path.isdir(cwd):
        raise Invalid(f"working directory {cwd!r} does not exist")
    cwd = real_dir(cwd)
    worker_env = dict(inherited) | env
    if problem := command_problem(argv, worker_env):
        raise Invalid(problem)
    _check_executable(argv[0], cwd, worker_env)
    return Launch(argv, env, cwd, worker_env, timeout, grace, model, agent)


def real_dir(path: str) -> str:
    """A directory by its one real name (symlinks resolved; `.`, `..` and trailing slashes
    gone), as a spawn's cwd is kept and `latest_resumable` looks it up, so the two compare
    however each was spelled. Raises ValueError for a NUL byte."""
    return os.path.realpath(path)


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}


def _check_executable(program: str, cwd: str, env: Mapping[str, str]) -> None:
    """Refuse a spawn whose program cannot be found, naming where it was looked for."""
    if "/" in program:
        path = os.path.join(cwd, program)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            raise Invalid(f"cannot execute {program!r}: {path} is not an executable file")
        return
    search = env.get("PATH", os.defpath)
    if shutil.which(program, path=search) is None:
        raise Invalid(f"cannot execute {program!r}: not found on PATH ({search})")
