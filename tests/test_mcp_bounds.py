"""subagentd-mcp's `max_bytes`, by calling it: whatever a worker wrote (any bytes, invalid
UTF-8, entries bigger than the bound), an answer's text and structured output stay within
the bound, every answer makes progress, and reading on from where each answer says gives
back every byte, once, in order.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from subagentd.client import _mcp_bounds as bounds
from subagentd.client import _mcp_shapes as shapes
from subagentd.client._mcp_text import wake_line
from subagentd.protocol import Entry, GrepMatch, Wake

# Repeated pieces, so that entries often pass the bound (hypothesis draws small ones).
PIECE = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20).map(lambda text: text.encode("utf-8", errors="surrogatepass")),
)
DATA = st.tuples(PIECE, st.integers(min_value=1, max_value=300)).map(lambda p: p[0] * p[1])
LIMIT = st.one_of(st.sampled_from([1024, 1100, 2048]), st.integers(1024, 9000))
KINDS = st.sampled_from(["stdout", "stderr", "note"])


def journal(datas: list[tuple[str, bytes]]) -> list[Entry]:
    return [
        Entry(seq=i + 1, kind=kind, data=data, at=1.0)  # type: ignore[arg-type]
        for i, (kind, data) in enumerate(datas)
    ]


def within(limit: int, kept: bounds.Kept) -> None:
    assert bounds.size(kept.text()) <= limit - bounds.FOOTER
    assert len(json.dumps(kept.structured(), ensure_ascii=False).encode()) <= limit


@settings(max_examples=150, deadline=None)
@given(
    datas=st.lists(st.tuples(KINDS, DATA), max_size=12),
    limit=LIMIT,
)
def test_paging_on_from_each_cut_gives_back_every_byte(
    datas: list[tuple[str, bytes]], limit: int
) -> None:
    entries = journal(datas)
    read: dict[int, bytes] = {}
    cursor, offset = 0, 0
    for _ in range(10_000):
        if cursor >= len(entries):
            break
        kept = bounds.page_within(entries[cursor:], offset, bounds.Budget(limit), cursor)
        within(limit, kept)
        assert kept.entries, "an answer with nothing in it"
        for entry, data, _ in kept.entries:
            read[entry.seq] = read.get(entry.seq, b"") + data
        moved = (kept.next, kept.offset) != (cursor, offset)
        assert moved or not kept.truncated
        if not kept.truncated:
            break
        cursor, offset = kept.next, kept.offset
    else:
        raise AssertionError("the reading never ended")
    assert [read.get(e.seq, b"") for e in entries] == [e.data for e in entries]


@settings(max_examples=100, deadline=None)
@given(
    datas=st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), DATA), max_size=8),
    limit=LIMIT,
)
def test_a_tail_keeps_its_end_within_the_bound(datas: list[tuple[str, bytes]], limit: int) -> None:
    entries = journal(datas)
    kept = bounds.tail_within([(e, e.data) for e in entries], bounds.Budget(limit))
    within(limit, kept)
    shown = b"".join(data for _, data, _ in kept.entries)
    whole = b"".join(e.data for e in entries)
    assert whole.endswith(shown)
    assert kept.truncated == (shown != whole)


@settings(max_examples=100, deadline=None)
@given(
    lines=st.lists(st.text(max_size=20).map(lambda t: t * 50), min_size=1, max_size=30),
    context=st.integers(min_value=0, max_value=20),
    limit=LIMIT,
)
def test_matches_fit_whole_or_the_first_is_cut(lines: list[str], context: int, limit: int) -> None:
    matches = [
        GrepMatch(
            line_no=i + 1, kind="stdout", line=line, before=lines[:context], after=lines[:context]
        )
        for i, line in enumerate(lines)
    ]
    kept, cut = bounds.matches_within(matches, bounds.Budget(limit))
    assert kept
    structured = [
        {"line_no": m.line_no, "kind": m.kind, "line": m.line, "before": m.before, "after": m.after}
        for m in kept
    ]
    assert len(json.dumps(structured, ensure_ascii=False).encode()) <= limit
    assert cut == (kept != matches[: len(kept)] or len(kept) < len(matches))


@settings(max_examples=100, deadline=None)
@given(raw=st.text(max_size=40).map(lambda t: t * 200), limit=LIMIT)
def test_a_result_is_cut_at_its_start_within_the_bound(raw: str, limit: int) -> None:
    shown, cut = bounds.text_within(raw, bounds.Budget(limit))
    assert raw.startswith(shown)
    assert cut == (shown != raw)
    assert len(json.dumps(shown, ensure_ascii=False).encode()) <= limit


@settings(max_examples=150, deadline=None)
@given(
    previews=st.lists(st.text(max_size=200), max_size=40),
    run=st.text(min_size=1, max_size=256),
    limit=LIMIT,
)
def test_wakes_fit_whole_and_one_always_comes(previews: list[str], run: str, limit: int) -> None:
    # Any preview (escapes, which JSON spells in six bytes), ids up to their bound.
    wakes = [
        Wake(seq=i + 1, id=f"w-{i}", run=run, state="failed", exit_code=1, preview=preview)
        for i, preview in enumerate(previews)
    ]
    kept = bounds.wakes_within(wakes, bounds.Budget(limit))
    text = "\n".join(wake_line(wake) for wake in kept)
    structured = json.dumps([shapes.wake(wake) for wake in kept], ensure_ascii=False)
    assert bounds.size(text) <= limit - bounds.FOOTER
    assert len(structured.encode()) <= limit
    assert bool(kept) == bool(wakes)  # never none of them: the next call gets on
    assert [wake.seq for wake in kept] == [wake.seq for wake in wakes[: len(kept)]]
    for got, given_ in zip(kept[:-1], wakes, strict=False):
        assert got == given_  # whole, but perhaps the first alone (its preview cut)


@given(text=st.text(max_size=20), cut=st.integers(0, 80))
def test_a_piece_cut_by_bytes_ends_on_a_whole_character(text: str, cut: int) -> None:
    data = text.encode("utf-8", errors="surrogatepass")[:cut]
    whole = bounds.whole_characters(data)
    assert text.encode("utf-8", errors="surrogatepass").startswith(data[:whole])
    data[:whole].decode("utf-8", errors="surrogatepass")  # no character cut in two
    assert len(data) - whole < 4


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "61", "1e308", "", "soon"])
def test_a_progress_interval_of_no_use_is_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from subagentd.client._mcp import PROGRESS_INTERVAL, progress_interval

    monkeypatch.setenv("SUBAGENTD_MCP_PROGRESS_INTERVAL", value)
    assert progress_interval() == PROGRESS_INTERVAL


def test_a_progress_interval_in_range_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    from subagentd.client._mcp import progress_interval

    monkeypatch.setenv("SUBAGENTD_MCP_PROGRESS_INTERVAL", "0.25")
    assert progress_interval() == 0.25
