"""subagentd-mcp's answers stay within their bounds where the review found them open:
subagent_events within `max_bytes`, acknowledging only what it returns; a refusal's text
cleaned as every other text a model reads; a watch page that asks the daemon for about
what it keeps, its cursor exact; a restart that waits at most its `wait_timeout`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.client import _mcp_args as args
from subagentd.client._async import AsyncClient as ToolClient
from subagentd.client._mcp_reading import subagent_watch
from subagentd.protocol import MIN_ANSWER_BYTES, Page

from .conftest import DaemonProcess
from .helpers import sh
from .test_mcp import call, checked_call, mcp_server, refused, text_of

#: A result of 200 characters: the wake's preview is that long.
LONG_RESULT = "printf '%0200d' 0"


def answer_size(text: str, structured: Any) -> tuple[int, int]:
    return len(text.encode()), len(json.dumps(structured, ensure_ascii=False).encode())


async def test_subagent_events_answers_within_max_bytes_and_leaves_the_rest_pending(
    daemon: DaemonProcess,
) -> None:
    """A wake costs ~230 bytes of text and ~330 of structured content, so 40 of them do
    not fit in 4 KiB: each answer carries what fits, acknowledges only that, and says how
    many are left; calling again gets the rest, each wake once."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            first = await client.spawn(sh(LONG_RESULT))
            ids = [first.id]
            ids += [(await client.spawn(sh(LONG_RESULT), run=first.run)).id for _ in range(39)]
            for worker_id in ids:
                await client.wait(worker_id)
        seen: list[str] = []
        calls = 0
        async with mcp_server(daemon) as session:
            for _ in range(len(ids)):
                calls += 1
                result = await checked_call(
                    session, "subagent_events", {"run": first.run, "max_bytes": 4096}
                )
                assert not result.is_error, text_of(result)
                got = dict(result.structured_content or {})
                text, data = answer_size(text_of(result), got)
                assert text <= 4096, text
                assert data <= 4096, data
                seen += [wake["id"] for wake in got["wakes"]]
                assert got["pending"] == len(ids) - len(seen), got["pending"]
                assert got["truncated"] == (got["pending"] > 0)
                if got["pending"]:
                    assert got["wakes"], "an answer cut short still carries a wake"
                    assert f"{got['pending']} more wakes pending" in text_of(result)
                    assert "call subagent_events again" in text_of(result)
                else:
                    break
            assert sorted(seen) == sorted(ids)  # every wake, none twice
            assert calls >= 3, "4 KiB holds ~12 of these wakes"
            # All acknowledged now: nothing is left for anyone.
            after = await call(session, "subagent_events", run=first.run)
            assert (after["wakes"], after["pending"]) == ([], 0)


async def test_subagent_events_by_default_stays_within_32_kib(daemon: DaemonProcess) -> None:
    """The review's case: 150 wakes with long previews, ~85 KB in all, answered in parts."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            first = await client.spawn(sh(LONG_RESULT))
            ids = [first.id]
            ids += [(await client.spawn(sh(LONG_RESULT), run=first.run)).id for _ in range(149)]
            for worker_id in ids:
                await client.wait(worker_id)
        async with mcp_server(daemon) as session:
            first_answer = await checked_call(session, "subagent_events", {"run": first.run})
            got = dict(first_answer.structured_content or {})
            text, data = answer_size(text_of(first_answer), got)
            assert text <= args.DEFAULT_MAX_BYTES
            assert data <= args.DEFAULT_MAX_BYTES
            assert 0 < len(got["wakes"]) < len(ids)
            assert got["pending"] == len(ids) - len(got["wakes"])
            second = await call(session, "subagent_events", run=first.run, max_bytes=1 << 20)
            assert (len(second["wakes"]), second["pending"]) == (got["pending"], 0)
            returned = [w["id"] for w in got["wakes"]] + [w["id"] for w in second["wakes"]]
            assert sorted(returned) == sorted(ids)


@pytest.mark.parametrize("max_bytes", [0, 1023, 1 << 40, -1, "32768", 1.5, None])
async def test_subagent_events_refuses_a_max_bytes_out_of_bounds(
    daemon: DaemonProcess, max_bytes: Any
) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["true"])
            await client.wait(worker.id)
        async with mcp_server(daemon) as session:
            error = await refused(session, "subagent_events", run=worker.run, max_bytes=max_bytes)
            assert error["code"] == "invalid"
            assert error["message"].startswith("max_bytes: "), error
            # Nothing was acknowledged by the refused call.
            kept = await call(session, "subagent_events", run=worker.run)
            assert [wake["id"] for wake in kept["wakes"]] == [worker.id]


async def test_a_refusal_quoting_a_workers_directory_reaches_the_model_clean(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The daemon's refusal of a resume quotes the worker's cwd; a directory named with an
    OSC title and a clear-screen reaches the model without them, `code: ` still first."""
    hostile = tmp_path / "d\x1b]0;owned\x07\x1b[2J\x9b"
    hostile.mkdir()
    program = hostile / "prog"
    program.write_text("#!/bin/sh\nexit 3\n")
    program.chmod(0o755)
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["./prog"], cwd=str(hostile))
            await client.wait(worker.id)
        program.unlink()
        async with mcp_server(daemon) as session:
            result = await session.call_tool("subagent_resume", {"worker": worker.id})
    said = text_of(result)
    assert result.is_error, said
    assert said.startswith(("refused: ", "spawn_failed: ", "invalid: ")), said
    assert "prog" in said, said  # the path is still named
    assert not any(ord(char) < 0x20 and char not in "\n\t" for char in said), repr(said)
    assert "\x9b" not in said, repr(said)


def entries_text(pages: list[dict[str, Any]]) -> str:
    return "".join(e["data"] for page in pages for e in page["entries"] if e["kind"] == "stdout")


async def test_a_watch_page_asks_the_daemon_for_about_what_it_keeps(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool's own call, in this process, against the real daemon: each page the
    daemon sends carries about `max_bytes` of output, not its default 2 MiB (a 2 MB
    worker read page by page moved ~100 times its size before)."""
    sent: list[int] = []
    reading = ToolClient.watch_page

    async def watch_page(self: ToolClient, *given: Any, **options: Any) -> Page:
        page = await reading(self, *given, **options)
        sent.append(sum(len(entry.data) for entry in page.entries))
        return page

    monkeypatch.setattr(ToolClient, "watch_page", watch_page)
    monkeypatch.setenv("SUBAGENTD_SOCKET", str(daemon.socket))
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("head -c 2000000 /dev/zero | tr '\\0' x"))
            await client.wait(worker.id)
        for max_bytes in (args.DEFAULT_MAX_BYTES, MIN_ANSWER_BYTES):
            sent.clear()
            answer = await subagent_watch(
                args.WatchArguments(worker=worker.id, max_bytes=max_bytes)
            )
            assert answer.structured["truncated"]
            assert 0 < max(sent) <= max_bytes, (max_bytes, sent)


async def test_small_watch_pages_give_back_every_byte_in_order(daemon: DaemonProcess) -> None:
    """Paged at the smallest bound through output of multi-byte characters, with each
    answer's `next` and `offset`: every character comes back once, none cut in two."""
    script = "for i in $(seq 1 400); do printf 'é€😀 %04d ' $i; done; printf 'end\\n'"
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(script))
            await client.wait(worker.id)
        expected = "".join(f"é€😀 {i:04d} " for i in range(1, 401)) + "end\n"
        async with mcp_server(daemon) as session:
            for stream in (None, "stdout"):
                pages: list[dict[str, Any]] = []
                cursor, offset = 0, 0
                for _ in range(200):
                    asked: dict[str, Any] = {"worker": worker.id, "cursor": cursor}
                    asked |= {"offset": offset} if offset else {}
                    asked |= {"stream": stream} if stream else {}
                    page = await call(session, "subagent_watch", max_bytes=1024, **asked)
                    pages.append(page)
                    assert "\ufffd" not in entries_text([page])
                    if page["complete"]:
                        break
                    assert (page["next"], page["offset"]) != (cursor, offset), "no progress"
                    cursor, offset = page["next"], page["offset"]
                assert pages[-1]["complete"]
                assert entries_text(pages) == expected


async def test_a_restart_waits_at_most_its_wait_timeout_and_a_second_call_finishes_it(
    daemon: DaemonProcess,
) -> None:
    """A worker that ignores TERM, with a grace of 4 s: a restart that may wait 0.5 s
    answers `timed_out` with the stop under way (posting progress meanwhile); called
    again, it waits on that same stop, not a new one, and starts the next attempt."""
    seen: list[tuple[float, float | None]] = []

    async def progressed(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total))

    stubborn = sh("trap '' TERM; echo up; exec sleep 120")
    with trio.fail_after(60):
        async with mcp_server(daemon, {"SUBAGENTD_MCP_PROGRESS_INTERVAL": "0.1"}) as session:
            worker = await call(
                session, "subagent_spawn", argv=stubborn, grace=4, ready="up", ready_timeout=20
            )
            started = trio.current_time()
            first = await session.call_tool(
                "subagent_restart",
                {"worker": worker["id"], "wait_timeout": 0.5},
                progress_callback=progressed,
            )
            assert trio.current_time() - started < 3.5  # well before the grace ran out
            said = text_of(first)
            assert first.is_error, said
            assert said.startswith(f"timed_out: worker {worker['id']} is still stopping"), said
            assert "call subagent_restart again" in said
            assert seen, "no progress while the restart waited"
            assert all(total == 0.5 for _, total in seen), seen
            status = await call(session, "subagent_status", worker=worker["id"])
            assert (status["state"], status["stopping"]) == ("running", True)
            second = await call(session, "subagent_restart", worker=worker["id"], wait_timeout=20)
            assert second["stopped"] == []  # the first call's stop, waited on
            fresh = second["worker"]
            assert (fresh["id"], fresh["attempt"], fresh["state"]) == (worker["id"], 2, "running")
            assert fresh["pid"] != worker["pid"]
            assert trio.current_time() - started >= 3.5  # the grace was served, then KILL
            await call(session, "subagent_stop", worker=worker["id"], wait=False)
