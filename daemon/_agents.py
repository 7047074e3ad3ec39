"""Agent definitions from agents.toml, decoded into Structs so a bad file names its key.

A spawn of ``--agent NAME`` renders the agent's command template here; the
result is frozen into the worker's snapshot, so later edits of the file never
reach a worker already spawned.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec


class AgentDef(msgspec.Struct, forbid_unknown_fields=True):
    command: list[str]
    model: str = ""
    timeout: float = 0
    grace: float | None = None
    env: dict[str, str] = {}

    def render(self) -> list[str]:
        try:
            return [part.format(model=self.model) for part in self.command]
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"command template {self.command!r}: {exc!r}") from exc


class AgentsFile(msgspec.Struct, forbid_unknown_fields=True):
    agents: dict[str, AgentDef] = {}


class ConfigError(Exception):
    """agents.toml cannot be used; the message says where and why."""


def load_agents(path: Path) -> dict[str, AgentDef]:
    """The agents defined in `path`; none if the file does not exist."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
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
        if not agent.command:
            raise ConfigError(f"{path}: agents.{name}.command is empty")
        agent.render()
    return agents
