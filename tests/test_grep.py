"""grep and wait-for-pattern, searched in the daemon over a worker's journal, end to end.

A grep answers only the matching lines and their context, within bounds on matches and on
the bytes of journal one request scans; its patterns are RE2's, so a pattern that would
make a backtracking engine take exponential time is searched in linear time, and the
daemon serves on meanwhile. A wait-for answers once a line matches (what the worker wrote
before the request too), once the worker ends, or once its timeout (the daemon's trio
clock: MockClock, in process) has passed; sent again by the client across a reload.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.store._journal import PAGE_BYTES
from subagentd.daemon.workers._grep import MAX_LINE_BYTES
from subagentd.daemon.workers._reader import MAX_GREP_SCAN_BYTES
from subagentd.protocol.errors import Invalid, NotFound

from .conftest import DaemonProcess
from .helpers import Connect, sh, wait_output
from .inprocess import held, in_process


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_grep_answers_matching_lines_with_context(client: AsyncClient) -> None:
    with trio.fail_after(20):
        # Each stream is split into lines on its own: "par" + "tial" is one stdout line.
        worker = await client.spawn(
            sh(
                "echo one; echo 'ERROR first'; printf par; printf 'tial ERROR\\r\\n';"
                " echo four; echo five"
            )
        )
        await client.wait(worker.id)
        found = await client.grep(worker.id, "ERROR", before=1, after=2)
        # The streams are lines each on its own, numbered together in journal order.
        both = await client.spawn(sh("echo 'ERROR on stderr' >&2; echo out"))
        await client.wait(both.id)
        on_stderr = await client.grep(both.id, "ERROR")
        every = await client.grep(both.id, "^")
    assert sorted((m.kind, m.line) for m in every.matches) == [
        ("stderr", "ERROR on stderr"),
        ("stdout", "out"),
    ]
    assert [m.line_no for m in every.matches] == [1, 2]
    assert not found.truncated
    outputs = [(m.kind, m.line) for m in found.matches]
    assert outputs == [("stdout", "ERROR first"), ("stdout", "partial ERROR")]  # CR dropped
    assert [m.line_no for m in found.matches] == [2, 3]
    assert found.matches[0].before == ["one"]
    assert found.matches[0].after == ["partial ERROR", "four"]
    assert found.matches[1].before == ["ERROR first"]
    assert found.matches[1].after == ["four", "five"]
    assert [(m.kind, m.line) for m in on_stderr.matches] == [("stderr", "ERROR on stderr")]


async def test_grep_of_a_running_worker_counts_its_unended_last_line(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("echo ready; printf 'prompt> '; sleep 100000"))
        await wait_output(client, worker.id, b"prompt> ")
        found = await client.grep(worker.id, "^prompt")
        assert [m.line for m in found.matches] == ["prompt> "]
        await client.stop(worker.id)


async def test_grep_stops_at_its_limit_and_says_so(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("seq 1 1000"))
        await client.wait(worker.id)
        found = await client.grep(worker.id, "7$", limit=5, after=1)
        assert [m.line for m in found.matches] == ["7", "17", "27", "37", "47"]
        assert found.matches[-1].after == ["48"]
        assert found.truncated
        every = await client.grep(worker.id, "^99[0-9]$", limit=10)
        assert len(every.matches) == 10
        assert not every.truncated  # exactly as many as asked for: nothing left out


async def test_grep_scans_a_bounded_share_of_a_huge_journal(client: AsyncClient) -> None:
    with trio.fail_after(60):
        lines = MAX_GREP_SCAN_BYTES // 1000 * 2  # twice the bound, in lines of ~1 KB
        worker = await client.spawn(
            sh(f"yes \"$(head -c 990 /dev/zero | tr '\\0' x)\" | head -n {lines}; echo needle")
        )
        await client.wait(worker.id)
        found = await client.grep(worker.id, "needle")
        assert found.matches == []  # past what one grep scans
        assert found.truncated


async def test_a_catastrophic_pattern_is_searched_in_linear_time(client: AsyncClient) -> None:
    with trio.fail_after(30):
        # (a+)+$ on "aaa...ab" takes Python's re 2**n steps; RE2 takes one pass.
        worker = await client.spawn(
            sh("for i in $(seq 200); do printf 'a%.0s' $(seq 40); echo b; done")
        )
        await client.wait(worker.id)
        began = time.monotonic()
        found = await client.grep(worker.id, "(a+)+$")
        assert found.matches == []
        assert time.monotonic() - began < 5
        waited = await client.wait_for(worker.id, "(x+x+)+y", timeout=5)
        assert waited.outcome == "ended"


async def test_hostile_patterns_are_refused_naming_the_field(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("echo x"))
        await client.wait(worker.id)
        for pattern in ["(", "(a)\\1", "(?=x)", "a{1000}{1000}"]:
            with pytest.raises(Invalid, match="pattern") as refused:
                await client.grep(worker.id, pattern)
            assert "(?m)" not in str(refused.value)  # the daemon's own flag is not shown
            with pytest.raises(Invalid, match="pattern"):
                await client.wait_for(worker.id, pattern, timeout=1)
        with pytest.raises(Invalid, match="pattern"):
            await client.grep(worker.id, "x" * (p.MAX_PATTERN_LENGTH + 1))
        with pytest.raises(Invalid, match="before"):
            await client.grep(worker.id, "x", before=p.MAX_CONTEXT_LINES + 1)
        with pytest.raises(Invalid, match="limit"):
            await client.grep(worker.id, "x", limit=0)
        for timeout in (float("nan"), float("inf"), -1.0):
            with pytest.raises(Invalid, match="timeout"):
                await client.wait_for(worker.id, "x", timeout=timeout)
        with pytest.raises(NotFound):
            await client.grep("w-nope", "x")
        with pytest.raises(NotFound):
            await client.wait_for("w-nope", "x", timeout=1)
        assert (await client.grep(worker.id, "x")).matches[0].line == "x"  # served on


async def test_a_grep_of_a_long_journal_lets_the_daemon_serve_others(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        lines = MAX_GREP_SCAN_BYTES // 100
        worker = await client.spawn(
            sh(f"yes \"$(head -c 90 /dev/zero | tr '\\0' x)\" | head -n {lines}")
        )
        await client.wait(worker.id)
        answered: list[float] = []
        async with AsyncClient(daemon.socket) as other, trio.open_nursery() as nursery:

            async def grep() -> None:
                found = await client.grep(worker.id, "y")
                answered.append(time.monotonic())
                assert found.matches == []

            nursery.start_soon(grep)
            await trio.sleep(0.05)
            await other.status(worker.id)
            answered.insert(0, time.monotonic())
        assert answered[0] < answered[1]  # the status came back while the grep ran


async def test_wait_for_finds_a_line_already_written_and_one_still_to_come(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("echo 'listening on 8080'; sleep 100000"))
        first = await client.wait_for(worker.id, r"listening on \d+", timeout=10)
        assert (first.outcome, first.line) == ("matched", "listening on 8080")
        assert first.worker.state == "running"
        await client.stop(worker.id)
        second = await client.wait_for(worker.id, "ready now", timeout=10)
        assert (second.outcome, second.line) == ("ended", None)
        assert second.worker.state == "stopped"


async def test_wait_for_follows_output_written_after_it_was_asked(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("sleep 0.3; echo 'server: listening'; sleep 100000"))
        waited = await client.wait_for(worker.id, "listening$", timeout=15)
        assert (waited.outcome, waited.line) == ("matched", "server: listening")
        await client.stop(worker.id)


async def test_wait_for_times_out_on_the_daemons_clock(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):
            worker = await client.spawn(sh("echo busy; sleep 100000"))
            await wait_output(client, worker.id, b"busy\n")
        began = trio.current_time()
        waited = await client.wait_for(worker.id, "never", timeout=600)
        assert waited.outcome == "timed_out"
        assert waited.line is None
        assert waited.worker.state == "running"
        assert trio.current_time() - began == pytest.approx(600, abs=1)
        await client.stop(worker.id)


async def test_wait_for_survives_a_reload(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as other:
            worker = await client.spawn(sh("sleep 1.5; echo done waiting; sleep 100000"))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_reload_soon, other)
                waited = await client.wait_for(worker.id, "^done waiting$", timeout=30)
            assert (waited.outcome, waited.line) == ("matched", "done waiting")
            assert (await client.info()).reloads == 1
            await client.stop(worker.id)


async def _reload_soon(other: AsyncClient) -> None:
    await trio.sleep(0.3)
    await other.reload()


async def test_a_long_line_is_cut_into_pieces_that_start_and_end_only_where_it_does(
    client: AsyncClient,
) -> None:
    with trio.fail_after(20):
        # 100 kB of `a` then `b`: the line ends in `b`, so `a$` matches no piece of it.
        worker = await client.spawn(sh("head -c 100000 /dev/zero | tr '\\0' a; echo b; echo end"))
        await client.wait(worker.id)
        pieces = await client.grep(worker.id, "a", after=1)
        assert [len(m.line) for m in pieces.matches] == [MAX_LINE_BYTES] * 6 + [
            100001 % MAX_LINE_BYTES
        ]
        assert pieces.matches[-1].after == ["end"]
        assert (await client.grep(worker.id, "a$")).matches == []
        assert [m.line_no for m in (await client.grep(worker.id, "^a")).matches] == [1]
        assert [m.line_no for m in (await client.grep(worker.id, "ab$")).matches] == [7]
        assert [m.line_no for m in (await client.grep(worker.id, "^e")).matches] == [8]


async def test_a_line_the_grep_scan_stops_inside_is_not_ended_there(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    with trio.fail_after(90):
        # The case: one line longer than all a grep scans, of `a` then `b` (the
        # scan stops after the page that reaches its bound: a few MiB on, still in `a`).
        worker = await client.spawn(
            sh(f"head -c {MAX_GREP_SCAN_BYTES + 4 * PAGE_BYTES} /dev/zero | tr '\\0' a; echo b")
        )
        await client.wait(worker.id)
        found = await client.grep(worker.id, "a$")
        assert found.matches == []
        assert (found.truncated, found.next, found.stopped_in_line) == (True, None, True)
        assert [m.line_no for m in (await client.grep(worker.id, "^a", limit=2)).matches] == [1]
        printed = await trio.to_thread.run_sync(lambda: daemon.ctl("grep", worker.id, "a$"))
        assert (printed.returncode, printed.stdout) == (4, "")
        assert "was reached, inside a line whose end lies past it" in printed.stderr


async def test_a_raw_grep_request_answers_a_grep_result(connect: Connect) -> None:
    with trio.fail_after(20):
        conn = await connect()
        await conn.send(p.Grep(id=5, worker="w-nope", pattern="x"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert (reply.id, reply.code) == (5, "not_found")
        raw = msgspec.msgpack.encode({"op": "grep", "id": 6, "worker": "w-x", "pattern": ""})
        await conn.stream.send_all(len(raw).to_bytes(4, "big") + raw)
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "invalid"
        assert "pattern" in reply.message
