"""Answers built from a worker's output are bounded in bytes, whatever the request asks
within its schema, and say how to go on: a worker that wrote 10 MB, through watch, grep
and collect, from the libraries and from subagentctl. No reply comes near the frame
limit, each is within its request's max_bytes, and following the cursors gives the
whole output back with nothing lost or twice.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import BIN, DaemonProcess
from .helpers import Connect, RawConnection

LINES = 50_000
#: 200 bytes a line, numbered so that a line lost or seen twice shows: 10 MB in all.
WRITER = (
    "import sys\n"
    "w = sys.stdout.write\n"
    f"for i in range(1, {LINES + 1}):\n"
    "    w('%08d ' % i + 'x' * 190 + '\\n')\n"
)
OUTPUT = b"".join(b"%08d " % i + b"x" * 190 + b"\n" for i in range(1, LINES + 1))


def line(number: int) -> str:
    return f"{number:08d} " + "x" * 190


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


@pytest.fixture
async def big(client: AsyncClient) -> str:
    """A worker that wrote 10 MB to its stdout, ended."""
    with trio.fail_after(60):
        worker = await client.spawn([sys.executable, "-c", WRITER])
        ended = await client.wait(worker.id)
    assert ended.state == "finished"
    return worker.id


def body_size(reply: p.Reply) -> int:
    """The bytes of the frame body the daemon sent (msgspec encodes the same message the
    same way on both sides)."""
    return len(p.encode(reply)) - p.HEADER.size


async def test_a_default_watch_of_10_mb_pages_within_its_bound_and_loses_nothing(
    client: AsyncClient, big: str
) -> None:
    with trio.fail_after(60):
        seen, cursor, pages = b"", 0, []
        while True:
            page = await client.watch_page(big, since=cursor)
            pages.append(page)
            seen += b"".join(e.data for e in page.entries if e.kind == "stdout")
            cursor = page.next
            if page.complete:
                break
        assert (await client.info()).pid  # the daemon serves on
    assert seen == OUTPUT
    assert max(map(body_size, pages)) <= p.DEFAULT_ANSWER_BYTES
    assert len(pages) >= 5  # 10 MB in pages of about 1 MiB
    assert all(page.truncated for page in pages[:-1])
    assert not pages[-1].truncated
    assert all(page.next_offset == 0 for page in pages)  # no entry is over the default


async def test_small_pages_cut_entries_into_pieces_that_add_up(
    client: AsyncClient, big: str
) -> None:
    budget = 4096  # the writer's 8 KiB writes come in entries of 8 KiB or more
    with trio.fail_after(120):
        seen, since, offset, pages = b"", 0, 0, []
        while True:
            page = await client.watch_page(big, since=since, max_bytes=budget, offset=offset)
            pages.append(page)
            seen += b"".join(e.data for e in page.entries if e.kind == "stdout")
            since, offset = page.next, page.next_offset
            if page.complete:
                break
        # The smallest pages there are, on the first entry: a piece each, each further on.
        small, since, offset = [], 0, 0
        for _ in range(20):
            page = await client.watch_page(
                big, max_bytes=p.MIN_ANSWER_BYTES, since=since, offset=offset
            )
            small.append(page)
            since, offset = page.next, page.next_offset
    assert seen == OUTPUT
    assert max(map(body_size, pages)) <= budget
    assert any(page.next_offset for page in pages)
    assert max(map(body_size, small)) <= p.MIN_ANSWER_BYTES
    pieces = b"".join(e.data for page in small for e in page.entries if e.kind == "stdout")
    assert OUTPUT.startswith(pieces)
    assert len(pieces) > 15 * 800  # each page goes on: at least 800 bytes of data each
    assert all(page.entries and page.truncated for page in small)


async def test_a_followed_watch_with_small_pages_sees_every_byte_once(
    client: AsyncClient, big: str
) -> None:
    with trio.fail_after(120):
        seen = b""
        async for entry in client.watch(big, follow=True, max_bytes=256 * 1024):
            if entry.kind == "stdout":
                seen += entry.data
    assert seen == OUTPUT


async def test_a_grep_at_the_schemas_bounds_answers_within_max_bytes_and_goes_on(
    client: AsyncClient, big: str
) -> None:
    most = p.MAX_GREP_MATCHES
    context = p.MAX_CONTEXT_LINES
    with trio.fail_after(120):
        # What made a 100 MB answer before: every line matches, with all the context.
        first = await client.grep(big, "x$", before=context, after=context, limit=most)
        assert body_size(p.GrepReply(id=2**62, result=first)) <= p.DEFAULT_ANSWER_BYTES
        assert first.truncated
        assert first.next == first.matches[-1].line_no
        whole = await client.grep_all(big, "x$", before=context, after=context, limit=most)
        small = await client.grep(
            big, "x$", before=context, after=context, limit=most, max_bytes=64 * 1024
        )
        assert (await client.info()).pid
    assert [m.line_no for m in whole.matches] == list(range(1, most + 1))
    assert whole.truncated  # there are 50 000 lines matching
    assert whole.next == most
    for match in whole.matches:
        number = match.line_no
        assert match.line == line(number)
        assert not match.cut
        assert match.before == [line(n) for n in range(max(1, number - context), number)]
        assert match.after == [line(n) for n in range(number + 1, number + 1 + context)]
    assert body_size(p.GrepReply(id=2**62, result=small)) <= 64 * 1024
    assert [m.line_no for m in small.matches] == list(range(1, len(small.matches) + 1))
    assert small.matches  # a match and its context fit in 64 KiB: no cut needed
    assert not any(m.cut for m in small.matches)


async def test_a_grep_in_pages_goes_on_from_its_cursor_to_the_end(
    client: AsyncClient, big: str
) -> None:
    with trio.fail_after(120):
        # One line in a thousand matches; pages of 3 matches, then one answer of all.
        pattern = "^000[0-9][0-9]000 "
        numbers, since, answers = [], 0, 0
        while True:
            found = await client.grep(big, pattern, limit=3, since=since)
            numbers += [m.line_no for m in found.matches]
            answers += 1
            if found.next is None:
                break
            since = found.next
    assert numbers == list(range(1000, LINES + 1, 1000))
    assert answers == math.ceil(len(numbers) / 3) + (len(numbers) % 3 == 0)
    assert not found.truncated


async def test_a_match_over_the_budget_is_cut_and_said_so(client: AsyncClient) -> None:
    wide = "é" * 6000  # 12 000 bytes of UTF-8: a line over a 1 KiB answer by itself
    program = f"print('before'); print({wide!r} + ' ERROR'); print('after')"
    with trio.fail_after(60):
        worker = await client.spawn([sys.executable, "-c", program])
        await client.wait(worker.id)
        budget = p.MIN_ANSWER_BYTES
        alone = await client.grep(worker.id, "ERROR", before=1, after=1, max_bytes=budget)
        roomy = await client.grep(worker.id, "ERROR", before=1, after=1, max_bytes=16 * 1024)
        past = await client.grep(worker.id, "ERROR", since=alone.next or 0)
    [cut] = alone.matches
    assert cut.cut
    assert (alone.truncated, alone.next) == (True, 2)
    assert (cut.line_no, cut.before, cut.after) == (2, [], [])
    assert wide.startswith(cut.line)  # cut at a character's boundary
    assert len(cut.line) > 300
    assert body_size(p.GrepReply(id=2**62, result=alone)) <= budget
    [whole] = roomy.matches
    assert (whole.cut, whole.line, whole.before, whole.after) == (
        False,
        wide + " ERROR",
        ["before"],
        ["after"],
    )
    assert (past.matches, past.truncated, past.next) == ([], False, None)


async def test_collect_of_a_10_mb_worker_answers_the_end_of_its_output(
    client: AsyncClient, big: str
) -> None:
    with trio.fail_after(30):
        result = await client.collect(big)
    assert body_size(p.ResultReply(id=2**62, result=result)) <= 64 * 1024
    assert OUTPUT.endswith(result.result.encode())
    assert result.result.endswith(line(LINES) + "\n")


async def test_subagentctl_grep_and_watch_of_10_mb_succeed(
    daemon: DaemonProcess, client: AsyncClient, big: str
) -> None:
    with trio.fail_after(120):
        grepped = await trio.to_thread.run_sync(
            lambda: daemon.ctl("grep", big, "x$", "-B", "100", "-A", "100", "--max", "1000")
        )
        many = await trio.to_thread.run_sync(
            lambda: daemon.ctl("--json", "grep", big, "^0000[0-9]", "--max", "2500")
        )
        watched = await trio.to_thread.run_sync(lambda: _ctl_bytes(daemon, "watch", big))
    assert grepped.returncode == 0, grepped.stderr[-2000:]
    matched = re.findall(r"^(\d+):", grepped.stdout, re.MULTILINE)
    assert matched == [str(n) for n in range(1, 1001)]
    assert "there may be more matches (--max was reached)" in grepped.stderr
    assert many.returncode == 0, many.stderr[-2000:]
    answer = msgspec.json.decode(many.stdout)
    assert [m["line_no"] for m in answer["matches"]] == list(range(1, 2501))  # past 1000
    assert (answer["truncated"], answer["next"]) == (True, 2500)
    assert watched == OUTPUT


def _ctl_bytes(daemon: DaemonProcess, *args: str) -> bytes:
    """subagentctl's stdout as bytes (a watch prints the worker's raw output)."""
    done = subprocess.run(
        [str(BIN / "subagentctl"), *args], env=daemon.env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


HOSTILE: list[object] = [
    0,
    -1,
    1023,
    p.MAX_ANSWER_BYTES + 1,
    2**63,
    1024.0,
    1e300,
    "4096",
    None,
    True,
]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
async def test_a_hostile_max_bytes_is_refused_invalid_naming_it(
    connect: Connect, client: AsyncClient, value: object
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(["echo", "hi"])
        await client.wait(worker.id)
        conn = await connect()
        asked = [
            {"op": "watch", "id": 2, "worker": worker.id, "max_bytes": value},
            {"op": "grep", "id": 3, "worker": worker.id, "pattern": "h", "max_bytes": value},
        ]
        answers = []
        for request in asked:
            await conn.stream.send_all(p.frame(msgspec.msgpack.encode(request)))
            answers.append(await conn.receive())
        await conn.send(p.Watch(id=4, worker=worker.id, max_bytes=p.MIN_ANSWER_BYTES))
        fine = await conn.receive()
    for answer, request in zip(answers, asked, strict=True):
        assert isinstance(answer, p.Error), answer
        assert (answer.id, answer.code) == (request["id"], "invalid")
        assert "$.max_bytes" in answer.message
    assert isinstance(fine, p.Page)
    assert [e.data for e in fine.entries if e.kind == "stdout"] == [b"hi\n"]


@pytest.mark.parametrize("offset", ["its length", "past it", "no entry", -1, 2**63, 1.5, "1"])
async def test_an_offset_not_within_its_entry_is_refused_invalid(
    connect: Connect, client: AsyncClient, offset: object
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(["echo", "hi"])
        await client.wait(worker.id)
        page = await client.watch_page(worker.id)
        first = page.entries[0]
        since = 0
        match offset:
            case "its length":
                offset = len(first.data)
            case "past it":
                offset = len(first.data) + 100
            case "no entry":
                since, offset = page.next, 1
        conn: RawConnection = await connect()
        request = {"op": "watch", "id": 2, "worker": worker.id, "since": since, "offset": offset}
        await conn.stream.send_all(p.frame(msgspec.msgpack.encode(request)))
        answer = await conn.receive()
        piece = await client.watch_page(worker.id, offset=1)
    assert isinstance(answer, p.Error)
    assert (answer.id, answer.code) == (2, "invalid")
    assert "offset" in answer.message
    assert piece.entries[0].data == first.data[1:]  # within it: the rest of it


@pytest.mark.parametrize("since", [-1, 2**63, 1.5, "3", None], ids=repr)
async def test_a_hostile_grep_since_is_refused_invalid_naming_it(
    connect: Connect, client: AsyncClient, since: object
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(["echo", "hi"])
        await client.wait(worker.id)
        conn = await connect()
        request = {"op": "grep", "id": 2, "worker": worker.id, "pattern": "h", "since": since}
        await conn.stream.send_all(p.frame(msgspec.msgpack.encode(request)))
        answer = await conn.receive()
        beyond = await client.grep(worker.id, "h", since=p.MAX_INT)
    assert isinstance(answer, p.Error)
    assert (answer.id, answer.code) == (2, "invalid")
    assert "$.since" in answer.message
    assert (beyond.matches, beyond.truncated, beyond.next) == ([], False, None)
