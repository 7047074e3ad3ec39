"""subagentd-mcp end to end: the MCP SDK's own client starts the server as a host would
(a subprocess over stdio) against a real daemon, and calls its tools.

The SDK runs on anyio, which runs on trio here (pytest-trio's loop), so the client
session lives in the test's own task and every call is bounded by trio.fail_after. Every
call here checks its result as validating hosts do (`checked_call`); the other
tests/test_mcp_*.py files import these helpers.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs needed for one call
import pytest
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

from subagentd.client import AsyncClient

from .conftest import BIN, DaemonProcess
from .helpers import alive, sh, wait_output

TOOLS = {
    "subagent_new_run",
    "subagent_spawn",
    "subagent_restart",
    "subagent_list",
    "subagent_status",
    "subagent_watch",
    "subagent_grep",
    "subagent_wait",
    "subagent_send",
    "subagent_stop",
    "subagent_stop_run",
    "subagent_cancel",
    "subagent_pause",
    "subagent_unpause",
    "subagent_collect",
    "subagent_events",
    "subagent_resume",
    "subagent_latest_resumable",
}


@contextlib.asynccontextmanager
async def mcp_server(
    daemon: DaemonProcess, env: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    """subagentd-mcp started by the SDK's stdio client, as an MCP host starts it, with the
    environment of a client of `daemon` (and `env` over it); the session initialized."""
    params = StdioServerParameters(
        command=str(BIN / "subagentd-mcp"), env=daemon.env | (env or {}), cwd=daemon.root
    )
    # The server's stderr (the SDK's logging), kept for a failing test to show.
    with open(daemon.root / "mcp.log", "a") as errlog:  # noqa: ASYNC230  opened once, tiny
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def checked_call(
    session: ClientSession, tool: str, arguments: dict[str, Any], **options: Any
) -> CallToolResult:
    """Call `tool` and check its result as a host that validates results does (the
    TypeScript SDK, the MCP Inspector): a success's structured content against the tool's
    output schema, and a refusal's too if it carries any."""
    result: CallToolResult = await session.call_tool(tool, arguments, **options)
    schemas = {listed.name: listed.output_schema for listed in (await session.list_tools()).tools}
    schema = schemas.get(tool)
    if schema is not None and (result.structured_content is not None or not result.is_error):
        assert result.structured_content is not None, f"{tool}: no structured content"
        jsonschema.validate(result.structured_content, schema, jsonschema.Draft202012Validator)
    return result


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """Call `tool` and answer its structured result; a tool error fails the test."""
    result = await checked_call(session, tool, arguments)
    assert not result.is_error, f"{tool}: {text_of(result)}"
    assert result.structured_content is not None
    return dict(result.structured_content)


async def refused(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """Call `tool`, which must answer a tool error `code: message` with no structured
    content; its code and message."""
    result = await checked_call(session, tool, arguments)
    assert result.is_error, f"{tool} was not refused: {text_of(result)}"
    assert result.structured_content is None, result.structured_content
    code, colon, message = text_of(result).partition(": ")
    assert colon, text_of(result)
    assert re.fullmatch("[a-z_]+", code), text_of(result)
    return {"code": code, "message": message}


def text_of(result: CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


async def test_lists_every_tool_with_a_schema_and_a_description(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            tools = (await session.list_tools()).tools
    assert {tool.name for tool in tools} == TOOLS
    for tool in tools:
        assert len(tool.description or "") > 40, tool.name
        assert tool.input_schema["type"] == "object", tool.name
        assert tool.output_schema is not None, tool.name
    by_name = {tool.name: tool for tool in tools}
    assert by_name["subagent_watch"].input_schema["required"] == ["worker"]
    assert by_name["subagent_wait"].input_schema["required"] == ["worker"]
    assert set(by_name["subagent_spawn"].input_schema["properties"]) >= {
        "argv", "agent", "name", "cwd", "input", "timeout", "stdin_open", "env", "grace",
        "key", "ready",
    }  # fmt: skip


async def test_spawn_watch_wait_and_collect_a_worker(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            script = "echo one; echo two; echo three; echo four; echo five >&2"
            worker = await call(session, "subagent_spawn", argv=sh(script), name="counter")
            assert (worker["name"], worker["state"]) == ("counter", "running")
            waited = await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            assert waited["outcome"] == "ended"
            assert waited["worker"]["state"] == "finished"

            page = await call(session, "subagent_watch", worker=worker["id"], cursor=0)
            output = "".join(e["data"] for e in page["entries"] if e["kind"] == "stdout")
            assert output == "one\ntwo\nthree\nfour\n"
            assert page["complete"]
            after = await call(session, "subagent_watch", worker=worker["id"], cursor=page["next"])
            assert (after["entries"], after["next"]) == ([], page["next"])

            # stdout and stderr are read apart: only stdout's order is sure.
            tail = await call(session, "subagent_watch", worker=worker["id"], last=3)
            assert "".join(e["data"] for e in tail["entries"]).count("\n") == 3
            tail_out = "".join(e["data"] for e in tail["entries"] if e["kind"] == "stdout")
            assert tail_out in ("three\nfour\n", "two\nthree\nfour\n")
            assert [e["data"] for e in tail["entries"] if e["kind"] == "stderr"] in (
                [],
                ["five\n"],
            )
            listed = await call(session, "subagent_list", all=True)
            assert [w["id"] for w in listed["workers"]] == [worker["id"]]

            result = await call(session, "subagent_collect", worker=worker["id"])
            assert result["state"] == "finished"
            assert result["result"].endswith("four\n")


async def test_stop_one_worker_of_two_leaves_the_other_running(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            first = await call(session, "subagent_spawn", argv=["sleep", "60"])
            second = await call(session, "subagent_spawn", argv=["sleep", "60"], run=first["run"])
            stopped = await call(session, "subagent_stop", worker=first["id"])
            assert stopped == {"stopped": [first["id"]], "already_stopping": []}
            assert (await call(session, "subagent_status", worker=first["id"]))["state"] == (
                "stopped"
            )
            still = await call(session, "subagent_status", worker=second["id"])
            assert still["state"] == "running"
            assert alive(still["pid"])
            assert (await refused(session, "subagent_collect", worker=second["id"]))["code"] == (
                "busy"
            )
            waited = await refused(
                session, "subagent_collect", worker=second["id"], wait=True, timeout=0.2
            )
            assert waited["code"] == "timed_out"
            stopped_run = await call(session, "subagent_stop_run", run=first["run"])
            assert stopped_run["stopped"] == [second["id"]]


async def test_events_returns_each_wake_once(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            quick = await call(session, "subagent_spawn", argv=sh("echo done; exit 4"))
            run = quick["run"]
            woken = await call(session, "subagent_events", run=run, timeout=20)
            assert [(w["id"], w["state"], w["exit_code"]) for w in woken["wakes"]] == [
                (quick["id"], "failed", 4)
            ]
            assert await call(session, "subagent_events", run=run) == {
                "wakes": [],
                "pending": 0,
                "truncated": False,
            }


async def test_an_unknown_id_is_a_tool_error_with_the_daemons_code(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            for tool in ("subagent_status", "subagent_watch", "subagent_collect", "subagent_stop"):
                error = await refused(session, tool, worker="w-nobody")
                assert error["code"] == "not_found", (tool, error)
                assert "w-nobody" in error["message"]
            assert (await refused(session, "subagent_stop_run", run="r-nobody"))["code"] == (
                "not_found"
            )
            # Bad arguments are the caller's to correct, and the server serves on.
            bad_wait = await refused(session, "subagent_wait", worker="w-nobody", timeout=1e12)
            assert bad_wait["code"] == "invalid"
            assert bad_wait["message"].startswith("timeout: ")
            assert (await refused(session, "subagent_spawn"))["code"] == "invalid"
            assert (await call(session, "subagent_list"))["workers"] == []


async def test_without_a_daemon_the_server_serves_says_so_and_finds_one_started_later(
    daemon_dirs: DaemonProcess,
) -> None:
    with trio.fail_after(40):
        async with mcp_server(daemon_dirs) as session:
            assert len((await session.list_tools()).tools) == len(TOOLS)
            error = await refused(session, "subagent_list")
            assert error["code"] == "daemon_unavailable"
            assert str(daemon_dirs.socket) in error["message"]
            await trio.to_thread.run_sync(daemon_dirs.start)
            assert (await call(session, "subagent_list"))["workers"] == []


def worker_environment(env_file: Path) -> dict[str, str]:
    """The SUBAGENTD_ variables a worker found in its environment (it wrote `env` there)."""
    pairs = (line.partition("=") for line in env_file.read_text().splitlines())
    return {key: value for key, _, value in pairs if key.startswith("SUBAGENTD_")}


async def test_inside_a_worker_the_tools_act_as_that_worker(daemon: DaemonProcess) -> None:
    env_file = daemon.root / "worker.env"
    with trio.fail_after(30):
        async with mcp_server(daemon) as user:
            me = await call(
                user, "subagent_spawn", argv=sh(f"env > {env_file}; echo ready; sleep 60")
            )
            sibling = await call(user, "subagent_spawn", argv=["sleep", "60"], run=me["run"])
            page = await call(user, "subagent_wait", worker=me["id"], timeout=0.2)
            assert page["outcome"] == "timed_out"
            async with AsyncClient(daemon.socket) as client:
                await wait_output(client, me["id"], b"ready")
            worker_env = worker_environment(env_file)
            assert worker_env["SUBAGENTD_WORKER_ID"] == me["id"]

            async with mcp_server(daemon, worker_env) as inside:
                # The run-level tools, always forbidden to a worker, are not offered at all.
                listed = {tool.name: tool for tool in (await inside.list_tools()).tools}
                assert set(listed) == TOOLS - {
                    "subagent_new_run",
                    "subagent_stop_run",
                    "subagent_latest_resumable",
                }
                # A worker may resume a worker, never a run: `run` is not offered, nor taken.
                resume = listed["subagent_resume"].input_schema
                assert set(resume["properties"]) == {"worker", "timeout"}
                assert resume["required"] == ["worker"]
                not_offered = await refused(
                    inside, "subagent_resume", worker=me["id"], run=me["run"]
                )
                assert not_offered == {
                    "code": "invalid",
                    "message": "run: not an argument of this tool",
                }
                users = {tool.name: tool for tool in (await user.list_tools()).tools}
                assert "run" in users["subagent_resume"].input_schema["properties"]
                # A worker may pause a worker of its subtree, never a run nor a sibling.
                for tool in ("subagent_pause", "subagent_unpause"):
                    schema = listed[tool].input_schema
                    assert (set(schema["properties"]), schema["required"]) == (
                        {"worker"},
                        ["worker"],
                    )
                    assert (await refused(inside, tool, worker=sibling["id"]))["code"] == (
                        "forbidden"
                    )
                    assert (await refused(inside, tool, run=me["run"]))["code"] == "invalid"
                hidden = await refused(inside, "subagent_stop_run", run=me["run"])
                assert hidden["code"] == "not_found"
                hidden = await refused(inside, "subagent_new_run", max_running=2)
                assert hidden["code"] == "not_found"
                error = await refused(inside, "subagent_stop", worker=sibling["id"])
                assert error["code"] == "forbidden"
                for tool, arguments in [
                    ("subagent_cancel", {"scope": "all"}),
                    ("subagent_status", {"worker": sibling["id"]}),
                ]:
                    assert (await refused(inside, tool, **arguments))["code"] == "forbidden"
                child = await call(inside, "subagent_spawn", argv=["true"])
                assert child["parent"] == me["id"]
                seen = await call(inside, "subagent_list", all=True)
                assert sibling["id"] not in {w["id"] for w in seen["workers"]}
                # Its own children's wakes, by default.
                woken = await call(inside, "subagent_events", timeout=20)
                assert [w["id"] for w in woken["wakes"]] == [child["id"]]

            assert (await call(user, "subagent_status", worker=sibling["id"]))["state"] == (
                "running"
            )


def socket_count(pid: int) -> int:
    return sum(
        os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        for fd in os.listdir(f"/proc/{pid}/fd")
    )


def mcp_server_pid() -> int:
    """The subagentd-mcp this test started (the SDK's stdio client does not say)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"subagentd-mcp" in (
                cmdline
            ):
                return int(entry)
    raise AssertionError("no subagentd-mcp among this test's children")


@pytest.mark.parametrize(
    ("tool", "arguments", "expected"),
    [
        pytest.param(
            "subagent_wait", {"timeout": 30}, {"outcome": "ended", "line": None}, id="wait"
        ),
        pytest.param(
            "subagent_wait",
            {"timeout": 30, "pattern": "^rel"},
            {"outcome": "matched", "line": "released"},
            id="wait-for-pattern",
        ),
        pytest.param(
            "subagent_collect",
            {"wait": True},
            {"state": "finished", "result": "released\n"},
            id="collect",
        ),
    ],
)
async def test_a_tool_waiting_across_a_reload_answers(
    daemon: DaemonProcess, tool: str, arguments: dict[str, Any], expected: dict[str, Any]
) -> None:
    gate = daemon.root / "gate"
    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            worker = await call(
                session,
                "subagent_spawn",
                argv=sh(f"while [ ! -e {gate} ]; do sleep 0.02; done; echo released; sleep 0.3"),
            )
            server_pid = mcp_server_pid()
            idle_sockets = socket_count(server_pid)
            answers: list[dict[str, Any]] = []

            async def waiting() -> None:
                answers.append(await call(session, tool, worker=worker["id"], **arguments))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                # The tool's own connection to the daemon is open: its request is on the way.
                while socket_count(server_pid) == idle_sockets:  # noqa: ASYNC110  another process's
                    await trio.sleep(0.01)
                async with AsyncClient(daemon.socket) as other:
                    assert (await other.reload()).image_generation == 2
                gate.touch()
            [answer] = answers
            assert {key: answer[key] for key in expected} == expected
            # The same server, its next call on the reloaded daemon.
            info = await call(session, "subagent_status", worker=worker["id"])
            assert info["id"] == worker["id"]


async def test_grep_finds_lines_with_their_context(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            script = "for i in 1 2 3 4 5 6; do echo line $i; done; echo ERROR boom; echo after"
            worker = await call(session, "subagent_spawn", argv=sh(script))
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            found = await call(
                session, "subagent_grep", worker=worker["id"], pattern="ERR.R", before=1, after=1
            )
            assert found["truncated"] is False
            [match] = found["matches"]
            assert (match["line_no"], match["line"]) == (7, "ERROR boom")
            assert (match["before"], match["after"]) == (["line 6"], ["after"])
            assert (await refused(session, "subagent_grep", worker="w-x", pattern="a"))[
                "code"
            ] == "not_found"
            # Hostile patterns: one too long is the daemon's `invalid`; a catastrophic one
            # for a backtracking engine answers at once; the server serves on.
            huge = await refused(session, "subagent_grep", worker=worker["id"], pattern="a" * 5000)
            assert huge["code"] == "invalid"
            catastrophic = await call(
                session, "subagent_grep", worker=worker["id"], pattern="(l+)+$"
            )
            assert catastrophic["matches"] == []
            assert (await refused(session, "subagent_grep", worker=worker["id"], pattern="("))[
                "code"
            ] == "invalid"


async def test_wait_for_a_pattern_says_which_happened(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(
                session, "subagent_spawn", argv=sh("echo starting; echo ready on 8080; sleep 60")
            )
            matched = await call(
                session, "subagent_wait", worker=worker["id"], pattern=r"ready on \d+", timeout=20
            )
            assert (matched["outcome"], matched["line"]) == ("matched", "ready on 8080")
            assert matched["worker"]["state"] == "running"
            never = await call(
                session, "subagent_wait", worker=worker["id"], pattern="never", timeout=0.3
            )
            assert never["outcome"] == "timed_out"
            await call(session, "subagent_stop", worker=worker["id"])
            ended = await call(
                session, "subagent_wait", worker=worker["id"], pattern="never", timeout=20
            )
            assert ended["outcome"] == "ended"


async def test_send_writes_to_a_workers_stdin(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(
                session,
                "subagent_spawn",
                argv=sh("while read line; do echo got $line; done; echo bye"),
                stdin_open=True,
            )
            sent = await call(session, "subagent_send", worker=worker["id"], text="hello\n")
            assert sent == {"worker": worker["id"], "written": 6, "eof": False}
            await call(session, "subagent_send", worker=worker["id"], text="", eof=True)
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            result = await call(session, "subagent_collect", worker=worker["id"])
            assert result["result"] == "got hello\nbye\n"
            # Its stdin is closed now, and a worker spawned without stdin_open has none.
            closed = await refused(session, "subagent_send", worker=worker["id"], text="more\n")
            assert closed["code"] in ("refused", "invalid")
            assert (await refused(session, "subagent_send", worker="w-nobody", text="x"))[
                "code"
            ] == "not_found"
