"""subagentctl end to end, run as a person or a script runs it, against a real daemon.

Each test runs the installed `subagentctl` in a subprocess (bounded by a
timeout) and checks what a user would read: stdout, stderr, the exit status,
and with --json the document shapes protocol/README.md fixes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import BIN, DaemonProcess
from .helpers import alive

CTL = str(BIN / "subagentctl")

#: The --json shapes (protocol/README.md: "fields may be added, never renamed"): at least
#: these, a view as on the wire.
WORKER_FIELDS = {
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
    "stopping",  # added: a stop in flight (fields may be added, never renamed)
    "argv",  # added: what `status` shows as its command
    "cwd",
    "agent",
    "argv_cut",
}
COLLECT_FIELDS = {"id", "state", "exit_code", "result"}
ENTRY_FIELDS = {"seq", "kind", "data", "at"}
INFO_FIELDS = {
    "version",
    "protocol",
    "pid",
    "image_generation",
    "reloads",
    "workers",
    "holds_park",
    "problems",  # added after DESIGN's list: fields may be added, never renamed
    "tree_tracking",  # added: what `info` shows
    "socket",
    "state_dir",
    "authority",
    "caller",
}
SCOPE_FORMS = ("`all`", "`turn:G`", "`run:R`", "`worker:W`")

STUBBORN = "trap '' TERM; echo ready; while :; do sleep 0.1; done"


def said(proc: subprocess.CompletedProcess[str]) -> str:
    """What a run printed, for an assertion's message."""
    return f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, said(proc)
    return proc


def refused(proc: subprocess.CompletedProcess[str], code: str) -> str:
    """Exit 1 with the error `code` on stderr; the stderr, to check the message further."""
    assert proc.returncode == 1, said(proc)
    assert proc.stderr.startswith(f"subagentctl: {code}: "), proc.stderr
    assert proc.stdout == ""
    return proc.stderr


def json_error(proc: subprocess.CompletedProcess[str], code: str) -> str:
    """Exit 1 and, on stdout, exactly `{"error": {"code", "message"}}`; the message."""
    assert proc.returncode == 1, said(proc)
    document = json.loads(proc.stdout)
    assert set(document) == {"error"}
    assert set(document["error"]) == {"code", "message"}
    assert document["error"]["code"] == code
    message: str = document["error"]["message"]
    assert message
    return message


def js(daemon: DaemonProcess, *args: str, input: str | None = None) -> Any:
    """The one JSON document `subagentctl --json ARGS` prints."""
    return json.loads(ok(daemon.ctl("--json", *args, input=input)).stdout)


def js_lines(daemon: DaemonProcess, *args: str) -> list[Any]:
    """The JSON lines of a listing or a stream."""
    return [json.loads(line) for line in ok(daemon.ctl("--json", *args)).stdout.splitlines()]


def spawn(daemon: DaemonProcess, *args: str) -> dict[str, Any]:
    worker: dict[str, Any] = js(daemon, "spawn", *args)
    assert set(worker) >= WORKER_FIELDS
    return worker


def status(daemon: DaemonProcess, worker_id: str) -> dict[str, Any]:
    worker: dict[str, Any] = js(daemon, "status", worker_id)
    return worker


def wait_printed(daemon: DaemonProcess, worker_id: str, text: str, timeout: float = 15.0) -> None:
    """Read the worker's journal until its stdout holds `text` (a ready line, say)."""
    deadline = time.monotonic() + timeout
    while text not in (stdout := ok(daemon.ctl("watch", worker_id)).stdout):
        assert time.monotonic() < deadline, f"{worker_id} never printed {text!r}: {stdout!r}"
        time.sleep(0.05)


def ctl_at(socket_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """subagentctl pointed at `socket_path`, where no daemon of the tests' need be."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBAGENTD_")}
    env["SUBAGENTD_SOCKET"] = str(socket_path)
    return subprocess.run(
        [CTL, *args], env=env, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )


# -- the README's tour ---------------------------------------------------------------


def test_the_readme_tour_reads_as_the_readme_shows(daemon: DaemonProcess) -> None:
    spawned = ok(
        daemon.ctl(
            "spawn",
            "--name",
            "counter",
            "--",
            "sh",
            "-c",
            "for i in 1 2 3; do echo tick $i; sleep 0.2; done",
        )
    ).stdout
    match = re.fullmatch(r"(w-[\w-]+) \(run (r-[\w-]+)\)\n", spawned)
    assert match, spawned
    counter, run = match[1], match[2]
    sleeper_spawned = ok(
        daemon.ctl("spawn", "--run", run, "--name", "sleeper", "--", "sleep", "600")
    ).stdout
    sleeper = sleeper_spawned.split()[0]
    assert sleeper_spawned == f"{sleeper} (run {run})\n"

    table = ok(daemon.ctl("ls")).stdout.splitlines()
    assert table[0].split() == ["ID", "RUN", "STATE", "PID", "EXIT", "CPU%", "MEM", "NAME"]
    row = next(line.split() for line in table if line.startswith(sleeper))
    assert row[2:] == ["running", row[3], "-", row[5], row[6], "sleeper"]
    assert row[3].isdigit()
    assert float(row[5]) >= 0  # its CPU% and memory, read for the listing
    assert row[6][-1] in "KMG", row

    followed = ok(daemon.ctl("watch", "-f", counter))
    assert followed.stdout == "tick 1\ntick 2\ntick 3\n"
    notes = followed.stderr.splitlines()
    assert re.fullmatch(r"\[state\] running pid=\d+", notes[0]), notes
    assert notes[-1] == "[state] finished exit_code=0"
    assert ok(daemon.ctl("watch", counter)).stdout == followed.stdout  # a snapshot, once ended

    def listed(*args: str) -> dict[str, list[str]]:
        return {
            line.split()[0]: line.split()
            for line in ok(daemon.ctl("ls", *args)).stdout.splitlines()
        }

    assert counter not in listed()
    assert ok(daemon.ctl("stop", sleeper)).stdout == f"{sleeper}\n"
    retained = listed("--all")
    assert retained[counter][2:] == ["finished", retained[counter][3], "0", "-", "-", "counter"]
    assert retained[sleeper][2:] == ["stopped", retained[sleeper][3], "-15", "-", "-", "sleeper"]

    wakes = ok(daemon.ctl("events", "--run", run)).stdout.splitlines()
    assert sorted(wakes) == sorted(
        [f"{counter} finished exit=0 tick 1\\ntick 2\\ntick 3", f"{sleeper} stopped exit=-15"]
    )
    assert ok(daemon.ctl("events", "--run", run)).stdout == ""  # each was acknowledged

    assert ok(daemon.ctl("collect", counter)).stdout == "tick 1\ntick 2\ntick 3\n"
    rows = listed("--all")
    assert rows[sleeper][2:] == ["stopped", rows[sleeper][3], "-15", "-", "-", "sleeper"]
    assert counter not in rows  # collected: its handle is let go (README.md)
    assert "state: finished" in ok(daemon.ctl("status", counter)).stdout  # from its archive

    fields = dict(
        line.split(": ", 1) for line in ok(daemon.ctl("status", sleeper)).stdout.splitlines()
    )
    assert (fields["id"], fields["name"], fields["state"]) == (sleeper, "sleeper", "stopped")
    assert fields["exit_code"] == "-15"
    assert fields["command"] == "sleep 600"

    info = dict(line.split(": ", 1) for line in ok(daemon.ctl("info")).stdout.splitlines())
    assert info["workers"] == "stopped 1"
    assert info["socket"] == str(daemon.socket)
    assert info["pid"] == str(daemon.proc.pid)  # type: ignore[union-attr]

    missing = daemon.ctl("status", "w-nope")
    assert refused(missing, "not_found") == "subagentctl: not_found: no worker 'w-nope'\n"


def test_the_readme_tour_in_json_prints_the_documented_shapes(daemon: DaemonProcess) -> None:
    counter = spawn(daemon, "--name", "counter", "--", "sh", "-c", "echo tick 1; echo tick 2")
    assert (counter["name"], counter["parent"], counter["attempt"]) == ("counter", None, 1)
    assert counter["state"] == "running"
    sleeper = spawn(daemon, "--name", "sleeper", "--", "sleep", "600")

    listed = js_lines(daemon, "ls")
    assert sleeper["id"] in [worker["id"] for worker in listed]
    assert all(set(worker) >= WORKER_FIELDS for worker in listed)

    followed = js_lines(daemon, "watch", "-f", counter["id"])
    assert all(set(entry) == ENTRY_FIELDS for entry in followed)
    assert [entry["seq"] for entry in followed] == list(range(1, len(followed) + 1))
    assert "".join(e["data"] for e in followed if e["kind"] == "stdout") == "tick 1\ntick 2\n"
    assert (followed[0]["kind"], followed[-1]["kind"]) == ("state", "state")
    assert followed[-1]["data"] == "finished exit_code=0"
    since = js_lines(daemon, "watch", "--since", "1", counter["id"])
    assert since == followed[1:]
    assert counter["id"] not in {w["id"] for w in js_lines(daemon, "ls")}
    retained = {w["id"]: w for w in js_lines(daemon, "ls", "--all")}
    assert retained[counter["id"]]["state"] == "finished"

    result = js(daemon, "collect", counter["id"])
    assert result == {
        "id": counter["id"],
        "state": "finished",
        "exit_code": 0,
        "result": "tick 1\ntick 2\n",
    }
    assert set(result) == COLLECT_FIELDS

    assert js(daemon, "stop", sleeper["id"]) == {"stopped": [sleeper["id"]], "already_stopping": []}
    stopped = status(daemon, sleeper["id"])
    assert set(stopped) >= WORKER_FIELDS
    assert (stopped["state"], stopped["exit_code"]) == ("stopped", -15)
    assert stopped["ended_at"] >= stopped["started_at"]
    # The collected counter's handle is let go; the stopped sleeper's result still waits.
    assert [w["id"] for w in js_lines(daemon, "ls", "--all")] == [sleeper["id"]]

    info = js(daemon, "info")
    assert set(info) >= INFO_FIELDS
    assert info["workers"] == {"stopped": 1}
    assert (info["pid"], info["image_generation"]) == (daemon.proc.pid, 1)  # type: ignore[union-attr]
    # The sleeper's handle waits to be collected, but a stopped worker owes no result.
    assert info["holds_park"] is False
    assert js(daemon, "collect", sleeper["id"])["state"] == "stopped"
    run = js(daemon, "new-run")
    assert set(run) == {"run"}
    assert run["run"].startswith("r-")


# -- how it fails ----------------------------------------------------------------------


def test_no_daemon_at_the_socket_exits_3_saying_how_to_start_one(tmp_path: Path) -> None:
    nowhere = tmp_path / "none.sock"
    answer = ctl_at(nowhere, "info")
    assert answer.returncode == 3
    assert str(nowhere) in answer.stderr
    assert "start one with `subagentd`" in answer.stderr
    assert answer.stdout == ""
    # A socket file whose daemon is gone (connection refused) reads the same.
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(dead))
    answer = ctl_at(dead, "--json", "ls")
    assert answer.returncode == 3
    assert "start one with `subagentd`" in answer.stderr
    explicit = ctl_at(tmp_path / "env.sock", "--socket", str(nowhere), "status", "w-1")
    assert explicit.returncode == 3
    assert str(nowhere) in explicit.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
        (["spawn", "--name", "x"], "give a command after -- or an --agent"),
        (["spawn", "--env", "NOEQUALS", "--", "true"], "expected K=V"),
        (["stop"], "one of the arguments ID --run is required"),
        (["cancel"], "the following arguments are required: SCOPE"),
        (["fence", "--cancel", "one"], "invalid int value: 'one'"),
        (["fence", "--cancel", "1", "--clear"], "not allowed with argument"),
        (["events"], "one of the arguments --run --worker is required"),
        (["events", "--run", "r-1", "--worker", "w-1"], "not allowed with argument"),
    ],
)
def test_a_usage_error_exits_2_before_asking_any_daemon(
    tmp_path: Path, args: list[str], says: str
) -> None:
    answer = ctl_at(tmp_path / "none.sock", *args)
    assert answer.returncode == 2, answer
    assert says in answer.stderr
    assert "usage: subagentctl" in answer.stderr


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("spawn", "the command, after --"),
        ("new-run", "--outer R"),
        ("stop", "--run R"),
        ("turn", "cancel turn:G"),
        ("cancel", "worker:W"),
        ("fence", "--cancel E"),
        ("fence", "--clear"),
        ("fence", "stale epoch cancels nothing"),
        ("events", "acknowledged as soon as it is printed"),
        ("events", "stays pending for the next `events`"),
        ("events", "until Ctrl-C"),
    ],
)
def test_help_explains_each_command(tmp_path: Path, command: str, says: str) -> None:
    answer = ctl_at(tmp_path / "none.sock", command, "--help")
    assert answer.returncode == 0
    assert answer.stdout.startswith(f"usage: subagentctl {command}")
    assert says in " ".join(answer.stdout.split())


@pytest.mark.parametrize(
    "args",
    [["status", "w-nope"], ["stop", "w-nope"], ["watch", "w-nope"], ["collect", "w-nope"]],
    ids=lambda args: args[0],
)
def test_an_unknown_id_exits_1_not_found(daemon: DaemonProcess, args: list[str]) -> None:
    assert "w-nope" in refused(daemon.ctl(*args), "not_found")
    assert "w-nope" in json_error(daemon.ctl("--json", *args), "not_found")


# -- spawn's options ------------------------------------------------------------------


def test_spawn_input_env_cwd_and_name_reach_the_worker(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    typed = spawn(daemon, "--input", "hello there", "--", "cat")
    assert js(daemon, "collect", "--wait", typed["id"])["result"] == "hello there"

    piped = js(daemon, "spawn", "--input", "-", "--", "wc", "-c", input="x" * 5000)
    assert ok(daemon.ctl("collect", "--wait", piped["id"])).stdout.strip() == "5000"

    env = spawn(daemon, "--env", "A=1", "--env", "B=two words", "--", "sh", "-c", 'echo "$A|$B"')
    assert js(daemon, "collect", "--wait", env["id"])["result"] == "1|two words\n"

    where = spawn(daemon, "--cwd", str(tmp_path), "--name", "where", "--", "pwd", "-P")
    assert js(daemon, "collect", "--wait", where["id"])["result"] == f"{tmp_path.resolve()}\n"
    assert where["name"] == "where"
    assert status(daemon, where["id"])["name"] == "where"
    fields = ok(daemon.ctl("status", where["id"])).stdout
    assert f"cwd: {tmp_path}\n" in fields


def test_spawn_timeout_ends_the_worker_timed_out(daemon: DaemonProcess) -> None:
    worker = spawn(daemon, "--timeout", "0.3", "--", "sleep", "60")
    ended = ok(daemon.ctl("wait", worker["id"])).stdout
    assert ended == f"{worker['id']} timed_out, exit code -15\n"
    assert js(daemon, "wait", worker["id"])["state"] == "timed_out"


def test_spawn_grace_is_the_time_between_term_and_kill(daemon: DaemonProcess) -> None:
    stubborn = spawn(daemon, "--grace", "0.5", "--", "sh", "-c", STUBBORN)
    wait_printed(daemon, stubborn["id"], "ready")
    started = time.monotonic()
    assert js(daemon, "stop", stubborn["id"]) == {
        "stopped": [stubborn["id"]],
        "already_stopping": [],
    }
    took = time.monotonic() - started
    assert 0.5 <= took < 4.0  # the default grace is 5 s
    view = status(daemon, stubborn["id"])
    assert (view["state"], view["exit_code"]) == ("stopped", -9)
    assert not alive(view["pid"])


# -- runs -------------------------------------------------------------------------------


def test_a_stopped_run_and_its_nested_runs_refuse_later_spawns(daemon: DaemonProcess) -> None:
    outer = ok(daemon.ctl("new-run")).stdout.strip()
    assert outer.startswith("r-")
    inner = js(daemon, "new-run", "--outer", outer)["run"]
    in_outer = spawn(daemon, "--run", outer, "--", "sleep", "60")
    in_inner = spawn(daemon, "--run", inner, "--", "sleep", "60")
    elsewhere = spawn(daemon, "--", "sleep", "60")
    assert (in_outer["run"], in_inner["run"]) == (outer, inner)
    assert elsewhere["run"] not in (outer, inner)

    assert js(daemon, "stop", "--run", outer) == {
        "stopped": sorted([in_outer["id"], in_inner["id"]]),
        "already_stopping": [],
    }
    assert status(daemon, in_inner["id"])["state"] == "stopped"
    assert status(daemon, elsewhere["id"])["state"] == "running"

    assert outer in refused(daemon.ctl("spawn", "--run", outer, "--", "true"), "run_stopped")
    assert inner in json_error(
        daemon.ctl("--json", "spawn", "--run", inner, "--", "true"), "run_stopped"
    )
    refused(daemon.ctl("new-run", "--outer", outer), "run_stopped")
    again = ok(daemon.ctl("stop", "--run", outer))  # stopping is one-way, and idempotent
    assert (again.stdout, again.stderr) == ("", "nothing was left running to stop\n")
    assert "r-nope" in refused(daemon.ctl("stop", "--run", "r-nope"), "not_found")


# -- turns, cancel scopes, launch fences --------------------------------------------------


def test_cancel_turn_stops_only_the_workers_of_that_turn(daemon: DaemonProcess) -> None:
    before = spawn(daemon, "--", "sleep", "60")
    first = int(ok(daemon.ctl("turn")).stdout)
    assert first == before["turn"] + 1
    turn = first + 1
    assert js(daemon, "turn") == {"turn": turn}
    during = spawn(daemon, "--", "sleep", "60")
    also = spawn(daemon, "--run", during["run"], "--", "sleep", "60")
    assert (during["turn"], also["turn"]) == (turn, turn)

    cancelled = ok(daemon.ctl("cancel", f"turn:{turn}")).stdout.split()
    assert cancelled == sorted([during["id"], also["id"]])
    assert js(daemon, "wait", during["id"])["state"] == "stopped"
    assert js(daemon, "wait", also["id"])["state"] == "stopped"
    assert status(daemon, before["id"])["state"] == "running"
    # Already ended: nothing is stopping either.
    assert js(daemon, "cancel", f"turn:{turn}") == {"cancelled": [], "already_stopping": []}
    nothing = ok(daemon.ctl("cancel", f"turn:{turn}"))
    assert (nothing.stdout, nothing.stderr) == ("", "nothing was left running to cancel\n")
    assert js(daemon, "cancel", f"worker:{before['id']}") == {
        "cancelled": [before["id"]],
        "already_stopping": [],
    }


def test_cancel_with_a_malformed_scope_names_the_accepted_forms(daemon: DaemonProcess) -> None:
    message = refused(daemon.ctl("cancel", "everything"), "invalid")
    assert "everything" in message
    assert all(form in message for form in SCOPE_FORMS)
    message = json_error(daemon.ctl("--json", "cancel", "turn:last"), "invalid")
    assert all(form in message for form in SCOPE_FORMS)
    refused(daemon.ctl("cancel", "run:r-nope"), "not_found")


def test_a_cancelled_fence_stops_its_workers_and_every_later_spawn_at_birth(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    epoch = int(ok(daemon.ctl("fence")).stdout)
    fenced = spawn(daemon, "--", "sleep", "60")
    cancelled = ok(daemon.ctl("fence", "--cancel", str(epoch))).stdout.split()
    assert cancelled == [fenced["id"]]
    assert js(daemon, "wait", fenced["id"])["state"] == "stopped"

    marker = tmp_path / "ran"
    late = spawn(daemon, "--", "touch", str(marker))
    assert (late["state"], late["pid"]) == ("stopped", None)
    for_a_person = ok(daemon.ctl("spawn", "--", "touch", str(marker)))
    assert for_a_person.stdout.endswith(")\n")
    assert "already stopped" in for_a_person.stderr
    assert "fence" in ok(daemon.ctl("watch", late["id"])).stderr  # the note says why
    assert not marker.exists()

    cleared = ok(daemon.ctl("fence", "--clear"))
    assert (cleared.stdout, cleared.stderr) == ("", "")
    assert js(daemon, "fence", "--clear") == {"epoch": None}
    free = spawn(daemon, "--", "touch", str(marker))
    assert free["state"] == "running"
    assert js(daemon, "wait", free["id"])["state"] == "finished"
    assert marker.exists()


def test_a_stale_fence_epoch_cancels_nothing(daemon: DaemonProcess) -> None:
    stale = js(daemon, "fence")["epoch"]
    under_stale = spawn(daemon, "--", "sleep", "60")
    current = js(daemon, "fence")["epoch"]
    assert current > stale
    assert js(daemon, "fence", "--cancel", str(stale)) == {"cancelled": [], "already_stopping": []}
    nothing = ok(daemon.ctl("fence", "--cancel", str(stale)))
    assert (nothing.stdout, nothing.stderr) == ("", "nothing was left running to cancel\n")
    assert status(daemon, under_stale["id"])["state"] == "running"
    under_current = spawn(daemon, "--", "sleep", "60")
    assert under_current["state"] == "running"
    # The current epoch takes what registered under it, and nothing of the stale fence's.
    assert js(daemon, "fence", "--cancel", str(current)) == {
        "cancelled": [under_current["id"]],
        "already_stopping": [],
    }
    assert status(daemon, under_stale["id"])["state"] == "running"


# -- delegation: a worker's own subagentctl ----------------------------------------------


def test_a_worker_delegates_with_subagentctl_and_stop_takes_both(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    child_json = tmp_path / "child.json"
    script = f'"{CTL}" --json spawn -- sleep 60 > "{child_json}" && echo delegated; exec sleep 60'
    worker = spawn(daemon, "--", "sh", "-c", script)
    wait_printed(daemon, worker["id"], "delegated")
    child = json.loads(child_json.read_text())
    assert set(child) >= WORKER_FIELDS
    assert (child["parent"], child["run"], child["state"]) == (
        worker["id"],
        worker["run"],
        "running",
    )
    assert status(daemon, child["id"])["parent"] == worker["id"]

    assert js(daemon, "stop", worker["id"]) == {
        "stopped": sorted([worker["id"], child["id"]]),
        "already_stopping": [],
    }
    for view in (status(daemon, worker["id"]), status(daemon, child["id"])):
        assert view["state"] == "stopped"
        assert not alive(view["pid"])


def test_a_workers_own_subagentctl_is_forbidden_beyond_its_subtree(daemon: DaemonProcess) -> None:
    sibling = spawn(daemon, "--", "sleep", "60")
    script = (
        f'"{CTL}" --json stop "$SIBLING"; echo "exit $?"; '
        f'"{CTL}" --json fence; echo "exit $?"; '
        f'"{CTL}" cancel all; echo "exit $?"'
    )
    worker = spawn(
        daemon,
        "--run",
        sibling["run"],
        "--env",
        f"SIBLING={sibling['id']}",
        "--",
        "sh",
        "-c",
        script,
    )
    result = js(daemon, "collect", "--wait", worker["id"])
    assert result["state"] == "finished"
    stop_said, stop_exit, fence_said, fence_exit, cancel_exit = result["result"].splitlines()
    assert (stop_exit, fence_exit, cancel_exit) == ("exit 1", "exit 1", "exit 1")
    for answer in (stop_said, fence_said):
        document = json.loads(answer)
        assert document["error"]["code"] == "forbidden"
        assert worker["id"] in document["error"]["message"]
    stderr = "".join(
        e["data"] for e in js_lines(daemon, "watch", worker["id"]) if e["kind"] == "stderr"
    )
    assert stderr.startswith("subagentctl: forbidden: ")
    assert status(daemon, sibling["id"])["state"] == "running"
    assert isinstance(js(daemon, "fence")["epoch"], int)  # the user's own subagentctl may


def test_a_runtime_dir_fallback_not_ours_alone_is_refused_in_a_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    # No XDG_RUNTIME_DIR and no socket named: platformdirs falls back to runtime-<uid> in
    # the temporary directory, and refuses one somebody else made (they could listen there).
    planted = tmp_path / f"runtime-{os.geteuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, os.geteuid() + 1, -1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "SUBAGENTD_"))}
    env["TMPDIR"] = str(tmp_path)
    for program, status, says in (
        ("subagentctl", 3, "subagentctl: no safe place for the daemon's socket: "),
        ("subagentd", 2, "error: no safe place for the socket: "),
    ):
        done = subprocess.run(
            [str(BIN / program), "info"] if program == "subagentctl" else [str(BIN / program)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == status, done
        assert done.stderr.startswith(says), done.stderr
        assert f"runtime directory {planted}" in done.stderr
        assert "SUBAGENTD_SOCKET" in done.stderr
        assert "Traceback" not in done.stderr
    assert list(planted.iterdir()) == []  # nothing written into it


def test_the_runtime_dir_fallback_is_said_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "SUBAGENTD_"))}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run(
        [str(BIN / "subagentctl"), "info"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3, done  # no daemon there
    first, *rest = done.stderr.splitlines()
    fallback = tmp_path / f"runtime-{os.geteuid()}"
    assert first == (
        f"subagentctl: warning: XDG_RUNTIME_DIR is not set, falling back to {fallback}"
    )
    assert len(rest) == 1
    assert rest[0].startswith(f"subagentctl: no daemon at {fallback}/subagentd/subagentd.sock")
