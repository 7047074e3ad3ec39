"""Every text surface of subagentctl against a worker that names itself and writes to drive
the terminal: the bytes each command writes to a real terminal (a pty, its output taken as
written: no newline translation) hold no escape sequence or control character, and the raw
bytes stay where a program asks for them (a pipe, a file, --raw, --json). Then --json
against the text: each carries everything the other shows, and --json after the command.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import termios
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from subagentd.client._text import PrintableStream

from .conftest import DaemonProcess
from .test_cli import CTL, js, js_lines, ok, said, spawn

#: A name that clears the screen, retitles the window, reverses what follows, moves to the
#: line's start and rings the bell: as `printable` shows it, the characters left as ?.
HOSTILE_NAME = "\x1b[2J\x1b]0;pwned\x07ev\u202eil\r\x07"
NAME_SHOWN = "ev?il??"
#: What the worker writes (to stdout, then the same to stderr): SGR colours, a screen
#: clear, an OSC title, bells, a bidi override, a carriage return.
HOSTILE_LINE = b"ok \x1b[31mRED\x1b[0m\x1b[2J \x1b]0;pwned\x07bell\x07 rtl\xe2\x80\xae cr\rend\n"
LINE_SHOWN = b"ok RED bell? rtl? cr?end\n"
#: Bytes a terminal acts on rather than shows: none may reach it.
DRIVING = (b"\x1b", b"\x07", b"\r", "\u202e".encode(), b"\x9b")


@dataclass
class Shown:
    """What one subagentctl run wrote to each of its terminals."""

    returncode: int
    stdout: bytes
    stderr: bytes


def _terminal() -> tuple[int, int]:
    """A pty (master, slave) whose output is passed as written (no \\n to \\r\\n)."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    return master, slave


def on_terminal(daemon: DaemonProcess, *args: str, timeout: float = 30.0) -> Shown:
    """`subagentctl ARGS` with its stdout and its stderr each on a terminal of its own."""
    (out, out_slave), (err, err_slave) = _terminal(), _terminal()
    proc = subprocess.Popen(
        [CTL, *args], env=daemon.env, stdin=subprocess.DEVNULL, stdout=out_slave, stderr=err_slave
    )
    os.close(out_slave)
    os.close(err_slave)
    got = {out: b"", err: b""}
    reading = set(got)
    deadline = time.monotonic() + timeout
    try:
        while reading:
            left = deadline - time.monotonic()
            assert left > 0, f"subagentctl {shlex.join(args)} still writing after {timeout}s"
            ready, _, _ = select.select(list(reading), [], [], left)
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every slave end is closed
                    data = b""
                if data:
                    got[fd] += data
                else:
                    reading.discard(fd)
        returncode = proc.wait(timeout)
    finally:
        proc.kill()
        os.close(out)
        os.close(err)
    return Shown(returncode, got[out], got[err])


def piped(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[bytes]:
    """`subagentctl ARGS` with its output to pipes, as a program reads it."""
    return subprocess.run(
        [CTL, *args], env=daemon.env, stdin=subprocess.DEVNULL, capture_output=True, timeout=30
    )


def clean(shown: bytes) -> bytes:
    """`shown`, after asserting that nothing in it drives a terminal."""
    for driving in DRIVING:
        assert driving not in shown, (driving, shown)
    return shown


@pytest.fixture
def hostile(daemon: DaemonProcess, tmp_path: Path) -> dict[str, Any]:
    """A finished worker with a hostile name, argument and cwd, that wrote HOSTILE_LINE to
    its stdout and then to its stderr."""
    where = tmp_path / "d\x1b]0;pwned\x07ir"
    where.mkdir()
    script = 'printf "$1"; printf "$1" >&2'
    line = HOSTILE_LINE.decode().replace("%", "%%").replace("\\", "\\\\")
    worker: dict[str, Any] = js(
        daemon,
        "spawn",
        "--name",
        HOSTILE_NAME,
        "--cwd",
        str(where),
        "--",
        "sh",
        "-c",
        script,
        "sh",
        line,
    )
    ok(daemon.ctl("wait", worker["id"]))
    worker["where"] = where
    return worker


def test_a_hostile_name_and_output_reach_no_terminal_raw(
    daemon: DaemonProcess, hostile: dict[str, Any]
) -> None:
    worker_id = hostile["id"]

    listed = on_terminal(daemon, "ls", "--all")
    assert listed.returncode == 0, listed
    row = next(line for line in clean(listed.stdout).splitlines() if worker_id.encode() in line)
    assert row.split()[2:] == [
        b"finished", *row.split()[3:4], b"0", b"-", b"-", NAME_SHOWN.encode()
    ]  # fmt: skip

    shown = on_terminal(daemon, "status", worker_id)
    fields = dict(line.split(": ", 1) for line in clean(shown.stdout).decode().splitlines())
    assert fields["name"] == NAME_SHOWN
    assert fields["cwd"] == str(hostile["where"].parent / "dir")
    assert fields["command"].startswith("sh -c ")
    assert fields["command"].endswith("ok RED bell? rtl? cr?end?'")  # the argument's newline too

    events = on_terminal(daemon, "events", "--run", hostile["run"])
    expected = f"{worker_id} finished exit=0 ".encode() + LINE_SHOWN.rstrip() + b"\n"
    assert clean(events.stdout) == expected

    watched = on_terminal(daemon, "watch", worker_id)
    assert clean(watched.stdout) == LINE_SHOWN
    notes = clean(watched.stderr).splitlines(keepends=True)
    assert notes[0].startswith(b"[state] running pid=")
    assert b"".join(notes[1:-1]) == LINE_SHOWN
    assert notes[-1] == b"[state] finished exit_code=0\n"
    followed = on_terminal(daemon, "watch", "-f", worker_id)
    assert (followed.stdout, followed.stderr) == (watched.stdout, watched.stderr)

    grep = on_terminal(daemon, "grep", worker_id, "RED")
    assert clean(grep.stdout) == b"1:" + LINE_SHOWN + b"2:" + LINE_SHOWN
    matched = on_terminal(daemon, "wait", worker_id, "--for", "RED", "--timeout", "5")
    assert clean(matched.stdout) == LINE_SHOWN

    collected = on_terminal(daemon, "collect", worker_id)
    assert collected.returncode == 0, collected
    assert clean(collected.stdout) == LINE_SHOWN

    # A daemon's message quoting what it was given (an RE2 error quotes the pattern).
    refused = on_terminal(daemon, "wait", worker_id, "--for", "\x1b]0;pwned\x07(")
    assert refused.returncode == 1, refused
    assert clean(refused.stderr).startswith(b"subagentctl: invalid: pattern: missing ): ("), refused


def test_the_raw_bytes_stay_for_a_pipe_a_file_raw_and_json(
    daemon: DaemonProcess, hostile: dict[str, Any], tmp_path: Path
) -> None:
    worker_id = hostile["id"]
    watched = piped(daemon, "watch", worker_id)
    assert watched.stdout == HOSTILE_LINE, said(watched)  # type: ignore[arg-type]
    assert HOSTILE_LINE in watched.stderr
    raw = on_terminal(daemon, "watch", "--raw", worker_id)
    assert raw.stdout == HOSTILE_LINE
    assert HOSTILE_LINE in raw.stderr

    result = tmp_path / "result"
    with result.open("wb") as file:
        subprocess.run([CTL, "collect", worker_id], env=daemon.env, stdout=file, timeout=30)
    assert result.read_bytes() == HOSTILE_LINE
    assert piped(daemon, "collect", worker_id).stdout == HOSTILE_LINE
    assert on_terminal(daemon, "collect", "--raw", worker_id).stdout == HOSTILE_LINE

    assert js(daemon, "status", worker_id)["name"] == HOSTILE_NAME
    assert js(daemon, "collect", worker_id)["result"] == HOSTILE_LINE.decode()
    stdout = [e for e in js_lines(daemon, "watch", worker_id) if e["kind"] == "stdout"]
    assert "".join(e["data"] for e in stdout) == HOSTILE_LINE.decode()
    # Tables are for a person: cleaned to a pipe as well (--json is their program's form).
    assert clean(piped(daemon, "ls", "--all").stdout)


def test_an_escape_cut_between_two_entries_shows_no_debris(daemon: DaemonProcess) -> None:
    """A worker's output reaches the journal in the pieces its writes made: a title or a
    character cut in two is held until its end comes, not shown as text or U+FFFD."""
    script = (
        r"printf 'a \033]0;pwn'; sleep 0.3; printf 'ed\007 b \342\200'; sleep 0.3; "
        r"printf '\256 c \033[3'; sleep 0.3; printf '1mRED\n'"
    )
    worker = spawn(daemon, "--", "sh", "-c", script)
    ok(daemon.ctl("wait", worker["id"]))
    pieces = [e for e in js_lines(daemon, "watch", worker["id"]) if e["kind"] == "stdout"]
    assert len(pieces) == 4, pieces  # else the test shows nothing
    assert on_terminal(daemon, "watch", worker["id"]).stdout == b"a  b ? c RED\n"


# -- --json against the text -----------------------------------------------------------


def test_json_carries_every_field_the_text_shows(daemon: DaemonProcess, tmp_path: Path) -> None:
    worker = spawn(daemon, "--name", "named", "--cwd", str(tmp_path), "--", "sleep", "60")
    text = dict(
        line.split(": ", 1) for line in ok(daemon.ctl("status", worker["id"])).stdout.splitlines()
    )
    document = js(daemon, "status", worker["id"])
    usage = document["usage"]  # what it takes: the text's cpu, memory, processes lines
    assert text["processes"] == str(usage["processes"])
    assert text["usage_from"] == usage["source"]
    assert text["cpu"].startswith(f"{usage['cpu_seconds']:.2f} s, ")
    assert text["memory"].endswith(" at peak")
    for key, value in text.items():
        if key == "command":
            assert shlex.join(document["argv"]) == value
        elif key.endswith("_at"):
            assert key in document
        elif key in ("cpu", "memory", "processes", "usage_from"):
            continue  # above
        elif key == "ready":  # said for a person: yes, else nothing
            assert value == ("yes" if document["ready"] else "-")
        elif key == "retries":  # none asked: nothing
            assert value == str(document["retries"] or "-")
        else:
            assert str(document[key] if document[key] is not None else "-") == value, key
    assert (document["argv"], document["cwd"], document["agent"]) == (
        ["sleep", "60"],
        str(tmp_path),
        None,
    )
    listed = next(w for w in js_lines(daemon, "ls") if w["id"] == worker["id"])
    assert (listed["argv"], listed["cwd"], listed["name"]) == (
        ["sleep", "60"],
        str(tmp_path),
        "named",
    )

    info_text = dict(line.split(": ", 1) for line in ok(daemon.ctl("info")).stdout.splitlines())
    info = js(daemon, "info")
    for key in info_text:
        if key.startswith("workers_"):  # the live workers' usage together
            assert info["usage"] is not None, key
            continue
        if key.startswith("control_"):  # one line a control: a limit's kind, the freeze
            control = info["controls"][key.removeprefix("control_")]
            enforced = "enforced" if control["enforced"] else "not enforced"
            assert info_text[key] == f"{enforced}: {control['how']}", key
            continue
        assert ("problems" if key == "problem" else key) in info, key
    assert info_text["workers_processes"] == str(info["usage"]["processes"])
    assert (info["socket"], info["state_dir"]) == (str(daemon.socket), str(daemon.state_dir))
    assert info["tree_tracking"] == info_text["tree_tracking"]
    assert info_text["control_freeze"].startswith("enforced: ")
    assert "freeze" not in info  # said among the controls, not beside them
    ok(daemon.ctl("stop", worker["id"]))


@pytest.mark.parametrize(
    "args",
    [["ls", "--json"], ["ls", "--all", "--json"], ["info", "--json"], ["--json", "ls", "--json"]],
)
def test_json_after_the_command_as_before_it(daemon: DaemonProcess, args: list[str]) -> None:
    printed = ok(daemon.ctl(*args)).stdout
    before = ok(daemon.ctl("--json", *[a for a in args if a != "--json"])).stdout
    assert [set(json.loads(line)) for line in printed.splitlines()] == [
        set(json.loads(line)) for line in before.splitlines()
    ]
    assert printed.startswith("{") or printed == ""


# -- what --help says ------------------------------------------------------------------


def test_help_says_the_exit_statuses_where_watch_writes_and_hides_what_resume_refuses(
    daemon: DaemonProcess,
) -> None:
    top = " ".join(ok(daemon.ctl("--help")).stdout.split())
    for status in ("0 done", "1 refused or not found", "2 usage", "3 no daemon at the socket",
                   "4 no line matched", "5 timed out", "130 interrupted"):  # fmt: skip
        assert status in top, status
    assert "cannot drive your terminal" in top
    watch = " ".join(ok(daemon.ctl("watch", "--help")).stdout.split())
    assert "`[state] ...`, `[note] ...`, `[stdin] ...`, go to stderr" in watch
    assert "--raw" in watch
    resume = ok(daemon.ctl("resume", "--help")).stdout
    assert "--input" not in resume
    assert "--model" not in resume
    assert "CMD" not in resume
    # Still parsed, to be sent and refused by the daemon by name (tests/test_client_reload.py).
    refused = daemon.ctl("resume", "w-nope", "--model", "large")
    assert refused.returncode == 1, said(refused)


def test_a_stream_holds_only_an_unfinished_escape_and_only_so_long() -> None:
    stream = PrintableStream()
    assert stream.feed(b"a\x1b[3") == "a"  # a colour's start: more may come
    assert stream.feed(b"1mb\x1b[\xd0\x96") == "b\u0416"  # a malformed one is not waited for
    assert stream.feed(b"\x1b]0;" + b"t" * PrintableStream.HOLD) == ""  # let go, unfinished
    assert stream.feed(b"\x07c") == "?c"
    assert stream.feed(b"d\xe2\x80") == "d"
    assert stream.end() == "\ufffd"  # the stream ended in the middle of a character
