"""Limits as people write them: "64M", "2G", "1.5G", "512MiB" or bytes for memory, "1.5"
cores for CPU, a count for processes. One parser for every door a limit comes in by
(subagentctl's flags, agents.toml, the MCP tools), so each refuses what the wire would,
in the same words: `LimitError` names the field and says what it takes.

Suffixes are powers of 1024 (K, M, G, T, P, with or without "i" and "B"; "2G" is
2 GiB, as ulimit, docker and systemd read it). A value is checked against the wire's
bounds (`Limits`), so nan, inf, zero, a negative, one past the bound, a word or an empty
text never reaches the daemon.
"""

from __future__ import annotations

import math
import re

from ._messages import MAX_CPUS, MAX_MEMORY, MAX_PIDS, MIN_CPUS, MIN_MEMORY, Limits

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_MEMORY = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([kmgtp]?)(?:i?b)?", re.IGNORECASE)


class LimitError(ValueError):
    """A limit that cannot be taken; the message names the field and what it takes."""


def memory_bytes(value: object, field: str = "memory") -> int:
    """Bytes, from an int or a text such as "64M", "1.5G", "512MiB", "1048576"."""
    if isinstance(value, bool):
        raise LimitError(f"{field}: a size such as 512M or 2G, not {value!r}")
    if isinstance(value, int):
        amount = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise LimitError(f"{field}: a whole number of bytes or a size such as 2G, not {value}")
        amount = int(value)
    elif isinstance(value, str):
        found = _MEMORY.fullmatch(value.strip())
        if found is None:
            raise LimitError(
                f"{field}: a size such as 512M, 1.5G or 2GiB (or bytes), not {value!r}"
            )
        number, unit = found.groups()
        amount = math.floor(float(number) * _UNITS[unit.lower()])
    else:
        raise LimitError(f"{field}: a size such as 512M or 2G, not {value!r}")
    if not MIN_MEMORY <= amount <= MAX_MEMORY:
        raise LimitError(f"{field}: from 1M to 1P (2**50 bytes), not {value!r} ({amount} bytes)")
    return amount


def cores(value: object, field: str = "cpus") -> float:
    """Cores of CPU, from a number or a text such as "1.5"."""
    if isinstance(value, bool):
        raise LimitError(f"{field}: a number of cores such as 0.5 or 2, not {value!r}")
    if isinstance(value, str):
        try:
            amount = float(value.strip())
        except ValueError:
            raise LimitError(
                f"{field}: a number of cores such as 0.5 or 2, not {value!r}"
            ) from None
    elif isinstance(value, int | float):
        amount = float(value)
    else:
        raise LimitError(f"{field}: a number of cores such as 0.5 or 2, not {value!r}")
    if not MIN_CPUS <= amount <= MAX_CPUS:  # nan fails both
        raise LimitError(f"{field}: from {MIN_CPUS} to {MAX_CPUS:g} cores, not {value!r}")
    return amount


def process_count(value: object, field: str = "pids") -> int:
    """A count of processes, from an int or its digits."""
    if isinstance(value, bool):
        raise LimitError(f"{field}: a count of processes such as 100, not {value!r}")
    if isinstance(value, str) and value.strip().isdigit():
        amount = int(value.strip())
    elif isinstance(value, int):
        amount = value
    else:
        raise LimitError(f"{field}: a count of processes such as 100, not {value!r}")
    if not 1 <= amount <= MAX_PIDS:
        raise LimitError(f"{field}: from 1 to {MAX_PIDS}, not {value!r}")
    return amount


def parse_limits(
    memory: object = None, cpus: object = None, pids: object = None, *, where: str = ""
) -> Limits | None:
    """`Limits` from the forms above (None: a kind not asked); None if none is asked.
    `where` goes before each field's name in an error ("agents.toml [agents.x] ")."""
    limits = Limits(
        memory=None if memory is None else memory_bytes(memory, f"{where}memory"),
        cpus=None if cpus is None else cores(cpus, f"{where}cpus"),
        pids=None if pids is None else process_count(pids, f"{where}pids"),
    )
    return limits if limits else None


def memory_text(amount: int) -> str:
    """Bytes as the shortest exact form with a suffix ("64M", "1536M", "2G")."""
    for unit in "PTGMK":
        size = _UNITS[unit.lower()]
        if amount % size == 0:
            return f"{amount // size}{unit}"
    return str(amount)


def limits_text(limits: Limits | None) -> str:
    """A worker's limits in a line ("memory 64M, cpus 0.5, pids 20"); empty for none."""
    if not limits:
        return ""
    parts = []
    if limits.memory is not None:
        parts.append(f"memory {memory_text(limits.memory)}")
    if limits.cpus is not None:
        parts.append(f"cpus {limits.cpus:g}")
    if limits.pids is not None:
        parts.append(f"pids {limits.pids}")
    return ", ".join(parts)
