"""subagentd-mcp's tools that read a worker's output: watch (a page, or the tail) and grep,
each within `max_bytes`, filtered by time and stream, saying how to read on.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from subagentd.protocol import MAX_ANSWER_BYTES, MIN_ANSWER_BYTES, Entry, GrepMatch, GrepResult

from . import _mcp_args as args
from . import _mcp_bounds as bounds
from . import _mcp_text as text
from ._async import AsyncClient
from ._mcp_answer import Answer, connection

#: The journal entries one page read asks for when reading a whole tail.
TAIL_READ_LIMIT = 1000
#: What a page of one entry asks for when only its seq and time are wanted.
PROBE_BYTES = MIN_ANSWER_BYTES
#: Pages a watch filtered by stream skips through at most in one call before it answers
#: where it got to.
SKIP_PAGES = 64


async def subagent_watch(a: args.WatchArguments) -> Answer:
    """Read a worker's journal: its stdout and stderr output, state changes and notes.

    One page of entries after `cursor` (from the start when absent), with `next`, the
    cursor to pass for the following page; `complete` is true once the worker has ended
    and nothing follows. `since` keeps only what was written since then (10m, an ISO
    time); `stream` only stdout or stderr (past a long run of the other, an answer may
    come back empty with a later `next`: follow it). Or, with `last`, its last N output lines. At
    most `max_bytes` of output: a cut answer says the cursor (and offset) to read on
    from. Does not wait: use subagent_wait to wait for output or for the end."""
    if a.last is not None and (a.cursor is not None or a.offset):
        raise args.Invalid("last", "give cursor (and offset) or last, not both")
    since = args.since_of(a.since, time.time())
    async with connection() as daemon:
        if a.last is not None:
            return await _tail(daemon, a, since)
        return await _page(daemon, a, since)


def _wanted(stream: str | None, since: float | None) -> Callable[[Entry], bool]:
    def wanted(entry: Entry) -> bool:
        if stream is not None and entry.kind != stream:
            return False
        return since is None or entry.at >= since

    return wanted


def asked_bytes(max_bytes: int) -> int:
    """The `max_bytes` a watch page asks the daemon for, to keep `max_bytes` of it."""
    return max(MIN_ANSWER_BYTES, min(MAX_ANSWER_BYTES, max_bytes))


async def _page(daemon: AsyncClient, a: args.WatchArguments, since: float | None) -> Answer:
    wanted = _wanted(a.stream, since)
    cursor = a.cursor or 0
    offset = a.offset
    if since is not None:
        # Straight to the first entry written since then, however long the journal.
        skipped = await _cursor_since(daemon, a.worker, since, await _last_seq(daemon, a.worker))
        if skipped > cursor:
            cursor, offset = skipped, 0
    for _ in range(SKIP_PAGES):
        # About what this answer keeps (the daemon's page counts the raw bytes, which the
        # text and the structured content never take less of), not the daemon's 2 MiB.
        page = await daemon.watch_page(
            a.worker, since=cursor, limit=a.limit, max_bytes=asked_bytes(a.max_bytes), offset=offset
        )
        entries = [entry for entry in page.entries if wanted(entry)]
        if entries or page.complete or not page.entries:
            break
        cursor, offset = page.next, page.next_offset
    # The daemon sent the first entry from `offset` on, and the last one perhaps only
    # to `page.next_offset`: both are pieces.
    begun = offset if entries and entries[0].seq == cursor + 1 else 0
    pieces = {entries[0].seq} if begun else set()
    next_offset = page.next_offset
    if next_offset and entries and entries[-1].seq == page.next + 1:
        last = entries[-1]
        pieces.add(last.seq)
        # The daemon cuts by bytes: a character it cut in two is read whole next time.
        whole = bounds.whole_characters(last.data)
        next_offset -= len(last.data) - whole
        entries[-1] = Entry(seq=last.seq, kind=last.kind, data=last.data[:whole], at=last.at)
    kept = bounds.page_within(
        entries, 0, bounds.Budget(a.max_bytes), cursor, begun=begun, pieces=pieces
    )
    if not kept.truncated:
        kept.next, kept.offset = page.next, next_offset
        # The daemon's page stopped at its bytes (not at `limit`): more is there already.
        kept.truncated = next_offset > 0 or (page.truncated and len(page.entries) < a.limit)
    complete = page.complete and not kept.truncated
    # With `since`, the time it stood for: a `10m` said again later would skip what was
    # written between.
    same_time = "" if since is None else f" and since={since!r}"
    if kept.truncated:
        more = f"truncated at max_bytes: call subagent_watch with cursor={kept.next}" + (
            f" and offset={kept.offset}" if kept.offset else ""
        )
        more += same_time
    elif complete:
        more = "the worker has ended"
    else:
        more = f"next cursor: {kept.next}" + ("" if since is None else f" (since={since!r})")
    return Answer(
        text.with_footer(kept.text(), more, "no entries"),
        {
            "entries": kept.structured(),
            "next": kept.next,
            "offset": kept.offset,
            "complete": complete,
            "truncated": kept.truncated,
        },
    )


async def read_tail(
    daemon: AsyncClient, worker: str, lines: int, stream: str | None, since: float | None
) -> tuple[list[tuple[Entry, bytes]], int, bool]:
    """The output entries holding the last `lines` lines (the first one cut to start at
    its line), and the cursor after them, and whether the journal is complete. Read from
    the journal's end (found in a few one-entry pages) back as far as the lines need, not
    through the whole journal: a long one is no slower to tail."""
    last = await _last_seq(daemon, worker)
    reach = max(lines, 16)
    while True:
        start = max(0, last - reach)
        read = await _tail_from(daemon, worker, start, lines, stream, since)
        counted = sum(_lines_in(data) for _, data in read.tail)
        # Done when the journal's start was read, the lines are all there, or what was
        # read already began before `since` (all that comes before it is older still).
        older = since is not None and read.first_at is not None and read.first_at < since
        if start == 0 or counted >= lines or older:
            return read.tail, read.cursor, read.complete
        reach *= 4


@dataclass
class _Read:
    tail: list[tuple[Entry, bytes]]
    cursor: int
    complete: bool
    #: When the first entry read was written (None: none was).
    first_at: float | None


async def _last_seq(daemon: AsyncClient, worker: str) -> int:
    """The seq of the journal's last entry (0: none), by doubling then halving over pages of
    one entry (seqs run from 1 without a gap)."""
    known, probe = 0, 1
    while (
        await daemon.watch_page(worker, since=probe - 1, limit=1, max_bytes=PROBE_BYTES)
    ).entries:
        known, probe = probe, probe * 2
    while probe - known > 1:
        middle = (known + probe) // 2
        if (
            await daemon.watch_page(worker, since=middle - 1, limit=1, max_bytes=PROBE_BYTES)
        ).entries:
            known = middle
        else:
            probe = middle
    return known


async def _cursor_since(daemon: AsyncClient, worker: str, since: float, last: int) -> int:
    """The cursor just before the first entry written at or after `since` (`last`: the
    journal's last seq), by halving over pages of one entry: entries are written in time
    order. (A clock stepped back makes it approximate; the filter on `at` still holds.)"""
    low, high = 1, last + 1  # the first such seq lies in [low, high]; last + 1: none
    while low < high:
        middle = (low + high) // 2
        page = await daemon.watch_page(worker, since=middle - 1, limit=1, max_bytes=PROBE_BYTES)
        if not page.entries or page.entries[0].at >= since:
            high = middle
        else:
            low = middle + 1
    return low - 1


async def _tail_from(
    daemon: AsyncClient,
    worker: str,
    start: int,
    lines: int,
    stream: str | None,
    since: float | None,
) -> _Read:
    """The last `lines` wanted output lines after cursor `start`, read to the journal's end."""
    wanted = _wanted(stream, since)
    tail: collections.deque[tuple[Entry, bytes]] = collections.deque()
    cursor, complete, first_at = start, False, None
    while True:
        page = await daemon.watch_page(worker, since=cursor, limit=TAIL_READ_LIMIT)
        if page.entries and first_at is None:
            first_at = page.entries[0].at
        for entry in page.entries:
            if entry.kind in ("stdout", "stderr") and wanted(entry):
                tail.append((entry, entry.data))
                _trim(tail, lines)
        cursor, complete = page.next, page.complete
        if complete or not page.entries:
            break
    return _Read(list(tail), cursor, complete, first_at)


async def _tail(daemon: AsyncClient, a: args.WatchArguments, since: float | None) -> Answer:
    assert a.last is not None
    tail, cursor, complete = await read_tail(daemon, a.worker, a.last, a.stream, since)
    kept = bounds.tail_within(tail, bounds.Budget(a.max_bytes))
    body = "".join(text.entry_text(entry, data) for entry, data, _ in kept.entries)
    more = "the worker has ended" if complete else f"next cursor: {cursor}"
    if kept.truncated:
        more = (
            f"truncated at max_bytes: only the end of these lines is here; ask fewer, or "
            f"call subagent_watch with cursor={kept.next} to read them whole from there; {more}"
        )
    return Answer(
        text.with_footer(body, more, "no output yet"),
        {
            "entries": kept.structured(),
            "next": cursor,
            "offset": 0,
            "complete": complete,
            "truncated": kept.truncated,
        },
    )


def _trim(tail: collections.deque[tuple[Entry, bytes]], lines: int) -> None:
    """Drop from the front of `tail` what comes before its last `lines` lines."""
    total = sum(_lines_in(data) for _, data in tail)
    while tail and total > lines:
        entry, data = tail[0]
        extra = total - lines
        count = _lines_in(data)
        if count <= extra:
            tail.popleft()
            total -= count
            continue
        # Cut the oldest entry to its last (count - extra) lines.
        parts = data.splitlines(keepends=True)
        tail[0] = (entry, b"".join(parts[len(parts) - (count - extra) :]))
        total = lines


def _lines_in(data: bytes) -> int:
    return len(data.splitlines())


async def subagent_grep(a: args.GrepArguments) -> Answer:
    """Search a worker's output (stdout and stderr, line by line) for a regular expression.

    Runs in the daemon over the whole journal, bounded. Each match has its 1-based line
    number and the lines around it. `since` keeps only lines written since then (10m, an
    ISO time), `stream` only stdout or stderr lines: both filtered in the daemon, so
    `limit` counts only the matches they keep. An answer cut short (by `limit`,
    `max_bytes` or the daemon's bounds) says `truncated` and gives `next`: call again
    with the same arguments and `cursor` = `next` for the matches after, none lost or
    repeated (the text says exactly how); `next` is null when nothing more is to be had."""
    when = args.since_of(a.since, time.time())
    async with connection() as daemon:
        found = await daemon.grep(
            a.worker,
            a.pattern,
            before=a.before,
            after=a.after,
            limit=a.limit,
            since=a.cursor or 0,
            max_bytes=max(MIN_ANSWER_BYTES, a.max_bytes),
            written_since=when,
            stream=a.stream,
        )
    kept, cut = bounds.matches_within(found.matches, bounds.Budget(a.max_bytes))
    go_on = _grep_next(found, kept, cut)
    body = "".join(text.match_text(match) for match in kept)
    again = f"call subagent_grep with the same arguments and cursor={go_on}"
    if a.since is not None:
        again += f" and since={when!r}"  # the same time, not `10m` from a later now
    if go_on is not None and (cut or len(found.matches) < a.limit):
        more = f"truncated at max_bytes after line {go_on}: {again}"
    elif go_on is not None:
        more = f"limit reached after line {go_on}, there may be more: {again}"
    elif found.truncated:
        more = (
            "truncated: the daemon scans at most the first 64 MiB of a worker's output; "
            "read past it with subagent_watch"
        )
        if found.stopped_in_line:
            more += " (it stopped inside a line whose end lies past it)"
    else:
        more = "no more matches"
    said_cut = [match.line_no for match in kept if match.cut]
    if said_cut:
        more += (
            f"; line {said_cut[0]} is cut to fit: cursor={said_cut[0] - 1} and a larger "
            "max_bytes show it whole"
        )
    return Answer(
        text.with_footer(body, more, "no match"),
        {
            "matches": [msgspec.to_builtins(match) for match in kept],
            "truncated": found.truncated or cut,
            "next": go_on,
        },
    )


def _grep_next(found: GrepResult, kept: list[GrepMatch], cut: bool) -> int | None:
    """The cursor the next call goes on from: after the last match sent whole, so that a
    match `max_bytes` left out comes in the next answer; past the first match only when
    it alone was cut to fit (it would not fit the next time either); else the daemon's."""
    if not cut:
        return found.next
    return kept[-1].line_no
