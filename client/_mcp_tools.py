"""subagentd-mcp's tool table: what each tool is called, takes, answers and may wait for,
and which requests it sends (so that the tools a worker may never use are not offered
inside one). The tools themselves are in `_mcp_workers`, `_mcp_reading` and `_mcp_waiting`.
"""

from __future__ import annotations

import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mcp.types import ToolAnnotations

from subagentd.protocol import (
    Cancel,
    Collect,
    Grep,
    LatestResumable,
    ListWorkers,
    NewRun,
    Pause,
    Request,
    Resume,
    Send,
    Spawn,
    Status,
    Stop,
    StopRun,
    Subscribe,
    Unpause,
    Wait,
    WaitFor,
    Watch,
)

from . import _mcp_args as args
from . import _mcp_shapes as shapes
from ._mcp_answer import Answer
from ._mcp_reading import subagent_grep, subagent_watch
from ._mcp_waiting import subagent_collect, subagent_events, subagent_wait
from ._mcp_workers import (
    subagent_cancel,
    subagent_latest_resumable,
    subagent_list,
    subagent_new_run,
    subagent_pause,
    subagent_restart,
    subagent_resume,
    subagent_send,
    subagent_spawn,
    subagent_status,
    subagent_stop,
    subagent_stop_run,
    subagent_unpause,
)

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
STOPS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


@dataclass(frozen=True)
class Tool:
    """A tool as the server offers it."""

    run: Callable[[Any], Awaitable[Answer]]
    arguments: type[args.Arguments]
    output: type[shapes.Shape]
    hints: ToolAnnotations
    #: The requests it sends: offered inside a worker only if a worker may send each.
    requests: Sequence[type[Request[Any]]]
    #: It can wait (for an end, a line, a stop): progress goes to a host that asks.
    blocks: bool = False
    #: What it takes inside a worker, if less than `arguments` (what a worker may never
    #: ask for left out): offered there, and checked first there.
    worker_arguments: type[args.Arguments] | None = None

    @property
    def name(self) -> str:
        return self.run.__name__

    @property
    def description(self) -> str:
        return " ".join((self.run.__doc__ or "").split())

    @property
    def for_workers(self) -> bool:
        return all(request.for_workers for request in self.requests)

    def arguments_for(self, acting_as: str | None) -> type[args.Arguments]:
        """What it takes for whom this server acts (None: the user)."""
        if acting_as is not None and self.worker_arguments is not None:
            return self.worker_arguments
        return self.arguments


def _tool(
    run: Callable[[Any], Awaitable[Answer]],
    output: type[shapes.Shape],
    hints: ToolAnnotations,
    *requests: type[Request[Any]],
    blocks: bool = False,
    worker_arguments: type[args.Arguments] | None = None,
) -> Tool:
    arguments = cast("type[args.Arguments]", typing.get_type_hints(run)["a"])
    return Tool(run, arguments, output, hints, requests, blocks, worker_arguments)


TOOLS: tuple[Tool, ...] = (
    _tool(subagent_new_run, shapes.RunOut, CHANGES, NewRun),
    _tool(subagent_spawn, shapes.SpawnedOut, CHANGES, Spawn, WaitFor, Watch, blocks=True),
    _tool(subagent_restart, shapes.RestartedOut, STOPS, Stop, Wait, Resume, blocks=True),
    _tool(subagent_list, shapes.WorkersOut, READ_ONLY, ListWorkers),
    _tool(subagent_status, shapes.WorkerOut, READ_ONLY, Status),
    _tool(subagent_watch, shapes.PageOut, READ_ONLY, Watch),
    _tool(subagent_grep, shapes.GrepOut, READ_ONLY, Grep),
    _tool(subagent_wait, shapes.WaitOut, READ_ONLY, Wait, WaitFor, Status, blocks=True),
    _tool(subagent_send, shapes.SentOut, CHANGES, Send),
    _tool(subagent_stop, shapes.StoppedOut, STOPS, Stop, blocks=True),
    _tool(subagent_stop_run, shapes.StoppedOut, STOPS, StopRun, blocks=True),
    _tool(subagent_cancel, shapes.CancelledOut, STOPS, Cancel, blocks=True),
    _tool(
        subagent_pause,
        shapes.PausedOut,
        CHANGES,
        Pause,
        worker_arguments=args.WorkerPauseArguments,
    ),
    _tool(
        subagent_unpause,
        shapes.UnpausedOut,
        CHANGES,
        Unpause,
        worker_arguments=args.WorkerPauseArguments,
    ),
    _tool(subagent_collect, shapes.ResultOut, CHANGES, Collect, blocks=True),
    _tool(subagent_events, shapes.WakesOut, CHANGES, Subscribe, blocks=True),
    _tool(
        subagent_resume,
        shapes.ResumedListOut,
        CHANGES,
        Resume,
        worker_arguments=args.WorkerResumeArguments,
    ),
    _tool(subagent_latest_resumable, shapes.LatestOut, READ_ONLY, LatestResumable),
)
