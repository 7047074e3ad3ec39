"""subagentd-mcp's bound on an answer's size: what of a page, a tail, a grep or a result
fits in ``max_bytes``, cut the same in the text and in the structured content.

Whole items go in while they fit; the first that does not is cut (an entry's data, a
match's context and line, a result's text), never the JSON around it, and the answer says
where to read on. The text gets a little room of its own for the line that says so, so
neither the text nor the structured content's output exceeds ``max_bytes``. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from subagentd.protocol import Entry, GrepMatch, Wake

from . import _mcp_shapes as shapes
from ._mcp_text import entry_text, lines_text, match_text, wake_line

#: Room kept out of the budget for the text's last line (where the reading stands).
FOOTER = 256


def size(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", errors="surrogatepass"))


@dataclass
class Budget:
    """What is left of ``max_bytes``, for the text and the structured content each."""

    limit: int
    text: int = 0
    data: int = 0

    @property
    def room(self) -> int:
        return max(0, self.limit - FOOTER - max(self.text, self.data))

    def take(self, text: int, data: int) -> bool:
        """Count an item in if both its text and its structured content fit."""
        if self.text + text > self.limit - FOOTER or self.data + data > self.limit - FOOTER:
            return False
        self.text += text
        self.data += data
        return True


def _utf8_cut(data: bytes, length: int) -> int:
    """The longest prefix of `data` within `length` bytes not ending inside a UTF-8 character."""
    length = max(0, min(length, len(data)))
    cut = length
    while 0 < cut < len(data) and length - cut < 3 and (data[cut] & 0xC0) == 0x80:
        cut -= 1  # data[cut] goes on a character begun before it: leave that one out
    return cut if cut > 0 else length


def whole_characters(data: bytes) -> int:
    """The length of `data` without a UTF-8 character its end cuts short (a piece the
    daemon cut by bytes): that character is read whole with what follows."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: its lead is further back
        needs = (
            2
            if byte & 0xE0 == 0xC0
            else 3
            if byte & 0xF0 == 0xE0
            else 4
            if byte & 0xF8 == 0xF0
            else 1
        )
        return len(data) - back if needs > back else len(data)
    return len(data)


def _utf8_start(data: bytes, start: int) -> int:
    """The first character boundary at or after `start` (within three bytes)."""
    begin = start
    while begin < len(data) and begin - start < 3 and (data[begin] & 0xC0) == 0x80:
        begin += 1
    return begin


def _fitting(
    length: int, cost: Callable[[int], tuple[int, int]], budget: Budget
) -> tuple[int, tuple[int, int]]:
    """The largest n <= `length` (halving, then by ratio) whose cost the budget takes."""
    n = length
    while n > 0:
        text, data = cost(n)
        if budget.take(text, data):
            return n, (text, data)
        worst = max(text, data, 1)
        n = min(n - 1, n * max(budget.room, 1) // worst)
    return 0, (0, 0)


@dataclass
class Kept:
    """Entries of a page (or tail) that fit, each with the data kept of it."""

    entries: list[tuple[Entry, bytes, bool]] = field(default_factory=list)
    #: Cut short: `next` and `offset` say where the next read begins.
    truncated: bool = False
    next: int = 0
    offset: int = 0

    def text(self) -> str:
        return "".join(entry_text(entry, data) for entry, data, _ in self.entries)

    def structured(self) -> list[dict[str, Any]]:
        return [shapes.entry(entry, data, cut=cut) for entry, data, cut in self.entries]


def _costs(entry: Entry, data: bytes, cut: bool) -> tuple[int, int]:
    return size(entry_text(entry, data)), json_size(shapes.entry(entry, data, cut=cut))


def page_within(
    entries: Sequence[Entry],
    start_offset: int,
    budget: Budget,
    cursor: int,
    *,
    begun: int = 0,
    pieces: Container[int] = (),
) -> Kept:
    """The entries of a page from the front, the first read from `start_offset` bytes on;
    `next`/`offset` where the following read begins (`cursor`: where this one began).
    `begun`: bytes of the first entry that came before its data here (the daemon sent it
    from there); `pieces`: the seqs of entries whose data here is only part of them."""
    kept = Kept(next=cursor)
    for index, entry in enumerate(entries):
        skip = start_offset if index == 0 else 0
        data = entry.data[skip:]
        cut = bool(skip) or entry.seq in pieces
        if budget.take(*_costs(entry, data, cut)):
            kept.entries.append((entry, data, cut))
            kept.next, kept.offset = entry.seq, 0
            continue
        kept.truncated = True
        if not kept.entries:
            # Not even one entry: as much of it as fits, to read on from there.
            def cost(n: int, entry: Entry = entry, data: bytes = data) -> tuple[int, int]:
                return _costs(entry, data[: _utf8_cut(data, n)], True)

            n, _ = _fitting(len(data), cost, budget)
            n = _utf8_cut(data, n)
            kept.entries.append((entry, data[:n], True))
            kept.next, kept.offset = entry.seq - 1, (begun if index == 0 else 0) + skip + n
        break
    return kept


def tail_within(entries: Sequence[tuple[Entry, bytes]], budget: Budget) -> Kept:
    """The entries of a tail from the back, the earliest cut to start where the bound
    allows; `next` is the cursor to read what was left out before them from."""
    chosen: list[tuple[Entry, bytes, bool]] = []
    truncated = False
    for index in range(len(entries) - 1, -1, -1):
        entry, data = entries[index]
        if budget.take(*_costs(entry, data, False)):
            chosen.append((entry, data, False))
            continue
        # Cut short only if output is left out (not an empty entry alone).
        truncated = bool(data) or any(earlier for _, earlier in entries[:index])

        def cost(n: int, entry: Entry = entry, data: bytes = data) -> tuple[int, int]:
            return _costs(entry, data[_utf8_start(data, len(data) - n) :], True)

        n, _ = _fitting(len(data), cost, budget)
        if n:
            chosen.append((entry, data[_utf8_start(data, len(data) - n) :], True))
        break
    chosen.reverse()
    first = chosen[0][0].seq if chosen else (entries[-1][0].seq if entries else 1)
    return Kept(entries=chosen, truncated=truncated, next=first - 1)


def matches_within(matches: Sequence[GrepMatch], budget: Budget) -> tuple[list[GrepMatch], bool]:
    """The matches that fit, the first cut (its context, then its line) if none does."""
    kept: list[GrepMatch] = []
    for match in matches:
        if budget.take(*_match_costs(match)):
            kept.append(match)
            continue
        if not kept:
            bare = GrepMatch(line_no=match.line_no, kind=match.kind, line=match.line)

            def cost(n: int, bare: GrepMatch = bare) -> tuple[int, int]:
                return _match_costs(_line_cut(bare, n))

            n, _ = _fitting(len(bare.line), cost, budget)
            kept.append(_line_cut(bare, n))
        return kept, True
    return kept, False


def _line_cut(match: GrepMatch, length: int) -> GrepMatch:
    return GrepMatch(line_no=match.line_no, kind=match.kind, line=match.line[:length], cut=True)


def _match_costs(match: GrepMatch) -> tuple[int, int]:
    structured = {
        "line_no": match.line_no,
        "kind": match.kind,
        "line": match.line,
        "before": match.before,
        "after": match.after,
        "cut": match.cut,
    }
    # And the ", " that parts it from the match before it in the list.
    return size(match_text(match)), json_size(structured) + 2


def text_within(raw: str, budget: Budget) -> tuple[str, bool]:
    """The longest start of `raw` whose sanitised text and whose raw form both fit."""

    def cost(n: int) -> tuple[int, int]:
        return size(lines_text(raw[:n])), json_size(raw[:n])

    if budget.take(*cost(len(raw))):
        return raw, False
    n, _ = _fitting(len(raw), cost, budget)
    return raw[:n], True


def _wake_costs(wake: Wake) -> tuple[int, int]:
    # Its line and the newline after it; its object and the ", " before the next.
    return size(wake_line(wake)) + 1, json_size(shapes.wake(wake)) + 2


def wakes_within(wakes: Sequence[Wake], budget: Budget) -> list[Wake]:
    """The wakes from the front that fit, whole; if not even the first does (long ids and
    a preview of escapes), the first with as much of its preview as fits, so that every
    call returns one and the wakes can always be read on."""
    kept: list[Wake] = []
    for wake in wakes:
        if not budget.take(*_wake_costs(wake)):
            break
        kept.append(wake)
    if wakes and not kept:
        first = wakes[0]

        def cost(n: int, first: Wake = first) -> tuple[int, int]:
            return _wake_costs(_preview_cut(first, n))

        n, _ = _fitting(len(first.preview), cost, budget)
        kept.append(_preview_cut(first, n))
    return kept


def _preview_cut(wake: Wake, length: int) -> Wake:
    return msgspec.structs.replace(wake, preview=wake.preview[:length])
