"""subagentctl top: the daemon's workers (or one run's) as a live table, for a person.

One row per worker: its state (``stopping`` while a stop is in flight, ``paused`` while
paused, ``queued #N`` while it waits its turn under a cap), run, id indented under its
parent, name, age, pid, its CPU % and memory now (its whole tree's, read once a frame
with the listing: `Usage`) and the last line of its output. Keys select a row, stop its
worker (and subtree) or its run, follow its journal, and sort the rows by CPU % or
memory (biggest first) or put them back in the tree's order.
A worker that ends while shown stays on screen, in its final state.

Drawn with rich's ``Live`` (the optional extra ``subagentd[top]``), driven from
trio by the `AsyncClient`, which reconnects across a reload by itself. rich, not
textual: textual runs its own asyncio loop, and the client is trio's; rich only
draws, so the frame is a pure function of what was read (`frame`), and the loop
around it is ours.

Each frame costs a bounded amount whatever the journals hold: the last line is
read from the journal's end (`JournalTail`), found by galloping from the last
cursor, at most `PAGES_PER_FRAME` page requests a frame across all rows (what a
frame leaves undone the next one does). Everything a worker wrote is shown only
after `printable` has taken out escape sequences and control characters, so
output cannot drive the terminal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
import trio

from subagentd.protocol import TERMINAL_STATES, Entry, Page, WorkerView
from subagentd.protocol.errors import NotFound, RemoteError, TransportError

from . import _text
from ._async import AsyncClient
from ._figures import memory_text, percent_text
from ._text import ESCAPE

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_INTERRUPTED = 130

INSTALL_HINT = "pip install 'subagentd[top]'"
#: Seconds between frames when nothing happens.
REFRESH = 1.0
#: Page requests a frame may make for last lines (and the followed journal), all rows together.
PAGES_PER_FRAME = 64
#: Entries read from a journal's end for its last line (an entry holds up to 256 KiB).
TAIL_ENTRIES = 4
#: Pages of `TAIL_ENTRIES` a row may read back, over all frames, for a journal that ends
#: in entries other than output (state changes, notes, stdin) before a line is found.
LOOK_BACK = 8
#: Of a last line, the characters kept (the table cuts it to the column).
LINE_CHARS = 400
#: Workers that ended while shown, kept on screen in their final state.
ENDED_KEPT = 50
#: Lines kept of the followed journal.
FOLLOW_LINES = 500

_OUTPUT = ("stdout", "stderr")


def printable(text: str, limit: int = LINE_CHARS) -> str:
    """`text` as it may reach a terminal (`_text.printable`), at most `limit` characters."""
    return _text.printable(text, limit)


def last_line(entries: Sequence[Entry]) -> str | None:
    """The last line of output among `entries` that shows something (None: they hold none),
    as written, without the whitespace around it; a line not yet ended by a newline counts.
    It is shown through `printable`; `--json` carries it as it is."""
    data = b"".join(entry.data[-LINE_CHARS * 4 :] for entry in entries if entry.kind in _OUTPUT)
    for line in reversed(data.decode("utf-8", errors="replace").splitlines()):
        if printable(line).strip():
            return line.strip()
    return None


# -- reading journals' ends, bounded ---------------------------------------------------


class Spent(Exception):
    """This frame's page requests are used up: the rest waits for the next frame."""


class Budget:
    """Page requests one frame may still make."""

    def __init__(self, pages: int = PAGES_PER_FRAME) -> None:
        self.pages = pages

    async def page(self, daemon: AsyncClient, worker_id: str, since: int, limit: int) -> Page:
        if self.pages <= 0:
            raise Spent
        self.pages -= 1
        return await daemon.watch_page(worker_id, since, limit)


@dataclass
class JournalTail:
    """Where one worker's journal has been read to, from its end: a journal of a million
    entries costs a few dozen small pages once (galloping, then halving), then a page
    a frame while it grows slowly."""

    worker_id: str
    #: Every entry up to this seq has been read or skipped.
    cursor: int = 0
    #: The journal will never grow again (its worker ended): nothing more is asked.
    complete: bool = False
    #: While no line of output is found: the oldest seq read, to look back from (0: none).
    back_from: int = 0
    #: Pages read looking back, at most `LOOK_BACK`.
    looked_back: int = 0

    async def advance(self, daemon: AsyncClient, budget: Budget, want: int) -> list[Entry]:
        """The newest entries after the cursor, at most `want`: those between are skipped.
        All or nothing: a budget spent half way leaves the cursor where it was."""
        if self.complete:
            return []
        first = await budget.page(daemon, self.worker_id, self.cursor, want)
        if not first.entries:
            self.complete = first.complete
            return []
        # A page may be short of `want` by its byte bound, not the end: ask what follows.
        if first.complete or not await self._exists(daemon, budget, first.next + 1):
            self.cursor, self.complete = first.next, first.complete
            return first.entries
        end = await self._find_end(daemon, budget, first.next + 1)
        last = await budget.page(daemon, self.worker_id, max(end - want, first.next), want)
        self.cursor = last.next if last.entries else first.next
        self.complete = last.complete
        entries = last.entries
        if not entries or entries[0].seq == first.entries[-1].seq + 1:
            # The two pages meet: the newest `want` may begin in the first.
            entries = [*first.entries, *entries][-want:]
        return entries

    async def _exists(self, daemon: AsyncClient, budget: Budget, seq: int) -> bool:
        return bool((await budget.page(daemon, self.worker_id, seq - 1, 1)).entries)

    async def _find_end(self, daemon: AsyncClient, budget: Budget, known: int) -> int:
        """The last seq in the journal, given that `known` is in it."""
        step = TAIL_ENTRIES
        beyond = known + step
        while await self._exists(daemon, budget, beyond):
            known, step = beyond, step * 2
            beyond = known + step
        while beyond - known > 1:
            middle = (known + beyond) // 2
            if await self._exists(daemon, budget, middle):
                known = middle
            else:
                beyond = middle
        return known


# -- what is shown ---------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    view: WorkerView
    depth: int


def tree(views: Sequence[WorkerView]) -> list[Row]:
    """`views` with each worker's children under it, oldest first; a worker whose parent
    is not among them (ended, or of another run) is a root."""
    ids = {view.id for view in views}
    children: dict[str | None, list[WorkerView]] = {}
    for view in views:
        parent = view.parent if view.parent in ids else None
        children.setdefault(parent, []).append(view)
    for siblings in children.values():
        siblings.sort(key=lambda v: (v.started_at, v.id))
    rows: list[Row] = []
    seen: set[str] = set()

    def place(view: WorkerView, depth: int) -> None:
        if view.id in seen:
            return
        seen.add(view.id)
        rows.append(Row(view, depth))
        for child in children.get(view.id, []):
            place(child, depth + 1)

    for root in children.get(None, []):
        place(root, 0)
    return rows


def state_of(view: WorkerView) -> str:
    if view.state in TERMINAL_STATES:
        return f"{view.state} ({view.reason})" if view.reason else view.state
    if view.retry_at is not None and not view.stopping:
        return f"retrying (attempt {view.attempt})"
    if view.queued and not view.stopping:
        return "queued" if view.queue_position is None else f"queued #{view.queue_position}"
    if view.ready and not view.stopping and not view.paused:
        return "ready"
    return "stopping" if view.stopping else "paused" if view.paused else view.state


def _running(rows: list[Row]) -> int:
    """Of `rows`, the workers not ended and not waiting in the queue."""
    return sum(1 for row in rows if row.view.state not in TERMINAL_STATES and not row.view.queued)


def _queued(rows: list[Row]) -> int:
    return sum(1 for row in rows if row.view.queued)


def age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


@dataclass
class Follow:
    """The journal of one worker, followed: its last lines of output."""

    worker_id: str
    journal: JournalTail
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=FOLLOW_LINES))
    partial: str = ""
    #: The last seq taken into `lines`.
    taken: int = 0
    #: Why the journal cannot be read (gone, damaged), once said.
    problem: str = ""

    def take(self, entries: Sequence[Entry]) -> None:
        if entries and entries[0].seq > self.taken + 1:
            self.lines.append("[... earlier output skipped ...]")
            self.partial = ""
        if entries:
            self.taken = entries[-1].seq
        for entry in entries:
            if entry.kind not in _OUTPUT:
                continue
            text = self.partial + entry.data.decode("utf-8", errors="replace")
            *whole, self.partial = text.split("\n")
            self.partial = self.partial[-LINE_CHARS * 4 :]
            self.lines.extend(printable(line) for line in whole)

    def shown(self) -> list[str]:
        partial = [printable(self.partial)] if self.partial else []
        return [*self.lines, *partial]


Confirm = Literal["stop", "stop_run"]
#: How the rows are ordered: the tree (children under their parent, oldest first), or
#: by CPU % or memory, biggest first (those without usage, ended ones, last).
Order = Literal["tree", "cpu", "mem"]
ORDERS: tuple[Order, ...] = ("tree", "cpu", "mem")
#: The key that sorts by each order.
ORDER_KEYS: dict[str, Order] = {"t": "tree", "c": "cpu", "m": "mem"}


def by_usage(views: Sequence[WorkerView], order: Order) -> list[Row]:
    """`views` flat, biggest first by CPU % (`cpu`) or memory now (`mem`); those with no
    usage (ended, starting) last, each group oldest first among equals."""

    def figure(view: WorkerView) -> float:
        usage = view.usage
        if usage is None:
            return -1.0
        if order == "mem":
            return float(usage.memory)
        return usage.cpu_percent if usage.cpu_percent is not None else 0.0

    ordered = sorted(views, key=lambda v: (-figure(v), v.started_at, v.id))
    return [Row(view, 0) for view in ordered]


@dataclass
class Screen:
    """What top shows and where the person is in it: pure, changed by `key` and `saw`."""

    run: str | None = None
    views: list[WorkerView] = field(default_factory=list)
    ended: dict[str, WorkerView] = field(default_factory=dict)
    lines: dict[str, str] = field(default_factory=dict)
    selected: str | None = None
    asking: Confirm | None = None
    message: str = ""
    follow: Follow | None = None
    quit: bool = False
    order: Order = "tree"

    def rows(self) -> list[Row]:
        live = {view.id for view in self.views}
        kept = [view for worker_id, view in self.ended.items() if worker_id not in live]
        if self.order != "tree":
            return by_usage([*self.views, *kept], self.order)
        return tree([*self.views, *kept])

    def saw(self, views: list[WorkerView], gone: list[WorkerView]) -> None:
        """A new listing, and the views of those that left it since the last."""
        self.views = views
        for view in gone:
            self.ended[view.id] = view
        while len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]
        ids = [row.view.id for row in self.rows()]
        if self.selected not in ids:
            self.selected = ids[0] if ids else None

    def chosen(self) -> WorkerView | None:
        for row in self.rows():
            if row.view.id == self.selected:
                return row.view
        return None

    def move(self, by: int) -> None:
        ids = [row.view.id for row in self.rows()]
        if not ids:
            return
        at = ids.index(self.selected) if self.selected in ids else 0
        self.selected = ids[max(0, min(len(ids) - 1, at + by))]


# -- drawing ---------------------------------------------------------------------------

KEYS = "up/down select  s stop  r stop run  f follow  c/m/t sort cpu/mem/tree  q quit"
#: What the title says of an order other than the tree's.
ORDER_SHOWN = {"cpu": "by CPU%", "mem": "by MEM"}

COLUMNS = ("STATE", "RUN", "WORKER", "NAME", "AGE", "PID", "CPU%", "MEM", "LAST OUTPUT")
_RIGHT = frozenset({"AGE", "PID", "CPU%", "MEM"})
#: Widths a column never goes below while shown, so that a row changing (a state, an age,
#: a pid, a figure) moves nothing: the common states to "timed_out"; ages to "99d23h";
#: Linux's largest pid, 4194304 (PID_MAX_LIMIT); "99.9" and "1023M" (`_figures`).
LEAST = {"STATE": 9, "AGE": 6, "PID": 7, "CPU%": 5, "MEM": 5}
#: Widths a column never goes above: what is wider is cut (with an ellipsis).
MOST = {"RUN": 14, "NAME": 20, "LAST OUTPUT": LINE_CHARS}
#: What the last output asks of a screen when the table is fitted to it: it gets the rest,
#: but how much it wants is not what it says this frame, so the other columns do not move
#: from one frame to the next as it changes.
LAST_WANTED = 24
#: In order, what gives way when the table is wider than the screen: a column cut down to
#: a width, or left out whole (0). Ids, the PID and the state keep their width to the end:
#: a column is left out before it is cut to a digit.
GIVE_WAY = (
    ("RUN", 0),
    ("LAST OUTPUT", 8),
    ("NAME", 8),
    ("MEM", 0),
    ("CPU%", 0),
    ("LAST OUTPUT", 0),
    ("NAME", 0),
    ("AGE", 0),
    ("PID", 0),
    ("STATE", 0),
)
GAP = 2


def widths(cells: Sequence[Sequence[str]], width: int | None) -> dict[str, int]:
    """The columns shown and their widths, for rows of `cells` (one string per column of
    `COLUMNS`) on a screen `width` cells wide; None: as wide as the cells ask, nothing cut."""
    from rich.cells import cell_len

    asked = {}
    for at, title in enumerate(COLUMNS):
        widest = max([cell_len(title), *(cell_len(row[at]) for row in cells)])
        asked[title] = max(min(widest, MOST.get(title, widest)), LEAST.get(title, 0))
    if width is None:
        return asked
    shown = asked | {"LAST OUTPUT": LAST_WANTED}

    def over() -> int:
        return sum(shown.values()) + GAP * (len(shown) - 1) - width

    for title, least in GIVE_WAY:
        if over() <= 0:
            break
        if title not in shown:
            continue
        if least:  # cut to `least` at most, never widened to it
            shown[title] = min(shown[title], max(least, shown[title] - over()))
        else:
            del shown[title]
    if "NAME" in shown and over() < 0:  # what a dropped last output left: the name's again
        shown["NAME"] = min(asked["NAME"], shown["NAME"] - over())
    if "LAST OUTPUT" in shown:
        shown["LAST OUTPUT"] = max(1, shown["LAST OUTPUT"] - over())
    return shown


def frame(
    screen: Screen, now: float, height: int, width: int | None, *, live: bool = True
) -> RenderableType:
    """What the screen shows: `frame_lines` as one renderable."""
    from rich.console import Group

    return Group(*frame_lines(screen, now, height, width, live=live))


def frame_lines(
    screen: Screen, now: float, height: int, width: int | None, *, live: bool = True
) -> list[Text]:
    """The lines of one frame, each at most `width` cells (None: as long as it is)."""
    if screen.follow is not None:
        lines = _follow_lines(screen, screen.follow, height)
    else:
        rows = screen.rows()
        scope = f"run {screen.run}" if screen.run else "all runs"
        title = f"subagentd top: {scope}, {_running(rows)} running"
        if queued := _queued(rows):
            title += f", {queued} queued"
        title += f", {len(rows)} shown"
        if screen.order in ORDER_SHOWN:
            title += f", {ORDER_SHOWN[screen.order]}"
        lines = [_line(title, "bold")]
        if live:
            lines.append(_line(_footer(screen), "bold" if screen.asking else "dim"))
        if not rows:
            lines.append(_line("no workers" + (f" in run {screen.run}" if screen.run else "")))
        else:
            shown = _window(screen, rows, height - 4 if live else len(rows))
            lines += _table(screen, shown, now, width, pad=live)
    if width is not None:
        for line in lines:
            line.truncate(width, overflow="ellipsis")
    return lines


def document(screen: Screen, now: float) -> dict[str, object]:
    """One frame for a program (`top --once --json`): every worker shown, in the order
    shown (the tree's, unless sorted), as `subagentctl --json status` prints it (its
    usage too, live ones), with its depth in the tree (0 sorted) and its last line of
    output as written (null: none yet); `now` is when it was read."""
    rows = screen.rows()
    return {
        "run": screen.run,
        "at": now,
        "running": _running(rows),
        "queued": _queued(rows),
        "workers": [
            {
                **msgspec.to_builtins(row.view),
                "depth": row.depth,
                "last_output": screen.lines.get(row.view.id),
            }
            for row in rows
        ],
    }


def _line(text: str, style: str = "") -> Text:
    """One line of the screen, cut rather than wrapped on a narrow terminal."""
    from rich.text import Text

    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _footer(screen: Screen) -> str:
    if screen.asking is not None:
        chosen = screen.chosen()
        what = "?" if chosen is None else chosen.id
        if screen.asking == "stop":
            return f"stop {what} and its subtree? y: yes, any other key: no"
        run = "?" if chosen is None else chosen.run
        return f"stop run {run}, every worker in it? y: yes, any other key: no"
    return printable(screen.message, 200) if screen.message else KEYS


def _window(screen: Screen, rows: list[Row], height: int) -> list[Row]:
    """The rows that fit, the selected one among them."""
    height = max(1, height)
    at = next((i for i, row in enumerate(rows) if row.view.id == screen.selected), 0)
    first = max(0, min(at - height + 1, len(rows) - height)) if at >= height else 0
    return rows[first : first + height]


def _table(
    screen: Screen, rows: list[Row], now: float, width: int | None, *, pad: bool
) -> list[Text]:
    """The header and `rows`, laid out by `widths` (not by rich's Table, whose widths move
    with what the cells hold and which cuts every column alike when the screen is narrow)."""
    from rich.text import Text

    cells = []
    for row in rows:
        view = row.view
        ended_at = view.ended_at if view.ended_at is not None else now
        cells.append(
            (
                state_of(view),
                printable(view.run, 60),
                "  " * row.depth + printable(view.id, 60),
                printable(view.name, 60),
                age(ended_at - view.started_at),
                "" if view.pid is None else str(view.pid),
                "" if view.usage is None else percent_text(view.usage.cpu_percent),
                "" if view.usage is None else memory_text(view.usage.memory),
                printable(screen.lines.get(view.id, "")),
            )
        )
    shown = widths(cells, width)

    def laid_out(values: Sequence[str], styles: Sequence[str]) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis")
        for at, title in enumerate(COLUMNS):
            if title not in shown:
                continue
            cell = Text(values[at], style=styles[at])
            room = shown[title]
            cell.truncate(room, overflow="ellipsis")
            if title in _RIGHT:
                cell.pad_left(room - cell.cell_len)
            elif title != COLUMNS[-1] or pad:
                cell.pad_right(room - cell.cell_len)
            if len(line):
                line.append(" " * GAP)
            line.append_text(cell)
        return line

    lines = [laid_out(COLUMNS, ["bold"] * len(COLUMNS))]
    for row, values in zip(rows, cells, strict=True):
        style = _STATE_STYLES.get(values[0].partition(" ")[0], "")  # "queued #3": queued
        line = laid_out(values, [style, *[""] * (len(COLUMNS) - 1)])
        if row.view.id == screen.selected:
            line.stylize("reverse")
        lines.append(line)
    return lines


_STATE_STYLES = {
    "running": "green",
    "stopping": "yellow",
    "paused": "cyan",
    "queued": "blue",
    "retrying": "blue",
    "ready": "green",
    "failed": "red",
    "timed_out": "red",
}


def _follow_lines(screen: Screen, follow: Follow, height: int) -> list[Text]:
    view = next((r.view for r in screen.rows() if r.view.id == follow.worker_id), None)
    state = "gone" if view is None else state_of(view)
    problem = f"  [{follow.problem}]" if follow.problem else ""
    head = _line(
        f"following {follow.worker_id} ({state})  f or Esc: back  q: quit{problem}", "bold"
    )
    shown = follow.shown()[-max(1, height - 1) :]
    return [head, *(_line(line) for line in shown)]


# -- reading the daemon ----------------------------------------------------------------


class Reader:
    """Reads, each frame, what the screen shows: the listing, the views of those that
    left it, and last lines for the rows that fit (and the followed journal)."""

    def __init__(self, daemon: AsyncClient, run: str | None, show_all: bool) -> None:
        self.daemon = daemon
        self.run = run
        self.show_all = show_all
        self._tails: dict[str, JournalTail] = {}
        self._listed: set[str] = set()
        self._turn = 0

    async def read(self, screen: Screen, height: int) -> None:
        # Usage with the listing: one read of each live worker's counters a frame.
        views = await self.daemon.ls(all=self.show_all, run=self.run, usage=True)
        listed = {view.id for view in views}
        # Those that ended since the last frame, in their final state: a request each, so
        # at most as many as are kept on screen.
        left = sorted(self._listed - listed)[:ENDED_KEPT]
        gone = [await self._ended(worker_id) for worker_id in left]
        self._listed = listed
        screen.saw(views, [view for view in gone if view is not None])
        self._forget_all_but({row.view.id for row in screen.rows()}, screen)
        budget = Budget()
        with contextlib.suppress(Spent):
            if screen.follow is not None:
                await self._follow(screen.follow, budget)
            # Starting a row further each frame: a budget spent early is not always the
            # same rows' loss.
            rows = _window(screen, screen.rows(), height)
            self._turn = (self._turn + 1) % max(1, len(rows))
            for row in rows[self._turn :] + rows[: self._turn]:
                await self._last_line(screen, row.view, budget)

    def _forget_all_but(self, shown: set[str], screen: Screen) -> None:
        for worker_id in set(self._tails) - shown:
            del self._tails[worker_id]
        for worker_id in set(screen.lines) - shown:
            del screen.lines[worker_id]

    async def _ended(self, worker_id: str) -> WorkerView | None:
        try:
            return await self.daemon.status(worker_id)
        except NotFound:
            return None

    async def _last_line(self, screen: Screen, view: WorkerView, budget: Budget) -> None:
        tail = self._tails.setdefault(view.id, JournalTail(view.id))
        tail.complete = tail.complete and view.state in TERMINAL_STATES  # a resume runs it again
        try:
            entries = await tail.advance(self.daemon, budget, TAIL_ENTRIES)
        except RemoteError:
            return  # its journal is gone or damaged: the line shown stays
        line = last_line(entries)
        if line is None and view.id not in screen.lines:
            if entries:
                tail.back_from = entries[0].seq
            with contextlib.suppress(RemoteError):
                line = await self._look_back(tail, budget)
        if line is not None:
            screen.lines[view.id] = line

    async def _look_back(self, tail: JournalTail, budget: Budget) -> str | None:
        """A line of output from before what `advance` read, for a row that shows none yet:
        its journal may end in a few entries of other kinds (a stop's states, a resume's
        note, what `send` wrote). At most `LOOK_BACK` pages, over all frames."""
        while tail.back_from > 1 and tail.looked_back < LOOK_BACK:
            since = max(0, tail.back_from - 1 - TAIL_ENTRIES)
            page = await budget.page(self.daemon, tail.worker_id, since, tail.back_from - 1 - since)
            tail.looked_back += 1
            older = [entry for entry in page.entries if entry.seq < tail.back_from]
            tail.back_from = older[0].seq if older else 0
            if (line := last_line(older)) is not None:
                tail.back_from = 0
                return line
        return None

    async def _follow(self, follow: Follow, budget: Budget) -> None:
        try:
            entries = await follow.journal.advance(self.daemon, budget, FOLLOW_LINES)
        except RemoteError as exc:
            follow.problem = printable(str(exc), 200)
            return
        follow.take(entries)


# -- keys ------------------------------------------------------------------------------

_SEQUENCES = {
    "\x1b[A": "up",
    "\x1b[B": "down",
    "\x1bOA": "up",
    "\x1bOB": "down",
    "\x1b[5~": "pageup",
    "\x1b[6~": "pagedown",
    "\x1b[H": "home",
    "\x1b[F": "end",
}


def keys(data: str) -> Iterator[str]:
    """The keys in what the terminal sent: a name for a known sequence, else the character
    (an unknown escape sequence is dropped whole)."""
    at = 0
    while at < len(data):
        known = next((seq for seq in _SEQUENCES if data.startswith(seq, at)), None)
        if known is not None:
            yield _SEQUENCES[known]
            at += len(known)
        elif data[at] == "\x1b" and at + 1 < len(data) and data[at + 1] in "[O":
            end = ESCAPE.match(data, at)
            at = end.end() if end else len(data)
        else:
            yield "escape" if data[at] == "\x1b" else data[at]
            at += 1


@dataclass(frozen=True)
class Act:
    """What a key asks of the daemon."""

    what: Literal["stop", "stop_run"]
    target: str


def press(screen: Screen, key: str, page: int) -> Act | None:
    """What `key` does to the screen, and what it asks of the daemon if anything."""
    if screen.asking is not None:
        asking, screen.asking = screen.asking, None
        chosen = screen.chosen()
        if key not in ("y", "Y") or chosen is None:
            screen.message = "not stopped"
            return None
        if asking == "stop":
            return Act("stop", chosen.id)
        return Act("stop_run", chosen.run)
    screen.message = ""
    if key in ("q", "Q"):
        screen.quit = True
    elif screen.follow is not None:
        if key in ("f", "escape", "\r", "\n"):
            screen.follow = None
    elif key in ("up", "k"):
        screen.move(-1)
    elif key in ("down", "j"):
        screen.move(1)
    elif key == "pageup":
        screen.move(-page)
    elif key == "pagedown":
        screen.move(page)
    elif key == "home":
        screen.move(-len(screen.rows()))
    elif key == "end":
        screen.move(len(screen.rows()))
    elif key in ORDER_KEYS:
        screen.order = ORDER_KEYS[key]
    elif key in ("s", "r") and screen.chosen() is not None:
        screen.asking = "stop" if key == "s" else "stop_run"
    elif key in ("f", "\r", "\n") and screen.selected is not None:
        screen.follow = Follow(screen.selected, JournalTail(screen.selected))
    return None


@contextlib.contextmanager
def cbreak(fd: int) -> Iterator[None]:
    """Keys as they are pressed, not echoed; the terminal as it was afterwards."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)


# -- the loops -------------------------------------------------------------------------


class Top:
    """The live view: a frame each `interval` seconds, and at once after a key."""

    def __init__(
        self,
        daemon: AsyncClient,
        reader: Reader,
        console: Console,
        interval: float,
        order: Order = "tree",
    ) -> None:
        self.daemon = daemon
        self.reader = reader
        self.console = console
        self.interval = interval
        self.screen = Screen(run=reader.run, order=order)
        self._wake = trio.Event()

    def height(self) -> int:
        return self.console.size.height

    async def run(self) -> None:
        from rich.live import Live

        fd = sys.stdin.fileno()
        with cbreak(fd), Live(console=self.console, screen=True, auto_refresh=False) as live:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_keys, fd, nursery)
                nursery.start_soon(self._redraw_on_resize)
                while not self.screen.quit:
                    await self.reader.read(self.screen, self.height() - 4)
                    shown = frame(self.screen, time.time(), self.height(), self.console.width)
                    live.update(shown, refresh=True)
                    with trio.move_on_after(self.interval):
                        await self._wake.wait()
                    self._wake = trio.Event()
                nursery.cancel_scope.cancel()

    async def _read_keys(self, fd: int, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            data = os.read(fd, 1024).decode("utf-8", errors="replace")
            if not data:  # the terminal is gone
                self.screen.quit = True
                self._wake.set()
                return
            for key in keys(data):
                act = press(self.screen, key, max(1, self.height() - 5))
                if act is not None:
                    nursery.start_soon(self._act, act)
            self._wake.set()

    async def _redraw_on_resize(self) -> None:
        with trio.open_signal_receiver(signal.SIGWINCH) as resized:
            async for _ in resized:
                self._wake.set()

    async def _act(self, act: Act) -> None:
        try:
            if act.what == "stop":
                await self.daemon.stop(act.target, wait=False)
                self.screen.message = f"stopping {act.target} and its subtree"
            else:
                stopped = await self.daemon.stop_run(act.target, wait=False)
                self.screen.message = f"stopping run {act.target}: {len(stopped)} workers"
        except (RemoteError, TransportError) as exc:
            self.screen.message = f"stop of {act.target}: {exc}"
        self._wake.set()


async def _top(
    socket: str | None,
    run: str | None,
    show_all: bool,
    once: bool,
    interval: float,
    as_json: bool,
    order: Order = "tree",
) -> None:
    from rich.console import Console

    async with AsyncClient(socket) as daemon:
        reader = Reader(daemon, run, show_all)
        try:
            if once:
                screen = Screen(run=run, order=order)
                await reader.read(screen, height=10**6)
                _print_once(screen, time.time(), as_json)
                return
            await Top(daemon, reader, Console(highlight=False), interval, order).run()
        except* TransportError as lost:
            raise DaemonGone(lost.exceptions[0]) from lost


def _print_once(screen: Screen, now: float, as_json: bool) -> None:
    """`top --once`: the frame on a terminal as wide as it; elsewhere as wide as what it
    shows ($COLUMNS, if set, cuts it), with no padding; with `as_json`, `document`."""
    from rich.console import Console

    if as_json:
        sys.stdout.write(msgspec.json.encode(document(screen, now)).decode() + "\n")
        return
    console = Console(highlight=False, soft_wrap=False)
    if console.is_terminal:
        console.print(frame(screen, now, 10**6, console.width, live=False))
        return
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdecimal() and int(columns) > 0 else None
    for line in frame_lines(screen, now, 10**6, width, live=False):
        sys.stdout.write(line.plain.rstrip() + "\n")


class DaemonGone(Exception):
    """The daemon went away while top showed it (and did not come back within the
    client's reconnect window); not there at the start is the client's own error."""


def _unwrapped(call: Callable[..., object], *args: object) -> None:
    """`call`, raising the one error that ended it rather than a group holding it (the
    loop's nursery wraps what its tasks raise)."""
    try:
        call(*args)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        first = next((e for e in leaves if isinstance(e, KeyboardInterrupt)), leaves[0])
        raise first from group


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def main(
    socket: str | None,
    *,
    run: str | None = None,
    show_all: bool = False,
    once: bool = False,
    interval: float = REFRESH,
    as_json: bool = False,
    order: Order = "tree",
) -> int:
    """`subagentctl top`: the exit status (README.md, "Watching live: top")."""
    try:
        import rich  # noqa: F401
    except ImportError:
        print(
            f"subagentctl: top needs the optional extra 'top' (rich): {INSTALL_HINT}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(
            "subagentctl: top needs a terminal; `subagentctl top --once` prints one frame",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        _unwrapped(trio.run, _top, socket, run, show_all, once, interval, as_json, order)
    except DaemonGone as exc:
        print(
            f"subagentctl: top: the daemon went away: {printable(str(exc), 1000)}", file=sys.stderr
        )
        return EXIT_NO_DAEMON
    except TransportError as exc:
        print(f"subagentctl: {printable(str(exc), 1000)}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except RemoteError as exc:
        print(f"subagentctl: {printable(str(exc), 1000)}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK
