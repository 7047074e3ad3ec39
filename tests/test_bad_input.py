"""Bad bytes on the control socket cost their sender an error, never the daemon."""

from __future__ import annotations

import os
import struct
import sys

import msgspec
import trio

from subagentd import protocol as p

from .conftest import DaemonProcess
from .helpers import Connect


async def _still_serves(connect: Connect) -> None:
    conn = await connect()
    await conn.send(p.Info(id=2))
    reply = await conn.receive()
    assert isinstance(reply, p.InfoReply)


async def test_malformed_message_gets_invalid_and_the_connection_goes_on(connect: Connect) -> None:
    with trio.fail_after(10):
        conn = await connect()
        await conn.stream.send_all(p.frame(b"\xc1 not msgpack"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "invalid"
        await conn.stream.send_all(
            p.frame(msgspec.msgpack.encode({"op": "spawn", "id": 7, "argv": 5}))
        )
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert (reply.id, reply.code) == (7, "invalid")
        assert "argv" in reply.message
        await conn.stream.send_all(p.frame(msgspec.msgpack.encode({"op": "no_such_op", "id": 8})))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert (reply.id, reply.code) == (8, "invalid")
        await conn.send(p.Info(id=9))
        assert isinstance(await conn.receive(), p.InfoReply)


async def test_oversized_frame_is_refused_and_closed_others_unaffected(connect: Connect) -> None:
    with trio.fail_after(10):
        bystander = await connect()
        conn = await connect()
        await conn.stream.send_all(struct.pack(">I", p.DEFAULT_FRAME_LIMIT + 1))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "too_large"
        assert await conn.receive() is None
        await bystander.send(p.Info(id=2))
        assert isinstance(await bystander.receive(), p.InfoReply)


async def test_connection_must_open_with_hello(connect: Connect) -> None:
    with trio.fail_after(10):
        conn = await connect(hello=False)
        await conn.send(p.Info(id=1))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert "hello" in reply.message
        assert await conn.receive() is None
        await _still_serves(connect)


async def test_wrong_protocol_version_is_refused(connect: Connect) -> None:
    with trio.fail_after(10):
        conn = await connect(hello=False)
        await conn.send(p.Hello(id=1, version=p.PROTOCOL_VERSION + 1))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "unsupported_version"
        assert await conn.receive() is None


async def test_torn_frame_then_hangup_keeps_serving(connect: Connect) -> None:
    with trio.fail_after(10):
        for cut in (1, 3, 5, 9):
            conn = await connect()
            await conn.stream.send_all(p.encode(p.Info(id=2))[:cut])
            await conn.stream.aclose()
        await _still_serves(connect)


async def test_unknown_ids_answer_not_found(connect: Connect) -> None:
    with trio.fail_after(10):
        conn = await connect()
        requests: list[p.Request[p.Reply]] = [
            p.Status(id=0, worker="w-nope"),
            p.Watch(id=0, worker="w-nope"),
            p.Collect(id=0, worker="w-nope"),
            p.Wait(id=0, worker="w-nope"),
            p.Spawn(id=0, argv=["true"], run="r-nope"),
            p.Spawn(id=0, argv=["true"], parent="w-nope"),
        ]
        for i, request in enumerate(requests, start=2):
            request.id = i
            await conn.send(request)
            reply = await conn.receive()
            assert isinstance(reply, p.Error), request
            assert (reply.id, reply.code) == (i, "not_found")
        await conn.send(p.Stop(id=20, worker="w-nope"))
        reply = await conn.receive()
        assert isinstance(reply, p.Stopped)
        assert not reply.found


async def test_spawn_of_a_missing_executable_names_it(connect: Connect) -> None:
    with trio.fail_after(10):
        conn = await connect()
        await conn.send(p.Spawn(id=2, argv=["no-such-program-xyz"], cwd="/"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "invalid"
        assert "no-such-program-xyz" in reply.message
        await conn.send(p.Spawn(id=3, argv=["./nope"], cwd="/tmp"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert "/tmp/./nope" in reply.message
        await conn.send(p.Spawn(id=4, argv=["true"], cwd="/no/such/dir"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert "/no/such/dir" in reply.message
        await _still_serves(connect)


async def test_another_uid_is_refused_even_with_the_socket_opened_up(
    daemon: DaemonProcess, connect: Connect
) -> None:
    if os.getuid() != 0:
        return  # only root can act as another uid here; SO_PEERCRED is still checked
    os.chmod(daemon.root, 0o755)
    os.chmod(daemon.socket.parent, 0o755)
    os.chmod(daemon.socket, 0o777)
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "s.sendall(bytes.fromhex(sys.argv[2]))\n"
        "data = b''\n"
        "while chunk := s.recv(4096): data += chunk\n"
        "sys.stdout.write(data.hex())\n"
    )
    hello = p.encode(p.Hello(id=1)).hex()
    with trio.fail_after(20):
        result = await trio.run_process(
            [sys.executable, "-c", probe, str(daemon.socket), hello],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode()
    decoder = p.FrameDecoder()
    decoder.feed(bytes.fromhex(result.stdout.decode()))
    replies = [p.daemon_decoder.decode(b) for b in decoder.frames()]
    assert len(replies) == 1
    assert isinstance(replies[0], p.Error)
    assert replies[0].code == "forbidden"
    with trio.fail_after(10):
        await _still_serves(connect)
