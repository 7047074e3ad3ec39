"""What a spawn request runs: its command (an agent's rendered from agents.toml), its
working directory (by its real path) and environment, checked for what exec would refuse
before anything is registered (a resume's frozen command is checked the same way). Pure
but for looking at the file system (the cwd, the program, the daemon's own bin directory)."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
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
    #: The daemon's environment less its private variables, plus env; the daemon's bin
    #: directory last on PATH (see `worker_environment`).
    worker_env: dict[str, str]
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
    tools: str | None = None,
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
    worker_env = worker_environment(inherited, env, tools)
    if problem := launch_problem(argv, cwd, worker_env):
        raise Invalid(problem)
    return Launch(argv, env, cwd, worker_env, timeout, grace, model, agent)


def launch_problem(argv: list[str], cwd: str, env: Mapping[str, str]) -> str | None:
    """Why `argv` could not start in `cwd` with `env` (None: it can): the directory gone,
    a command exec would refuse, a program not found. What a spawn is refused for before
    anything is registered, and a resume before an attempt is burnt."""
    if not os.path.isdir(cwd):
        return f"working directory {cwd!r} does not exist"
    if problem := command_problem(argv, env):
        return problem
    return _executable_problem(argv[0], cwd, env)


def worker_environment(
    inherited: Mapping[str, str], asked: Mapping[str, str], tools: str | None
) -> dict[str, str]:
    """A worker's environment (before the daemon's SUBAGENTD_ variables go in): the daemon's
    own less its private variables (`inherited`), with what the spawn asked for on top, and
    `tools`, the daemon's own bin directory, last on PATH unless PATH has it already.

    Last, so the worker's PATH wins every name (a venv's bin holds a `python` and a `pip`
    no worker should get instead of its own); a `subagentctl` found earlier on it is used
    instead of the daemon's, which speaks the same protocol or refuses the hello saying so.
    Without it, a daemon started from a venv not on PATH (`make run`) has workers that
    cannot find `subagentctl` to delegate with."""
    env = dict(inherited) | dict(asked)
    if tools is not None:
        path = env.get("PATH", os.defpath)  # unset: what exec searches then
        if tools not in path.split(os.pathsep):
            env["PATH"] = f"{path}{os.pathsep}{tools}" if path else tools
    return env


def own_bin_dir() -> str | None:
    """The directory holding the `subagentctl` of the install this daemon runs from: its
    interpreter's (a venv's or pipx's bin), else the scripts directory of its scheme, else
    the user scheme's (`pip install --user`); None if none holds one."""
    candidates = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    if f"{os.name}_user" in sysconfig.get_scheme_names():
        candidates.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    for folder in candidates:
        program = os.path.join(folder, "subagentctl")
        if folder and os.path.isfile(program) and os.access(program, os.X_OK):
            return folder
    return None


def real_dir(path: str) -> str:
    """A directory by its one real name (symlinks resolved; `.`, `..` and trailing slashes
    gone), as a spawn's cwd is kept and `latest_resumable` looks it up, so the two compare
    however each was spelled. Raises ValueError for a NUL byte."""
    return os.path.realpath(path)


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}


def _executable_problem(program: str, cwd: str, env: Mapping[str, str]) -> str | None:
    """Why `program` cannot be found, naming where it was looked for (None: it can)."""
    if "/" in program:
        path = os.path.join(cwd, program)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            return f"cannot execute {program!r}: {path} is not an executable file"
        return None
    search = env.get("PATH", os.defpath)
    if shutil.which(program, path=search) is None:
        return f"cannot execute {program!r}: not found on PATH ({search})"
    return None
