"""trio helpers the client and its stop switch share: a task run beside a block.

Owns no connection; the callers say what runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import trio


@contextlib.asynccontextmanager
async def running(task: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run `task` beside the body, and cancel it when the body is done.

    The body's own exception comes out as it went in: the nursery would wrap it
    in an ExceptionGroup, which a caller (of ``async with AsyncClient()``, of a
    switch's `move_on_stopped`) has no reason to expect from a task that never raises.
    """
    raised: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(task)
            try:
                yield
            except BaseException as exc:
                raised = exc
                raise
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _, rest = group.split(lambda exc: exc is raised or isinstance(exc, trio.Cancelled))
        if raised is None or rest is not None:
            raise
    if raised is not None:
        raise raised
