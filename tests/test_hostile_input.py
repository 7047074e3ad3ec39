"""Odd values at the boundary: refused as `invalid` naming the field, never the daemon's end.

Each test is one case of issue 11, driven as a user or a client written from
protocol/README.md alone would drive it: `subagentctl`, `subagentd --check`,
or msgpack frames on the real socket of a real daemon.
"""

from __future__ import annotations

import math
import os
import subprocess

import msgspec
import pytest
import trio

from subagentd import protocol as p

from .conftest import BIN, DaemonProcess
from .helpers import Connect, RawConnection, alive, write_old_record


async def _ask(
    conn: RawConnection, request: p.Request[p.Reply] | dict[str, object]
) -> p.DaemonMessage:
    """Send one request (a Struct, or a map as any client may write it) and read the answer."""
    if isinstance(request, dict):
        await conn.stream.send_all(p.frame(msgspec.msgpack.encode(request)))
    else:
        await conn.send(request)
    reply = await conn.receive()
    assert reply is not None, "the daemon closed the connection"
    return reply


def _assert_invalid(reply: p.DaemonMessage, request_id: int, field: str) -> None:
    assert isinstance(reply, p.Error), reply
    assert (reply.id, reply.code) == (request_id, "invalid"), reply
    assert field in reply.message, reply.message


async def _still_serves(daemon: DaemonProcess, connect: Connect) -> None:
    conn = await connect()
    assert isinstance(await _ask(conn, p.Info(id=2)), p.InfoReply)
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, daemon.log()


def _check(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "subagentd"), "--check", "--config", str(daemon.config),
         "--state-dir", str(daemon.state_dir)],
        env=daemon.env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


# -- 1. every number that crosses is finite and in range -------------------------


def test_spawn_with_nan_grace_is_invalid_and_daemon_serves_on(daemon: DaemonProcess) -> None:
    # It used to be taken; when `true` ended, trio.move_on_after(nan) ended the daemon.
    refused = daemon.ctl("spawn", "--grace", "nan", "--", "true")
    assert refused.returncode == 1, refused
    assert "invalid" in refused.stderr
    assert "grace" in refused.stderr
    again = daemon.ctl("--json", "spawn", "--", "true")
    assert again.returncode == 0, again
    ended = daemon.ctl("wait", msgspec.json.decode(again.stdout)["id"])
    assert ended.returncode == 0, ended
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, daemon.log()
    assert daemon.ctl("info").returncode == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("grace", math.nan),
        ("grace", math.inf),
        ("grace", -1.0),
        ("grace", p.MAX_GRACE * 2),
        ("timeout", math.nan),
        ("timeout", math.inf),
        ("timeout", -math.inf),
        ("timeout", 1e300),
    ],
)
async def test_spawn_with_an_unusable_time_is_invalid_naming_it(
    daemon: DaemonProcess, connect: Connect, field: str, value: float
) -> None:
    with trio.fail_after(10):
        conn = await connect()
        request = {"op": "spawn", "id": 7, "argv": ["true"], "cwd": "/", field: value}
        _assert_invalid(await _ask(conn, request), 7, f"$.{field}")
        resume = {"op": "resume", "id": 8, "worker": "w-nope", "timeout": value}
        if field == "timeout":
            _assert_invalid(await _ask(conn, resume), 8, "$.timeout")
        await _still_serves(daemon, connect)


async def test_spawn_with_inf_grace_is_invalid_not_stored_as_null(
    daemon: DaemonProcess, connect: Connect
) -> None:
    # It used to be stored (JSON writes inf as null); after a restart its archive no
    # longer decoded, and status and collect answered not_found.
    with trio.fail_after(10):
        conn = await connect()
        _assert_invalid(
            await _ask(conn, p.Spawn(id=3, argv=["true"], cwd="/", grace=math.inf)), 3, "grace"
        )
        listing = await _ask(conn, p.ListWorkers(id=4, all=True))
        assert isinstance(listing, p.WorkerList)
        assert listing.workers == []


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("grace = nan", "agents.coder.grace"),
        ("grace = inf", "agents.coder.grace"),
        ("grace = -1.0", "agents.coder.grace"),
        ("timeout = inf", "agents.coder.timeout"),
        ("timeout = -inf", "agents.coder.timeout"),
        ('command = [""]', "program"),
        ('command = ["true", "a\\u0000b"]', "NUL"),
    ],
)
def test_check_refuses_an_agent_that_spawn_would_refuse(
    daemon_dirs: DaemonProcess, line: str, key: str
) -> None:
    command = "" if line.startswith("command") else 'command = ["true"]\n'
    daemon_dirs.config.write_text(f"[agents.coder]\n{command}{line}\n")
    checked = _check(daemon_dirs)
    assert checked.returncode == 1, checked
    assert key in checked.stderr, checked.stderr


def test_check_takes_an_agent_within_bounds(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.config.write_text(
        '[agents.coder]\ncommand = ["true"]\ngrace = 0.0\ntimeout = 2592000.0\n'
    )
    checked = _check(daemon_dirs)
    assert checked.returncode == 0, checked


def test_check_refuses_a_config_that_is_a_fifo_without_hanging(
    daemon_dirs: DaemonProcess,
) -> None:
    os.mkfifo(daemon_dirs.config)  # nobody will ever write to it
    checked = _check(daemon_dirs)  # bounded: _check times out after 30 s
    assert checked.returncode == 1, checked
    assert "not a regular file" in checked.stderr, checked.stderr


def test_a_daemon_whose_config_is_a_fifo_serves_and_says_why(
    daemon_dirs: DaemonProcess,
) -> None:
    os.mkfifo(daemon_dirs.config)
    daemon_dirs.start()  # READY=1 within START_TIMEOUT, not a hang
    refused = daemon_dirs.ctl("spawn", "--agent", "coder")
    assert refused.returncode == 1, refused
    assert "not a regular file" in refused.stderr, refused.stderr


def test_a_symlinked_config_is_followed(daemon_dirs: DaemonProcess) -> None:
    # A dotfiles manager links agents.toml from elsewhere: the user's own file.
    real = daemon_dirs.root / "dotfiles-agents.toml"
    real.write_text('[agents.coder]\ncommand = ["true"]\n')
    daemon_dirs.config.symlink_to(real)
    checked = _check(daemon_dirs)
    assert checked.returncode == 0, checked


def test_archive_written_with_null_grace_still_answers_after_restart(
    daemon: DaemonProcess,
) -> None:
    # An old daemon wrote a grace of inf as null in record.json and snapshot.json: such
    # an archive (its record.json taken into the store by an upgrade) must still answer
    # status, collect, watch and resume.
    made = daemon.ctl("--json", "spawn", "--", "sh", "-c", "echo kept; exit 3")
    assert made.returncode == 0, made
    worker_id = msgspec.json.decode(made.stdout)["id"]
    view = msgspec.json.decode(daemon.ctl("--json", "wait", worker_id).stdout)
    archive = daemon.state_dir / "archives" / worker_id
    daemon.terminate()
    for name in ("state.db", "state.db-wal"):  # a state dir as an image before the store left it
        (daemon.state_dir / name).unlink(missing_ok=True)
    snapshot = msgspec.json.decode((archive / "snapshot.json").read_bytes())
    assert snapshot["grace"] == 5.0, snapshot
    write_old_record(archive, view, grace=None, cwd=snapshot["cwd"], argv=snapshot["argv"])
    snapshot["grace"] = None
    (archive / "snapshot.json").write_bytes(msgspec.json.encode(snapshot))
    daemon.start()
    status = daemon.ctl("--json", "status", worker_id)
    assert status.returncode == 0, status
    assert msgspec.json.decode(status.stdout)["state"] == "failed"
    collected = daemon.ctl("collect", worker_id)
    assert collected.returncode == 0, collected
    assert "kept" in collected.stdout
    resumed = daemon.ctl("resume", worker_id)
    assert resumed.returncode == 0, resumed
    again = daemon.ctl("--json", "wait", worker_id)
    assert again.returncode == 0, again
    assert msgspec.json.decode(again.stdout)["attempt"] == 2
    assert not (archive / "record.json").exists()  # taken into the store, and gone
    assert "problem" not in daemon.ctl("info").stdout


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"argv": ["true"] * (p.MAX_ARGS + 1)}, "$.argv"),
        ({"argv": ["true", "x" * (p.MAX_ARG_BYTES + 1)]}, "$.argv[1]"),
        ({"argv": ["true", "é" * (p.MAX_ARG_BYTES // 2 + 1)]}, "argument 1"),
        ({"argv": ["true", *["x" * 100_000] * 25]}, "exec takes at most"),
        ({"argv": ["true", "a\x00b"]}, "NUL"),
        ({"argv": ["true"], "env": {"A": "x" * (p.MAX_ARG_BYTES + 1)}}, "$.env"),
        ({"argv": ["true"], "env": {"A=B": "c"}}, "'A=B'"),
        ({"argv": ["true"], "env": {"": "c"}}, "name '' is empty"),
        ({"argv": ["true"], "name": "n" * (p.MAX_NAME_LENGTH + 1)}, "$.name"),
        ({"argv": ["true"], "cwd": "/" * (p.MAX_PATH_LENGTH + 1)}, "$.cwd"),
        ({"argv": ["true"], "run": "r" * (p.MAX_ID_LENGTH + 1)}, "$.run"),
        ({"agent": "a" * (p.MAX_NAME_LENGTH + 1)}, "$.agent"),
        ({"argv": ["true"], "input": b"i" * (p.MAX_INPUT_BYTES + 1)}, "$.input"),
    ],
)
async def test_spawn_beyond_a_bound_is_invalid_naming_it(
    daemon: DaemonProcess, connect: Connect, request_fields: dict[str, object], field: str
) -> None:
    with trio.fail_after(20):
        conn = await connect()
        request = {"op": "spawn", "id": 9, "cwd": "/"} | request_fields
        _assert_invalid(await _ask(conn, request), 9, field)
        listing = await _ask(conn, p.ListWorkers(id=10, all=True))
        assert isinstance(listing, p.WorkerList)
        assert listing.workers == [], "a refused spawn left a worker behind"
        await _still_serves(daemon, connect)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"op": "ack", "id": 4, "wakes": list(range(p.MAX_ACK_WAKES + 1))}, "$.wakes"),
        ({"op": "ack", "id": 4, "wakes": [-1]}, "$.wakes[0]"),
        ({"op": "watch", "id": 4, "worker": "w-x", "since": -1}, "$.since"),
        ({"op": "watch", "id": 4, "worker": "w-x", "limit": 0}, "$.limit"),
        ({"op": "cancel_fence", "id": 4, "epoch": -1}, "$.epoch"),
        ({"op": "abort", "id": 4, "request": 0}, "$.request"),
        ({"op": "cancel", "id": 4, "scope": "s" * (p.MAX_NAME_LENGTH + 1)}, "$.scope"),
        ({"op": "status", "id": 4, "worker": "w" * (p.MAX_ID_LENGTH + 1)}, "$.worker"),
    ],
)
async def test_a_request_beyond_a_bound_is_invalid_naming_it(
    daemon: DaemonProcess, connect: Connect, message: dict[str, object], field: str
) -> None:
    with trio.fail_after(10):
        conn = await connect()
        _assert_invalid(await _ask(conn, message), 4, field)
        assert isinstance(await _ask(conn, p.Info(id=5)), p.InfoReply)


# -- 2. a spawn without a command ------------------------------------------------


@pytest.mark.parametrize("argv", [None, [], [""]])
async def test_spawn_without_a_command_is_invalid_not_internal(
    daemon: DaemonProcess, connect: Connect, argv: list[str] | None
) -> None:
    with trio.fail_after(10):
        conn = await connect()
        request: dict[str, object] = {"op": "spawn", "id": 6, "cwd": "/"}
        if argv is not None:
            request["argv"] = argv
        reply = await _ask(conn, request)
        _assert_invalid(reply, 6, "command")
        await _still_serves(daemon, connect)


# -- 3. ids: 0 is never a request; when a connection closes -----------------------


@pytest.mark.parametrize("request_id", [0, -1, -(2**63)])
async def test_request_with_id_zero_or_negative_is_invalid_and_the_connection_goes_on(
    connect: Connect, request_id: int
) -> None:
    with trio.fail_after(10):
        conn = await connect()
        # The answer carries the id as given: 0, like an event, but an `invalid`
        # is never an event that closes (see protocol/README.md, Events).
        _assert_invalid(await _ask(conn, {"op": "info", "id": request_id}), request_id, "$.id")
        _assert_invalid(
            await _ask(conn, {"op": "spawn", "id": request_id, "argv": ["true"]}),
            request_id,
            "$.id",
        )
        reply = await _ask(conn, p.Info(id=3))
        assert isinstance(reply, p.InfoReply)
        assert reply.id == 3


async def test_malformed_message_is_answered_and_the_connection_goes_on(
    connect: Connect,
) -> None:
    with trio.fail_after(10):
        conn = await connect()
        for body in (b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"id": 4})):
            await conn.stream.send_all(p.frame(body))
            reply = await conn.receive()
            assert isinstance(reply, p.Error), reply
            assert reply.code == "invalid"
        reply = await _ask(conn, p.Info(id=5))
        assert isinstance(reply, p.InfoReply)


@pytest.mark.parametrize(
    "first",
    [b"\xc1", msgspec.msgpack.encode({"op": "hello", "id": 0}),
     msgspec.msgpack.encode({"op": "hello", "id": 1, "version": "one"})],
)  # fmt: skip
async def test_a_first_message_that_is_no_hello_is_refused_and_closed(
    daemon: DaemonProcess, connect: Connect, first: bytes
) -> None:
    with trio.fail_after(10):
        conn = await connect(hello=False)
        await conn.stream.send_all(p.frame(first))
        reply = await conn.receive()
        assert isinstance(reply, p.Error), reply
        assert reply.code == "invalid"
        assert await conn.receive() is None, "a failed hello must close the connection"
        await _still_serves(daemon, connect)


# -- 4. abort at the in-flight limit ----------------------------------------------


async def test_abort_works_at_the_in_flight_limit(daemon: DaemonProcess, connect: Connect) -> None:
    with trio.fail_after(30):
        conn = await connect()
        spawned = await _ask(conn, p.Spawn(id=2, argv=["sleep", "600"], cwd="/"))
        assert isinstance(spawned, p.WorkerReply)
        worker = spawned.worker
        follow_id = 10
        await conn.send(p.Watch(id=follow_id, worker=worker.id, follow=True))
        for i in range(1, 256):
            await conn.send(p.Wait(id=follow_id + i, worker=worker.id))
        busy = await _ask(conn, p.Info(id=5))
        while not isinstance(busy, p.Error):  # the follow's first page may come first
            assert isinstance(busy, p.Page)
            busy = await _read(conn)
        assert (busy.id, busy.code) == (5, "busy"), busy
        await conn.send(p.Abort(id=6, request=follow_id))
        after_done: list[p.DaemonMessage] = []
        while not isinstance(reply := await _read(conn), p.Done):
            assert reply.id == follow_id, reply  # a page sent before the abort
        assert reply.id == 6
        # The stream has ended: nothing more with its id, and a slot is free again.
        await conn.send(p.Info(id=7))
        while not isinstance(reply := await _read(conn), p.InfoReply):
            after_done.append(reply)
        assert after_done == []
        assert alive(worker.pid or 0)


async def _read(conn: RawConnection) -> p.DaemonMessage:
    reply = await conn.receive()
    assert reply is not None, "the daemon closed the connection"
    return reply


@pytest.mark.parametrize(
    "flag",
    ["--finished-ttl", "--idle-exit", "--keep-archives", "--reload-interval", "--request-key-ttl"],
)
@pytest.mark.parametrize("value", ["nan", "-1", "soon"])
def test_a_daemon_number_that_is_not_zero_or_more_is_refused_naming_it(
    daemon_dirs: DaemonProcess, flag: str, value: str
) -> None:
    ran = subprocess.run(
        [str(BIN / "subagentd"), "--check", "--state-dir", str(daemon_dirs.state_dir),
         "--socket", str(daemon_dirs.socket), flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 2, ran
    assert flag in ran.stderr, ran.stderr
    assert not daemon_dirs.state_dir.exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ('["run", "{modl}"]', "agents.writer.command: unknown placeholder {modl}: only {model}"),
        ('["run", "{model"]', "agents.writer.command: not a template: "),
        ('["run", "{0}"]', "agents.writer.command: "),
    ],
)
def test_a_broken_command_template_is_named_by_file_agent_and_placeholder(
    daemon_dirs: DaemonProcess, command: str, said: str
) -> None:
    daemon_dirs.config.write_text(f'[agents.writer]\ncommand = {command}\nmodel = "m"\n')
    checked = _check(daemon_dirs)
    assert checked.returncode == 1, checked
    assert f"{daemon_dirs.config}: {said}" in checked.stderr, checked.stderr
    assert "KeyError" not in checked.stderr
    assert "Traceback" not in checked.stderr
