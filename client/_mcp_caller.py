"""Whom subagentd-mcp acts for: the one place the server decides it is inside a worker.

Inside a worker the daemon answers every tool as that worker whatever this server
believes; this answer only shapes what is offered (the tools a worker may never use are
not listed), the instructions, and the default parent of `subagent_events`.
"""

from __future__ import annotations

import os

from . import _core


async def caller() -> str | None:
    """The worker this server acts as (its id; "" if its environment does not name it),
    or None when it acts for the user. Today: the worker whose token is in the
    environment, as every client of the daemon presents it."""
    if _core.token() is None:
        return None
    return os.environ.get("SUBAGENTD_WORKER_ID", "")
