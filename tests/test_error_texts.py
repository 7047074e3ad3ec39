"""What a refusal says to a protocol client: the wire's words (ops, fields), never a Python
class of protocol/, a command or an option of subagentctl (a client in another language has
neither; the CLI adds its own hints on its side).

Every refusal a client can provoke, through the socket alone, against a real daemon.
"""

from __future__ import annotations

import inspect
import re
import struct
import typing

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.protocol import errors

from .conftest import DaemonProcess
from .helpers import Connect, RawConnection, sh

MAX_IN_FLIGHT = 256  # protocol/README.md, A conversation


def _protocol_class_names() -> set[str]:
    """Every class protocol/ defines (messages, values, errors, the frame decoder) whose
    name is no English word: a compound (`NewRun`, `NotFound`) or a request's (`Spawn`,
    `Status`: what `type(request).__name__` once put where the op belongs). A reply's or
    an error's single word (`Invalid`, `Done`) may begin a sentence, msgspec's own included
    ("Invalid value 'x' - at `$.op`")."""
    return {
        name
        for module in (p, errors)
        for name, value in inspect.getmembers(module, inspect.isclass)
        if value.__module__.startswith("subagentd.protocol")
        and (sum(c.isupper() for c in name) > 1 or issubclass(value, p.Request))
    }


CLASS_NAMES = _protocol_class_names()
#: What a refusal must not say: a class of protocol/ (as a word of its own, case and all),
#: the CLI by name, or a CLI option (`--wait`): none of them is on the wire.
NOT_WIRE_WORDS = re.compile(
    r"\b(" + "|".join(sorted(CLASS_NAMES, key=len, reverse=True)) + r")\b"
    r"|subagentctl"
    r"|(?<![\w-])--[a-z]"
)


def test_the_check_knows_the_protocols_classes() -> None:
    assert {"NewRun", "Spawn", "Status", "WorkerView", "NotFound", "RunStopped"} <= CLASS_NAMES
    assert NOT_WIRE_WORDS.search("NewRun is not for a worker's connection")
    assert NOT_WIRE_WORDS.search("no run 'r-1' (`subagentctl ls --all` lists them)")
    assert NOT_WIRE_WORDS.search("collect --wait waits for it")
    assert not NOT_WIRE_WORDS.search("new_run is not for a worker's connection")
    assert not NOT_WIRE_WORDS.search("a collect with wait: true waits; a stop-run")


class Refusals:
    """The errors a connection gets, gathered by what provoked them."""

    def __init__(self) -> None:
        self.said: dict[str, p.Error] = {}
        self._ids = iter(range(100, 1_000_000))

    async def ask(self, conn: RawConnection, what: str, request: p.Request[p.Reply]) -> None:
        """Send `request` under a fresh id and keep the error that answers it."""
        request.id = next(self._ids)
        await conn.send(request)
        await self.take(conn, what, request.id)

    async def send_raw(self, conn: RawConnection, what: str, body: bytes, answer_id: int) -> None:
        await conn.stream.send_all(p.frame(body))
        await self.take(conn, what, answer_id)

    async def take(self, conn: RawConnection, what: str, answer_id: int) -> None:
        reply = await conn.receive()
        assert isinstance(reply, p.Error), f"{what}: answered {reply!r}, not an error"
        assert reply.id == answer_id, f"{what}: {reply!r}"
        self.said[what] = reply


async def _worker_token(user: RawConnection) -> tuple[p.WorkerView, str]:
    """A worker that prints its token, and that token."""
    await user.send(p.Spawn(id=2, argv=sh('echo "token=$SUBAGENTD_TOKEN"; exec sleep 60')))
    reply = await user.receive()
    assert isinstance(reply, p.WorkerReply)
    boss = reply.worker
    await user.send(p.Watch(id=3, worker=boss.id, follow=True))
    printed = b""
    while b"\n" not in printed:
        page = await user.receive()
        assert isinstance(page, p.Page)
        printed += b"".join(e.data for e in page.entries if e.kind == "stdout")
    await user.send(p.Abort(id=4, request=3))
    while not isinstance(await user.receive(), p.Done):
        pass  # pages already on their way
    return boss, printed.decode().split("token=", 1)[1].split()[0]


async def _answer(conn: RawConnection, request: p.Request[p.Reply]) -> p.Reply:
    await conn.send(request)
    reply = await conn.receive()
    assert reply is not None
    assert reply.id == request.id, reply
    return reply


async def _worker(conn: RawConnection, rid: int, argv: list[str], **fields: object) -> p.WorkerView:
    reply = await _answer(conn, p.Spawn(id=rid, argv=argv, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, p.WorkerReply), reply
    return reply.worker


async def _user_refusals(conn: RawConnection, refusals: Refusals, daemon: DaemonProcess) -> None:
    """What the user's own connection can be refused."""
    running = await _worker(conn, 10, ["sleep", "60"])
    finished = await _worker(conn, 11, ["true"])
    stopped = await _worker(conn, 12, ["sleep", "60"])
    assert isinstance(await _answer(conn, p.Wait(id=13, worker=finished.id)), p.WorkerReply)
    assert isinstance(await _answer(conn, p.Stop(id=14, worker=stopped.id)), p.Stopped)
    done_run = await _answer(conn, p.NewRun(id=15))
    assert isinstance(done_run, p.RunReply)
    stopped_run = done_run.run
    assert isinstance(await _answer(conn, p.StopRun(id=16, run=stopped_run)), p.Stopped)
    ask = refusals.ask

    await ask(conn, "spawn: neither argv nor agent", p.Spawn(id=0))
    await ask(conn, "spawn: argv and agent", p.Spawn(id=0, argv=["true"], agent="reviewer"))
    await ask(conn, "spawn: unknown agent", p.Spawn(id=0, agent="nobody"))
    await ask(conn, "spawn: program not found", p.Spawn(id=0, argv=["no-such-program-x"]))
    await ask(conn, "spawn: not executable", p.Spawn(id=0, argv=[str(daemon.root)]))
    await ask(conn, "spawn: no cwd", p.Spawn(id=0, argv=["true"], cwd="/no/such/dir"))
    await ask(conn, "spawn: unknown run", p.Spawn(id=0, argv=["true"], run="r-nope"))
    await ask(conn, "spawn: unknown parent", p.Spawn(id=0, argv=["true"], parent="w-nope"))
    await ask(
        conn,
        "spawn: run not the parent's",
        p.Spawn(id=0, argv=["true"], parent=running.id, run=finished.run),
    )
    await ask(conn, "spawn: stopped run", p.Spawn(id=0, argv=["true"], run=stopped_run))
    await ask(conn, "spawn: parent ended", p.Spawn(id=0, argv=["true"], parent=finished.id))
    await ask(conn, "new_run: unknown outer", p.NewRun(id=0, outer="r-nope"))
    await ask(conn, "new_run: stopped outer", p.NewRun(id=0, outer=stopped_run))
    await ask(conn, "list_workers: bad cursor", p.ListWorkers(id=0, after="nonsense"))
    await ask(conn, "status: unknown", p.Status(id=0, worker="w-nope"))
    await ask(conn, "status: not an id", p.Status(id=0, worker="../etc"))
    await ask(conn, "watch: unknown", p.Watch(id=0, worker="w-nope"))
    await ask(conn, "wait: unknown", p.Wait(id=0, worker="w-nope"))
    await ask(conn, "collect: still running", p.Collect(id=0, worker=running.id))
    await ask(conn, "collect: unknown", p.Collect(id=0, worker="w-nope"))
    await ask(conn, "wait_run_stopped: unknown", p.WaitRunStopped(id=0, run="r-nope"))
    await ask(conn, "cancel: bad scope", p.Cancel(id=0, scope="everything"))
    await ask(conn, "cancel: bad turn", p.Cancel(id=0, scope="turn:x"))
    await ask(conn, "cancel: unknown run", p.Cancel(id=0, scope="run:r-nope"))
    await ask(conn, "cancel: unknown worker", p.Cancel(id=0, scope="worker:w-nope"))
    await ask(conn, "ack: never delivered", p.Ack(id=0, wakes=[987654]))
    await ask(conn, "subscribe: no parent", p.Subscribe(id=0))
    await ask(conn, "subscribe: two parents", p.Subscribe(id=0, run="r-1", worker="w-1"))
    await ask(conn, "subscribe: unknown run", p.Subscribe(id=0, run="r-nope"))
    await ask(conn, "resume: finished", p.Resume(id=0, worker=finished.id))
    await ask(conn, "resume: running", p.Resume(id=0, worker=running.id))
    await ask(conn, "resume: unknown", p.Resume(id=0, worker="w-nope"))
    await ask(conn, "resume: input again", p.Resume(id=0, worker=stopped.id, input=b"x"))
    await ask(conn, "resume: argv again", p.Resume(id=0, worker=stopped.id, argv=["x"]))
    await ask(conn, "resume_run: unknown", p.ResumeRun(id=0, run="r-nope"))
    await ask(conn, "resume_run: live", p.ResumeRun(id=0, run=running.run))
    await ask(conn, "resume_run: ended well", p.ResumeRun(id=0, run=finished.run))
    await ask(conn, "resume: env again", p.Resume(id=0, worker=stopped.id, env={"A": "1"}))
    await ask(conn, "reopen_run: unknown", p.ReopenRun(id=0, run="r-nope"))
    await ask(conn, "latest_resumable: none", p.LatestResumable(id=0, cwd="/no/such/dir"))
    await ask(conn, "hello: a second", p.Hello(id=0))

    # Frames the daemon cannot take as they are.
    raw = refusals.send_raw
    await raw(conn, "frame: not msgpack", b"\xc1 not msgpack", 0)
    await raw(conn, "frame: unknown op", msgspec.msgpack.encode({"op": "nope", "id": 20}), 20)
    await raw(conn, "frame: no op", msgspec.msgpack.encode({"id": 21}), 21)
    await raw(conn, "frame: not a map", msgspec.msgpack.encode([1, 2]), 0)
    await raw(conn, "frame: id 0", msgspec.msgpack.encode({"op": "info", "id": 0}), 0)
    await raw(
        conn, "frame: wrong type", msgspec.msgpack.encode({"op": "spawn", "id": 22, "argv": 5}), 22
    )
    await raw(
        conn,
        "frame: out of range",
        msgspec.msgpack.encode({"op": "spawn", "id": 23, "argv": ["true"], "grace": -1}),
        23,
    )
    await raw(conn, "frame: field missing", msgspec.msgpack.encode({"op": "status", "id": 24}), 24)

    # Ids in flight: one taken twice, and one too many (waits on a worker that runs on).
    first = 10_000_000  # above the ids `ask` gives
    await conn.send(p.Wait(id=first, worker=running.id))
    await conn.send(p.Wait(id=first, worker=running.id))
    await refusals.take(conn, "id in flight", first)
    for rid in range(first + 1, first + MAX_IN_FLIGHT):
        await conn.send(p.Wait(id=rid, worker=running.id))
    await refusals.ask(conn, "too many in flight", p.Info(id=0))


async def _worker_refusals(
    daemon: DaemonProcess, token: str, boss: p.WorkerView, refusals: Refusals
) -> None:
    """What a worker's connection can be refused: each request kept from workers, and
    whatever reaches outside its subtree."""
    user = await RawConnection.open(daemon.socket)
    async with user.stream:
        stranger = await _worker(user, 2, ["sleep", "60"])
    conn = RawConnection(await trio.open_unix_socket(str(daemon.socket)))
    async with conn.stream:
        await conn.send(p.Hello(id=1, token=token))
        assert isinstance(await conn.receive(), p.Welcome)
        kept_from_workers: list[p.Request[p.Reply]] = [
            p.NewRun(id=0),
            p.StopRun(id=0, run=boss.run),
            p.WaitRunStopped(id=0, run=boss.run),
            p.BeginTurn(id=0),
            p.SetFence(id=0),
            p.CancelFence(id=0, epoch=1),
            p.ClearFence(id=0),
            p.Reload(id=0),
            p.ResumeRun(id=0, run=boss.run),
            p.ReopenRun(id=0, run=boss.run),
            p.LatestResumable(id=0, cwd="/"),
        ]
        assert {type(r) for r in kept_from_workers} == {
            kind for kind in typing.get_args(p.ClientMessage) if not kind.for_workers
        }
        for request in kept_from_workers:
            await refusals.ask(conn, f"as a worker: {p.op(request)}", request)
        ask = refusals.ask
        await ask(conn, "as a worker: spawn outside", p.Spawn(id=0, argv=["x"], parent=stranger.id))
        await ask(conn, "as a worker: subscribe to a run", p.Subscribe(id=0, run=boss.run))
        await ask(conn, "as a worker: cancel all", p.Cancel(id=0, scope="all"))
        for kind in (p.Status, p.Watch, p.Collect, p.Wait, p.Resume):
            request = kind(id=0, worker=stranger.id)
            await refusals.ask(conn, f"as a worker: {p.op(request)} outside", request)
        await refusals.ask(
            conn, "as a worker: cancel outside", p.Cancel(id=0, scope=f"worker:{stranger.id}")
        )


async def _hello_refusals(daemon: DaemonProcess, connect: Connect, refusals: Refusals) -> None:
    """What the first message of a connection, and a frame over the limit, are answered."""
    for what, first, answer_id in [
        ("hello: not first", p.encode(p.Info(id=5)), 5),
        ("hello: wrong version", p.encode(p.Hello(id=1, version=99)), 1),
        ("hello: unknown token", p.encode(p.Hello(id=1, token="not-a-token")), 1),
        ("hello: not msgpack", p.frame(b"\xc1"), 0),
    ]:
        conn = await connect(hello=False)
        await conn.stream.send_all(first)
        await refusals.take(conn, what, answer_id)
    conn = await connect()
    await conn.stream.send_all(struct.pack(">I", p.DEFAULT_FRAME_LIMIT + 1))
    await refusals.take(conn, "frame: over the limit", 0)


async def test_no_refusal_names_a_python_class_or_the_cli(
    daemon: DaemonProcess, connect: Connect
) -> None:
    refusals = Refusals()
    with trio.fail_after(60):
        user = await connect()
        boss, token = await _worker_token(user)
        await _user_refusals(user, refusals, daemon)
        await _worker_refusals(daemon, token, boss, refusals)
        await _hello_refusals(daemon, connect, refusals)
        daemon.config.write_text('[agents.reviewer]\ncommand = ["x"]\ntimeout = "soon"\n')
        await refusals.ask(await connect(), "reload: broken config", p.Reload(id=0))

    codes = {error.code for error in refusals.said.values()}
    assert codes >= {
        "invalid", "not_found", "forbidden", "refused", "run_stopped", "frozen", "busy",
        "unsupported_version", "too_large",
    }  # fmt: skip
    assert refusals.said["too many in flight"].code == "busy"
    assert refusals.said["as a worker: spawn outside"].code == "forbidden"
    not_wire = {
        what: error.message
        for what, error in refusals.said.items()
        if NOT_WIRE_WORDS.search(error.message)
    }
    assert not_wire == {}, "\n".join(f"{k}: {v}" for k, v in not_wire.items())


@pytest.mark.parametrize("kind", [p.NewRun, p.ListWorkers, p.WaitRunStopped, p.Error])
def test_op_names_a_message_class_by_its_wire_tag(
    kind: type[p.Request[p.Reply]] | type[p.Reply],
) -> None:
    """So that a daemon's text names an op without spelling it out, nor a class."""
    assert p.op(kind) == kind.__struct_config__.tag
