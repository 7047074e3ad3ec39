"""send: writing to a running worker's stdin, kept open at spawn (stdin_open), end to end.

What is written is journaled (kind stdin); eof closes the pipe; the pipe is carried across
a reload with the worker's other pipes, so a send after the reload reaches the same
process. The daemon never waits for room in a pipe: a worker that does not read answers
`busy` once its pipe is full, and the daemon serves on. A worker's token sends only within
its subtree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Client
from subagentd.protocol.errors import Busy, Invalid, NotFound, Refused

from .conftest import DaemonProcess
from .helpers import RawConnection, paged_stdout, sh, wait_output
from .test_cli import ok, said


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_send_reaches_a_cat_and_eof_ends_it(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(["cat"], stdin_open=True)
        assert await client.send(worker.id, "hello\n") == 6
        assert await wait_output(client, worker.id, b"hello\n") == b"hello\n"
        assert await client.send(worker.id, b"bye\n", eof=True) == 4
        ended = await client.wait(worker.id)
        assert (ended.state, ended.exit_code) == ("finished", 0)
        assert await paged_stdout(client, worker.id) == b"hello\nbye\n"
        journal = [entry async for entry in client.watch(worker.id)]
        assert [e.data for e in journal if e.kind == "stdin"] == [b"hello\n", b"bye\n"]
        assert b"stdin closed: eof sent" in [e.data for e in journal if e.kind == "note"]


async def test_send_is_refused_clearly_where_there_is_no_open_stdin(client: AsyncClient) -> None:
    with trio.fail_after(20):
        plain = await client.spawn(["sleep", "100000"])
        with pytest.raises(Refused, match="not spawned with stdin_open"):
            await client.send(plain.id, "x")
        closed = await client.spawn(["sleep", "100000"], stdin_open=True)
        assert await client.send(closed.id, "", eof=True) == 0
        with pytest.raises(Refused, match="stdin is closed"):
            await client.send(closed.id, "x")
        done = await client.spawn(["true"], stdin_open=True)
        await client.wait(done.id)
        with pytest.raises(Refused, match="ended"):
            await client.send(done.id, "x")
        with pytest.raises(NotFound):
            await client.send("w-nope", "x")
        with pytest.raises(Invalid, match="stdin_open"):
            await client.spawn(["cat"], input="x", stdin_open=True)
        with pytest.raises(Invalid, match="data"):
            await client.send(closed.id, b"x" * (p.MAX_SEND_BYTES + 1))
        # A worker that closed its own stdin: refused, and said in its journal.
        closer = await client.spawn(sh("exec 0<&-; echo closed; sleep 100000"), stdin_open=True)
        await wait_output(client, closer.id, b"closed\n")
        with pytest.raises(Refused, match="closed its stdin"):
            await client.send(closer.id, "x")
        for worker in (plain, closed, closer):
            await client.stop(worker.id)


async def test_a_worker_that_never_reads_gets_busy_and_the_daemon_serves_on(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        deaf = await client.spawn(["sleep", "100000"], stdin_open=True)
        taken = await client.send(deaf.id, b"x" * p.MAX_SEND_BYTES)
        assert 0 < taken < p.MAX_SEND_BYTES  # what its pipe had room for, no more
        with pytest.raises(Busy) as busy:
            await client.send(deaf.id, b"more")
        assert busy.value.retry_after is not None
        async with AsyncClient(daemon.socket) as other:
            assert (await other.status(deaf.id)).state == "running"
            echo = await other.spawn(["cat"], stdin_open=True)
            assert await other.send(echo.id, "still serving\n", eof=True) == 14
            assert (await other.collect(echo.id, wait=True)).result == "still serving\n"
        await client.stop(deaf.id)


async def test_stdin_is_carried_across_a_reload_to_the_same_process(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(["cat"], stdin_open=True)
        await client.send(worker.id, "before\n")
        await wait_output(client, worker.id, b"before\n")
        async with AsyncClient(daemon.socket) as other:
            reloaded = await other.reload()
        assert reloaded.carried_live == 1
        assert await client.send(worker.id, "after\n", eof=True) == 6
        ended = await client.wait(worker.id)
        assert (ended.state, ended.pid) == ("finished", worker.pid)
        assert await paged_stdout(client, worker.id) == b"before\nafter\n"


async def test_a_workers_token_sends_only_within_its_subtree(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(30):
        boss = await client.spawn(sh('echo "token=$SUBAGENTD_TOKEN"; exec sleep 100000'))
        sibling = await client.spawn(["cat"], stdin_open=True)
        child = await client.spawn(["cat"], stdin_open=True, parent=boss.id)
        printed = await wait_output(client, boss.id, b"\n")
        token = printed.decode().split("token=", 1)[1].split()[0]
        conn = RawConnection(await trio.open_unix_socket(str(daemon.socket)))
        try:
            await conn.send(p.Hello(id=1, token=token))
            assert isinstance(await conn.receive(), p.Welcome)
            await conn.send(p.Send(id=2, worker=sibling.id, data=b"not yours\n"))
            refused = await conn.receive()
            assert isinstance(refused, p.Error)
            assert refused.code == "forbidden"
            await conn.send(p.Send(id=3, worker=child.id, data=b"mine\n", eof=True))
            sent = await conn.receive()
            assert isinstance(sent, p.Sent)
            assert sent.written == 5
        finally:
            await conn.stream.aclose()
        assert (await client.collect(child.id, wait=True)).result == "mine\n"
        assert [e async for e in client.watch(sibling.id) if e.kind == "stdin"] == []
        await client.stop(boss.id)
        await client.stop(sibling.id)


def test_the_blocking_client_sends_too(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, timeout=20) as client:
        worker = client.spawn(["cat"], stdin_open=True)
        assert client.send(worker.id, b"sync\n", eof=True) == 5
        assert client.collect(worker.id, wait=True).result == "sync\n"


def test_subagentctl_send_and_spawn_stdin_open(daemon: DaemonProcess) -> None:
    spawned = ok(daemon.ctl("--json", "spawn", "--stdin", "open", "--", "cat"))
    worker_id = spawned.stdout.split('"id":"', 1)[1].split('"', 1)[0]
    assert ok(daemon.ctl("send", worker_id, "typed\n")).stdout == f"{worker_id}: wrote 6 bytes\n"
    piped = ok(daemon.ctl("--json", "send", worker_id, "-", "--eof", input="piped\n"))
    assert piped.stdout == f'{{"worker":"{worker_id}","written":6,"eof":true}}\n'
    ok(daemon.ctl("wait", worker_id))
    assert ok(daemon.ctl("collect", worker_id)).stdout == "typed\npiped\n"
    refused = daemon.ctl("send", worker_id, "late")
    assert refused.returncode == 1, said(refused)
    assert "ended" in refused.stderr
    both = daemon.ctl("spawn", "--stdin", "open", "--input", "x", "--", "cat")
    assert both.returncode == 2
    nothing = daemon.ctl("send", worker_id)
    assert nothing.returncode == 2


async def test_a_resumed_attempt_has_its_stdin_open_again(client: AsyncClient) -> None:
    """`stdin_open` is frozen in the snapshot like everything a spawn asked: a worker
    stopped and resumed can be sent to again."""
    with trio.fail_after(20):
        worker = await client.spawn(["cat"], stdin_open=True)
        await client.stop(worker.id)
        resumed = await client.resume(worker.id)
        assert resumed.attempt == 2
        assert await client.send(worker.id, "again\n") == 6
        assert (await wait_output(client, worker.id, b"again\n")).endswith(b"again\n")
        await client.stop(worker.id)
