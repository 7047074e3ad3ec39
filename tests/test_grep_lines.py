"""The grep scanner by itself (pure, no daemon): lines split per stream whatever the entries'
boundaries, numbered, matched and given their context as a plain reading of the text says."""

from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from subagentd.daemon.workers._grep import MAX_LINE_BYTES, LineScanner, compile_pattern
from subagentd.protocol import Entry

PATTERNS = ["ab", "^a", "b$", "a+b", "^$", "(a|b)b"]


def _entries(text: bytes, cuts: list[int]) -> list[Entry]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]
    return [Entry(seq=i + 1, kind="stdout", data=p, at=0.0) for i, p in enumerate(pieces)]


@given(
    text=st.text(alphabet="ab\n\r", max_size=200).map(str.encode),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=20),
    pattern=st.sampled_from(PATTERNS),
    before=st.integers(min_value=0, max_value=3),
    after=st.integers(min_value=0, max_value=3),
    batched=st.booleans(),
)
def test_the_scanner_reads_output_as_its_lines_say_however_it_was_cut(
    text: bytes, cuts: list[int], pattern: str, before: int, after: int, batched: bool
) -> None:
    scanner = LineScanner(compile_pattern(pattern), before=before, after=after, limit=10_000)
    entries = _entries(text, cuts)
    if batched:
        scanner.feed(entries)
    else:
        for entry in entries:
            scanner.feed([entry])
    scanner.finish()

    *ended, unended = text.decode().split("\n")
    # A line ends at its newline, before a CR just ahead of it; the last may be unended.
    lines = [line.removesuffix("\r") for line in ended] + ([unended] if unended else [])
    expected = [
        (i + 1, line, lines[max(0, i - before) : i], lines[i + 1 : i + 1 + after])
        for i, line in enumerate(lines)
        if re.search(pattern, line)
    ]
    found = [(m.line_no, m.line, m.before, m.after) for m in scanner.matches]
    assert found == expected
    assert scanner.line_no == len(lines)
    assert not scanner.more


def test_the_limit_stops_matching_yet_context_after_is_still_filled() -> None:
    scanner = LineScanner(compile_pattern("x"), after=2, limit=1)
    scanner.feed([Entry(seq=1, kind="stdout", data=b"x1\n", at=0.0)])
    assert not scanner.done  # its context after is still owed
    scanner.feed([Entry(seq=2, kind="stdout", data=b"x2\nx3\n", at=0.0)])
    assert scanner.done
    assert [(m.line, m.after) for m in scanner.matches] == [("x1", ["x2", "x3"])]
    assert scanner.more


def test_state_and_note_entries_are_not_lines_and_streams_do_not_mix() -> None:
    scanner = LineScanner(compile_pattern("^ab$"), limit=10)
    scanner.feed(
        [
            Entry(seq=1, kind="stdout", data=b"a", at=0.0),
            Entry(seq=2, kind="stderr", data=b"z\n", at=0.0),
            Entry(seq=3, kind="note", data=b"ab\n", at=0.0),
            Entry(seq=4, kind="stdin", data=b"ab\n", at=0.0),
            Entry(seq=5, kind="stdout", data=b"b\r\n", at=0.0),
        ]
    )
    assert [(m.line_no, m.kind, m.line) for m in scanner.matches] == [(2, "stdout", "ab")]


def _pieces_of(line: str) -> list[tuple[str, int]]:
    """A line as the scanner holds it: pieces of MAX_LINE_BYTES, each with where it starts."""
    starts = range(0, max(len(line), 1), MAX_LINE_BYTES)
    return [(line[at : at + MAX_LINE_BYTES], at) for at in starts]


def _within(pattern: str, line: str, start: int, end: int) -> bool:
    """A match of `pattern` in the whole `line` lies in `start:end`: `^`, `$` and `\\b`
    see the line itself, not a piece of it (each start tried, re's match there taken)."""
    compiled = re.compile(pattern)
    while (found := compiled.search(line, start)) is not None and found.start() <= end:
        if found.end() <= end:
            return True
        start = found.start() + 1
    return False


LONG_RUN = st.builds(
    str.__mul__, st.sampled_from("ab"), st.integers(MAX_LINE_BYTES - 3, 2 * MAX_LINE_BYTES + 3)
)


@given(
    runs=st.lists(st.one_of(st.text(alphabet="ab\n\r", max_size=8), LONG_RUN), max_size=6),
    cuts=st.lists(st.floats(min_value=0, max_value=1), max_size=12),
    pattern=st.sampled_from([*PATTERNS, "a$", "^b", r"a\b", r"\Bb"]),
)
@settings(deadline=None)
def test_a_long_lines_pieces_start_and_end_only_where_the_line_does(
    runs: list[str], cuts: list[float], pattern: str
) -> None:
    text = "".join(runs).encode()
    scanner = LineScanner(compile_pattern(pattern), limit=10_000)
    for entry in _entries(text, [int(c * len(text)) for c in cuts]):
        scanner.feed([entry])
    scanner.finish()

    *ended, unended = text.decode().split("\n")
    lines = [line.removesuffix("\r") for line in ended] + ([unended] if unended else [])
    pieces = [(line, *piece) for line in lines for piece in _pieces_of(line)]
    expected = [
        (i + 1, piece)
        for i, (line, piece, at) in enumerate(pieces)
        if _within(pattern, line, at, at + len(piece))
    ]
    assert [(m.line_no, m.line) for m in scanner.matches] == expected
    assert scanner.line_no == len(pieces)


def test_a_line_the_scan_stops_inside_is_not_ended_there() -> None:
    for pattern, matched in [("a$", False), ("a", True), (r"a\b", False), ("^xa", True)]:
        scanner = LineScanner(compile_pattern(pattern), limit=10)
        scanner.feed([Entry(seq=1, kind="stdout", data=b"x" + b"a" * 10, at=0.0)])
        scanner.finish(cut=True)
        assert bool(scanner.matches) == matched, pattern
        assert scanner.stopped_in_line
    ended = LineScanner(compile_pattern("a$"))
    ended.feed([Entry(seq=1, kind="stdout", data=b"xa", at=0.0)])
    ended.finish()  # the output ends there: its unended last line ends with it
    assert [m.line for m in ended.matches] == ["xa"]
    assert not ended.stopped_in_line
