"""Reading what workers did: lookups by id, status, collect, journal pages and follows.

The reader answers from what is live (the supervisor's journals), from the registry's
handles and tombstones, and for a released worker from the store and its archive. An
ended worker's journal is verified once and kept open for the pages that follow (a few
at once, the most recently read); verifying a long one runs in a thread of its own.
"""

from __future__ import annotations

import bisect
import collections
import functools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

import trio

from subagentd.protocol import (
    DEFAULT_ANSWER_BYTES,
    TERMINAL_STATES,
    Collect,
    Entry,
    GrepResult,
    OutputKind,
    Page,
    WaitForResult,
    WaitOutcome,
    Watch,
    WorkerResult,
    WorkerView,
    op,
)
from subagentd.protocol.errors import Busy, Invalid, NotFound, Refused

from ..core._registry import Registry, Tombstone, WorkerRecord
from ..store._archive import Archive
from ..store._files import NotRegularFile
from ..store._journal import PAGE_BYTES, Journal, JournalCorrupt, JournalTooLong
from ..store._statedir import StateDir
from ..store._store import Store
from ._answers import fit_entries
from ._grep import CHECKPOINT_BYTES, Checkpoint, LineScanner, compile_pattern
from ._supervisor import LiveWorker, Supervisor

#: A journal up to this long is verified on the event loop (a few ms at the worst:
#: entries are at least ~20 bytes and cost ~5 us each); a longer one in a thread.
INLINE_JOURNAL_BYTES = 64 * 1024
#: Ended workers' journals kept open for paging, the most recently read first.
OPEN_JOURNALS = 16
#: Ended journals verified at once (each in a thread).
JOURNAL_SCANS = 2
#: A watch page never holds more entries than this, whatever the client asks.
MAX_PAGE_ENTRIES = 10_000
#: The bytes of output one grep scans at most (from the journal's start): past it the
#: answer says `truncated`. RE2 scans ~1 GB/s; splitting into lines costs more.
MAX_GREP_SCAN_BYTES = 64 * 1024 * 1024
#: A page of output up to this long is searched on the event loop; a longer one in a
#: thread, so a grep of a long journal delays no one else.
INLINE_SCAN_BYTES = 64 * 1024
#: Greps and wait-fors searching in threads at once.
SCANS = 2
#: Places to start a grep again kept for one journal: one a MiB of the scan's bound.
MAX_CHECKPOINTS = MAX_GREP_SCAN_BYTES // CHECKPOINT_BYTES


class PageOutlet(Protocol):
    """Where a followed watch's pages go (a connection's, see serving/_server.py)."""

    def room(self, most: int) -> AbstractAsyncContextManager[int]:
        """For its body, the bytes of the next page (at most `most`), held for it: once
        there is room to send one, and only then."""
        ...

    async def send(self, page: PageInHand) -> None: ...


class PageInHand:
    """A followed page on its way, and how to read it again: once its socket took part of
    it and no more for a while, the outlet lets it go, and reads it again to send the
    rest (a follower that stops reading mid-page holds nothing meanwhile)."""

    def __init__(self, page: Page, again: Callable[[], Awaitable[Page]]) -> None:
        self._page: Page | None = page
        self.again = again

    def take(self) -> Page:
        """The page, given up: the taker holds it alone."""
        page, self._page = self._page, None
        assert page is not None, "a page in hand is taken once"
        return page


class Releases(Protocol):
    """What a collect asks of retention (see `_retention.Retention`)."""

    def collected(self, worker_id: str) -> None: ...

    def tombstone_collected(self, stone: Tombstone, answer: str) -> None: ...


class Reader:
    def __init__(
        self, state_dir: StateDir, registry: Registry, store: Store, supervisor: Supervisor
    ) -> None:
        self._state_dir = state_dir
        self._registry = registry
        self._store = store
        self._supervisor = supervisor
        self._retention: Releases | None = None
        self._journals: collections.OrderedDict[str, Journal] = collections.OrderedDict()
        #: Where greps of a journal may start again (the most recently searched first).
        self._checkpoints: collections.OrderedDict[str, list[Checkpoint]] = (
            collections.OrderedDict()
        )
        #: Threads verifying journals (see open_journal): their own, so a worker's huge
        #: journal read by many requests holds these and never those a spawn needs.
        self._journal_scans = trio.CapacityLimiter(JOURNAL_SCANS)
        #: Threads searching output for greps and wait-fors: their own, as above.
        self._scans = trio.CapacityLimiter(SCANS)

    def releasing_through(self, retention: Releases) -> None:
        """Who lets a handle go once it is collected (made after the reader)."""
        self._retention = retention

    def stdout_tail(self, found: WorkerRecord | Tombstone) -> bytes:
        """The end of an ended worker's stdout: kept in the store where its journal would
        not give it as well, else its journal's end (not read again if open)."""
        kept = self._store.tail(found.id)
        if kept is not None:
            return kept
        return self.archive_of(found.id).stdout_tail(self._journals.get(found.id))

    def lookup(self, worker_id: str) -> WorkerRecord | Tombstone:
        """A worker by id: its handle, its tombstone, or else its record in the store."""
        found = self._registry.handle(worker_id) or self._registry.tombstone(worker_id)
        if found is not None:
            return found
        released = self._store.worker(worker_id)
        if released is None:
            raise NotFound(f"no worker {worker_id!r}")
        released.archive = str(self.archive_of(worker_id).path)  # as the state dir is now
        return released

    def archive_of(self, worker_id: str) -> Archive:
        """The worker's archive: where the state dir keeps it for that id, never where a
        record says (its worker may rewrite its record); NotFound for no worker id."""
        path = self._state_dir.archive(worker_id)
        if path is None:
            raise NotFound(f"no worker {worker_id!r} (not a worker id)")
        return Archive(path)

    async def wait(self, worker_id: str) -> WorkerView:
        await self._wait_last_attempt(worker_id)
        return self.lookup(worker_id).view()

    async def _wait_last_attempt(self, worker_id: str) -> None:
        """Until the worker has ended for good: an attempt that failed with retries left
        is followed by the next (`Registry.retry`), the same id, waited for in turn."""
        while self.lookup(worker_id).state not in TERMINAL_STATES:
            if self._supervisor.get(worker_id) is None:
                return  # not live, not ended: an ended image's record (recovery's to end)
            await self._supervisor.wait_ended([worker_id])

    async def collect(self, worker_id: str, *, wait: bool) -> WorkerResult:
        found = self.lookup(worker_id)
        if wait:
            await self._wait_last_attempt(worker_id)
            found = self.lookup(worker_id)
        elif found.state not in TERMINAL_STATES:
            raise Busy(f"worker {worker_id} is still {found.state}: {op(Collect)} it with wait")
        if isinstance(found, Tombstone) and found.answered is not None:
            # A repeat answers the same, whatever became of the archive since.
            return _result(found, found.answered)
        archive = self.archive_of(found.id)
        text = ""
        if archive.path.exists():
            text = archive.result_text(lambda: self.stdout_tail(found))
        if isinstance(found, Tombstone):
            text = text or found.output.decode("utf-8", errors="replace")
            self._releases().tombstone_collected(found, text)
        elif self._registry.holds(worker_id):
            self._releases().collected(worker_id)
        return _result(found, text)

    async def watch_page(
        self,
        worker_id: str,
        since: int,
        limit: int,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
        offset: int = 0,
        *,
        room: int | None = None,
    ) -> Page:
        """The entries after `since` (`offset` bytes into the first already sent) that fit
        in `max_bytes` of answer: whole entries, or a piece of one alone over it. With
        `room` (less than `max_bytes`: a follower's socket takes no more at once), those
        that fit in `room`, or the first alone, whole or cut as `max_bytes` would cut it:
        never cut to fit the room."""
        if since < 0 or limit < 1:
            raise Invalid(f"{op(Watch)} needs since >= 0 and limit >= 1, not {since} and {limit}")
        fit = max_bytes if room is None else min(room, max_bytes)
        journal, live, entries = await self._entries(
            worker_id, since, min(limit, MAX_PAGE_ENTRIES), min(fit, PAGE_BYTES)
        )
        if offset and not (entries and offset < len(entries[0].data)):
            raise Invalid(
                f"{op(Watch)}'s offset {offset} is not within entry {since + 1} of worker "
                f"{worker_id}: send the next_offset of the page before, with its next as since"
            )
        page = fit_entries(entries, since, offset, fit)
        if page.next_offset and fit < max_bytes:
            page = fit_entries(entries[:1], since, offset, max_bytes)  # read whole: a bound
        more = page.next_offset > 0 or page.next < journal.last_seq
        return Page(
            id=0,
            entries=page.entries,
            next=page.next,
            next_offset=page.next_offset,
            complete=live is None and not more,
            truncated=more,
        )

    async def _entries(
        self, worker_id: str, since: int, limit: int, data_bytes: int
    ) -> tuple[Journal, LiveWorker | None, list[Entry]]:
        """Whole entries after `since`: at most `limit`, and about `data_bytes` of data
        (always one, if there is one); with the worker's journal, and its live self if any."""
        found = self.lookup(worker_id)
        live = self._supervisor.get(worker_id)
        journal = live.journal if live is not None else await self._ended_journal(found)
        try:
            return journal, live, journal.read(since, limit, data_bytes)
        except JournalCorrupt as exc:
            raise _damaged(found.id, exc) from None

    async def grep(
        self,
        worker_id: str,
        pattern: str,
        *,
        before: int,
        after: int,
        limit: int,
        since: int = 0,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
        written_since: float | None = None,
        stream: OutputKind | None = None,
    ) -> GrepResult:
        """The lines of the worker's output after line `since` that match, with their
        context, in `max_bytes` of answer; only lines of `stream` and written at or after
        `written_since`, if given. From the start of its journal (or from a checkpoint an
        earlier grep of it passed: near `since` going on, before `written_since`'s first
        entry), scanning at most MAX_GREP_SCAN_BYTES of it from the start; an unended last
        line counts."""
        scanner = LineScanner(
            compile_pattern(pattern),
            before=before,
            after=after,
            limit=limit,
            since=since,
            max_bytes=max_bytes,
            stream=stream,
            written_since=written_since,
        )
        self.lookup(worker_id)
        cursor = 0
        first_line = since  # no match is on this line or one before it
        if (
            written_since is not None
            and (mark := await self._mark_before(worker_id, written_since)) is not None
        ):
            first_line = max(first_line, mark.line_no)
        if (start := self._checkpoint_before(worker_id, first_line - before)) is not None:
            scanner.start_at(start)  # a grep going on: not from the journal's start again
            cursor = start.seq
        bounded = False
        while not scanner.done:
            *_, entries = await self._entries(worker_id, cursor, MAX_PAGE_ENTRIES, PAGE_BYTES)
            await self._scan(scanner, entries)
            if not entries:
                break
            cursor = entries[-1].seq
            if scanner.scanned >= MAX_GREP_SCAN_BYTES:
                bounded = True
                break
        scanner.finish(cut=bounded)  # a line the bound falls in is not ended there
        self._keep_checkpoints(worker_id, scanner.checkpoints)
        matches = scanner.matches
        go_on = matches[-1].line_no if scanner.more and matches else None
        return GrepResult(
            matches=matches,
            truncated=scanner.more or bounded,
            next=go_on,
            stopped_in_line=scanner.stopped_in_line,
        )

    async def _mark_before(self, worker_id: str, when: float) -> Checkpoint | None:
        """The last checkpoint a grep of this journal passed before its first entry written
        at or after `when` (found by halving over its seqs: entries are written in time
        order; a clock stepped back makes it approximate). Every line written since then
        comes after its line."""
        marks = self._checkpoints.get(worker_id, [])
        if not marks:
            return None
        low, high = 1, marks[-1].seq + 1  # the first seq written at or after `when`
        while low < high:
            middle = (low + high) // 2
            *_, entries = await self._entries(worker_id, middle - 1, 1, 1)
            if not entries or entries[0].at >= when:
                high = middle
            else:
                low = middle + 1
        index = bisect.bisect_left([mark.seq for mark in marks], low)
        return marks[index - 1] if index else None

    def _checkpoint_before(self, worker_id: str, line_no: int) -> Checkpoint | None:
        """The last place a grep of this journal passed where a scan may start again and
        still have every line after `line_no`."""
        marks = self._checkpoints.get(worker_id, [])
        index = bisect.bisect_right([mark.line_no for mark in marks], line_no)
        return marks[index - 1] if index else None

    def _keep_checkpoints(self, worker_id: str, found: list[Checkpoint]) -> None:
        """Remember where a grep of this journal may start again (a journal only grows, so
        they hold as long as it does); for the most recently searched journals."""
        marks = {mark.seq: mark for mark in self._checkpoints.pop(worker_id, [])}
        marks.update((mark.seq, mark) for mark in found)
        self._checkpoints[worker_id] = sorted(marks.values(), key=lambda mark: mark.seq)[
            -MAX_CHECKPOINTS:
        ]
        while len(self._checkpoints) > OPEN_JOURNALS:
            self._checkpoints.popitem(last=False)

    async def wait_for(
        self, worker_id: str, pattern: str, seconds: float, *, since: int = 0
    ) -> WaitForResult:
        """Once a line of the worker's output matches (what it wrote so far first, then what
        it writes), once it ends, or after `seconds`: whichever comes first. A line
        counts once it ends (or the output does); the scan's work is bounded by the time."""
        scanner = LineScanner(compile_pattern(pattern))
        self.lookup(worker_id)
        outcome: WaitOutcome = "timed_out"
        with trio.move_on_after(seconds):
            outcome = await self._wait_for_line(worker_id, scanner, since)
        line = scanner.matches[0].line if outcome == "matched" else None
        return WaitForResult(outcome=outcome, line=line, worker=self.lookup(worker_id).view())

    async def _wait_for_line(
        self, worker_id: str, scanner: LineScanner, since: int = 0
    ) -> WaitOutcome:
        cursor = since
        while True:
            live = self._supervisor.get(worker_id)
            grown = live.grown if live is not None else None
            journal, live, entries = await self._entries(
                worker_id, cursor, MAX_PAGE_ENTRIES, PAGE_BYTES
            )
            await self._scan(scanner, entries)
            if entries:
                cursor = entries[-1].seq
            complete = live is None and cursor >= journal.last_seq
            if complete:
                scanner.finish()
            if scanner.matches:
                return "matched"
            if complete:
                return "ended"
            if not entries and grown is not None:
                await grown.wait()
            else:
                await trio.lowlevel.checkpoint()  # a worker writing fast starves no one

    async def _scan(self, scanner: LineScanner, entries: list[Entry]) -> None:
        """Feed `entries` to `scanner`: a big page in a thread, so the loop serves on."""
        if sum(len(entry.data) for entry in entries) <= INLINE_SCAN_BYTES:
            scanner.feed(entries)
            return
        # Not abandoned on cancel: the scanner is left whole, and its work is bounded
        # (one page, searched in linear time).
        await trio.to_thread.run_sync(scanner.feed, entries, limiter=self._scans)

    async def _ended_journal(self, found: WorkerRecord | Tombstone) -> Journal:
        """An ended worker's journal, opened (and verified) once for many pages.

        Verifying reads the whole file, which its worker may have made huge:
        in a thread, so the daemon serves everyone else meanwhile.
        """
        journal = self._journals.pop(found.id, None)
        if journal is None:
            path = self.archive_of(found.id).file(Archive.JOURNAL)
            try:
                journal = await self.open_journal(path, writable=False)
            except FileNotFoundError:
                raise NotFound(
                    f"worker {found.id}'s journal is gone (its archive was pruned)"
                ) from None
            except NotRegularFile:
                raise Refused(
                    f"worker {found.id}'s journal is no longer a regular file (a symlink or "
                    "FIFO put in its place); the daemon does not read it"
                ) from None
            except JournalCorrupt as exc:
                raise _damaged(found.id, exc) from None
        self.keep_journal_open(found.id, journal)
        return journal

    async def open_journal(self, path: Path, *, writable: bool) -> Journal:
        """Journal.open, verifying every entry, in a thread: the one way a journal is
        opened while the daemon serves, so a journal its worker made huge delays only
        who asked for it. Few at once (JOURNAL_SCANS), so many such requests hold
        those threads and never those a spawn needs. One opened for writing may cut
        a torn tail: it is never abandoned half done.

        A short journal (most are) is verified at once, here: a thread costs more
        than its scan, and a reload adopting 1,000 workers opens 1,000 journals.
        """
        try:
            return Journal.open(path, writable=writable, most=INLINE_JOURNAL_BYTES)
        except JournalTooLong:
            pass
        return await trio.to_thread.run_sync(
            functools.partial(Journal.open, path, writable=writable),
            abandon_on_cancel=not writable,
            limiter=self._journal_scans,
        )

    def keep_journal_open(self, worker_id: str, journal: Journal) -> None:
        """Keep an ended worker's journal open for the pages and the collect that follow."""
        self._journals.pop(worker_id, None)
        self._journals[worker_id] = journal
        while len(self._journals) > OPEN_JOURNALS:
            self._journals.popitem(last=False)

    def forget_journal(self, worker_id: str) -> None:
        """Its worker runs again (a resume): the read-only view would go stale."""
        self._journals.pop(worker_id, None)
        self._checkpoints.pop(worker_id, None)

    async def follow(
        self,
        worker_id: str,
        since: int,
        limit: int,
        outlet: PageOutlet,
        max_bytes: int = DEFAULT_ANSWER_BYTES,
        offset: int = 0,
    ) -> None:
        """Send pages from `since` (and `offset`) as the journal grows, until it is complete.

        Each page is read once the previous one has been sent and the outlet has
        room for another, at the size it has room for (see `watch_page`): a
        follower that does not read holds back only itself, and nothing is read
        for it meanwhile. A page its socket takes only part of may be let go and
        read again to send the rest (`PageInHand`).
        """
        cursor = since
        while True:
            live = self._supervisor.get(worker_id)
            grown = live.grown if live is not None else None
            async with outlet.room(max_bytes) as room:
                page = await self.watch_page(worker_id, cursor, limit, max_bytes, offset, room=room)
                complete, empty = page.complete, not page.entries
                going_on = page.next, page.next_offset
                if page.entries or page.complete:
                    again = functools.partial(
                        self._page_again, worker_id, cursor, len(page.entries), max_bytes,
                        offset, room, page.complete, page.truncated,
                    )  # fmt: skip
                    in_hand = PageInHand(page, again)
                    del page  # the outlet's alone, to let go of
                    await outlet.send(in_hand)
                else:
                    del page
            if complete:
                return
            cursor, offset = going_on
            if empty and grown is not None:
                await grown.wait()

    async def _page_again(
        self,
        worker_id: str,
        since: int,
        count: int,
        max_bytes: int,
        offset: int,
        room: int,
        complete: bool,
        truncated: bool,
    ) -> Page:
        """A followed page read again as it was read the first time: its `count` entries
        from the same place, fitted the same way (the journal only grows, so they are
        the same entries), with the flags it had then."""
        page = await self.watch_page(worker_id, since, max(count, 1), max_bytes, offset, room=room)
        page.complete, page.truncated = complete, truncated
        return page

    def _releases(self) -> Releases:
        assert self._retention is not None, "Reader.releasing_through was not called"
        return self._retention


def _result(found: WorkerRecord | Tombstone, text: str) -> WorkerResult:
    return WorkerResult(id=found.id, state=found.state, exit_code=found.exit_code, result=text)


def _damaged(worker_id: str, exc: JournalCorrupt) -> Refused:
    """A journal damaged before its tail (its worker wrote into it): said, not served."""
    return Refused(
        f"worker {worker_id}'s journal is damaged at byte {exc.offset} ({exc.reason}); "
        "the daemon serves no page from it"
    )
