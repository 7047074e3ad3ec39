"""subagentd-mcp's results as a host that validates them sees them: every tool's success
and refusals, each result checked against the tool's output schema (`checked_call`, the
check the TypeScript SDK and the MCP Inspector make), refusals as `code: message` tool
errors; and the input schemas, which carry the daemon's bounds and no unknown property.

The same calls are made from the TypeScript SDK in tests/test_mcp_ts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.client._mcp_args import Invalid, checked
from subagentd.client._mcp_tools import TOOLS as TOOL_TABLE
from subagentd.protocol import (
    MAX_ARG_BYTES,
    MAX_ARGS,
    MAX_CONTEXT_LINES,
    MAX_GRACE,
    MAX_GREP_MATCHES,
    MAX_ID_LENGTH,
    MAX_INPUT_BYTES,
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
    MAX_PATH_LENGTH,
    MAX_PATTERN_LENGTH,
    MAX_SEND_BYTES,
    MAX_TIMEOUT,
)

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .test_mcp import TOOLS, call, checked_call, mcp_server, refused, text_of


@dataclass
class Workers:
    """Workers in each state a tool's success needs, made by the user's own client."""

    finished: str
    running: str
    failed: str
    resumable: str
    run: str


async def prepare(daemon: DaemonProcess) -> Workers:
    async with AsyncClient(daemon.socket) as client:
        finished = await client.spawn(sh("echo one; echo ERROR two; echo three"))
        run = finished.run
        running = await client.spawn(
            sh("echo up; while read line; do echo got $line; done"), run=run, stdin_open=True
        )
        failed = await client.spawn(sh("echo failing; exit 3"), run=run)
        resumable = await client.spawn(sh("echo again; exit 4"), run=run)
        for worker in (finished, failed, resumable):
            await client.wait(worker.id)
        await wait_output(client, running.id, b"up")
    return Workers(finished.id, running.id, failed.id, resumable.id, run)


def successes(w: Workers, cwd: str) -> list[tuple[str, dict[str, Any]]]:
    """A call of every tool that succeeds, in an order that keeps each one's world."""
    return [
        ("subagent_new_run", {"max_running": 2, "memory": "1G"}),
        ("subagent_spawn", {"argv": ["sh", "-c", "echo ready now"], "ready": "ready"}),
        ("subagent_list", {"all": True}),
        ("subagent_status", {"worker": w.finished}),
        ("subagent_watch", {"worker": w.finished}),
        ("subagent_watch", {"worker": w.finished, "last": 2, "stream": "stdout"}),
        ("subagent_grep", {"worker": w.finished, "pattern": "ERR", "before": 1}),
        ("subagent_wait", {"worker": w.finished, "timeout": 5}),
        ("subagent_wait", {"worker": w.running, "pattern": "never", "timeout": 0.1}),
        ("subagent_send", {"worker": w.running, "text": "x\n"}),
        ("subagent_collect", {"worker": w.finished}),
        ("subagent_events", {"run": w.run, "max_bytes": 1024}),
        ("subagent_events", {"run": w.run}),
        ("subagent_restart", {"worker": w.failed}),
        ("subagent_resume", {"worker": w.resumable}),
        ("subagent_pause", {"worker": w.running}),
        ("subagent_unpause", {"run": w.run}),
        ("subagent_stop", {"worker": w.running}),
        ("subagent_cancel", {"scope": f"worker:{w.failed}"}),
        ("subagent_stop_run", {"run": w.run}),
        ("subagent_latest_resumable", {"cwd": cwd}),
    ]


#: A refusal of every tool, with the code it must carry: the daemon's, this server's,
#: and the arguments' (unknown, wrong type, out of range, empty, huge).
REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("subagent_new_run", {"max_running": 0}, "invalid"),
    ("subagent_new_run", {"max_running": "4"}, "invalid"),
    ("subagent_new_run", {"outer": "r-nope"}, "not_found"),
    ("subagent_spawn", {}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "envv": {"A": "1"}}, "invalid"),
    ("subagent_spawn", {"argv": "true"}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "timeout": -1}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "timeout": 1e300}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "grace": MAX_GRACE * 2}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "key": "has space"}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "env": {"A": 1}}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "env": {"A=B": "1"}}, "invalid"),
    ("subagent_spawn", {"argv": ["tr\0ue"]}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "ready": "("}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "ready": "x", "ready_timeout": 1e9}, "invalid"),
    ("subagent_spawn", {"argv": ["true"], "run": "r-nope"}, "not_found"),
    ("subagent_restart", {"worker": "w-nope"}, "not_found"),
    ("subagent_restart", {"worker": "w-nope", "wait_timeout": -1}, "invalid"),
    ("subagent_restart", {"worker": "w-nope", "wait_timeout": 1e9}, "invalid"),
    ("subagent_list", {"bogus": True}, "invalid"),
    ("subagent_status", {"worker": "w-nope"}, "not_found"),
    ("subagent_status", {"worker": ""}, "invalid"),
    ("subagent_status", {"worker": "w" * (MAX_ID_LENGTH + 1)}, "invalid"),
    ("subagent_watch", {"worker": "w-nope"}, "not_found"),
    ("subagent_watch", {"worker": "w-nope", "since": "yesterday"}, "invalid"),
    ("subagent_watch", {"worker": "w-nope", "since": "nan"}, "invalid"),
    ("subagent_watch", {"worker": "w-nope", "stream": "stdin"}, "invalid"),
    ("subagent_watch", {"worker": "w-nope", "max_bytes": 10}, "invalid"),
    ("subagent_watch", {"worker": "w-nope", "cursor": 1, "last": 2}, "invalid"),
    ("subagent_grep", {"worker": "w-nope", "pattern": "a"}, "not_found"),
    ("subagent_grep", {"worker": "w-nope", "pattern": "a" * (MAX_PATTERN_LENGTH + 1)}, "invalid"),
    ("subagent_grep", {"worker": "w-nope", "pattern": ""}, "invalid"),
    ("subagent_wait", {"worker": "w-nope", "timeout": 1}, "not_found"),
    ("subagent_wait", {"worker": "w-nope", "timeout": "soon"}, "invalid"),
    ("subagent_send", {"worker": "w-nope", "text": "x"}, "not_found"),
    ("subagent_send", {"worker": "w-nope"}, "invalid"),
    ("subagent_stop", {"worker": "w-nope"}, "not_found"),
    ("subagent_stop_run", {"run": "r-nope"}, "not_found"),
    ("subagent_pause", {"worker": "w-nope"}, "not_found"),
    ("subagent_pause", {"run": "r-nope"}, "not_found"),
    ("subagent_pause", {}, "invalid"),
    ("subagent_pause", {"worker": "w-nope", "run": "r-nope"}, "invalid"),
    ("subagent_pause", {"worker": ""}, "invalid"),
    ("subagent_pause", {"worker": "w" * (MAX_ID_LENGTH + 1)}, "invalid"),
    ("subagent_pause", {"worker": 7}, "invalid"),
    ("subagent_unpause", {"worker": "w-nope"}, "not_found"),
    ("subagent_unpause", {}, "invalid"),
    ("subagent_cancel", {"scope": "everything"}, "invalid"),
    ("subagent_collect", {"worker": "w-nope"}, "not_found"),
    ("subagent_events", {"run": "r-nope", "worker": "w-nope"}, "invalid"),
    ("subagent_events", {"run": "r-nope", "max_bytes": 10}, "invalid"),
    ("subagent_events", {"run": "r-nope", "max_bytes": 1 << 40}, "invalid"),
    ("subagent_resume", {}, "invalid"),
    ("subagent_resume", {"worker": "w-nope"}, "not_found"),
    ("subagent_latest_resumable", {"cwd": "/nonexistent"}, "not_found"),
    ("subagent_nope", {}, "not_found"),
]


async def test_every_tool_answers_what_its_output_schema_admits(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        w = await prepare(daemon)
        async with mcp_server(daemon) as session:
            made = successes(w, str(daemon.root))
            assert {tool for tool, _ in made} == TOOLS
            for tool, arguments in made:
                await call(session, tool, **arguments)


async def test_every_refusal_is_a_tool_error_with_its_code(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            for tool, arguments, code in REFUSALS:
                error = await refused(session, tool, **arguments)
                assert error["code"] == code, (tool, arguments, error)
                assert "errors.pydantic.dev" not in error["message"]
                assert "Traceback" not in error["message"]
            # The server serves on, and refused calls left nothing behind.
            assert (await call(session, "subagent_list", all=True))["workers"] == []
    assert {tool for tool, _, _ in REFUSALS} >= TOOLS


async def test_nan_and_infinities_are_refused_as_invalid(daemon: DaemonProcess) -> None:
    # Over the wire: a client's JSON may carry them as null, which a wait's timeout refuses.
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            for value in (float("nan"), float("inf"), -float("inf")):
                for tool, arguments in [
                    ("subagent_wait", {"worker": "w", "timeout": value}),
                    ("subagent_collect", {"worker": "w", "wait": True, "timeout": value}),
                    ("subagent_events", {"run": "r", "timeout": value}),
                    ("subagent_spawn", {"argv": ["true"], "ready": "x", "ready_timeout": value}),
                ]:
                    error = await refused(session, tool, **arguments)
                    assert error["code"] == "invalid", (tool, value)
            assert (await call(session, "subagent_list", all=True))["workers"] == []


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf"), -1.0, 1e300, "5", True]
)
def test_every_number_argument_refuses_what_the_daemon_would(value: Any) -> None:
    # As the server gets them (Python's JSON parser takes NaN and Infinity too).
    seen = 0
    for tool in TOOL_TABLE:
        for name, info in tool.arguments.model_fields.items():
            if info.annotation not in (float, float | None):
                continue
            arguments = {"worker": "w", "run": "r", "text": "t", "scope": "all", "pattern": "p"}
            arguments = {k: v for k, v in arguments.items() if k in tool.arguments.model_fields}
            with pytest.raises(Invalid) as refused_as:
                checked(tool.arguments, arguments | {name: value})
            assert refused_as.value.field == name, (tool.name, name)
            seen += 1
    assert seen >= 8  # timeouts, grace, ready_timeout: every tool's


async def test_an_argument_error_names_the_field_and_why(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            unknown = await refused(session, "subagent_spawn", argv=["true"], envv={"A": "1"})
            assert unknown["message"] == "envv: not an argument of this tool"
            big = await refused(session, "subagent_wait", worker="w", timeout=1e12)
            assert big["message"] == "timeout: input should be less than or equal to 3600"
            missing = await refused(session, "subagent_send", worker="w")
            assert missing["message"] == "text: required"
            pattern = await refused(session, "subagent_spawn", argv=["true"], ready="(")
            assert pattern["message"].startswith("ready: missing )")
            # Refused before anything ran: no worker was started with the bad pattern.
            assert (await call(session, "subagent_list", all=True))["workers"] == []


async def test_an_unknown_argument_is_refused_and_env_reaches_the_worker(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(
                session,
                "subagent_spawn",
                argv=sh("echo value=$GREETING"),
                env={"GREETING": "hello there"},
                ready="^value=",
            )
            assert worker["ready"]["line"] == "value=hello there"


def _property(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """A property's schema, its null alternative set aside."""
    found: dict[str, Any] = schema["properties"][name]
    for alternative in found.get("anyOf", []):
        if alternative.get("type") != "null":
            return {**found, **alternative}
    return found


async def test_input_schemas_carry_the_daemons_bounds_and_forbid_the_rest(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
    for tool in tools.values():
        assert tool.input_schema.get("additionalProperties") is False, tool.name
    spawn = tools["subagent_spawn"].input_schema
    argv = _property(spawn, "argv")
    assert (argv["maxItems"], argv["items"]["maxLength"]) == (MAX_ARGS, MAX_ARG_BYTES)
    env = _property(spawn, "env")
    assert (env["maxProperties"], env["additionalProperties"]["maxLength"]) == (
        MAX_ARGS,
        MAX_ARG_BYTES,
    )
    assert _property(spawn, "input")["maxLength"] == MAX_INPUT_BYTES
    assert _property(spawn, "timeout")["maximum"] == MAX_TIMEOUT
    assert _property(spawn, "grace")["maximum"] == MAX_GRACE
    assert _property(spawn, "key")["maxLength"] == MAX_KEY_LENGTH
    assert _property(spawn, "name")["maxLength"] == MAX_NAME_LENGTH
    assert _property(spawn, "cwd")["maxLength"] == MAX_PATH_LENGTH
    assert _property(spawn, "ready")["maxLength"] == MAX_PATTERN_LENGTH
    grep = tools["subagent_grep"].input_schema
    assert _property(grep, "pattern")["maxLength"] == MAX_PATTERN_LENGTH
    assert _property(grep, "before")["maximum"] == MAX_CONTEXT_LINES
    assert _property(grep, "limit")["maximum"] == MAX_GREP_MATCHES
    assert _property(tools["subagent_send"].input_schema, "text")["maxLength"] == MAX_SEND_BYTES
    assert _property(tools["subagent_status"].input_schema, "worker")["maxLength"] == (
        MAX_ID_LENGTH
    )
    # Every wait's default fits in a host's 60 s, and its description says to keep it short.
    for name, field in [
        ("subagent_wait", "timeout"),
        ("subagent_collect", "timeout"),
        ("subagent_events", "timeout"),
        ("subagent_spawn", "ready_timeout"),
    ]:
        wait = _property(tools[name].input_schema, field)
        assert wait["default"] <= 50, name
        assert "call again" in wait["description"], name


def _defs(schema: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = schema["$defs"][name]
    return found


async def test_output_schemas_name_states_outcomes_kinds_and_timestamps(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
    status = tools["subagent_status"].output_schema
    assert status is not None
    assert "stopped" in status["properties"]["state"]["enum"]
    assert "seconds since the epoch, UTC" in status["properties"]["started_at"]["description"]
    wait = tools["subagent_wait"].output_schema
    assert wait is not None
    assert wait["properties"]["outcome"]["enum"] == ["matched", "ended", "timed_out"]
    watch = tools["subagent_watch"].output_schema
    assert watch is not None
    entry = _defs(watch, "EntryOut")
    assert set(entry["properties"]["kind"]["enum"]) == {
        "stdout",
        "stderr",
        "state",
        "note",
        "stdin",
    }
    assert "seconds since the epoch, UTC" in entry["properties"]["at"]["description"]
    grep = tools["subagent_grep"].output_schema
    assert grep is not None
    assert _defs(grep, "GrepMatchOut")["properties"]["kind"]["enum"] == ["stdout", "stderr"]


async def test_a_refusal_reads_as_the_daemon_said_it(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            result = await checked_call(session, "subagent_status", {"worker": "w-nope"})
            assert result.is_error
            assert result.structured_content is None
            assert text_of(result) == "not_found: no worker 'w-nope'"
