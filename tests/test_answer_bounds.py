"""Fitting answers to their bytes, by itself (pure, no daemon): a watch page and a grep's
result, encoded as the daemon sends them, never exceed the request's max_bytes, however
long the entries, lines or context; and going on from their cursors gives back every
byte and every match once, in order."""

from __future__ import annotations

import itertools
import re

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from subagentd import protocol as p
from subagentd.daemon.workers._answers import cut_match, fit_entries, match_cost
from subagentd.daemon.workers._grep import Checkpoint, LineScanner, compile_pattern
from subagentd.protocol import Entry, GrepMatch

#: The widest ids and cursors msgpack can carry: what costs most in an answer.
WIDEST = 2**63 - 1
KINDS = st.sampled_from(["stdout", "stderr", "state", "note", "stdin"])
BUDGETS = st.integers(min_value=p.MIN_ANSWER_BYTES, max_value=20_000)


def page_size(entries: list[Entry], next_seq: int, next_offset: int) -> int:
    page = p.Page(
        id=WIDEST,
        entries=entries,
        next=next_seq,
        complete=False,
        next_offset=next_offset,
        truncated=True,
    )
    return len(p.encode(page)) - p.HEADER.size


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=30_000), min_size=1, max_size=30),
    kinds=st.lists(KINDS, min_size=30, max_size=30),
    budget=BUDGETS,
    first_seq=st.sampled_from([1, 2**40]),
)
def test_pages_fit_their_budget_and_their_pieces_add_up(
    sizes: list[int], kinds: list[str], budget: int, first_seq: int
) -> None:
    journal = [
        Entry(seq=first_seq + i, kind=kinds[i], data=bytes([65 + i % 26]) * size, at=1e9 + 0.5)  # type: ignore[arg-type]
        for i, size in enumerate(sizes)
    ]
    since, offset, read = first_seq - 1, 0, {entry.seq: b"" for entry in journal}
    for _ in range(10_000):
        rest = [entry for entry in journal if entry.seq > since]
        if not rest:
            break
        page = fit_entries(rest, since, offset, budget)
        assert page.entries, "every page makes progress"
        assert page_size(page.entries, WIDEST, WIDEST) <= budget
        for entry in page.entries:
            read[entry.seq] += entry.data
        assert (page.next, page.next_offset) > (since, offset)
        since, offset = page.next, page.next_offset
    assert read == {entry.seq: entry.data for entry in journal}
    assert (since, offset) == (journal[-1].seq, 0)


def result_size(matches: list[GrepMatch]) -> int:
    result = p.GrepResult(matches=matches, truncated=True, next=WIDEST, stopped_in_line=True)
    return len(p.encode(p.GrepReply(id=WIDEST, result=result))) - p.HEADER.size


LINE = st.text(alphabet="aé\U0001f600x", max_size=3000)


@settings(max_examples=100, deadline=None)
@given(
    lines=st.lists(LINE, min_size=1, max_size=60),
    before=st.integers(min_value=0, max_value=p.MAX_CONTEXT_LINES),
    after=st.integers(min_value=0, max_value=p.MAX_CONTEXT_LINES),
    limit=st.integers(min_value=1, max_value=20),
    budget=BUDGETS,
)
def test_grep_answers_fit_their_budget_and_going_on_finds_every_match_once(
    lines: list[str], before: int, after: int, limit: int, budget: int
) -> None:
    output = "".join(line + "\n" for line in lines).encode()
    expected = [number for number, line in enumerate(lines, start=1) if "a" in line]
    found: list[int] = []
    since: int | None = 0
    while since is not None:
        scanner = LineScanner(
            compile_pattern("a"),
            before=before,
            after=after,
            limit=limit,
            since=since,
            max_bytes=budget,
        )
        scanner.feed([Entry(seq=1, kind="stdout", data=output, at=0.0)])
        scanner.finish()
        matches = scanner.matches
        assert result_size(matches) <= budget
        assert len(matches) <= limit
        for match in matches:
            number = match.line_no
            assert match.line == lines[number - 1] or (
                match.cut and lines[number - 1].startswith(match.line)
            )
            assert match.before == lines[number - 1 - len(match.before) : number - 1]
            assert match.after == lines[number : number + len(match.after)]
            if not match.cut:
                assert len(match.before) == min(before, number - 1)
                assert len(match.after) == min(after, len(lines) - number)
        found += [m.line_no for m in matches]
        since = matches[-1].line_no if scanner.more else None
        assert not scanner.more or matches, "an answer that stops short holds a match"
    assert found == expected


def test_a_match_is_cut_to_its_room_at_a_characters_boundary() -> None:
    wide = "é" * 5000
    match = GrepMatch(line_no=7, kind="stderr", line=wide, before=["b"] * 3, after=["c"] * 3)
    for room in (300, 1000, 9000, match_cost(match)):
        cut = cut_match(match, room)
        assert cut.cut
        assert match_cost(cut) <= room
        assert wide.startswith(cut.line)
    roomy = cut_match(match, match_cost(match))
    assert (roomy.line, roomy.before, roomy.after) == (wide, ["b"] * 3, ["c"] * 3)
    tight = cut_match(match, match_cost(match) - 1)
    assert tight.line == wide
    assert len(tight.before) + len(tight.after) == 5  # the farthest one left out
    assert re.fullmatch("é+", cut_match(match, 300).line)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n\r", max_size=400).map(str.encode),
    cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=40),
    streams=st.lists(st.sampled_from(["stdout", "stderr", "note"]), min_size=41, max_size=41),
    before=st.integers(min_value=0, max_value=4),
    after=st.integers(min_value=0, max_value=4),
    since=st.integers(min_value=0, max_value=60),
    every=st.integers(min_value=1, max_value=40),
)
def test_a_scan_from_a_checkpoint_answers_as_one_from_the_start(
    text: bytes,
    cuts: list[int],
    streams: list[str],
    before: int,
    after: int,
    since: int,
    every: int,
) -> None:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    entries = [
        Entry(seq=i + 1, kind=streams[i], data=text[a:b], at=0.0)  # type: ignore[arg-type]
        for i, (a, b) in enumerate(itertools.pairwise(points))
    ]

    def scan(start: Checkpoint | None) -> LineScanner:
        scanner = LineScanner(
            compile_pattern("a|^$"), before=before, after=after, limit=10_000, since=since
        )
        scanner.checkpoint_every = every
        rest = entries
        if start is not None:
            scanner.start_at(start)
            rest = [entry for entry in entries if entry.seq > start.seq]
        for entry in rest:
            scanner.feed([entry])
        scanner.finish()
        return scanner

    whole = scan(None)
    usable = [mark for mark in whole.checkpoints if mark.line_no + before <= since]
    for mark in usable:
        again = scan(mark)
        assert again.matches == whole.matches
        assert (again.line_no, again.scanned) == (whole.line_no, whole.scanned)


class _OldPage(msgspec.Struct, tag="page", tag_field="op"):
    """`Page` as a client before max_bytes knew it."""

    id: int
    entries: list[Entry]
    next: int
    complete: bool


class _OldGrepMatch(msgspec.Struct):
    line_no: int
    kind: str
    line: str
    before: list[str] = []
    after: list[str] = []


class _OldGrepResult(msgspec.Struct):
    matches: list[_OldGrepMatch]
    truncated: bool = False


def test_old_peers_read_the_new_answers_and_send_requests_the_daemon_reads() -> None:
    entry = Entry(seq=4, kind="stdout", data=b"piece", at=1.0)
    page = p.Page(id=3, entries=[entry], next=3, complete=False, next_offset=5, truncated=True)
    old = msgspec.msgpack.decode(p.encode(page)[p.HEADER.size :], type=_OldPage)
    assert (old.entries, old.next, old.complete) == ([entry], 3, False)
    match = GrepMatch(line_no=2, kind="stdout", line="x", cut=True)
    result = p.GrepResult(matches=[match], truncated=True, next=2)
    older = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=_OldGrepResult)
    assert ([m.line for m in older.matches], older.truncated) == (["x"], True)
    # An old client's requests leave the new fields out: the defaults hold.
    watch = p.client_decoder.decode(msgspec.msgpack.encode({"op": "watch", "id": 2, "worker": "w"}))
    grep = p.client_decoder.decode(
        msgspec.msgpack.encode({"op": "grep", "id": 3, "worker": "w", "pattern": "x"})
    )
    assert isinstance(watch, p.Watch)
    assert isinstance(grep, p.Grep)
    assert (watch.max_bytes, watch.offset) == (p.DEFAULT_ANSWER_BYTES, 0)
    assert (grep.max_bytes, grep.since) == (p.DEFAULT_ANSWER_BYTES, 0)
