"""What protocol/README.md says of the wire in corners a client meets, tried against the
daemon: a listing of an unknown run, an id reused while in flight, ids out of range, what
may follow the id-0 `reloading` event, how long a worker's token opens a connection."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import Connect, RawConnection, sh, wait_output
from .inprocess import held, in_process


async def test_a_listing_of_an_unknown_run_is_not_found(connect: Connect) -> None:
    with trio.fail_after(30):
        conn = await connect()
        await conn.send(p.ListWorkers(id=2, run="r-nope"))
        reply = await conn.receive()
        assert isinstance(reply, p.Error), reply
        assert (reply.id, reply.code) == (2, "not_found")
        assert "r-nope" in reply.message


async def test_an_id_reused_while_in_flight_is_refused_under_that_same_id(
    daemon: DaemonProcess, connect: Connect
) -> None:
    """Two answers come under the id then: the refusal at once, the first request's later."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"])
            conn = await connect()
            await conn.send(p.Wait(id=5, worker=worker.id))
            await conn.send(p.Status(id=5, worker=worker.id))
            refusal = await conn.receive()
            assert isinstance(refusal, p.Error), refusal
            assert (refusal.id, refusal.code) == (5, "invalid")
            assert "request id 5 is already in flight" in refusal.message
            await client.stop(worker.id)
            answer = await conn.receive()
            assert isinstance(answer, p.WorkerReply), answer
            assert (answer.id, answer.worker.state) == (5, "stopped")


@pytest.mark.parametrize("rid", [0, -1, -(2**63), 2**63, 2**64 - 1])
async def test_an_id_out_of_range_is_refused_and_echoed_as_sent(connect: Connect, rid: int) -> None:
    with trio.fail_after(30):
        conn = await connect()
        body = msgspec.msgpack.encode({"op": "info", "id": rid})
        await conn.stream.send_all(p.frame(body))
        reply = await conn.receive()
        assert isinstance(reply, p.Error), reply
        assert (reply.id, reply.code) == (rid, "invalid")
        await conn.send(p.Info(id=3))  # the connection carries on
        assert isinstance(await conn.receive(), p.InfoReply)


def _token_of(pid: int) -> str:
    """A worker's token, as its process has it (nobody else is told it)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in env if v.startswith(b"SUBAGENTD_TOKEN=")).decode().split("=", 1)[1]


async def _hello_with(daemon: DaemonProcess, token: str) -> p.Reply | None:
    conn = await RawConnection.open(daemon.socket, hello=False)
    async with conn.stream:
        await conn.send(p.Hello(id=1, token=token))
        return await conn.receive()


async def test_a_workers_token_opens_a_connection_while_its_handle_is_held(
    daemon: DaemonProcess,
) -> None:
    """Running, ended and uncollected (within the finished TTL), resumed again: yes;
    collected (or past the TTL): the token names no worker the daemon holds."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            # A shell that stays (no exec into `sleep`, in whose midst its environ reads
            # empty), read once it has said it runs.
            worker = await client.spawn(sh("echo ready; while :; do sleep 1; done"))
            await wait_output(client, worker.id, b"ready")
        assert worker.pid is not None  # its token is handed to its process alone: read there
        token = _token_of(worker.pid)
        welcome = await _hello_with(daemon, token)
        assert isinstance(welcome, p.Welcome)
        assert welcome.worker == worker.id
        async with AsyncClient(daemon.socket) as client:
            await client.stop(worker.id)
            welcome = await _hello_with(daemon, token)
            assert isinstance(welcome, p.Welcome), welcome  # stopped, not yet collected
            await client.collect(worker.id)
            refused = await _hello_with(daemon, token)
            assert isinstance(refused, p.Error), refused
            assert (refused.id, refused.code) == (1, "forbidden")
            await client.resume(worker.id)  # its next attempt has the same token
            welcome = await _hello_with(daemon, token)
            assert isinstance(welcome, p.Welcome)
            assert welcome.worker == worker.id
            await client.stop(worker.id)


async def test_a_spawn_read_after_the_reloading_event_is_answered_reloading_under_its_id(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    """The event comes first; until the connection closes, the daemon still answers what it
    reads, a spawn `reloading` under its own id (held here: the clock stands still in the
    moment the daemon gives its clients to hang up)."""
    async with in_process(short_tmp) as d:
        conn = await RawConnection.open(d.socket)
        async with conn.stream, trio.open_nursery() as nursery:
            with held(autojump_clock):
                nursery.start_soon(d.reload_in_place)
                event = await conn.receive()
                assert isinstance(event, p.Error), event
                assert (event.id, event.code) == (0, "reloading")
                await conn.send(p.Spawn(id=7, argv=["true"], key="k-after-the-event"))
                answer = await conn.receive()
                assert isinstance(answer, p.Error), answer
                assert (answer.id, answer.code) == (7, "reloading")
                assert answer.retry_after is not None
            assert await conn.receive() is None  # then it is closed
