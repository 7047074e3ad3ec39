"""subagent_list within `max_bytes`: a listing cut short says how to go on, and following its
cursor lists every worker exactly once; its hostile arguments are refused naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import trio

from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .test_mcp import call, mcp_server, refused
from .test_mcp_output import texted, within


async def test_a_listing_cut_at_max_bytes_goes_on_from_its_cursor(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            first = await client.spawn(["sleep", "60"], name="w0")
            spawned = [first.id]
            for i in range(1, 30):
                worker = await client.spawn(["sleep", "60"], name=f"w{i}", run=first.run)
                spawned.append(worker.id)
        async with mcp_server(daemon) as session:
            whole = await call(session, "subagent_list")
            assert [w["id"] for w in whole["workers"]] == spawned
            assert (whole["next"], whole["truncated"]) == (None, False)
            listed: list[str] = []
            cursor: dict[str, Any] = {}
            calls = 0
            while calls < 100:
                calls += 1
                body, page = await texted(
                    session, "subagent_list", run=first.run, max_bytes=2048, **cursor
                )
                within(2048, body, page)
                listed += [w["id"] for w in page["workers"]]
                assert len(page["workers"]) < 30
                if page["next"] is None:
                    assert not page["truncated"]
                    break
                assert page["truncated"]
                said = re.search(
                    r'call subagent_list with the same arguments and cursor="(.+)"', body
                )
                assert said is not None, body
                assert said.group(1) == page["next"]
                cursor = {"cursor": page["next"]}
            assert listed == spawned
            assert calls > 3


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        pytest.param({"cursor": ""}, "cursor", id="cursor-empty"),
        pytest.param({"cursor": "x" * 5000}, "cursor", id="cursor-huge"),
        pytest.param({"cursor": 5}, "cursor", id="cursor-a-number"),
        pytest.param({"max_bytes": 10}, "max_bytes", id="max-bytes-tiny"),
        pytest.param({"max_bytes": 2**40}, "max_bytes", id="max-bytes-huge"),
        pytest.param({"max_bytes": 4096.5}, "max_bytes", id="max-bytes-not-whole"),
    ],
)
async def test_hostile_list_arguments_are_refused_naming_the_field(
    daemon: DaemonProcess, arguments: dict[str, Any], field: str
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            error = await refused(session, "subagent_list", **arguments)
            assert error["code"] == "invalid"
            assert error["message"].startswith(f"{field}: "), error


async def test_a_cursor_the_daemon_never_gave_and_a_worker_too_big_are_refused(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=["sleep", "60"], name="n" * 1000)
            forged = await refused(session, "subagent_list", cursor="not-a-cursor")
            assert forged["code"] == "invalid"
            assert "cursor" in forged["message"]
            alone = await refused(session, "subagent_list", max_bytes=1024)
            assert alone["code"] == "invalid"
            assert alone["message"].startswith(f"max_bytes: worker {worker['id']} alone takes")
