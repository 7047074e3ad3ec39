"""Agent definitions from agents.toml, decoded into Structs so a bad file names its key.

A spawn of ``--agent NAME`` renders the agent's command template here; the
result is frozen into the worker's snapshot, so later edits of the file never
reach a worker already spawned. The bounds are the spawn request's, so
``subagentd --check`` refuses what a spawn would (`command_problem` too).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from subagentd.protocol import (
    MAX_ARG_BYTES,
    MAX_EXEC_BYTES,
    Argv,
    Backoff,
    Env,
    Grace,
    LimitError,
    Limits,
    MaxRunning,
    Name,
    Retries,
    RetryOn,
    Timeout,
    parse_limits,
)

from ..store._archive import FrozenAgent
from ..store._files import NotRegularFile, read_regular

#: Bytes of a pointer in exec's argv and envp arrays, which count towards its limit.
_POINTER = 8
#: Bytes of one argument or variable without its NUL.
_ARG_MOST = MAX_ARG_BYTES - 1


class AgentDef(msgspec.Struct, forbid_unknown_fields=True):
    command: Argv
    model: Name = ""
    timeout: Timeout = 0
    grace: Grace | None = None
    env: Env = {}
    #: Its limits, as people write them ("2G", 1.5, 100): `limits()` reads them.
    memory: int | str | None = None
    cpus: float | str | None = None
    pids: int | str | None = None
    #: How many workers of this agent may run at once, across runs (more wait, queued).
    max_running: MaxRunning | None = None
    #: Its retry policy (`Spawn.retries`...), unless a spawn gives retries of its own.
    retries: Retries = 0
    backoff: Backoff = 1.0
    backoff_max: Backoff | None = None
    retry_on: RetryOn = []

    def limits(self) -> Limits | None:
        """Its limits (LimitError naming the key, for one that cannot be taken)."""
        return parse_limits(self.memory, self.cpus, self.pids)

    def render(self) -> list[str]:
        try:
            return [part.format(model=self.model) for part in self.command]
        except KeyError as exc:
            raise ConfigError(
                f"command: unknown placeholder {{{exc.args[0]}}}: only {{model}} is filled in "
                "(write {{ and }} for a literal brace)"
            ) from exc
        except (IndexError, ValueError) as exc:
            raise ConfigError(
                f"command: not a template: {exc} (only {{model}} is filled in; write {{{{ and "
                "}} for a literal brace)"
            ) from exc


class AgentsFile(msgspec.Struct, forbid_unknown_fields=True):
    agents: dict[str, AgentDef] = {}


#: agents.toml larger than this is refused: no sane agent list comes near it.
CONFIG_LIMIT = 4 * 1024 * 1024


class ConfigError(Exception):
    """agents.toml cannot be used; the message says where and why."""


def load_agents(path: Path) -> dict[str, AgentDef]:
    """The agents defined in `path`; none if the file does not exist."""
    try:
        # The user's own file, so a symlink to it is followed; but a FIFO or a
        # device there must not hang the daemon (or a reload's --check) at start.
        raw = read_regular(path, CONFIG_LIMIT + 1, follow=True)
    except FileNotFoundError:
        return {}
    except NotRegularFile:
        raise ConfigError(f"{path}: not a regular file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
    if len(raw) > CONFIG_LIMIT:
        raise ConfigError(f"{path}: larger than {CONFIG_LIMIT // 1024 // 1024} MiB")
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(document) - {"agents"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown top-level key {sorted(unknown)[0]!r}; expected [agents.NAME]"
        )
    tables = document.get("agents", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: agents must be a table of [agents.NAME] tables")
    agents: dict[str, AgentDef] = {}
    for name, table in tables.items():
        try:
            agents[name] = msgspec.convert(table, AgentDef)
        except msgspec.ValidationError as exc:
            # msgspec says "... - at `$.timeout`"; name the key as it stands in the file.
            message, _, where = str(exc).partition(" - at `$")
            key = f"agents.{name}{where.rstrip('`')}" if where else f"agents.{name}"
            raise ConfigError(f"{path}: {key}: {message}") from exc
    for name, agent in agents.items():
        try:
            argv = agent.render()
        except ConfigError as exc:
            raise ConfigError(f"{path}: agents.{name}.{exc}") from exc
        if problem := command_problem(argv, agent.env):
            raise ConfigError(f"{path}: agents.{name}: {problem}")
        try:
            agent.limits()
        except LimitError as exc:  # "memory: from 1M to ..." : its key, as in the file
            raise ConfigError(f"{path}: agents.{name}.{exc}") from exc
    return agents


def command_problem(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why exec would refuse to run `argv` with `env`, said for a person; None if it would not.

    Linux refuses a string over MAX_ARG_STRLEN, and strings plus pointers over
    a quarter of the stack limit; Python refuses a NUL inside one.
    """
    if not argv:
        return "the command is empty: give a program to run (argv) or an agent"
    if not argv[0]:
        return "the command's program (its first word) is empty"
    total = _POINTER * (len(argv) + len(env) + 2)
    for i, arg in enumerate(argv):
        size = len(os.fsencode(arg)) + 1
        if "\0" in arg:
            return f"argument {i} of the command holds a NUL byte, which exec cannot pass"
        if size > MAX_ARG_BYTES:
            return (
                f"argument {i} of the command is {size - 1} bytes; exec takes {_ARG_MOST} at most"
            )
        total += size
    for key, value in env.items():
        size = len(os.fsencode(key)) + len(os.fsencode(value)) + 2
        if not key or "=" in key or "\0" in key:
            return f"environment variable name {key!r} is empty or holds '=' or a NUL byte"
        if "\0" in value:
            return f"environment variable {key} holds a NUL byte, which exec cannot pass"
        if size > MAX_ARG_BYTES:
            return f"environment variable {key} is {size - 1} bytes; exec takes {_ARG_MOST} at most"
        total += size
    if total > MAX_EXEC_BYTES:
        return (
            f"the command and its environment take {total} bytes; exec takes at most "
            f"{MAX_EXEC_BYTES}: pass large data as input or in a file"
        )
    return None


def frozen_agent(agent: AgentDef) -> FrozenAgent:
    return FrozenAgent(
        command=list(agent.command),
        model=agent.model,
        timeout=agent.timeout,
        grace=agent.grace,
        env=dict(agent.env),
    )
