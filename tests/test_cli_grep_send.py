"""subagentctl grep, wait --for and send (with spawn --stdin open), as a person at a shell
runs them: what they print, with and without --json, and their exit statuses."""

from __future__ import annotations

import json

from .conftest import DaemonProcess
from .test_cli import js, json_error, ok, said, spawn


def test_grep_prints_as_grep_n_does_and_exits_4_when_nothing_matches(
    daemon: DaemonProcess,
) -> None:
    worker = spawn(daemon, "--", "sh", "-c", "printf 'a\\nb\\nhit 1\\nc\\nd\\ne\\nhit 2\\n'")
    ok(daemon.ctl("wait", worker["id"]))
    printed = ok(daemon.ctl("grep", worker["id"], "^hit", "-B", "1", "-A", "1"))
    assert printed.stdout == "2-b\n3:hit 1\n4-c\n--\n6-e\n7:hit 2\n"
    found = js(daemon, "grep", worker["id"], "hit", "--max", "1")
    assert found == {
        "matches": [
            {
                "line_no": 3,
                "kind": "stdout",
                "line": "hit 1",
                "before": [],
                "after": [],
                "cut": False,
            }
        ],
        "truncated": True,
        "next": 3,
        "stopped_in_line": False,
    }
    none = daemon.ctl("grep", worker["id"], "nothing")
    assert (none.returncode, none.stdout) == (4, ""), said(none)
    bad = daemon.ctl("--json", "grep", worker["id"], "(")
    assert "pattern" in json_error(bad, "invalid")


def test_wait_for_says_which_outcome_by_its_exit_status(daemon: DaemonProcess) -> None:
    server = spawn(daemon, "--", "sh", "-c", "echo 'listening on 8080'; sleep 100000")
    matched = ok(daemon.ctl("wait", server["id"], "--for", r"listening on \d+", "--timeout", "20"))
    assert matched.stdout == "listening on 8080\n"
    timed = daemon.ctl("--json", "wait", server["id"], "--for", "never", "--timeout", "0.2")
    assert timed.returncode == 5, said(timed)
    answer = json.loads(timed.stdout)
    assert (answer["outcome"], answer["line"], answer["worker"]["state"]) == (
        "timed_out",
        None,
        "running",
    )
    ok(daemon.ctl("stop", server["id"]))
    ended = daemon.ctl("wait", server["id"], "--for", "never")
    assert ended.returncode == 4, said(ended)
    assert ended.stdout.startswith(f"{server['id']} stopped")
    usage = daemon.ctl("wait", server["id"], "--timeout", "1")
    assert usage.returncode == 2
    nan = daemon.ctl("--json", "wait", server["id"], "--for", "x", "--timeout", "nan")
    assert "timeout" in json_error(nan, "invalid")


def test_the_readmes_stdin_tour_reads_as_the_readme_shows(daemon: DaemonProcess) -> None:
    spawned = ok(daemon.ctl("spawn", "--stdin", "open", "--name", "repl", "--", *REPL)).stdout
    repl = spawned.split()[0]
    assert ok(daemon.ctl("send", repl, "print(6 * 7)\n")).stdout == f"{repl}: wrote 13 bytes\n"
    waited = ok(daemon.ctl("wait", repl, "--for", "^42$", "--timeout", "10"))
    assert waited.stdout == "42\n"
    closed = ok(daemon.ctl("send", repl, "-", "--eof", input="exit()\n"))
    assert closed.stdout == f"{repl}: wrote 7 bytes, then closed its stdin\n"
    assert ok(daemon.ctl("wait", repl)).stdout == f"{repl} finished, exit code 0\n"
    watched = ok(daemon.ctl("watch", repl))
    assert "[stdin] print(6 * 7)" in watched.stderr


def test_the_readmes_grep_tour_reads_as_the_readme_shows(daemon: DaemonProcess) -> None:
    script = 'echo starting; echo "listening on 8080"; sleep 600'
    web = ok(daemon.ctl("spawn", "--name", "web", "--", "sh", "-c", script)).stdout.split()[0]
    waited = ok(daemon.ctl("wait", web, "--for", r"listening on \d+", "--timeout", "30"))
    assert waited.stdout == "listening on 8080\n"
    grepped = ok(daemon.ctl("grep", web, "listening", "-B", "1"))
    assert grepped.stdout == "1-starting\n2:listening on 8080\n"
    ok(daemon.ctl("stop", web))


REPL = ["python3", "-u", "-i", "-q"]
