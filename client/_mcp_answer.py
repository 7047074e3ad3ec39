"""What a subagentd-mcp tool gives back, and the connection each call makes.

A tool answers an `Answer` (the text a model reads, the structured content) or raises
`Refusal` (or `_mcp_args.Invalid`, or lets a daemon's `SubagentdError` through), which the
server turns into a tool error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ._async import AsyncClient


class Refusal(Exception):
    """A refusal of this server's own (a wait that timed out, say): a tool error
    ``code: message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Answer:
    """A tool's success: the text a model reads, and the structured content."""

    text: str
    structured: dict[str, Any]


@contextlib.asynccontextmanager
async def connection() -> AsyncIterator[AsyncClient]:
    """A connection for one tool call (so a daemon down at start, or reloaded between
    calls, costs nothing); it reconnects across a reload in the call by itself."""
    async with AsyncClient() as daemon:
        yield daemon
