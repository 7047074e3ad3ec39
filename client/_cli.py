"""subagentctl: the control CLI, one daemon request per command, over the blocking `Client`.

Each command asks the daemon and hands the answer to an `Output`: `Human`
prints for a person, `Json` prints for programs the shapes protocol/README.md fixes
(a view as on the wire; fields may be added, never renamed).
What `Human` prints passes through the one sanitiser (`_text`): tables, fields, previews,
matched lines and messages always; a worker's output (watch, collect) when it goes to a
terminal, while to a pipe or a file, or with --raw, it is the bytes as written.
Exit status: `EXIT_STATUS`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, BinaryIO, Protocol, TextIO

import msgspec

from subagentd.protocol import (
    MAX_BACKOFF,
    MAX_CPUS,
    MAX_GRACE,
    MAX_PIDS,
    MAX_PRIORITY,
    MAX_RETRIES,
    MAX_RUNNING,
    MAX_SEND_BYTES,
    MAX_TIMEOUT,
    MIN_CPUS,
    TERMINAL_STATES,
    Cancel,
    CancelFence,
    DaemonInfo,
    Entry,
    GrepResult,
    LimitError,
    Limits,
    ReloadReply,
    ResumableRun,
    Resume,
    Resumed,
    Stop,
    StopRun,
    Usage,
    WaitForResult,
    Wake,
    WorkerResult,
    WorkerView,
    cores,
    limits_text,
    memory_bytes,
    one_line_warnings,
    process_count,
)
from subagentd.protocol.errors import (
    Busy,
    Invalid,
    NotFound,
    ProtocolError,
    Refused,
    RemoteError,
    TransportError,
)

from . import _core, _top
from ._figures import cpu_text, memory_now_and_peak, memory_text, percent_text
from ._sync import Client
from ._text import PrintableStream, printable, printable_lines
from ._when import SINCE_SYNTAX, parse_since

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_NO_DAEMON = 3  # (2, a usage error, is argparse's own)
EXIT_NO_MATCH = 4  # grep found nothing; wait --for: the worker ended without the line
EXIT_TIMED_OUT = 5  # wait --for: the timeout passed first
#: How long `send` keeps offering what a worker's full stdin will not take.
SEND_PATIENCE = 10.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what any filter whose reader went away exits with
EXIT_STATUS = (
    "Exit status: 0 done; 1 refused or not found; 2 usage; 3 no daemon at the socket; "
    "4 no line matched (grep; wait --for: the worker ended first); 5 timed out (wait --for); "
    "130 interrupted (Ctrl-C); 141 the reader of its output went away."
)
#: How a worker's own text reaches a person, and where its bytes stay for a program.
CLEAN_TEXT = (
    "What a worker wrote or named is shown cleaned: escape sequences removed, other control "
    "and formatting characters as ?, so it cannot drive your terminal. Tables, fields, "
    "previews, matched lines and messages are always cleaned; a worker's output (watch, "
    "collect) is cleaned on a terminal and written as the bytes it wrote to a pipe or a "
    "file, or with --raw. --json carries every string raw (JSON escapes it)."
)

WORKER_FIELDS = (
    "id",
    "run",
    "parent",
    "name",
    "state",
    "pid",
    "exit_code",
    "attempt",
    "turn",
    "started_at",
    "ended_at",
    "archive",
    "stopping",
    "paused",
    "queued",
    "queue_position",
)
WAKE_FIELDS = ("id", "run", "parent", "state", "exit_code", "preview", "attempt", "reason")
RELOAD_FIELDS = ("image_generation", "carried_live", "stopped_by_reload")
#: What `info` says of each way of deciding whom a connection acts as.
AUTHORITY_MEANS = {
    "kernel": "kernel (a process inside a worker's cgroup acts as that worker, whatever "
    "token it gives or omits; only one outside every worker's acts for the user)",
    "token": "token (advisory: no cgroups, so a connection is whom its token says, and a "
    "worker's process that omits its token acts for the user)",
}


# -- output --------------------------------------------------------------------


class Output(Protocol):
    def worker(self, view: WorkerView) -> None: ...
    def spawned(self, view: WorkerView) -> None: ...
    def resumed(self, view: Resumed) -> None: ...
    def latest(self, answer: ResumableRun) -> None: ...
    def ended(self, view: WorkerView) -> None: ...
    def workers(self, views: list[WorkerView]) -> None: ...
    def run(self, run_id: str) -> None: ...
    def stopped(self, ids: list[str], already_stopping: list[str]) -> None: ...
    def cancelled(self, ids: list[str], already_stopping: list[str]) -> None: ...
    def paused(
        self, verb: str, ids: list[str], already: list[str], outside: dict[str, int] | None = None
    ) -> None: ...
    def turn(self, turn: int) -> None: ...
    def fence(self, epoch: int | None) -> None: ...
    def reopened(self, run: str) -> None: ...
    def entry(self, entry: Entry) -> None: ...
    def entries_end(self) -> None: ...
    def wake(self, wake: Wake) -> None: ...
    def no_wakes(self, parent: str) -> None: ...
    def result(self, result: WorkerResult) -> None: ...
    def info(self, info: DaemonInfo) -> None: ...
    def reloaded(self, reply: ReloadReply) -> None: ...
    def error(self, exc: RemoteError | ProtocolError) -> None: ...
    def grep_found(self, found: GrepResult) -> None: ...
    def waited_for(self, waited: WaitForResult) -> None: ...
    def sent(self, worker_id: str, written: int, eof: bool) -> None: ...


class Human:
    """Output for a person: a line, a table or key: value lines, each cleaned (`printable`);
    a worker's output cleaned on a terminal, as its bytes elsewhere or when `raw`."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        #: Each output stream of a watch, cleaned across the journal's entries.
        self._streams = {"stdout": PrintableStream(), "stderr": PrintableStream()}

    def _cleans(self, stream: TextIO) -> bool:
        """Whether a worker's output written to `stream` is cleaned: it reaches a person."""
        return not self.raw and stream.isatty()

    def worker(self, view: WorkerView) -> None:
        _print_fields(
            [
                ("id", view.id),
                ("run", view.run),
                ("parent", view.parent),
                ("name", view.name),
                ("state", _state(view)),
                ("limits", limits_text(view.limits)),
                ("pid", view.pid),
                *_usage_fields(view.usage),
                ("exit_code", view.exit_code),
                ("attempt", view.attempt),
                ("ready", "yes" if view.ready else None),
                ("retries", view.retries or None),
                ("retry_at", _time(view.retry_at)),
                ("turn", view.turn),
                ("started_at", _time(view.started_at)),
                ("ended_at", _time(view.ended_at)),
                ("archive", view.archive),
                ("agent", view.agent),
                ("command", shlex.join(view.argv)),
                ("cwd", view.cwd),
            ]
        )

    def spawned(self, view: WorkerView) -> None:
        worker_id = printable(view.id)
        print(f"{worker_id} (run {printable(view.run)})")
        if view.queued:
            print(
                f"subagentctl: {worker_id} is {_state(view)}: over a cap on workers running "
                "at once, it starts in its turn",
                file=sys.stderr,
            )
        if view.state in TERMINAL_STATES:
            # Registered but never run: a cancelled launch fence, or an exec that failed.
            print(
                f"subagentctl: {worker_id} is already {view.state}; "
                f"`subagentctl watch {worker_id}` says why",
                file=sys.stderr,
            )

    def resumed(self, view: Resumed) -> None:
        self.spawned(view)
        if view.changed:  # it runs its snapshot all the same
            print(f"  changed since its spawn: {printable(view.changed)}")

    def latest(self, answer: ResumableRun) -> None:
        _print_fields(
            [
                ("run", answer.run),
                ("resumable", answer.resumable),
                ("reason", answer.reason),
                ("from", ", ".join(answer.from_)),
            ]
        )

    def ended(self, view: WorkerView) -> None:
        exit_code = "" if view.exit_code is None else f", exit code {view.exit_code}"
        print(f"{printable(view.id)} {_state(view)}{exit_code}")

    def workers(self, views: list[WorkerView]) -> None:
        rows = [["ID", "RUN", "STATE", "PID", "EXIT", "CPU%", "MEM", "NAME"]]
        for w in views:
            percent = None if w.usage is None else w.usage.cpu_percent
            memory = None if w.usage is None else w.usage.memory
            values = (
                w.id,
                w.run,
                _state(w),
                _or_dash(w.pid),
                _or_dash(w.exit_code),
                percent_text(percent),
                memory_text(memory),
                w.name,
            )
            rows.append([printable(value) for value in values])
        # Every column but the last, the free-form name, is padded to its widest cell.
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
        for *cells, name in rows:
            padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=True)]
            print("  ".join([*padded, name]))

    def run(self, run_id: str) -> None:
        print(printable(run_id))

    def stopped(self, ids: list[str], already_stopping: list[str]) -> None:
        _said_stopping(already_stopping)
        if not ids and not already_stopping:
            print("nothing was left running to stop", file=sys.stderr)
        for worker_id in ids:
            print(printable(worker_id))

    def cancelled(self, ids: list[str], already_stopping: list[str]) -> None:
        _said_stopping(already_stopping)
        if not ids and not already_stopping:
            print("nothing was left running to cancel", file=sys.stderr)
        for worker_id in ids:
            print(printable(worker_id))

    def paused(
        self, verb: str, ids: list[str], already: list[str], outside: dict[str, int] | None = None
    ) -> None:
        # The ids this one changed on stdout; those that already were, and what a pause
        # held outside a worker's cgroup, on stderr.
        for worker_id in already:
            print(f"{printable(worker_id)} already {verb}d", file=sys.stderr)
        for worker_id, count in sorted((outside or {}).items()):
            said = "process" if count == 1 else "processes"
            print(
                f"{printable(worker_id)}: {count} {said} outside its cgroup held by SIGSTOP",
                file=sys.stderr,
            )
        for worker_id in ids:
            print(printable(worker_id))

    def turn(self, turn: int) -> None:
        print(turn)

    def fence(self, epoch: int | None) -> None:
        if epoch is not None:  # a cleared fence is said by the exit status alone
            print(epoch)

    def reopened(self, run: str) -> None:
        print(f"run {printable(run)} reopened: it accepts spawns again")

    def entry(self, entry: Entry) -> None:
        match entry.kind:
            case "stdout" | "stderr" as kind:
                stream = sys.stdout if kind == "stdout" else sys.stderr
                if self._cleans(stream):
                    _write(stream.buffer, self._streams[kind].feed(entry.data).encode())
                else:
                    _write(stream.buffer, entry.data)
            case kind:
                line = b"[%s] %s\n" % (kind.encode(), entry.data.rstrip(b"\n"))
                if self._cleans(sys.stderr):
                    line = printable_lines(line.decode(errors="replace")).encode()
                _write(sys.stderr.buffer, line)

    def entries_end(self) -> None:
        for kind, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            if self._cleans(stream):
                _write(stream.buffer, self._streams[kind].end().encode())

    def wake(self, wake: Wake) -> None:
        state = f"{wake.state} ({wake.reason})" if wake.reason else wake.state
        words = [wake.id, state, f"exit={_or_dash(wake.exit_code)}"]
        if wake.attempt > 1:
            words.append(f"attempt={wake.attempt}")
        if preview := _one_line(wake.preview):
            words.append(preview)
        print(" ".join(words), flush=True)  # flushed before it is acknowledged

    def no_wakes(self, parent: str) -> None:
        print(f"no wakes pending for {printable(parent)}", file=sys.stderr)

    def result(self, result: WorkerResult) -> None:
        text = printable_lines(result.result) if self._cleans(sys.stdout) else result.result
        sys.stdout.write(text if not text or text.endswith("\n") else text + "\n")

    def info(self, info: DaemonInfo) -> None:
        counts = ", ".join(f"{state} {count}" for state, count in sorted(info.workers.items()))
        _print_fields(
            [
                ("version", info.version),
                ("protocol", info.protocol),
                ("pid", info.pid),
                ("image_generation", info.image_generation),
                ("reloads", info.reloads),
                ("workers", counts or "none"),
                ("queued", info.queued),
                ("max_running", "no cap" if info.max_running is None else info.max_running),
                *_usage_fields(info.usage, "workers_"),
                *_recovering_field(info),
                ("holds_park", info.holds_park),
                ("tree_tracking", info.tree_tracking),
                *_relays_field(info),
                *_controls_fields(info),
                ("authority", AUTHORITY_MEANS.get(info.authority, info.authority)),
                ("caller", info.caller or "the user"),
                ("socket", info.socket),
                ("state_dir", info.state_dir),
                *(("problem", problem) for problem in info.problems),
            ]
        )

    def reloaded(self, reply: ReloadReply) -> None:
        stopped = ", ".join(reply.stopped_by_reload) or "none"
        print(
            f"image generation {reply.image_generation}: carried {reply.carried_live} live, "
            f"stopped by reload: {printable(stopped)}"
        )

    def error(self, exc: RemoteError | ProtocolError) -> None:
        _said(exc)

    def grep_found(self, found: GrepResult) -> None:
        """As grep -n prints: `N:line` for a match, `N-line` around it, `--` between."""
        for index, match in enumerate(found.matches):
            if index and (match.before or found.matches[index - 1].after):
                print("--")
            first = match.line_no - len(match.before)
            for offset, line in enumerate(match.before):
                print(f"{first + offset}-{_one_line(line)}")
            print(f"{match.line_no}:{_one_line(match.line)}")
            for offset, line in enumerate(match.after, start=1):
                print(f"{match.line_no + offset}-{_one_line(line)}")
        if found.truncated:
            reached = "--max" if found.next is not None else "the 64 MiB a grep scans"
            inside = ", inside a line whose end lies past it" if found.stopped_in_line else ""
            print(
                f"subagentctl: there may be more matches ({reached} was reached{inside})",
                file=sys.stderr,
            )

    def waited_for(self, waited: WaitForResult) -> None:
        view = waited.worker
        if waited.outcome == "matched":
            print(_one_line(waited.line or ""))
        elif waited.outcome == "ended":
            self.ended(view)
            print(f"subagentctl: {view.id} ended before a line matched", file=sys.stderr)
        else:
            print(f"subagentctl: timed out; {view.id} is {_state(view)}", file=sys.stderr)

    def sent(self, worker_id: str, written: int, eof: bool) -> None:
        closed = ", then closed its stdin" if eof else ""
        print(f"{printable(worker_id)}: wrote {written} bytes{closed}")


class Json:
    """Output for a program: one JSON document per answer, one line per entry when streaming."""

    def worker(self, view: WorkerView) -> None:
        _dump(msgspec.to_builtins(view))  # as on the wire: every field `status` shows, and more

    spawned = ended = resumed = worker

    def latest(self, answer: ResumableRun) -> None:
        _dump(msgspec.to_builtins(answer))  # run, resumable, reason, from

    def workers(self, views: list[WorkerView]) -> None:
        for view in views:
            self.worker(view)

    def run(self, run_id: str) -> None:
        _dump({"run": run_id})

    def stopped(self, ids: list[str], already_stopping: list[str]) -> None:
        _dump({"stopped": ids, "already_stopping": already_stopping})

    def cancelled(self, ids: list[str], already_stopping: list[str]) -> None:
        _dump({"cancelled": ids, "already_stopping": already_stopping})

    def paused(
        self, verb: str, ids: list[str], already: list[str], outside: dict[str, int] | None = None
    ) -> None:
        shown: dict[str, object] = {f"{verb}d": ids, f"already_{verb}d": already}
        if outside is not None:
            shown["held_outside"] = outside
        _dump(shown)

    def turn(self, turn: int) -> None:
        _dump({"turn": turn})

    def fence(self, epoch: int | None) -> None:
        _dump({"epoch": epoch})

    def reopened(self, run: str) -> None:
        _dump({"run": run, "reopened": True})

    def entry(self, entry: Entry) -> None:
        data = entry.data.decode(errors="replace")
        _dump({"seq": entry.seq, "kind": entry.kind, "data": data, "at": entry.at})

    def entries_end(self) -> None:
        pass  # each entry was a whole line

    def wake(self, wake: Wake) -> None:
        _dump({field: getattr(wake, field) for field in WAKE_FIELDS})

    def no_wakes(self, parent: str) -> None:
        pass  # no line at all: a program reads an empty stream

    def result(self, result: WorkerResult) -> None:
        _dump(msgspec.structs.asdict(result))

    def info(self, info: DaemonInfo) -> None:
        _dump(msgspec.to_builtins(info))  # every field the daemon answers, as `info` shows them

    def reloaded(self, reply: ReloadReply) -> None:
        _dump({field: getattr(reply, field) for field in RELOAD_FIELDS})

    def error(self, exc: RemoteError | ProtocolError) -> None:
        code = exc.code if isinstance(exc, RemoteError) else "protocol"
        message = exc.message if isinstance(exc, RemoteError) else str(exc)
        error: dict[str, object] = {"code": code, "message": message}
        if isinstance(exc, RemoteError) and exc.stopped_by_reload:  # a reload that failed
            error["stopped_by_reload"] = exc.stopped_by_reload
        _dump({"error": error})

    def grep_found(self, found: GrepResult) -> None:
        _dump(msgspec.to_builtins(found))

    def waited_for(self, waited: WaitForResult) -> None:
        worker = msgspec.to_builtins(waited.worker)
        _dump({"outcome": waited.outcome, "line": waited.line, "worker": worker})

    def sent(self, worker_id: str, written: int, eof: bool) -> None:
        _dump({"worker": worker_id, "written": written, "eof": eof})


def _dump(document: dict[str, Any]) -> None:
    sys.stdout.write(msgspec.json.encode(document).decode() + "\n")
    sys.stdout.flush()  # a program following a watch reads each line as it comes


def _write(stream: BinaryIO, data: bytes) -> None:
    stream.write(data)
    stream.flush()


def _one_line(text: str) -> str:
    """`text` on one line, cleaned by the one sanitiser (`printable`): its line breaks
    written ``\\n`` so that a preview of several lines still reads as them."""
    return printable(text.rstrip().replace("\n", "\\n"))


def _said(exc: BaseException) -> None:
    """An error on stderr, cleaned: a daemon's message may quote a worker's name or text."""
    print(f"subagentctl: {printable_lines(str(exc))}", file=sys.stderr)


def _state(view: WorkerView) -> str:
    """Its state as a person reads it: `stopping` while a stop is in flight, `paused`
    while paused, `retrying (attempt N)` while it waits out a retry's backoff, `queued #N`
    while it waits its turn (N its place in the queue), and why
    it ended beyond its state ("failed (memory_limit)")."""
    if view.stopping:
        return "stopping"
    if view.paused:
        return "paused"
    if view.retry_at is not None:
        return f"retrying (attempt {view.attempt})"
    if view.queued:
        return "queued" if view.queue_position is None else f"queued #{view.queue_position}"
    if view.ready and view.state not in TERMINAL_STATES:
        return f"{view.state} (ready)"
    return f"{view.state} ({view.reason})" if view.reason else view.state


def _said_stopping(ids: list[str]) -> None:
    """Workers a stop or cancel reached whose stop was already in flight: on stderr, so
    stdout still lists only the ids this one stopped."""
    for worker_id in ids:
        print(f"{printable(worker_id)} already stopping", file=sys.stderr)


def _print_fields(fields: Iterable[tuple[str, object]]) -> None:
    for key, value in fields:
        print(f"{key}: {printable(_or_dash(value))}")


def _or_dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _time(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


# -- commands ------------------------------------------------------------------


def spawn(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    text: str | None = args.input
    worker_input: str | bytes | None = sys.stdin.buffer.read() if text == "-" else text
    worker = daemon.spawn(
        args.argv,
        name=args.name,
        run=args.run,
        parent=args.parent,
        agent=args.agent,
        input=worker_input,
        cwd=args.cwd,
        env=dict(args.env),
        timeout=args.timeout,
        grace=args.grace,
        key=args.key,
        stdin_open=args.stdin == "open",
        limits=_limits(args),
        priority=args.priority,
        retries=args.retries,
        backoff=args.backoff[0],
        backoff_max=args.backoff[1],
        retry_on=args.retry_on,
        ready=args.ready,
        after=args.after,
        after_ok=args.after_ok,
        after_ready=args.after_ready,
    )
    out.spawned(worker)


def new_run(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.run(daemon.new_run(args.outer, limits=_limits(args), max_running=args.max_running))


def _limits(args: argparse.Namespace) -> Limits | None:
    limits = Limits(memory=args.memory, cpus=args.cpus, pids=args.pids)
    return limits if limits else None


def ls(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.workers(daemon.ls(all=args.all, run=args.run, usage=True))


def status(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.worker(daemon.status(args.worker))


def stop(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    # Not Client.stop or stop_run: they answer only whether the worker was found, or the ids
    # stopped, and we print what stopped and what was already stopping.
    wait = not args.no_wait
    if args.run is not None:
        asked_run = StopRun(id=0, run=args.run, wait=wait)
        answer = _core.answer(asked_run, daemon.request(asked_run))
        if not answer.found:
            raise _core.unknown_run(args.run)
    else:
        asked = Stop(id=0, worker=args.worker, wait=wait)
        answer = _core.answer(asked, daemon.request(asked))
        if not answer.found:
            raise _core.unknown_worker(args.worker)
    out.stopped(answer.stopped, answer.already_stopping)


def pause(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    answer = daemon.pause(worker=args.worker, run=args.run)
    out.paused("pause", answer.paused, answer.already_paused, answer.held_outside)


def unpause(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    answer = daemon.unpause(worker=args.worker, run=args.run)
    out.paused("unpause", answer.unpaused, answer.already_unpaused)


def watch(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    for entry in daemon.watch(args.worker, since=args.since, follow=args.follow):
        out.entry(entry)
    out.entries_end()


def events(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    printed = 0
    # Acknowledged only once printed and flushed: a reader that went away (or a Ctrl-C)
    # before that leaves the wake pending for the next `events`.
    for wake in daemon.events(run=args.run, worker=args.worker, follow=args.follow, ack=False):
        out.wake(wake)
        daemon.ack([wake.seq])
        printed += 1
    if not printed:
        out.no_wakes(f"run {args.run}" if args.run is not None else f"worker {args.worker}")


def collect(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.result(daemon.collect(args.worker, wait=args.wait))


def wait(daemon: Client, args: argparse.Namespace, out: Output) -> int | None:
    if args.ready:
        view = daemon.wait(args.worker, ready=True)
        out.worker(view)
        return EXIT_OK if view.ready else EXIT_NO_MATCH
    if args.pattern is None:
        out.ended(daemon.wait(args.worker))
        return None
    timeout = MAX_TIMEOUT if args.timeout is None else args.timeout
    waited = daemon.wait_for(args.worker, args.pattern, timeout=timeout)
    out.waited_for(waited)
    return {"matched": EXIT_OK, "ended": EXIT_NO_MATCH}.get(waited.outcome, EXIT_TIMED_OUT)


def grep(daemon: Client, args: argparse.Namespace, out: Output) -> int:
    written_since = None
    if args.written_since is not None:
        try:
            written_since = parse_since(args.written_since, time.time())
        except ValueError as exc:
            raise Invalid(f"--written-since: {exc}") from None
    # Answer by answer (each bounded in bytes by the daemon), up to --max matches in all.
    found = daemon.grep_all(
        args.worker,
        args.pattern,
        before=args.before,
        after=args.after,
        limit=args.max,
        written_since=written_since,
        stream=args.stream,
    )
    out.grep_found(found)
    return EXIT_OK if found.matches else EXIT_NO_MATCH


def send(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    """All of the data, in requests the protocol allows, waiting while the worker's stdin
    is full (up to SEND_PATIENCE seconds without progress); then --eof."""
    text: str | None = args.text
    data = sys.stdin.buffer.read() if text == "-" else (text or "").encode()
    written = 0
    patience = time.monotonic() + SEND_PATIENCE
    while True:
        chunk = data[written : written + MAX_SEND_BYTES]
        last = written + len(chunk) == len(data)
        try:
            took = daemon.send(args.worker, chunk, eof=args.eof and last)
        except Busy as exc:
            if time.monotonic() >= patience:
                raise Busy(
                    f"worker {args.worker} took {written} of {len(data)} bytes; its stdin "
                    f"stayed full for {SEND_PATIENCE:.0f} s (is it reading?)"
                ) from exc
            time.sleep(exc.retry_after or 0.1)
            continue
        if took:
            patience = time.monotonic() + SEND_PATIENCE
        written += took
        if written == len(data) and (took == len(chunk)):
            break
    out.sent(args.worker, written, args.eof)


def _controls_fields(info: DaemonInfo) -> list[tuple[str, object]]:
    """Each limit's kind, and the freeze of a pause: enforced or not, and how."""
    return [
        (f"control_{kind}", f"{'enforced' if c.enforced else 'not enforced'}: {c.how}")
        for kind, c in info.controls.items()
    ]


def _relays_field(info: DaemonInfo) -> list[tuple[str, object]]:
    """The output relays, where any runs: how many pipes they hold of how many."""
    relays = info.relays
    if relays is None or not relays.pids:
        return []
    pids = ", ".join(str(pid) for pid in relays.pids)
    return [
        (
            "relays",
            f"{relays.streams:,} pipes of {relays.capacity:,} (pid {pids}); workers whose "
            f"pipes come at descriptor {relays.relay_above:,} or above are relayed",
        )
    ]


def _usage_fields(usage: Usage | None, whose: str = "") -> list[tuple[str, object]]:
    """What a worker (or, in `info`, the live workers together) takes: none if not read."""
    if usage is None:
        return []
    return [
        (f"{whose}cpu", cpu_text(usage)),
        (f"{whose}memory", memory_now_and_peak(usage)),
        (f"{whose}processes", usage.processes),
        (f"{whose}usage_from", usage.source),
    ]


def _recovering_field(info: DaemonInfo) -> list[tuple[str, object]]:
    """While a restart recovers: how far along (every other request then waits for it)."""
    at = info.recovering
    if at is None:
        return []
    return [("recovering", f"{at.phase}: {at.done} of {at.total}, {at.seconds:.1f} s so far")]


def info(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.info(daemon.info(usage=True))


def turn(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.turn(daemon.begin_turn())


def cancel(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    _cancelled(daemon, Cancel(id=0, scope=args.scope), out)


def _cancelled(daemon: Client, asked: Cancel | CancelFence, out: Output) -> None:
    """Not Client.cancel: we print what was already stopping too."""
    answer = _core.answer(asked, daemon.request(asked))
    out.cancelled(answer.cancelled, answer.already_stopping)


def fence(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    if args.cancel is not None:
        _cancelled(daemon, CancelFence(id=0, epoch=args.cancel), out)
    elif args.clear:
        daemon.clear_fence()
        out.fence(None)
    else:
        out.fence(daemon.set_fence())


def reopen(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    daemon.reopen_run(args.run)
    out.reopened(args.run)


def reload(daemon: Client, args: argparse.Namespace, out: Output) -> None:
    out.reloaded(daemon.reload())


def resume(daemon: Client, args: argparse.Namespace, out: Output) -> int | None:
    if args.latest:
        return _resume_latest(daemon, args, out)
    if args.run is not None:
        _resumed(daemon.resume_run(args.run), out)
    elif args.input is None and not args.argv and args.model is None:
        out.resumed(daemon.resume(args.worker, timeout=args.timeout, key=args.key))
    else:
        # Sent all the same, for the daemon to say why it will not (frozen): one refusal,
        # one message, whichever client asks.
        given = Resume(
            id=0,
            worker=args.worker,
            timeout=args.timeout,
            input=args.input.encode() if args.input is not None else None,
            argv=args.argv or None,
            model=args.model,
        )
        out.spawned(_core.answer(given, daemon.request(given)).worker)
    return None


def _resume_latest(daemon: Client, args: argparse.Namespace, out: Output) -> int:
    """`resume --latest`: the newest resumable run started here; `--dry-run`: only say it."""
    here = os.getcwd()
    try:
        latest = daemon.latest_resumable(here)
    except NotFound:
        raise NotFound(f"no run with a snapshot to resume from was started in {here}") from None
    if args.dry_run:
        out.latest(latest)
        return EXIT_OK if latest.resumable else EXIT_REFUSED
    if not latest.resumable:
        raise Refused(
            f"the newest run started in {here}, {latest.run}, would not resume: {latest.reason}"
        )
    _resumed(daemon.resume_run(latest.run), out)
    return EXIT_OK


def _resumed(workers: list[Resumed], out: Output) -> None:
    if not workers:
        print("nothing in that run was left to resume", file=sys.stderr)
    for worker in workers:
        out.resumed(worker)


RAW_HELP = "write the worker's bytes as they are, even to a terminal (they may drive it)"

#: A command; what it returns, if anything, is its exit status.
Command = Callable[[Client, argparse.Namespace, Output], int | None]


def _limit_flag(read: Callable[[object], object]) -> Callable[[str], object]:
    """An argparse type from a limit's parser (`memory_bytes`...): its error, as it says it."""

    def parse(text: str) -> object:
        try:
            return read(text)
        except LimitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = read.__name__
    return parse


def _limit_flags(sub: argparse.ArgumentParser, whose: str) -> None:
    """--memory, --cpus, --pids: what `whose` may take together."""
    group = sub.add_argument_group(
        "limits",
        f"What {whose} may take together, enforced by the kernel (cgroups): refused if "
        "this daemon cannot (subagentctl info lists what it enforces, and how).",
    )
    group.add_argument(
        "--memory",
        metavar="SIZE",
        type=_limit_flag(memory_bytes),
        help="memory, as 512M, 1.5G, 2GiB or bytes (1M to 1P): past it the kernel kills "
        "in it, and a worker so killed ends failed (memory_limit)",
    )
    group.add_argument(
        "--cpus",
        metavar="N",
        type=_limit_flag(cores),
        help=f"CPU, in cores ({MIN_CPUS} to {MAX_CPUS:g}; 1.5 is a core and a half)",
    )
    group.add_argument(
        "--pids",
        metavar="N",
        type=_limit_flag(process_count),
        help=f"processes and threads at once (1 to {MAX_PIDS}): a fork past it fails",
    )


def _ids(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _backoff(text: str) -> tuple[float, float | None]:
    """--backoff S or S:MAX: seconds, the daemon checks their bounds (nan, inf, negative)."""
    first, colon, most = text.partition(":")
    try:
        return float(first), float(most) if colon else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S or S:MAX in seconds, got {text!r}") from None


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected K=V, got {text!r}")
    return key, value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="subagentctl",
        description="Control subagentd: spawn, watch, stop and collect supervised workers.",
        epilog=f"{CLEAN_TEXT} {EXIT_STATUS}",
    )
    top.add_argument(
        "--socket",
        metavar="PATH",
        help="the daemon's socket (default: $SUBAGENTD_SOCKET, else the per-user runtime dir)",
    )
    json_help = "print JSON: one document per answer, one line per entry when streaming"
    top.add_argument("--json", action="store_true", help=json_help)
    commands = top.add_subparsers(metavar="COMMAND", required=True)

    def command(
        name: str, run: Command, summary: str, details: str = ""
    ) -> argparse.ArgumentParser:
        description = f"{summary} {details}" if details else summary
        sub = commands.add_parser(name, help=summary, description=description)
        # The parser too, so that a check argparse cannot express reports with this command's usage.
        sub.set_defaults(command=run, parser=sub)
        # After the command as before it; not given here, the one before it stands.
        sub.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=json_help)
        return sub

    sub = command(
        "spawn",
        spawn,
        "Start a worker running CMD (or the agent named by --agent) and print its id and run.",
    )
    sub.add_argument("--run", metavar="R", help="the run to start it in (default: a new run)")
    sub.add_argument("--parent", metavar="W", help="the worker that delegated it")
    sub.add_argument("--name", metavar="N", default="", help="a name to tell it by")
    sub.add_argument("--agent", metavar="A", help="an agent from agents.toml to run")
    sub.add_argument("--input", metavar="TEXT", help="its stdin; - reads it from this stdin")
    sub.add_argument("--cwd", metavar="D", help="its working directory (default: this one)")
    sub.add_argument(
        "--env",
        metavar="K=V",
        type=_env_pair,
        action="append",
        default=[],
        help="an environment variable for it; repeat for more",
    )
    sub.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        help=f"seconds before it is stopped (0 to {MAX_TIMEOUT:.0f}; 0: never)",
    )
    sub.add_argument(
        "--grace",
        metavar="S",
        type=float,
        help=f"seconds between TERM and KILL (0 to {MAX_GRACE:.0f}; default: the agent's, else 5)",
    )
    sub.add_argument(
        "--key",
        metavar="K",
        help="an idempotency key (printable, no space, at most 128): run again with the same "
        "key, the command answers the worker the first run made, not a new one "
        "(default: a new random key, so a reload never makes a second worker)",
    )
    sub.add_argument(
        "--stdin",
        choices=["open"],
        help="open: keep its stdin a pipe the daemon holds, for `subagentctl send` "
        "(carried across a reload); not with --input",
    )
    sub.add_argument(
        "--priority",
        metavar="P",
        type=int,
        default=0,
        help=f"over a cap on workers running at once (its run's --max-running, its agent's "
        f"max_running, the daemon's), where it waits: higher first, then first in "
        f"(-{MAX_PRIORITY} to {MAX_PRIORITY}; default: 0)",
    )
    sub.add_argument(
        "--ready",
        metavar="PATTERN",
        help="mark it ready once a line of its output matches PATTERN (RE2, as wait --for): "
        "shown in status and ls, kept across reloads; `subagentctl wait --ready` waits for it",
    )
    for flag, meaning in (
        ("--after", "have all ended"),
        (
            "--after-ok",
            "have all finished with exit 0 (else it ends stopped (skipped), naming which)",
        ),
        ("--after-ready", "are all ready (their spawn --ready matched)"),
    ):
        sub.add_argument(
            flag,
            metavar="W1,W2",
            type=_ids,
            default=[],
            help=f"start it (queued until then) once these workers {meaning}",
        )
    sub.add_argument(
        "--retries",
        metavar="N",
        type=int,
        default=0,
        help=f"when it ends failed (a non-zero exit, or memory_limit), start it again, up to "
        f"N times (0 to {MAX_RETRIES}): the same id, from its snapshot, after --backoff; its "
        "parent is woken once, when the last attempt ends; a stop ends the retries",
    )
    sub.add_argument(
        "--backoff",
        metavar="S[:MAX]",
        type=_backoff,
        default=(1.0, None),
        help=f"seconds before the first retry, doubling each time up to MAX (0 to "
        f"{MAX_BACKOFF:.0f}; default: 1, up to a day)",
    )
    sub.add_argument(
        "--retry-on",
        choices=["timeout"],
        action="append",
        default=[],
        help="retry a worker that timed out too (not retried unless asked)",
    )
    _limit_flags(sub, "it and every worker it delegates (over its agent's limits)")
    sub.add_argument("argv", nargs="*", metavar="CMD", help="the command, after --")

    sub = command("new-run", new_run, "Create a run and print its id.")
    sub.add_argument("--outer", metavar="R", help="nest it under run R: stopping R stops it too")
    sub.add_argument(
        "--max-running",
        metavar="N",
        type=int,
        help=f"run at most N of its workers at once (1 to {MAX_RUNNING}): a spawn over it is "
        "answered at once, queued (ls shows `queued #K`), and starts as one of them ends, "
        "first in first out (or by --priority); a stop of the run ends the queued unstarted",
    )
    _limit_flags(sub, "the run's workers")

    sub = command(
        "ls", ls, "List the running workers (with --all, the retained finished ones too)."
    )
    sub.add_argument("--all", action="store_true", help="include finished workers")
    sub.add_argument("--run", metavar="R", help="only the workers of run R")

    sub = command("status", status, "Show one worker.")
    sub.add_argument("worker", metavar="ID")

    sub = command(
        "stop",
        stop,
        "Stop a worker and everything it delegated, or a whole run, and print the ids stopped.",
    )
    target = sub.add_mutually_exclusive_group(required=True)
    target.add_argument("worker", metavar="ID", nargs="?", help="the worker to stop")
    target.add_argument("--run", metavar="R", help="stop every worker of run R instead")
    sub.add_argument(
        "--no-wait", action="store_true", help="return without waiting for the processes to exit"
    )

    for verb, does, held in (
        ("pause", pause, "Hold a worker and everything it delegated, or a whole run, still"),
        ("unpause", unpause, "Let a paused worker and what it delegated, or a run, go on"),
    ):
        sub = command(
            verb,
            does,
            f"{held}, and print the ids {verb}d.",
            "A paused worker's processes keep their pids, pipes and memory; the kernel "
            "freezes its cgroup (or, without cgroups, the daemon sends its process tree "
            "SIGSTOP, and SIGCONT to unpause). Its timeout does not run while it is paused; "
            "a stop ends it at once. Those that already were are said on stderr.",
        )
        target = sub.add_mutually_exclusive_group(required=True)
        target.add_argument("worker", metavar="ID", nargs="?", help=f"the worker to {verb}")
        target.add_argument("--run", metavar="R", help=f"{verb} every live worker of run R")

    sub = command(
        "watch",
        watch,
        "Print a worker's journal: its output, state changes and notes.",
        "Its stdout goes to stdout; its stderr, and the journal's other entries as lines "
        "`[state] ...`, `[note] ...`, `[stdin] ...`, go to stderr, so stdout holds only what "
        "it wrote to its stdout. On a terminal that output is cleaned of escape sequences "
        "and control characters; to a pipe or a file, or with --raw, it is the bytes the "
        "worker wrote. --json prints every entry (seq, kind, data, at) on stdout, one line each.",
    )
    sub.add_argument("worker", metavar="ID")
    sub.add_argument("--since", metavar="N", type=int, default=0, help="start after cursor N")
    sub.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the worker ends"
    )
    sub.add_argument("--raw", action="store_true", help=RAW_HELP)

    sub = command(
        "events",
        events,
        "Print the wakes of one parent: each ending of a run's top-level worker, or of a "
        "worker's delegated children.",
        "Each wake is acknowledged as soon as it is printed, and is then never printed "
        "again, here or by any other subscriber; a wake not yet printed (the command "
        "interrupted, its reader gone) stays pending for the next `events`. Without -f, "
        "prints what is pending and exits. A line reads ID STATE exit=CODE PREVIEW, the "
        "preview being the start of the worker's result; --json prints id, run, parent, "
        "state, exit_code and preview.",
    )
    parent = sub.add_mutually_exclusive_group(required=True)
    parent.add_argument("--run", metavar="R", help="the wakes of run R's top-level workers")
    parent.add_argument("--worker", metavar="W", help="the wakes of the workers W delegated")
    sub.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing wakes as workers end, until Ctrl-C",
    )

    sub = command(
        "collect",
        collect,
        "Print a worker's result and mark it collected.",
        "On a terminal the result is cleaned of escape sequences and control characters; "
        "to a pipe or a file (`collect W > result.txt`), or with --raw, it is printed as "
        "the worker wrote it. --json prints id, state, exit_code and result (raw).",
    )
    sub.add_argument("worker", metavar="ID")
    sub.add_argument("--wait", action="store_true", help="wait for the worker to end first")
    sub.add_argument("--raw", action="store_true", help=RAW_HELP)

    sub = command(
        "wait",
        wait,
        "Block until a worker ends, then print how it ended; with --for, until a line of "
        "its output matches.",
        "With --for PATTERN (RE2 syntax, searched in the daemon): the output written before "
        "is searched too, then each line as it comes; prints the line that matched (exit "
        "0), or how the worker ended if it ended first (exit 4), or says it timed out "
        "(exit 5). --json prints outcome (matched, ended, timed_out), line and worker.",
    )
    sub.add_argument("worker", metavar="ID")
    sub.add_argument(
        "--for", dest="pattern", metavar="PATTERN", help="wait for a line matching PATTERN"
    )
    sub.add_argument(
        "--ready",
        action="store_true",
        help="until it is ready (its spawn --ready pattern matched: exit 0) or has ended "
        "(exit 4); prints its status",
    )
    sub.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        help=f"with --for: give up after S seconds (0 to {MAX_TIMEOUT:.0f}; default: the most)",
    )

    sub = command(
        "grep",
        grep,
        "Print the lines of a worker's output matching PATTERN, searched in the daemon.",
        "PATTERN is RE2 syntax (no backreferences or lookaround; linear time). stdout and "
        "stderr are split into lines each on its own and numbered together in journal "
        "order; printed as grep -n does (N:match, N-context, -- between groups). The daemon "
        "answers in parts of at most 2 MiB, which grep asks for one after the other; a "
        "match too long for one (its context, or the line itself) is cut. A grep scans at "
        "most 64 MiB of the journal from its start; when that or --max is reached it says "
        "there may be more. --since and --stream keep only the lines written since a time, "
        "or of one stream, in the daemon (so --max counts only those); the other lines are "
        "still numbered, and still context. (--since here is a time; watch's --since is a "
        "cursor.) Exit 0 if a line matched, 4 if none did. --json prints matches (line_no, "
        "kind, line, before, after, cut), truncated, next (the line to go on after) and "
        "stopped_in_line (the 64 MiB were reached inside a line, not taken to end there).",
    )
    sub.add_argument("worker", metavar="ID")
    sub.add_argument("pattern", metavar="PATTERN")
    sub.add_argument(
        "-B", dest="before", metavar="N", type=int, default=0, help="N lines before each match"
    )
    sub.add_argument(
        "-A", dest="after", metavar="N", type=int, default=0, help="N lines after each match"
    )
    sub.add_argument(
        "--max", metavar="N", type=int, default=100, help="at most N matches in all (default 100)"
    )
    sub.add_argument(
        "--written-since",
        metavar="WHEN",
        help=f"only lines written since WHEN: {SINCE_SYNTAX} (not watch's --since, a cursor)",
    )
    sub.add_argument("--stream", choices=("stdout", "stderr"), help="only the lines of this stream")

    sub = command(
        "send",
        send,
        "Write TEXT to the stdin of a worker spawned with --stdin open.",
        "The daemon journals what was written (watch shows it, kind stdin). A worker whose "
        "stdin is full (it does not read) gets the rest as it makes room, for up to "
        f"{SEND_PATIENCE:.0f} s without progress, then the command fails saying how much "
        "went in. --json prints worker, written and eof.",
    )
    sub.add_argument("worker", metavar="ID")
    sub.add_argument(
        "text",
        metavar="TEXT",
        nargs="?",
        help="what to write (as is: add a newline yourself); - reads it from this stdin",
    )
    sub.add_argument("--eof", action="store_true", help="then close its stdin")

    command(
        "turn",
        turn,
        "Begin a turn and print its generation.",
        "Workers registered from now on carry it; `cancel turn:G` stops the workers of turn G.",
    )

    sub = command(
        "cancel",
        cancel,
        "Stop every worker in a scope and print the ids cancelled.",
        "Workers already ended or stopping are left as they are. A worker's own "
        "subagentctl may cancel only worker:W within its subtree.",
    )
    sub.add_argument(
        "scope",
        metavar="SCOPE",
        help="`all`; `turn:G`, the workers registered in turn G; `run:R`, run R and the runs "
        "nested in it; `worker:W`, worker W and everything it delegated",
    )

    sub = command(
        "fence",
        fence,
        "Set a launch fence and print its epoch (or cancel or clear it).",
        "Cancelling the fence by its epoch stops every worker registered under it and "
        "stops at birth (state stopped, never run) every later spawn, until a new fence "
        "replaces it or it is cleared; a stale epoch cancels nothing. A worker's own "
        "subagentctl may not touch the fence.",
    )
    action = sub.add_mutually_exclusive_group()
    action.add_argument(
        "--cancel",
        metavar="E",
        type=int,
        help="cancel the fence of epoch E instead, and print the ids it stopped",
    )
    action.add_argument(
        "--clear",
        action="store_true",
        help="remove the fence instead: later spawns start as usual (--json prints epoch null)",
    )

    sub = command(
        "reopen",
        reopen,
        "Start a stopped run again: it (and the runs nested in it) accepts spawns again.",
        "A stopped run stays stopped, resumes included (a resumed worker runs, and may "
        "delegate, but nothing else may spawn in the run) until this is asked. Refused "
        "while a run it is nested in is stopped. A worker's own subagentctl may not.",
    )
    sub.add_argument("run", metavar="RUN")

    command(
        "reload",
        reload,
        "Reload the daemon in place and print what it carried.",
        "The daemon re-execs its image from disk (a new version, a new agents.toml) in the "
        "same pid and keeps every running worker, its output and its pending wakes; this "
        "returns once the new image serves. Prints the new image generation, how many "
        "workers were carried live, and those that could not be, stopped by the reload "
        "and resumable by their ids. A broken agents.toml or an image that fails its "
        "check refuses the reload with the reason (exit 1), and the old image serves on; "
        "so does a reload asked less than a second after the last (busy). Other clients "
        "reconnect by themselves.",
    )

    sub = command(
        "resume",
        resume,
        "Carry an ended worker, or a run, on from where it stopped, and print it.",
        "A stopped, failed, timed-out, interrupted or stopped-by-reload worker resumes "
        "under the same id as its next attempt, with the same journal: it runs what its "
        "snapshot froze at spawn (the command, the agent definition as it was then, its "
        "model, env, cwd and input), never today's agents.toml, and sees its attempt in "
        "$SUBAGENTD_RESUME. Only --timeout may be given again; a new input, command or "
        "model is refused (frozen). A worker that finished well, one still running, a "
        "missing snapshot, or a git work tree now on another branch refuses the resume "
        "with the reason (exit 1). What changed on disk since its spawn (its agent's "
        "definition in agents.toml, its work tree's HEAD) is printed under it, `changed "
        "since its spawn: ...`, and written in its journal's resume note.",
    )
    which = sub.add_mutually_exclusive_group(required=True)
    which.add_argument("worker", metavar="ID", nargs="?", help="the worker to resume")
    which.add_argument(
        "--run",
        metavar="R",
        help="resume run R instead: its highest unfinished workers, one line each",
    )
    which.add_argument(
        "--latest",
        action="store_true",
        help="resume the newest resumable run started in this directory; if none would "
        "resume, print the newest and why not (exit 1)",
    )
    sub.add_argument(
        "--dry-run",
        action="store_true",
        help="with --latest: resume nothing, print what it would take (run, resumable, reason, "
        "from: the workers it would carry on); exit 1 if it would not resume",
    )
    sub.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        help=f"seconds before it is stopped, this attempt (0 to {MAX_TIMEOUT:.0f}; 0: never)",
    )
    sub.add_argument(
        "--key",
        metavar="K",
        help="an idempotency key (printable, no space, at most 128): run again with the same "
        "key, the command answers the attempt the first run started, not refused as running "
        "(default: a new random key, so a reload never makes a second worker)",
    )
    # Parsed only to be sent and refused by the daemon (frozen), so not offered in --help.
    sub.add_argument("--input", help=argparse.SUPPRESS)
    sub.add_argument("--model", help=argparse.SUPPRESS)
    sub.add_argument("argv", nargs="*", help=argparse.SUPPRESS)

    command(
        "info",
        info,
        "Show the daemon's version, pid, reloads and workers by state.",
        "Also how authority is decided (kernel: by cgroups; token: advisory) and whom this "
        "connection acts as (caller: a worker's id, or the user).",
    )
    from . import _units  # install-units: needs no daemon, so main runs it before connecting

    _units.add_command(commands)

    sub = command(
        "top",
        live_view,
        "Show the workers live: state, run, tree, name, age, pid, CPU, memory and last "
        "line of output.",
        "CPU% is of one core, over the last frame's interval; MEM is memory now, each of "
        "its whole tree. Keys: up/down (or j/k) select, s stops the selected worker and "
        "its subtree, r its run (each asks y to confirm), f or Enter follows its output, "
        "c sorts by CPU%, m by MEM (biggest first), t puts back the tree's order, q quits. "
        f"Needs the optional extra: {_top.INSTALL_HINT}. Exit status 3 when the daemon "
        "goes away.",
    )
    sub.add_argument("--run", metavar="R", help="only the workers of run R")
    sub.add_argument("--all", action="store_true", help="ended workers too")
    sub.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit (for scripts): on a terminal as wide as it, else as "
        "wide as what it shows ($COLUMNS, if set); with --json, the frame as one JSON document",
    )
    sub.add_argument(
        "--sort",
        choices=_top.ORDERS,
        default="tree",
        help="the rows' order to start with: tree (default), cpu or mem (biggest first)",
    )
    sub.add_argument(
        "--interval",
        metavar="S",
        type=float,
        default=_top.REFRESH,
        help=f"seconds between frames (default {_top.REFRESH:g})",
    )
    return top


def live_view(daemon: Client, args: argparse.Namespace, out: Output) -> int:
    """Not called through a `Client`: `main` runs `top` on its own trio loop."""
    raise AssertionError("subagentctl top runs from main")


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = one_line_warnings("subagentctl")
    args = parser().parse_args(argv)
    from . import _units

    if args.command is _units.install_units:  # needs no daemon: before any connect
        written: int = _units.install_units(args)  # (`is` leaves it Any to mypy)
        return written
    if args.command is spawn and not args.argv and args.agent is None:
        args.parser.error("give a command after -- or an --agent")
    if args.command is spawn and args.stdin == "open" and args.input is not None:
        args.parser.error("--stdin open: not with --input")
    if args.command is wait and args.timeout is not None and args.pattern is None:
        args.parser.error("--timeout: only with --for")
    if args.command is send and args.text is None and not args.eof:
        args.parser.error("give TEXT, - to read it from stdin, or --eof")
    if args.command is resume and args.dry_run and not args.latest:
        args.parser.error("--dry-run: only with --latest")
    if args.command is resume and args.worker is None:
        given = [
            flag
            for flag, value in (
                ("--timeout", args.timeout),
                ("--key", args.key),
                ("--input", args.input),
                ("--model", args.model),
                ("CMD", args.argv or None),
            )
            if value is not None
        ]
        if given:
            args.parser.error(f"{', '.join(given)}: only with a worker ID")
    if args.command is live_view:
        if not 0.05 <= args.interval <= 3600:
            args.parser.error("--interval: from 0.05 to 3600 seconds")
        if args.json and not args.once:
            args.parser.error("--json: only with --once (a live view is drawn, not printed)")
        return _top.main(
            args.socket,
            run=args.run,
            show_all=args.all,
            once=args.once,
            interval=args.interval,
            as_json=args.json,
            order=args.sort,
        )
    out: Output = Json() if args.json else Human(raw=getattr(args, "raw", False))
    try:
        with Client(args.socket) as daemon:
            status = args.command(daemon, args, out)
    except TransportError as exc:
        _said(exc)
        return EXIT_NO_DAEMON
    except (RemoteError, ProtocolError) as exc:
        out.error(exc)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read our output has gone; point stdout at /dev/null so the
        # interpreter's final flush does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return EXIT_OK if status is None else status
