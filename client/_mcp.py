"""subagentd-mcp: the daemon's tools for an agent, served over MCP on stdio.

The server is the MCP SDK's low-level `Server`, so that this module decides what every
host sees: the input schemas (no unknown property, the daemon's bounds), a refusal as
``isError`` with the text ``code: message`` and no structured content (so no host's check
of a result against the tool's output schema trips on it), argument errors in the same
``invalid: <field>: <why>`` form, and progress notifications while a tool waits. The
tools are listed in `_mcp_tools`. Inside a worker every tool acts as that worker, as
any client there does; the tools a worker may never use are not offered. Needs the
`mcp` extra.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import anyio
import trio
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage
from mcp.types import (
    CallToolRequestParams,
    CallToolResult,
    ErrorData,
    JSONRPCError,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
)
from mcp.types import Tool as McpTool

from subagentd.protocol import package_version
from subagentd.protocol.errors import (
    ConnectionLost,
    DaemonUnavailable,
    ProtocolError,
    RemoteError,
    SubagentdError,
)

from . import _mcp_args as args
from . import _mcp_wire as wire
from ._mcp_answer import Answer, Refusal
from ._mcp_caller import caller
from ._mcp_shapes import output_schema
from ._mcp_tools import TOOLS, Tool
from ._text import printable_lines

#: Seconds between two progress notifications of a tool that waits (the environment
#: variable sets another: tests use a fraction of a second).
PROGRESS_INTERVAL = 5.0
PROGRESS_INTERVAL_VARIABLE = "SUBAGENTD_MCP_PROGRESS_INTERVAL"

_BY_NAME = {tool.name: tool for tool in TOOLS}


def progress_interval() -> float:
    """PROGRESS_INTERVAL, or the environment's (a positive number of seconds, at most 60)."""
    try:
        asked = float(os.environ.get(PROGRESS_INTERVAL_VARIABLE, PROGRESS_INTERVAL))
    except ValueError:
        return PROGRESS_INTERVAL
    return asked if math.isfinite(asked) and 0 < asked <= 60 else PROGRESS_INTERVAL


# -- results -------------------------------------------------------------------------------


def error_result(code: str, message: str) -> CallToolResult:
    """A tool error: ``code: message`` for the model, and no structured content, which no
    output schema then needs to admit. The one place every refusal passes, so the one
    place its text is cleaned: a daemon's message may quote a worker's own strings (a
    directory's name, a program's path), which reach the model without their control
    bytes, as on a terminal."""
    return CallToolResult(
        content=[TextContent(type="text", text=printable_lines(f"{code}: {message}"))],
        is_error=True,
    )


def _refused(exc: SubagentdError | Refusal | args.Invalid) -> CallToolResult:
    match exc:
        case args.Invalid():
            return error_result("invalid", str(exc))
        case Refusal():
            return error_result(exc.code, exc.message)
        case RemoteError():
            return error_result(str(exc.code), exc.message)
        case DaemonUnavailable():
            return error_result("daemon_unavailable", str(exc))
        case ConnectionLost():
            return error_result("connection_lost", str(exc))
        case ProtocolError():
            return error_result("protocol", str(exc))
        case _:
            return error_result("error", str(exc))


def _success(answer: Answer) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=answer.text)],
        structured_content=answer.structured,
    )


# -- the listing ---------------------------------------------------------------------------


def offered(tool: Tool, acting_as: str | None) -> bool:
    """Whether `tool` is listed: inside a worker, only those a worker may ever use."""
    return acting_as is None or tool.for_workers


def listing(acting_as: str | None) -> list[McpTool]:
    return [
        McpTool(
            name=tool.name,
            description=tool.description,
            input_schema=tool.arguments_for(acting_as).model_json_schema(),
            output_schema=output_schema(tool.output),
            annotations=tool.hints,
        )
        for tool in TOOLS
        if offered(tool, acting_as)
    ]


def instructions(acting_as: str | None) -> str:
    """What the host tells its model about this server: whom the tools act for."""
    if acting_as is not None:
        who = (
            f"These tools act as subagentd worker {acting_as or '(this worker)'}: what you "
            "spawn is its child, and you can see and stop only it and the workers it "
            "delegated to."
        )
    else:
        who = "These tools act for the user: every worker of the daemon is in reach."
    return (
        "subagentd supervises background worker processes (agents, builds, servers): "
        "spawn them, read and search their output, wait for a line or for the end, write to "
        "their stdin, stop a worker with its whole subtree, collect results. Waits are "
        "short (default 30 s): call again to wait longer. " + who
    )


# -- a call --------------------------------------------------------------------------------


async def call_tool(
    ctx: ServerRequestContext[Any, Any], params: CallToolRequestParams
) -> CallToolResult:
    """One tool call, answered: a refusal (the daemon's, this server's, or of the
    arguments) as a tool error; the server serves on whatever the call did."""
    refused = (ctx.meta or {}).get(wire.REFUSED_META)
    if isinstance(refused, str):  # arguments that are not text (see _mcp_wire)
        return error_result("invalid", refused)
    tool = _BY_NAME.get(params.name)
    acting_as = await caller()
    if tool is None or not offered(tool, acting_as):
        return error_result("not_found", f"no tool {params.name!r} here")
    try:
        given = dict(params.arguments or {})
        # Inside a worker, first as it is offered there: what it leaves out is refused.
        args.checked(tool.arguments_for(acting_as), given)
        arguments = args.checked(tool.arguments, given)
        if not tool.blocks or (ctx.meta or {}).get("progress_token") is None:
            return _success(await tool.run(arguments))
        return _success(await _posting_progress(ctx, tool, arguments))
    except (SubagentdError, Refusal, args.Invalid) as exc:
        return _refused(exc)
    except Exception as exc:
        # A fault of this server's: said to the model as what it is, the trace to the log.
        traceback.print_exc(file=sys.stderr)
        return error_result("internal", f"subagentd-mcp failed: {type(exc).__name__}: {exc}")


async def _posting_progress(
    ctx: ServerRequestContext[Any, Any], tool: Tool, arguments: args.Arguments
) -> Answer:
    """`tool` run, with a progress notification every few seconds until it answers: the
    seconds waited so far, out of the most it may wait."""
    total = arguments.waits()
    interval = progress_interval()
    answers: list[Answer] = []
    failures: list[Exception] = []

    async def run() -> None:
        try:
            answers.append(await tool.run(arguments))
        except Exception as exc:
            failures.append(exc)  # raised below as it is, not in a nursery's group
        finally:
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        started = trio.current_time()
        while True:
            await trio.sleep(interval)
            waited = trio.current_time() - started
            await ctx.session.report_progress(
                waited, total, f"{tool.name}: still waiting after {waited:.0f} s"
            )
    if failures:
        raise failures[0]
    [answer] = answers
    return answer


async def list_tools(
    ctx: ServerRequestContext[Any, Any], params: PaginatedRequestParams | None
) -> ListToolsResult:
    return ListToolsResult(tools=listing(await caller()))


def server(acting_as: str | None) -> Server[Any]:
    return Server(
        "subagentd",
        version=package_version(),
        instructions=instructions(acting_as),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve() -> None:
    """Serve MCP on stdin and stdout until the host closes them: stdin's lines read by
    `_mcp_wire` first, which answers those the SDK would drop."""
    mcp = server(await caller())
    with wire.claimed_stdin() as lines:
        stdin = wire.CheckedStdin(lines)
        async with stdio_server(stdin=stdin) as (read, write):
            stdin.answering(functools.partial(_answer_refused, write))
            await mcp.run(read, write, mcp.create_initialization_options())


async def _answer_refused(write: Any, refused: wire.Refusal) -> None:
    """A request `_mcp_wire` kept from the SDK, answered as a JSON-RPC error on the SDK's
    own stream out (so that no answer is written inside another)."""
    error = ErrorData(code=refused.code, message=f"invalid: {refused.field}: {refused.why}")
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await write.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=refused.id, error=error)))


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: serve MCP on stdin and stdout until the host closes them."""
    asked = list(sys.argv[1:] if argv is None else argv)
    if asked:
        helping = asked[0] in ("-h", "--help")
        print(
            "usage: subagentd-mcp  (no arguments: an MCP host runs it and speaks MCP on "
            "stdin/stdout; $SUBAGENTD_SOCKET picks the daemon)",
            file=sys.stdout if helping else sys.stderr,
        )
        return 0 if helping else 2
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(serve, backend="trio")
    return 0
