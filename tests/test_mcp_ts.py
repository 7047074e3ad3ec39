"""subagentd-mcp as most MCP hosts drive it: the official TypeScript SDK (tests/mcp_ts/, pinned
by its package-lock.json, installed by `make test` with `npm ci`), configured exactly as the
README shows, which checks every result against the tool's output schema and throws when
one does not match. Every tool's success and refusals go through it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from .conftest import BIN, DaemonProcess
from .helpers import sh
from .test_mcp import TOOLS
from .test_mcp_results import REFUSALS, prepare, successes

HOST = Path(__file__).parent / "mcp_ts"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (HOST / "node_modules" / "@modelcontextprotocol").is_dir(),
    reason="the TypeScript SDK is not installed: `make test` installs it (npm ci, tests/mcp_ts)",
)


def readme_config(daemon: DaemonProcess, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The README's host configuration, for this daemon's socket."""
    return {
        "mcpServers": {
            "subagentd": {
                "command": str(BIN / "subagentd-mcp"),
                "args": [],
                "env": {"SUBAGENTD_SOCKET": str(daemon.socket)} | (env or {}),
            }
        }
    }


async def host(
    daemon: DaemonProcess, calls: list[dict[str, Any]], env: dict[str, str] | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """Run the TypeScript host over `calls`: the tools it was offered, and each call's line."""
    done = await trio.run_process(
        ["node", str(HOST / "host.mjs"), json.dumps(readme_config(daemon, env)), json.dumps(calls)],
        cwd=daemon.root,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    first, *lines = (json.loads(line) for line in done.stdout.decode().splitlines())
    return first["tools"], lines


def text_of(result: dict[str, Any]) -> str:
    return "".join(block["text"] for block in result["content"] if block["type"] == "text")


async def test_every_tool_succeeds_under_the_typescript_sdk(daemon: DaemonProcess) -> None:
    with trio.fail_after(90):
        w = await prepare(daemon)
        made = successes(w, str(daemon.root))
        tools, answers = await host(
            daemon, [{"tool": tool, "arguments": arguments} for tool, arguments in made]
        )
    assert set(tools) == TOOLS
    assert len(answers) == len(made)
    for (tool, _), answer in zip(made, answers, strict=True):
        assert "thrown" not in answer, answer
        assert answer["result"].get("isError") is not True, (tool, text_of(answer["result"]))
        assert "structuredContent" in answer["result"], tool


async def test_every_refusal_reaches_a_typescript_host_as_a_tool_error(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(90):
        _, answers = await host(
            daemon, [{"tool": tool, "arguments": arguments} for tool, arguments, _ in REFUSALS]
        )
    assert len(answers) == len(REFUSALS)
    for (tool, arguments, code), answer in zip(REFUSALS, answers, strict=True):
        # The SDK threw nothing (no -32602 "Structured content does not match"): the model
        # reads the refusal.
        assert "thrown" not in answer, (tool, arguments, answer)
        result = answer["result"]
        assert result["isError"] is True, (tool, arguments)
        assert text_of(result).startswith(f"{code}: "), (tool, arguments, text_of(result))
    assert any(text_of(a["result"]) == "not_found: no worker 'w-nope'" for a in answers)


async def test_a_typescript_host_sees_progress_while_a_tool_waits(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        calls = [
            {"tool": "subagent_spawn", "arguments": {"argv": sh("sleep 30")}},
        ]
        _, [spawned] = await host(daemon, calls)
        worker = spawned["result"]["structuredContent"]["id"]
        wait = {"worker": worker, "timeout": 1.5}
        _, [waited] = await host(
            daemon,
            [{"tool": "subagent_wait", "arguments": wait, "progress": True}],
            env={"SUBAGENTD_MCP_PROGRESS_INTERVAL": "0.2"},
        )
    assert waited["result"]["structuredContent"]["outcome"] == "timed_out"
    assert len(waited["progress"]) >= 3, waited["progress"]
    assert all(note["total"] == 1.5 for note in waited["progress"])
    progressed = [note["progress"] for note in waited["progress"]]
    assert progressed == sorted(progressed)


async def test_a_typescript_hosts_call_holding_a_lone_surrogate_is_answered_invalid(
    daemon: DaemonProcess,
) -> None:
    """A JavaScript string may hold a lone surrogate, and the SDK's JSON.stringify writes
    it as `\\ud800`: the call is answered as the tool's error, not left to time out."""
    with trio.fail_after(60):
        _, [answer] = await host(
            daemon,
            [{"tool": "subagent_grep", "arguments": {"worker": "w-nope", "pattern": "a\ud800"}}],
        )
    assert "thrown" not in answer, answer
    assert answer["result"]["isError"] is True
    assert text_of(answer["result"]).startswith("invalid: pattern: holds a lone surrogate")
