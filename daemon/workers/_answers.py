"""What an answer built from a worker's output costs in bytes, and fitting it to a budget.

Pure and synchronous. A watch page and a grep's result are as long as their worker made
its output, so each is held to its request's ``max_bytes`` (at most half the frame
limit): costs here are upper bounds on what msgpack takes for each part, so an answer
counted within its budget is encoded within it too, whatever the output held.
"""

from __future__ import annotations

from dataclasses import dataclass

from subagentd.protocol import Entry, GrepMatch

#: What a page or a grep's result costs besides its entries or matches: the message's
#: map, its keys, the id and cursors (each at most 9 bytes), with room to spare.
ANSWER_COST = 128
#: What one entry costs besides its data: its map, keys, seq, kind, time, bin header.
ENTRY_COST = 64
#: What one match costs besides its strings: its map, keys, line number, kind, flags.
MATCH_COST = 128
#: What one string costs besides its UTF-8 bytes: its header.
LINE_COST = 8


@dataclass(frozen=True, slots=True)
class FittedPage:
    """Entries cut to a budget; the next page starts after ``next`` and ``next_offset``
    bytes into the entry after it (0: at its start)."""

    entries: list[Entry]
    next: int
    next_offset: int


def fit_entries(entries: list[Entry], since: int, offset: int, max_bytes: int) -> FittedPage:
    """The entries (from seq ``since + 1``, its first ``offset`` bytes already sent) that fit
    in a page of ``max_bytes``; an entry alone over it is sent as a piece, never skipped."""
    room = max_bytes - ANSWER_COST
    fitted: list[Entry] = []
    for index, entry in enumerate(entries):
        skip = offset if index == 0 else 0
        cost = ENTRY_COST + len(entry.data) - skip
        if cost <= room:
            fitted.append(_piece(entry, skip, len(entry.data)) if skip else entry)
            room -= cost
            continue
        if fitted:
            return FittedPage(fitted, fitted[-1].seq, 0)
        end = skip + room - ENTRY_COST
        return FittedPage([_piece(entry, skip, end)], entry.seq - 1, end)
    return FittedPage(fitted, fitted[-1].seq if fitted else since, 0)


def _piece(entry: Entry, start: int, end: int) -> Entry:
    """The entry with its data from `start` to `end` alone (copied once: pieces of an
    entry of a MiB are cut one after another)."""
    data = bytes(memoryview(entry.data)[start:end])
    return Entry(seq=entry.seq, kind=entry.kind, data=data, at=entry.at)


def text_cost(text: str) -> int:
    """What `text` costs in an answer (its UTF-8 bytes, and a header)."""
    return LINE_COST + (len(text) if text.isascii() else len(text.encode()))


def match_cost(match: GrepMatch) -> int:
    return (
        MATCH_COST
        + text_cost(match.line)
        + sum(map(text_cost, match.before))
        + sum(map(text_cost, match.after))
    )


def cut_match(match: GrepMatch, room: int) -> GrepMatch:
    """`match` cut to cost at most `room` (at least MATCH_COST + LINE_COST + 4): the context
    nearest its line kept, taking turns after and before; the line itself cut (at a
    character's boundary) if even it is too long. Marked ``cut``."""
    line = match.line
    cost = MATCH_COST + text_cost(line)
    if cost > room:
        raw = line.encode()[: room - MATCH_COST - LINE_COST]
        line = raw.decode("utf-8", errors="ignore")
        return GrepMatch(line_no=match.line_no, kind=match.kind, line=line, cut=True)
    before: list[str] = []
    after: list[str] = []
    for distance in range(max(len(match.before), len(match.after))):
        for side, kept in ((match.after, after), (match.before[::-1], before)):
            if distance < len(side) and len(kept) == distance:
                extra = text_cost(side[distance])
                if cost + extra <= room:
                    kept.append(side[distance])
                    cost += extra
    return GrepMatch(
        line_no=match.line_no,
        kind=match.kind,
        line=line,
        before=before[::-1],
        after=after,
        cut=True,
    )
