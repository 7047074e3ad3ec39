"""subagentctl top: the daemon's workers (or one run's) as a live table, for a person.

One row per worker: its state (``stopping`` while a stop is in flight), run, id
indented under its parent, name, age, pid and the last line of its output. Keys
select a row, stop its worker (and subtree) or its run, and follow its journal.
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

import trio

from subagentd.protocol import TERMINAL_STATES, Entry, Page, WorkerView
from subagentd.protocol.errors import NotFound, RemoteError, TransportError

from . import _text
from ._async import AsyncClient
from ._text import ESCAPE

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

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
    """The last non-blank line of output among `entries` (None: they hold none); a line
    not yet ended by a newline counts."""
    data = b"".join(entry.data[-LINE_CHARS * 4 :] for entry in entries if entry.kind in _OUTPUT)
    for line in reversed(data.decode("utf-8", errors="replace").splitlines()):
        shown = printable(line).strip()
        if shown:
            return shown
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

    async def advance(self, daemon: AsyncClient, budget: Budget, want: int) -> list[Entry]:
        """The newest entries after the cursor, at most `want`: those between are skipped."""
        if self.complete:
            return []
        page = await budget.page(daemon, self.worker_id, self.cursor, want)
        self.complete = page.complete
        if not page.entries:
            return []
        self.cursor = page.next
        # A page may be short of `want` by its byte bound, not the end: ask what follows.
        if page.complete or not await self._exists(daemon, budget, self.cursor + 1):
            return page.entries
        end = await self._find_end(daemon, budget, self.cursor + 1)
        page = await budget.page(daemon, self.worker_id, max(end - want, self.cursor), want)
        self.complete = page.complete
        if page.entries:
            self.cursor = page.next
        return page.entries

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
    return "stopping" if view.stopping and view.state not in TERMINAL_STATES else view.state


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

    def rows(self) -> list[Row]:
        live = {view.id for view in self.views}
        kept = [view for worker_id, view in self.ended.items() if worker_id not in live]
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

KEYS = "up/down select  s stop  r stop run  f follow  q quit"


def frame(screen: Screen, now: float, height: int, *, live: bool = True) -> RenderableType:
    from rich.console import Group

    if screen.follow is not None:
        return _follow_frame(screen, screen.follow, height)
    rows = screen.rows()
    scope = f"run {screen.run}" if screen.run else "all runs"
    running = sum(1 for row in rows if row.view.state not in TERMINAL_STATES)
    title = _line(f"subagentd top: {scope}, {running} running, {len(rows)} shown", "bold")
    parts: list[RenderableType] = [title]
    if live:
        parts.append(_line(_footer(screen), "bold" if screen.asking else "dim"))
    if not rows:
        parts.append(_line("no workers" + (f" in run {screen.run}" if screen.run else "")))
        return Group(*parts)
    parts.append(_table(screen, _window(screen, rows, height - 4 if live else len(rows)), now))
    return Group(*parts)


def _line(text: str, style: str = "") -> RenderableType:
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


def _table(screen: Screen, rows: list[Row], now: float) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, expand=True, show_edge=False)
    table.add_column("STATE", no_wrap=True, min_width=8, max_width=11)
    table.add_column("RUN", no_wrap=True, max_width=14, overflow="ellipsis")
    table.add_column("WORKER", no_wrap=True, min_width=8, overflow="ellipsis")
    table.add_column("NAME", no_wrap=True, max_width=20, overflow="ellipsis")
    table.add_column("AGE", no_wrap=True, justify="right")
    table.add_column("PID", no_wrap=True, justify="right")
    table.add_column("LAST OUTPUT", no_wrap=True, ratio=1, overflow="ellipsis")
    for row in rows:
        view = row.view
        state = state_of(view)
        ended_at = view.ended_at if view.ended_at is not None else now
        table.add_row(
            Text(state, style=_STATE_STYLES.get(state, "")),
            Text(view.run),
            Text("  " * row.depth + view.id),
            Text(printable(view.name, 60)),
            Text(age(ended_at - view.started_at)),
            Text("" if view.pid is None else str(view.pid)),
            Text(screen.lines.get(view.id, "")),
            style="reverse" if view.id == screen.selected else None,
        )
    return table


_STATE_STYLES = {"running": "green", "stopping": "yellow", "failed": "red", "timed_out": "red"}


def _follow_frame(screen: Screen, follow: Follow, height: int) -> RenderableType:
    from rich.console import Group

    view = next((r.view for r in screen.rows() if r.view.id == follow.worker_id), None)
    state = "gone" if view is None else state_of(view)
    problem = f"  [{follow.problem}]" if follow.problem else ""
    head = _line(
        f"following {follow.worker_id} ({state})  f or Esc: back  q: quit{problem}", "bold"
    )
    shown = follow.shown()[-max(1, height - 1) :]
    return Group(head, *(_line(line) for line in shown))


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
        views = await self.daemon.ls(all=self.show_all, run=self.run)
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
        if line is not None:
            screen.lines[view.id] = line

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
        self, daemon: AsyncClient, reader: Reader, console: Console, interval: float
    ) -> None:
        self.daemon = daemon
        self.reader = reader
        self.console = console
        self.interval = interval
        self.screen = Screen(run=reader.run)
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
                    live.update(frame(self.screen, time.time(), self.height()), refresh=True)
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
    socket: str | None, run: str | None, show_all: bool, once: bool, interval: float
) -> None:
    from rich.console import Console

    async with AsyncClient(socket) as daemon:
        reader = Reader(daemon, run, show_all)
        try:
            if once:
                console = Console(highlight=False, soft_wrap=False)
                screen = Screen(run=run)
                await reader.read(screen, height=10**6)
                console.print(frame(screen, time.time(), 10**6, live=False))
                return
            await Top(daemon, reader, Console(highlight=False), interval).run()
        except* TransportError as lost:
            raise DaemonGone(lost.exceptions[0]) from lost


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
        _unwrapped(trio.run, _top, socket, run, show_all, once, interval)
    except DaemonGone as exc:
        print(f"subagentctl: top: the daemon went away: {exc}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except TransportError as exc:
        print(f"subagentctl: {exc}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except RemoteError as exc:
        print(f"subagentctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK
