"""subagentd-mcp's text: what a model reads of each result, every byte of it sanitised.

A worker's output, its name, its command and its directory are anyone's bytes; each passes
through the one sanitiser (client/_text.py) before it reaches a model, so no escape
sequence, bell or bidi override a worker wrote is handed on. Structured content keeps the
raw data. Pure: no I/O.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from subagentd.protocol import Entry, GrepMatch, Wake, WorkerView

from ._figures import memory_text, percent_text, usage_line
from ._mcp_shapes import state_of, uptime
from ._text import printable, printable_bytes, printable_lines

#: The characters of a command or a path shown on a worker's line.
SHOWN_COMMAND = 200
#: The characters of a name or a preview shown on one line.
SHOWN_NAME = 120


def duration(seconds: float) -> str:
    """`seconds` as a person says it: 42s, 3m12s, 2h05m, 3d04h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3600:02d}h"


def worker_line(view: WorkerView) -> str:
    """One worker on one line: id, run, name, state, exit code."""
    exit_code = "" if view.exit_code is None else f" exit={view.exit_code}"
    name = f" {printable(view.name, SHOWN_NAME)!r}" if view.name else ""
    return f"{view.id} (run {view.run}){name} {state_of(view)}{exit_code}"


def listed_line(view: WorkerView) -> str:
    """A worker's line in a listing: `worker_line`, and what it takes if it is live."""
    if view.usage is None:
        return worker_line(view)
    usage = view.usage
    return (
        f"{worker_line(view)} cpu={percent_text(usage.cpu_percent)}% "
        f"mem={memory_text(usage.memory)}"
    )


def command(view: WorkerView, limit: int = SHOWN_COMMAND) -> str:
    what = shlex.join(view.argv) if view.argv else f"agent {view.agent}" if view.agent else ""
    shown = printable(what, limit)
    return shown + ("..." if view.argv_cut or len(what) > len(shown) else "")


def status_text(view: WorkerView, now: float) -> str:
    """A worker as `subagentctl status` shows it: its line, then what it runs, where, how long."""
    lines = [worker_line(view)]
    if view.argv or view.agent:
        lines.append(f"command: {command(view)}")
    if view.cwd:
        lines.append(f"cwd: {printable(view.cwd, SHOWN_COMMAND)}")
    ran = duration(uptime(view, now))
    lines.append(f"uptime: {ran}" if view.ended_at is None else f"ran for: {ran}")
    if view.pid is not None:
        lines.append(f"pid: {view.pid}")
    if view.usage is not None:
        lines.append(f"usage: {usage_line(view.usage)}")
    return "\n".join(lines)


def entry_text(entry: Entry, data: bytes | None = None) -> str:
    """An entry as a model reads it: output as written (sanitised), the rest tagged."""
    raw = entry.data if data is None else data
    if entry.kind in ("stdout", "stderr"):
        return printable_bytes(raw)
    return f"[{entry.kind}] {printable_bytes(raw).rstrip()}\n"


def match_text(match: GrepMatch) -> str:
    lines = [f"  {printable(line)}" for line in match.before]
    lines.append(f"{match.line_no}: {printable(match.line)}")
    lines += [f"  {printable(line)}" for line in match.after]
    return "\n".join(lines) + "\n"


def wake_line(wake: Wake) -> str:
    # As `subagentctl events` prints it: the preview on the wake's one line.
    preview = printable(wake.preview, SHOWN_NAME)
    state = f"{wake.state} ({wake.reason})" if wake.reason else wake.state
    attempt = f" attempt={wake.attempt}" if wake.attempt > 1 else ""
    return f"{wake.id} {state} exit={wake.exit_code}{attempt} {preview}".rstrip()


def ids(found: Iterable[str]) -> str:
    return ", ".join(found) or "none"


def with_footer(text: str, more: str, none: str) -> str:
    """The output as the model reads it, then where the reading stands, on a line of its own."""
    return f"{text.rstrip(chr(10))}\n[{more}]" if text else f"[{none}; {more}]"


def lines_text(text: str) -> str:
    return printable_lines(text)
