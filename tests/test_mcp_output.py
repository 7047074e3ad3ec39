"""What subagentd-mcp gives a model of a worker's output: bounded by `max_bytes` with the way
to read on, clean of the worker's terminal control sequences (the structured content keeps
them raw), and filtered by time and by stream; and what `subagent_status` says of a worker.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import trio
from mcp import ClientSession

from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .test_mcp import call, mcp_server, text_of

#: One line of the big worker's output, and how much of it it writes.
LINE = b"the quick brown fox jumps over the lazy dog 0123456789\n"
BIG = 10 * 1000 * 1000
#: What a model must never be handed: escape sequences, a bell, a carriage return, bidi.
HOSTILE_NAME = "\x1b[2J\x1b]0;pwned\x07evil\u202etxt"
HOSTILE_OUTPUT = "\x1b[31mred\x1b[0m \x1b]0;title\x07 \x1b[2J bell\x07 cr\r \u202eabc ERR\n"
FORBIDDEN = ("\x1b", "\x07", "\r", "\u202e")


async def texted(session: ClientSession, tool: str, **arguments: Any) -> tuple[str, dict[str, Any]]:
    """A tool's text and structured content (a tool error fails the test)."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return text_of(result), dict(result.structured_content)


def within(max_bytes: int, body: str, structured: dict[str, Any]) -> None:
    assert len(body.encode()) <= max_bytes, len(body.encode())
    assert len(json.dumps(structured, ensure_ascii=False).encode()) <= max_bytes


async def big_worker(session: ClientSession) -> str:
    script = f"yes '{LINE.decode().strip()}' | head -c {BIG}; echo ERROR at the end"
    worker = await call(session, "subagent_spawn", argv=sh(script))
    waited = await call(session, "subagent_wait", worker=worker["id"], timeout=40)
    assert waited["worker"]["state"] == "finished"
    return str(worker["id"])


def expected_output(length: int) -> bytes:
    return (LINE * (length // len(LINE) + 1))[:length]


async def test_a_10_mb_worker_is_read_in_bounded_pieces_with_the_way_on(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(90):
        async with mcp_server(daemon) as session:
            worker = await big_worker(session)
            # watch: the default bound, then on from the cursor it gives, losing nothing.
            read = b""
            cursor: dict[str, int] = {}
            for _ in range(3):
                body, page = await texted(session, "subagent_watch", worker=worker, **cursor)
                within(32 * 1024, body, page)
                assert page["truncated"]
                hint = f"call subagent_watch with cursor={page['next']}"
                if page["offset"]:
                    hint += f" and offset={page['offset']}"
                assert hint in body
                read += "".join(
                    e["data"] for e in page["entries"] if e["kind"] == "stdout"
                ).encode()
                cursor = {"cursor": page["next"], "offset": page["offset"]}
            assert len(read) > 3 * 16 * 1024
            assert read == expected_output(len(read))

            # A bound smaller than one entry: the entry is cut, and read on from its offset.
            read, next_cursor, offset = b"", 0, 0
            for _ in range(4):
                body, page = await texted(
                    session,
                    "subagent_watch",
                    worker=worker,
                    cursor=next_cursor,
                    offset=offset,
                    max_bytes=1024,
                    stream="stdout",
                )
                within(1024, body, page)
                assert page["truncated"]
                read += "".join(e["data"] for e in page["entries"]).encode()
                next_cursor, offset = page["next"], page["offset"]
            assert offset, "no entry was cut"
            assert read == expected_output(len(read))

            # The tail: its end, within the bound.
            body, tail = await texted(session, "subagent_watch", worker=worker, last=1000)
            within(32 * 1024, body, tail)
            assert tail["truncated"]
            assert "ERROR at the end" in body

            found_text, found = await texted(
                session, "subagent_grep", worker=worker, pattern="fox", limit=1000, after=100
            )
            within(32 * 1024, found_text, found)
            assert found["truncated"]
            assert "truncated at max_bytes" in found_text
            assert 0 < len(found["matches"]) < 1000

            collected_text, collected = await texted(
                session, "subagent_collect", worker=worker, max_bytes=2048
            )
            within(2048, collected_text, collected)
            assert collected["truncated"]
            assert "call subagent_collect again with a larger max_bytes" in collected_text


async def test_a_model_reads_no_control_sequence_a_worker_wrote(daemon: DaemonProcess) -> None:
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            script = f"printf '%s' '{HOSTILE_OUTPUT}'; printf '%s' '{HOSTILE_OUTPUT}' >&2"
            spawned, worker = await texted(
                session, "subagent_spawn", argv=sh(script), name=HOSTILE_NAME, ready="ERR"
            )
            texts = [spawned]
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            events, _ = await texted(session, "subagent_events", run=worker["run"], timeout=20)
            texts.append(events)
            calls: list[tuple[str, dict[str, Any]]] = [
                ("subagent_list", {"all": True}),
                ("subagent_status", {}),
                ("subagent_watch", {}),
                ("subagent_watch", {"last": 5}),
                ("subagent_grep", {"pattern": "ERR", "before": 1}),
                ("subagent_wait", {"pattern": "ERR"}),
                ("subagent_collect", {}),
            ]
            for tool, arguments in calls:
                if tool != "subagent_list":
                    arguments["worker"] = worker["id"]
                body, structured = await texted(session, tool, **arguments)
                texts.append(body)
                if tool == "subagent_watch" and "last" not in arguments:
                    raw = "".join(e["data"] for e in structured["entries"] if e["kind"] == "stdout")
                    assert raw == HOSTILE_OUTPUT, "the structured content keeps the raw output"
            for body in texts:
                for char in FORBIDDEN:
                    assert char not in body, (char, body)
            assert "red" in texts[4]
            assert "evil" in texts[2]
            assert worker["name"] == HOSTILE_NAME


async def test_watch_keeps_what_came_since_a_time_and_one_stream(daemon: DaemonProcess) -> None:
    gate = daemon.root / "gate"
    script = f"echo out1; echo err1 >&2; while [ ! -e {gate} ]; do sleep 0.02; done; "
    script += "echo out2; echo err2 >&2"
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=sh(script), ready="err1")
            async with AsyncClient(daemon.socket) as client:
                await wait_output(client, worker["id"], b"out1")
            between = time.time()
            gate.touch()
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)

            def data(page: dict[str, Any]) -> list[tuple[str, str]]:
                return [(e["kind"], e["data"]) for e in page["entries"] if e["kind"] != "state"]

            since = await call(session, "subagent_watch", worker=worker["id"], since=str(between))
            assert sorted(data(since)) == [("stderr", "err2\n"), ("stdout", "out2\n")]
            recent = await call(session, "subagent_watch", worker=worker["id"], since="10m")
            assert {"out1\n", "out2\n", "err1\n", "err2\n"} <= {d for _, d in data(recent)}
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(between + 3600))
            future = await call(session, "subagent_watch", worker=worker["id"], since=stamp)
            assert data(future) == []
            errors = await call(session, "subagent_watch", worker=worker["id"], stream="stderr")
            assert data(errors) == [("stderr", "err1\n"), ("stderr", "err2\n")]
            tail = await call(
                session, "subagent_watch", worker=worker["id"], last=5, stream="stdout"
            )
            assert data(tail) == [("stdout", "out1\n"), ("stdout", "out2\n")]
            grep = await call(
                session, "subagent_grep", worker=worker["id"], pattern="2", stream="stderr"
            )
            assert [(m["kind"], m["line"]) for m in grep["matches"]] == [("stderr", "err2")]


async def test_status_says_the_command_its_directory_and_how_long_it_has_run(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(
                session, "subagent_spawn", argv=["sleep", "60"], cwd=str(daemon.root)
            )
            body, status = await texted(session, "subagent_status", worker=worker["id"])
            assert "command: sleep 60" in body
            assert f"cwd: {daemon.root}" in body
            assert "uptime: " in body
            assert status["argv"] == ["sleep", "60"]
            assert status["cwd"] == str(daemon.root)
            assert 0 <= status["uptime"] < 30
            await call(session, "subagent_stop", worker=worker["id"])
            body, _ = await texted(session, "subagent_status", worker=worker["id"])
            assert "ran for: " in body


async def test_status_of_a_huge_command_is_cut_to_max_bytes(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            argv = ["sh", "-c", "sleep 60", *(f"argument-{i}" for i in range(5000))]
            worker = await call(session, "subagent_spawn", argv=argv)
            body, status = await texted(
                session, "subagent_status", worker=worker["id"], max_bytes=2048
            )
            within(2048, body, status)
            assert status["argv_cut"]
            assert status["argv"] == argv[: len(status["argv"])]
            assert len(status["argv"]) > 3
            assert "command: sh -c 'sleep 60' argument-0 " in body
            whole = await call(session, "subagent_status", worker=worker["id"], max_bytes=2**20)
            assert (whole["argv"], whole["argv_cut"]) == (argv, False)


async def test_a_tail_reads_back_from_the_end_as_far_as_its_lines_need(
    daemon: DaemonProcess,
) -> None:
    # In bursts of 50 lines a hundredth of a second apart, so the journal holds many entries
    # however the daemon's reads fall (on a busy machine, one read may take all it finds).
    script = (
        "echo early >&2; i=0; while [ $i -lt 3000 ]; do i=$((i+1)); echo line $i; "
        "[ $((i % 50)) -ne 0 ] || sleep 0.01; done"
    )
    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=sh(script))
            await call(session, "subagent_wait", worker=worker["id"], timeout=40)
            entries = (await call(session, "subagent_watch", worker=worker["id"]))["entries"]
            tail = await call(session, "subagent_watch", worker=worker["id"], last=3)
            assert (
                "".join(e["data"] for e in tail["entries"]) == "line 2998\nline 2999\nline 3000\n"
            )
            assert tail["complete"]
            # The one stderr line is far back from the end: read back until it is found.
            early = await call(
                session, "subagent_watch", worker=worker["id"], last=1, stream="stderr"
            )
            assert [e["data"] for e in early["entries"]] == ["early\n"]
            assert len(entries) > 40, "too few entries: the tail would read it all at once"


async def test_a_watch_since_a_time_goes_on_at_that_same_time(daemon: DaemonProcess) -> None:
    script = "i=0; while [ $i -lt 200 ]; do i=$((i+1)); echo line $i; done"
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=sh(script))
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            body, page = await texted(
                session, "subagent_watch", worker=worker["id"], since="10m", max_bytes=1024
            )
            assert page["truncated"]
            said = re.search(r"call subagent_watch with cursor=(\d+) and since=([0-9.]+)", body)
            assert said is not None, body
            assert int(said.group(1)) == page["next"]
            assert abs(float(said.group(2)) - (time.time() - 600)) < 30
            # Going on as it says reads on from there.
            more = await call(
                session,
                "subagent_watch",
                worker=worker["id"],
                cursor=page["next"],
                since=said.group(2),
                max_bytes=1024,
            )
            assert more["entries"][0]["seq"] == page["next"] + 1
