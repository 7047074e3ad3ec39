"""Small things the end-to-end tests share: shell commands and process checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

from subagentd.client import AsyncClient


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie has already ended)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return raw[raw.rindex(b")") + 2 : raw.rindex(b")") + 3] not in (b"Z", b"X")


def pids_in(path: Path) -> list[int]:
    """The pids a worker wrote into `path`, one per line."""
    return [int(line) for line in path.read_text().split()]


async def wait_output(client: AsyncClient, worker_id: str, marker: bytes) -> bytes:
    """Follow the worker's journal until its stdout holds `marker`; the stdout so far."""
    seen = b""
    async with contextlib.aclosing(client.watch(worker_id, follow=True)) as entries:
        async for entry in entries:
            if entry.kind == "stdout":
                seen += entry.data
                if marker in seen:
                    return seen
    raise AssertionError(f"worker {worker_id} ended without printing {marker!r}: {seen!r}")
