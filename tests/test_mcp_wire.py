"""subagentd-mcp over its stdio as raw JSON-RPC lines, as a host writes them: a request whose
JSON holds a lone surrogate (valid JSON, no text), which the MCP SDK's reader refuses and
its server would drop without a word, is answered `invalid` naming the field, and the
server serves on. The pure check (`_mcp_wire.checked`) by itself at the end."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import mcp_types
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from subagentd.client import AsyncClient
from subagentd.client._mcp_wire import DROPPED, INVALID_PARAMS, REFUSED_META, Refusal, checked

from .conftest import BIN, DaemonProcess
from .helpers import sh


class RawHost:
    """subagentd-mcp's stdin and stdout, one JSON-RPC message a line."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._read = bytearray()

    async def send(self, line: str) -> None:
        await self._stdin.send_all(line.encode() + b"\n")

    async def request(self, request_id: int, method: str, params: dict[str, Any]) -> None:
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        await self.send(json.dumps(message))

    async def receive(self) -> dict[str, Any]:
        """The next message the server writes (a notification, a log line, an answer)."""
        while b"\n" not in self._read:
            chunk = await self._stdout.receive_some()
            assert chunk, "subagentd-mcp closed its stdout"
            self._read += chunk
        line, _, rest = bytes(self._read).partition(b"\n")
        self._read[:] = rest
        message: dict[str, Any] = json.loads(line)
        return message

    async def answer(self) -> dict[str, Any]:
        """The next answer (notifications passed by)."""
        while "method" in (message := await self.receive()):
            pass
        return message

    async def answer_to(self, line: str) -> dict[str, Any]:
        """The answer to `line`, which the SDK alone would drop: bounded on its own, so a
        request dropped fails at once (its id: the line's, or null if that is no id)."""
        await self.send(line)
        with trio.fail_after(10):
            return await self.answer()


@pytest.fixture
async def host(daemon: DaemonProcess) -> AsyncIterator[RawHost]:
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(
            [str(BIN / "subagentd-mcp")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=daemon.env,
            cwd=daemon.root,
        )
        raw = RawHost(process)
        await raw.request(
            1,
            "initialize",
            {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "1"},
            },
        )
        assert (await raw.answer())["id"] == 1
        await raw.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
    try:
        yield raw
    finally:
        with trio.fail_after(10):
            assert process.stdin is not None
            await process.stdin.aclose()
            await process.wait()


def _tool_text(answer: dict[str, Any]) -> str:
    result = answer["result"]
    assert result["isError"] is True, answer
    [content] = result["content"]
    text: str = content["text"]
    return text


#: A tool call's line as a host writes it: JSON's own `\u` escapes (json.dumps), so a
#: lone surrogate goes as `\ud800`, as a JavaScript host's JSON.stringify writes it too.
def _call(request_id: int, name: str, arguments: Any, **params: Any) -> str:
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": name, "arguments": arguments, **params},
        }
    )


async def test_a_call_whose_json_holds_a_lone_surrogate_is_answered_invalid(
    host: RawHost, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo 'smile \U0001f600'"))
            await client.wait(worker.id)
        # Each answered, in order, each naming the field at fault; none dropped.
        hostile: list[tuple[str, str]] = [
            (_call(2, "subagent_grep", {"worker": worker.id, "pattern": "\ud800"}), "pattern"),
            (_call(3, "subagent_grep", {"worker": worker.id, "pattern": "a\udfffb"}), "pattern"),
            (
                _call(4, "subagent_spawn", {"command": ["true"], "env": {"A": "\udc00"}}),
                "env.A",
            ),
            (_call(5, "subagent_spawn", {"command": ["true", "\ud800"]}), "command.1"),
            (
                _call(6, "subagent_spawn", {"command": ["true"], "env": {"K\ud800": "v"}}),
                "env.K\\ud800",
            ),
            (
                _call(
                    7, "subagent_grep", {"worker": worker.id, "pattern": "x\ud800"}, _meta={"a": 1}
                ),
                "pattern",
            ),
        ]
        for line, field in hostile:
            answer = await host.answer_to(line)
            assert answer["id"] == json.loads(line)["id"], answer
            assert _tool_text(answer).startswith(f"invalid: {field}: holds a lone surrogate")

        # Outside a tool's arguments: a JSON-RPC error, for the id, or null if it is the id.
        error = await host.answer_to(_call(8, "subagent_gr\ud800", {}))
        assert (error["id"], error["error"]["code"]) == (8, INVALID_PARAMS)
        assert error["error"]["message"].startswith("invalid: params.name: holds a lone")
        unknown = await host.answer_to(
            json.dumps({"jsonrpc": "2.0", "id": "\ud800", "method": "ping"})
        )
        assert unknown["id"] is None
        assert unknown["error"]["message"].startswith("invalid: id: holds a lone surrogate")
        # A notification has no one to answer: dropped, and the server serves on.
        await host.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/\ud800"}))

        # A surrogate pair is a character like any other: the grep runs, and finds it.
        await host.send(_call(9, "subagent_grep", {"worker": worker.id, "pattern": "\U0001f600"}))
        found = await host.answer()
        assert found["id"] == 9
        assert not found["result"].get("isError"), found
        assert [m["line"] for m in found["result"]["structuredContent"]["matches"]] == [
            "smile \U0001f600"
        ]


ARGUMENT = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(st.characters(min_codepoint=0xD700, max_codepoint=0xE100), max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010)), inner)
    ),
    max_leaves=8,
)


@given(arguments=st.dictionaries(st.sampled_from(["pattern", "env", "x"]), ARGUMENT))
def test_a_tool_call_goes_to_the_sdk_as_text_saying_why_if_it_was_not(
    arguments: dict[str, Any],
) -> None:
    line = _call(2, "subagent_grep", arguments)
    # As JSON reads it: two surrogates side by side in a str are one character's pair.
    read_back = json.dumps(json.loads(json.dumps(arguments)), ensure_ascii=False)
    lone = any(0xD800 <= ord(c) <= 0xDFFF for c in read_back)
    found = checked(line)
    if not lone:
        assert found is None
        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return
    assert isinstance(found, str)
    read = mcp_types.jsonrpc_message_adapter.validate_json(found, by_name=False)  # the SDK's
    assert isinstance(read, mcp_types.JSONRPCRequest)
    assert read.id == 2
    assert read.params is not None
    assert "holds a lone surrogate" in read.params["_meta"][REFUSED_META]


def test_what_is_not_a_request_is_dropped_and_other_lines_go_on_as_they_came() -> None:
    for line in [
        '{"jsonrpc": "2.0", "method": "notifications/x", "params": {"a": "\\ud800"}}',
        '{"jsonrpc": "2.0", "id": 3, "result": {"a": "\\udfff"}}',
        '["\\ud800"]',
    ]:
        assert checked(line) is DROPPED
    for line in [
        '{"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"a": "\\\\ud800"}}',  # "\\"
        '{"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"a": "\\ud83d\\ude00"}}',
        '{"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"a": NaN, "b": "\\ud800',
        "not json \\ud800",
        "",
    ]:
        assert checked(line) is None, line
    assert checked('{"jsonrpc": "2.0", "id": [1], "method": "ping", "x": "\\ud800"}') == Refusal(
        None, -32600, "x", "holds a lone surrogate (\\ud800), which is not text"
    )
