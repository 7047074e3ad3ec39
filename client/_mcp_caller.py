"""Whom subagentd-mcp acts for: the one place the server decides it is inside a worker.

Inside a worker the daemon answers every tool as that worker whatever this server
believes; this answer only shapes what is offered (the tools a worker may never use are
not listed), the instructions, and the default parent of `subagent_events`.

It is the daemon's own answer (`info().caller`): where workers have cgroups the kernel
says whose this server is, so a host that started it with none of the worker's
environment (no `SUBAGENTD_TOKEN`) still gets a worker's tools. Asked once and kept: a
process never leaves its worker's cgroup, nor its token its environment. While the daemon
cannot be asked, the environment's token stands in (a daemon's refusal would say the rest).
"""

from __future__ import annotations

import os

from subagentd.protocol.errors import SubagentdError

from . import _core
from ._async import AsyncClient

#: The daemon's answer once had: (the worker's id, or None for the user).
_told: list[str | None] = []


async def caller() -> str | None:
    """The worker this server acts as (its id; "" if only a token in the environment says
    so, not which), or None when it acts for the user."""
    if _told:
        return _told[0]
    try:
        async with AsyncClient() as daemon:
            info = await daemon.info()
    except SubagentdError:
        return _by_environment()
    if info.authority == "kernel" or info.caller is not None:
        _told.append(info.caller)
        return info.caller
    return _by_environment()  # a daemon that does not say whom a connection acts as


def _by_environment() -> str | None:
    if _core.token() is None:
        return None
    return os.environ.get("SUBAGENTD_WORKER_ID", "")
