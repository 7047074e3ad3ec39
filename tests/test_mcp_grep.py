"""subagent_grep going on: the cursor it answers, followed call after call, gives every match
exactly once, whether the daemon cut the answer (its limit, its max_bytes) or the MCP
server did (its own max_bytes); and its filters by time and stream, done in the daemon, so
that `limit` counts only the matches they keep.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import trio
from mcp import ClientSession

from .conftest import DaemonProcess
from .helpers import sh
from .test_mcp import call, mcp_server, refused
from .test_mcp_output import LINE, texted, within

#: The 10 MB worker: LINE on every line but each MARK_EVERY-th, which says "MARK <n>".
LINES = 10 * 1000 * 1000 // len(LINE)
MARK_EVERY = 500
MARKS = list(range(MARK_EVERY, LINES + 1, MARK_EVERY))


async def marked_worker(session: ClientSession) -> str:
    filler = LINE.decode().strip()
    script = (
        f"awk 'BEGIN {{ for (i = 1; i <= {LINES}; i++) "
        f'if (i % {MARK_EVERY} == 0) print "MARK " i; else print "{filler}" }}\''
    )
    worker = await call(session, "subagent_spawn", argv=sh(script))
    waited = await call(session, "subagent_wait", worker=worker["id"], timeout=40)
    assert waited["worker"]["state"] == "finished"
    return str(worker["id"])


async def follow_cursors(
    session: ClientSession, max_bytes: int, start: int | None = None, **arguments: Any
) -> tuple[list[dict[str, Any]], int]:
    """Every match of `arguments` after line `start`, call after call as each answer's text
    says to go on; and how many calls that took. Checks each answer's bound and `next`."""
    matches: list[dict[str, Any]] = []
    cursor: dict[str, int] = {} if start is None else {"cursor": start}
    for calls in range(1, 1000):
        body, found = await texted(
            session, "subagent_grep", max_bytes=max_bytes, **arguments, **cursor
        )
        within(max_bytes, body, found)
        matches += found["matches"]
        if found["next"] is None:
            assert not found["truncated"]
            assert body.endswith("[no more matches]")
            return matches, calls
        assert found["truncated"]
        # The text says exactly what the structured content does.
        said = re.search(r"call subagent_grep with the same arguments and cursor=(\d+)", body)
        assert said is not None, body
        assert int(said.group(1)) == found["next"]
        cursor = {"cursor": found["next"]}
    raise AssertionError("the cursors never came to an end")


async def test_following_the_cursor_gives_every_match_of_a_10_mb_worker_once(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(240):
        async with mcp_server(daemon) as session:
            worker = await marked_worker(session)
            # Cut by the MCP server's max_bytes: ~6 matches with their context a call.
            # A match left out must come whole in the next answer, not be skipped.
            cut, calls = await follow_cursors(
                session, 8192, worker=worker, pattern="^MARK", after=20, limit=1000
            )
            assert [m["line_no"] for m in cut] == MARKS
            assert all(m["line"] == f"MARK {m['line_no']}" for m in cut)
            assert all(len(m["after"]) == 20 and not m["cut"] for m in cut)
            assert calls > len(MARKS) // 10
            # Cut by the daemon's limit.
            limited, calls = await follow_cursors(
                session, 32 * 1024, worker=worker, pattern="^MARK", limit=50
            )
            assert [m["line_no"] for m in limited] == MARKS
            assert calls == len(MARKS) // 50 + 1
            # Cut by the daemon's max_bytes (it counts as the server does, near enough):
            # every line matches; 1 KiB answers, a few matches each. Only the first 300
            # lines (a cursor near the end, as a model asks for the last matches).
            start = LINES - 300
            every, _ = await follow_cursors(
                session, 1024, worker=worker, pattern="o", start=start, limit=1000
            )
            assert [m["line_no"] for m in every] == [
                n for n in range(start + 1, LINES + 1) if n % MARK_EVERY
            ]


async def test_a_match_too_long_for_max_bytes_is_cut_and_the_text_says_how_to_see_it(
    daemon: DaemonProcess,
) -> None:
    script = "echo short one; printf 'long %05000d\\n' 0; echo short two"
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=sh(script))
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            first = await call(
                session, "subagent_grep", worker=worker["id"], pattern="o", max_bytes=1024
            )
            # The short line fits; the long one does not fit after it: left for the next.
            assert [m["line_no"] for m in first["matches"]] == [1]
            assert first["next"] == 1
            body, second = await texted(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="o",
                max_bytes=1024,
                cursor=1,
            )
            [long] = second["matches"]
            assert (long["line_no"], long["cut"]) == (2, True)
            assert long["line"].startswith("long 000")
            assert second["next"] == 2  # past it: it would not fit the next time either
            assert "line 2 is cut to fit: cursor=1 and a larger max_bytes show it whole" in body
            third = await call(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="o",
                max_bytes=1024,
                cursor=2,
            )
            assert [m["line"] for m in third["matches"]] == ["short two"]
            assert third["next"] is None


async def test_grep_counts_its_limit_among_the_lines_its_filters_keep(
    daemon: DaemonProcess,
) -> None:
    gate = daemon.root / "gate"
    # Many stdout matches first: a filter applied after the daemon's limit would see
    # none of the stderr ones, nor the late ones.
    script = (
        "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo hit out $i; done; echo hit err 1 >&2; "
        f"while [ ! -e {gate} ]; do sleep 0.02; done; echo hit late out; echo hit late err >&2"
    )
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=sh(script), ready="err 1")
            assert worker["ready"]["outcome"] == "matched"
            between = time.time()
            gate.touch()
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)

            def lines(found: dict[str, Any]) -> list[str]:
                return [m["line"] for m in found["matches"]]

            errors = await call(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="hit",
                stream="stderr",
                limit=5,
            )
            assert lines(errors) == ["hit err 1", "hit late err"]
            assert errors["next"] is None
            late = await call(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="hit",
                since=str(between),
                limit=5,
            )
            assert sorted(lines(late)) == ["hit late err", "hit late out"]
            both = await call(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="hit",
                since=str(between),
                stream="stdout",
                limit=1,
            )
            assert lines(both) == ["hit late out"]
            # Line numbers still count every line, as without a filter.
            unfiltered = await call(
                session, "subagent_grep", worker=worker["id"], pattern="late out"
            )
            assert unfiltered["matches"][0]["line_no"] == both["matches"][0]["line_no"]
            recent = await call(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="hit",
                since="10m",
                stream="stderr",
            )
            assert lines(recent) == ["hit err 1", "hit late err"]
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(between + 3600))
            future = await call(
                session, "subagent_grep", worker=worker["id"], pattern="hit", since=stamp
            )
            assert future["matches"] == []
            assert future["next"] is None
            # Going on from a cut answer names the time it used, not `10m` again.
            body, cut = await texted(
                session,
                "subagent_grep",
                worker=worker["id"],
                pattern="hit",
                since="10m",
                limit=2,
            )
            said = re.search(r"cursor=(\d+) and since=([0-9.]+)", body)
            assert said is not None, body
            assert int(said.group(1)) == cut["next"]
            assert abs(float(said.group(2)) - (time.time() - 600)) < 30


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        pytest.param({"since": "nan"}, "since", id="since-nan"),
        pytest.param({"since": "inf"}, "since", id="since-inf"),
        pytest.param({"since": "-5"}, "since", id="since-negative"),
        pytest.param({"since": "1e300"}, "since", id="since-huge"),
        pytest.param({"since": "99999999999d"}, "since", id="since-before-1970"),
        pytest.param({"since": "10000-01-01T00:00:00"}, "since", id="since-after-9999"),
        pytest.param({"since": "x" * 100}, "since", id="since-long"),
        pytest.param({"since": ""}, "since", id="since-empty"),
        pytest.param({"since": 600}, "since", id="since-not-a-string"),
        pytest.param({"stream": "stdin"}, "stream", id="stream-not-output"),
        pytest.param({"cursor": -1}, "cursor", id="cursor-negative"),
        pytest.param({"cursor": 2**64}, "cursor", id="cursor-huge"),
        pytest.param({"cursor": "3"}, "cursor", id="cursor-a-string"),
        pytest.param({"cursor": 1.5}, "cursor", id="cursor-not-whole"),
    ],
)
async def test_hostile_grep_arguments_are_refused_naming_the_field(
    daemon: DaemonProcess, arguments: dict[str, Any], field: str
) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            worker = await call(session, "subagent_spawn", argv=["echo", "hello"])
            error = await refused(
                session, "subagent_grep", worker=worker["id"], pattern="h", **arguments
            )
            assert error["code"] == "invalid"
            assert error["message"].startswith(f"{field}: "), error
            # Nothing lost: the server serves on, and the worker's output is all there.
            await call(session, "subagent_wait", worker=worker["id"], timeout=20)
            found = await call(session, "subagent_grep", worker=worker["id"], pattern="h")
            assert [m["line"] for m in found["matches"]] == ["hello"]
