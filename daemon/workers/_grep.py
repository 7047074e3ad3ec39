"""Searching a worker's output by line: what answers `grep` and `wait_for`.

Pure and synchronous: `LineScanner` is fed journal entries in order and returns nothing
but what it found; the reader decides where it runs (a big page in a thread). Lines are
its stdout and its stderr each split on its own (an entry may end mid-line; the line
goes on in that stream's next entry), numbered together from 1 in the order they were
completed. A line longer than MAX_LINE_BYTES is cut into pieces of that length, so no
worker makes the daemon hold an unbounded line; a cut is not a line's end: each piece is
searched with the bytes beside it as context, so `^` and `$` match only where the line
really starts and ends (and a line the scan stops inside is not ended there). The
matches a scanner keeps are held to the answer's bytes (`_answers`): past them it keeps
no more, so no worker's output makes a grep's answer, or what the daemon holds to build
it, larger than that.

Patterns are RE2's (google-re2): matching takes time linear in the text whatever the
pattern, which is what lets a worker's client, or a worker, hand the daemon any pattern;
Python's `re` backtracks, exponentially for patterns such as ``(a+)+$``. Backreferences
and lookaround, which only a backtracking engine can do, are refused as invalid. Each
batch of lines is searched as one buffer in which no match may cross a newline
(``never_nl``), so the search runs in C and Python touches only the lines that match.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from subagentd.protocol import DEFAULT_ANSWER_BYTES, Entry, GrepMatch, OutputKind
from subagentd.protocol.errors import Invalid

from ._answers import ANSWER_COST, cut_match, match_cost, text_cost

#: A line is cut into pieces this long: no line the daemon holds is longer.
MAX_LINE_BYTES = 16 * 1024
#: What RE2 may use to compile one pattern (its default): a bigger program is refused.
PATTERN_MEMORY = 8 * 1024 * 1024
#: A scanner marks a place to start again from (a `Checkpoint`) at most once per this
#: many bytes of output: a grep going on from its cursor starts at the nearest.
CHECKPOINT_BYTES = 1024 * 1024

_OUTPUT: tuple[OutputKind, ...] = ("stdout", "stderr")


def compile_pattern(pattern: str) -> Any:
    """`pattern` compiled, so that no match crosses a line's end; Invalid naming the field."""
    # Imported at the first grep, not before the daemon serves (a reload waits for that).
    import re2  # type: ignore[import-untyped]  # google-re2 ships no types

    options = re2.Options()
    options.log_errors = False  # said to the client instead, not on the daemon's stderr
    options.never_nl = True
    options.max_mem = PATTERN_MEMORY
    try:
        return re2.compile(b"(?m)" + pattern.encode(), options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args else str(exc)
        reason = reason.replace(f"(?m){pattern}", pattern)  # the pattern as it was sent
        raise Invalid(
            f"pattern: {reason} (patterns are RE2 syntax: no backreferences or lookaround)"
        ) from None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A place in a journal where a scan may start again exactly as if it had read it from
    the start: after entry `seq`, where neither stream has an unended line, `line_no`
    lines and `scanned` bytes of output in. Only lines after it can be context then."""

    seq: int
    line_no: int
    scanned: int


@dataclass
class _Found:
    match: GrepMatch
    owed: int  # lines of context after it still to come


@dataclass
class LineScanner:
    """Lines of a worker's output matched against one compiled pattern, fed in order.

    Only lines numbered after `since` are matched (the earlier ones are counted, and are
    context); and, if given, only lines of `stream`, and lines written at or after
    `written_since` (a line is written when the entry that ends it is), the others
    counted and context too, so `limit` counts only the matches these let through.
    The matches kept cost at most `max_bytes` in an answer: the first match alone over
    it is cut to fit (`GrepMatch.cut`), and a later one that would not fit, with the
    context it is owed, is left for the next answer."""

    pattern: Any
    before: int = 0
    after: int = 0
    limit: int = 1
    since: int = 0
    max_bytes: int = DEFAULT_ANSWER_BYTES
    stream: OutputKind | None = None
    written_since: float | None = None
    #: Bytes of output fed so far: what a bound on one request's work counts.
    scanned: int = 0
    line_no: int = 0
    matches: list[GrepMatch] = field(default_factory=list)
    #: A match beyond `limit` or `max_bytes` was found, or the first match was cut (so
    #: `matches` is not all there is): the next answer starts after the last of them.
    more: bool = False
    #: What the matches kept cost in an answer, the answer's own cost included.
    size: int = ANSWER_COST
    _partial: dict[str, bytearray] = field(
        default_factory=lambda: {kind: bytearray() for kind in _OUTPUT}
    )
    #: The last byte of the piece already given of each stream's unended line, if it was
    #: cut (b"": the unended line starts with what `_partial` holds): its next piece's
    #: context, so that no `^` matches after a cut.
    _cut_before: dict[str, bytes] = field(default_factory=lambda: dict.fromkeys(_OUTPUT, b""))
    #: `finish(cut=True)` found a line unended where the scan stopped: it was searched as
    #: going on past there (no `$` at the cut), and the answer says so.
    stopped_in_line: bool = False
    #: When each stream's unended line was last written to (what `finish` dates it by).
    _partial_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_OUTPUT, 0.0))
    _recent: collections.deque[str] = field(default_factory=collections.deque)
    _owed: list[_Found] = field(default_factory=list)
    #: Places passed where a later scan of the same journal may start (see `Checkpoint`),
    #: at most one per `checkpoint_every` bytes of output.
    checkpoints: list[Checkpoint] = field(default_factory=list)
    checkpoint_every: int = CHECKPOINT_BYTES
    _marked: int = 0

    def start_at(self, checkpoint: Checkpoint) -> None:
        """Scan on from `checkpoint` (a place a scan of the same journal passed): feed the
        entries after its seq. Only matches after the checkpoint's line plus `before` come
        out as a scan from the start gives them: the caller picks a checkpoint early
        enough for every match it asks for (see `Reader.grep`)."""
        self.line_no, self.scanned, self._marked = (
            checkpoint.line_no,
            checkpoint.scanned,
            checkpoint.scanned,
        )

    @property
    def done(self) -> bool:
        """Nothing fed from now on could change the answer: a match past the limit was
        seen (so `more`), and every match has its context after."""
        return self.more and not self._owed

    def feed(self, entries: Iterable[Entry]) -> None:
        """Take the next entries of the journal (other kinds than output pass by)."""
        batch = _Batch()
        for entry in entries:
            if entry.kind == "stdout" or entry.kind == "stderr":
                self.scanned += len(entry.data)
                batch.add(entry.kind, entry.at, *self._split(entry.kind, entry.data))
                if entry.data:  # an empty entry writes no line, nor any of one
                    self._partial_at[entry.kind] = entry.at
                if self.scanned - self._marked >= self.checkpoint_every and not any(
                    self._partial.values()
                ):
                    line_no = self.line_no + len(batch.lines)
                    self.checkpoints.append(Checkpoint(entry.seq, line_no, self.scanned))
                    self._marked = self.scanned
        self._take(batch)

    def finish(self, *, cut: bool = False) -> None:
        """The output has ended (or a grep takes it as it stands): unended lines count.

        `cut`: the scan stops here inside the output (its bound), so an unended line goes
        on past what was read: a match in it counts only if it holds whatever comes next
        (`$` does not match at the cut), and `stopped_in_line` says one was cut."""
        batch = _Batch()
        for kind in _OUTPUT:
            if self._partial[kind]:
                line = bytes(self._partial[kind])
                beside = (self._cut_before[kind], None if cut else b"")
                batch.add(kind, self._partial_at[kind], [line], _beside(0, *beside))
                self.stopped_in_line |= cut
                self._partial[kind].clear()
                self._cut_before[kind] = b""
        self._take(batch)

    def _split(self, kind: OutputKind, data: bytes) -> tuple[list[bytes], dict[int, Beside]]:
        """The lines `data` ends, the first carrying on the stream's unended line, and what
        is beside each piece of a line that was cut (by its index); what is left unended
        is kept for the stream's next entry. Whole-buffer operations (C's speed), never a
        Python step per line but for lines too long to keep whole."""
        partial = self._partial[kind]
        # A CRLF line ends before its CR: `$` matches there, as a person reads it.
        lines = data.replace(b"\r\n", b"\n").split(b"\n")
        rest = lines.pop()
        head = self._cut_before[kind]  # before the unended line's bytes kept, if cut
        if lines:
            if partial:
                if partial.endswith(b"\r") and data.startswith(b"\n"):
                    del partial[-1:]  # a CRLF cut between two entries
                lines[0] = bytes(partial) + lines[0]
                partial.clear()
            self._cut_before[kind] = b""  # what is left starts a line of its own
        beside = _beside(0, head, b"") if lines else {}
        if lines and max(map(len, lines)) > MAX_LINE_BYTES:
            lines, beside = _pieces(lines, head)
        partial += rest
        if len(partial) > MAX_LINE_BYTES:
            *cut, last = _cut(bytes(partial))
            if last == b"\r":  # kept with its piece, so that a "\n" next ends the line there
                last = cut.pop() + last
            if cut:
                start = len(lines)
                for index in range(len(cut)):
                    before = cut[index - 1][-1:] if index else self._cut_before[kind]
                    after = cut[index + 1][:1] if index + 1 < len(cut) else last[:1]
                    beside[start + index] = (before, after)
                lines += cut
                self._cut_before[kind] = cut[-1][-1:]
                partial[:] = last
        return lines, beside

    def _take(self, batch: _Batch) -> None:
        """Search a batch of whole lines; only the lines a match shows are decoded."""
        raw = batch.lines
        if not raw:
            return
        self._give_context(raw)
        if not self.more:
            wanted = batch.wanted(self.stream, self.written_since)
            first = max(0, self.since - self.line_no)
            for index in self._matching(raw, batch.beside, first, wanted):
                if len(self.matches) >= self.limit:
                    self.more = True
                    break
                self._found(index, batch.kind_of(index), raw)
                if self.more:
                    break
        self.line_no += len(raw)
        if self.before:
            self._recent.extend(_text(line) for line in raw[-self.before :])
            while len(self._recent) > self.before:
                self._recent.popleft()

    def _give_context(self, raw: list[bytes]) -> None:
        """The lines after matches still owed them, while they fit in the answer."""
        for found in self._owed:
            for line in raw[: found.owed]:
                text = _text(line)
                cost = text_cost(text)
                if self.size + cost > self.max_bytes:
                    self._over(found.match)
                    return
                found.match.after.append(text)
                found.owed -= 1
                self.size += cost
        self._owed = [found for found in self._owed if found.owed]

    def _over(self, match: GrepMatch) -> None:
        """`match` grew past the answer's bytes with its context: the first is cut there,
        a later one goes to the next answer, and so does every match after it."""
        index = next(i for i, kept in enumerate(self.matches) if kept is match)
        if index == 0:
            match.cut = True
            index = 1
        del self.matches[index:]
        self._owed = []
        self.more = True

    def _matching(
        self,
        lines: list[bytes],
        beside: dict[int, Beside],
        first: int,
        wanted: Callable[[int], int | None],
    ) -> Iterable[int]:
        """The indexes of the wanted lines from `first` on that match, in order, going on
        past a match in lines not wanted to the next wanted line (`wanted`: the first
        wanted index at or after one; None: none is)."""
        search = _Search(self.pattern, lines, beside)
        index = wanted(first) if first < len(lines) else None
        while index is not None and (found := search.next_match(index)) is not None:
            index = wanted(found)
            if index == found:
                yield found
                index = wanted(found + 1) if found + 1 < len(lines) else None

    def _found(self, index: int, kind: OutputKind, raw: list[bytes]) -> None:
        before: list[str] = []
        if self.before:
            earlier = [_text(line) for line in raw[max(0, index - self.before) : index]]
            missing = self.before - len(earlier)
            before = (list(self._recent)[-missing:] if missing else []) + earlier
        after = [_text(line) for line in raw[index + 1 : index + 1 + self.after]]
        match = GrepMatch(
            line_no=self.line_no + index + 1,
            kind=kind,
            line=_text(raw[index]),
            before=before,
            after=after,
        )
        cost = match_cost(match)
        if self.size + cost > self.max_bytes:
            self.more = True
            if not self.matches:  # alone too big: cut, so that every answer goes on
                self.matches.append(cut_match(match, self.max_bytes - self.size))
            return
        self.matches.append(match)
        self.size += cost
        if len(after) < self.after:
            self._owed.append(_Found(match, self.after - len(after)))


#: What is beside a piece of a line that was cut: the byte before it (b"": it starts the
#: line) and the byte after it (b"": it ends the line; None: unknown, past the scan).
Beside = tuple[bytes, bytes | None]


def _beside(index: int, before: bytes, after: bytes | None) -> dict[int, Beside]:
    """What is beside line `index` if it is a piece of a cut line (else nothing)."""
    return {index: (before, after)} if before or after != b"" else {}


def _pieces(lines: list[bytes], head: bytes) -> tuple[list[bytes], dict[int, Beside]]:
    """Whole lines (the first going on after `head`, if it was cut) cut into pieces of at
    most MAX_LINE_BYTES, and what is beside each piece of a cut line."""
    pieces: list[bytes] = []
    beside: dict[int, Beside] = {}
    for number, line in enumerate(lines):
        cut = _cut(line)
        for index, piece in enumerate(cut):
            before = cut[index - 1][-1:] if index else (head if number == 0 else b"")
            after = cut[index + 1][:1] if index + 1 < len(cut) else b""
            beside.update(_beside(len(pieces), before, after))
            pieces.append(piece)
    return pieces, beside


class _Search:
    """One batch's lines searched in order: each run of whole lines as one buffer (RE2 in
    C over all of it), and each piece of a cut line on its own, with the bytes beside it
    as RE2's context, so that a cut is neither a line's start nor its end for `^`, `$`
    or `\\b`; a match never crosses a cut."""

    def __init__(self, pattern: Any, lines: list[bytes], beside: dict[int, Beside]) -> None:
        self._pattern = pattern
        self._lines = lines
        self._beside = beside
        self._cuts = sorted(beside)
        #: Each run of whole lines searched so far: where it starts, its buffer, and
        #: where each of its lines starts in it.
        self._runs: dict[int, tuple[bytes, list[int]]] = {}

    def next_match(self, index: int) -> int | None:
        """The first line at or after `index` that matches; None: none does."""
        while index < len(self._lines):
            if index in self._beside:
                if self._piece_matches(index):
                    return index
                index += 1
                continue
            after = bisect.bisect_left(self._cuts, index)
            start = self._cuts[after - 1] + 1 if after else 0
            end = self._cuts[after] if after < len(self._cuts) else len(self._lines)
            found = self._run_match(start, end, index)
            if found is not None:
                return found
            index = end
        return None

    def _run_match(self, start: int, end: int, index: int) -> int | None:
        """The first line from `index` on in the run of whole lines `start:end` that
        matches: one search of the run as one buffer, in which no match crosses a
        newline (``never_nl``)."""
        if start not in self._runs:
            run = self._lines[start:end]
            starts = list(itertools.accumulate((len(line) + 1 for line in run[:-1]), initial=0))
            self._runs[start] = (b"\n".join(run), starts)
        buffer, starts = self._runs[start]
        found = self._pattern.search(buffer, starts[index - start])
        if found is None:
            return None
        return start + bisect.bisect_right(starts, found.start()) - 1

    def _piece_matches(self, index: int) -> bool:
        """Whether a piece of a cut line matches, searched with what is beside it as its
        context: one that goes on past the scan, whatever comes next (a word's byte or
        not; never a newline)."""
        before, after = self._beside[index]
        piece = self._lines[index]
        return all(
            self._pattern.search(before + piece + next_byte, len(before), len(before) + len(piece))
            is not None
            for next_byte in ((after,) if after is not None else (b"a", b"-"))
        )


class _Batch:
    """Whole lines in the order they were completed, and which stream each came from and
    when the entry that ended it was written (as runs, one an entry, not a tuple a line),
    and what is beside each piece of a cut line."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.beside: dict[int, Beside] = {}
        self._starts: list[int] = []
        self._kinds: list[OutputKind] = []
        self._ats: list[float] = []

    def add(
        self, kind: OutputKind, at: float, lines: list[bytes], beside: dict[int, Beside]
    ) -> None:
        if lines:
            self.beside.update((len(self.lines) + index, cut) for index, cut in beside.items())
            self._starts.append(len(self.lines))
            self._kinds.append(kind)
            self._ats.append(at)
            self.lines += lines

    def kind_of(self, index: int) -> OutputKind:
        return self._kinds[bisect.bisect_right(self._starts, index) - 1]

    def wanted(
        self, stream: OutputKind | None, written_since: float | None
    ) -> Callable[[int], int | None]:
        """The first index at or after a given one of a line of `stream` written at or
        after `written_since` (None for either: any); None when no line after is."""
        if stream is None and written_since is None:
            return lambda index: index

        def keeps(run: int) -> bool:
            if stream is not None and self._kinds[run] != stream:
                return False
            return written_since is None or self._ats[run] >= written_since

        def first_wanted(index: int) -> int | None:
            run = bisect.bisect_right(self._starts, index) - 1
            if keeps(run):
                return index
            for later in range(run + 1, len(self._starts)):
                if keeps(later):
                    return self._starts[later]
            return None

        return first_wanted


def _cut(line: bytes) -> list[bytes]:
    if len(line) <= MAX_LINE_BYTES:
        return [line]
    return [line[i : i + MAX_LINE_BYTES] for i in range(0, len(line), MAX_LINE_BYTES)]


def _text(line: bytes) -> str:
    return line.decode("utf-8", errors="replace")
