"""Every field issue 26 added, sent hostile over the wire to a live daemon: `invalid`
naming the field, nothing made, and the daemon serves on (the decoding alone is checked
in test_resource_limits.py; here the daemon's answer). Limits on spawn and new_run, the
pause verbs' worker and run."""

from __future__ import annotations

import msgspec
import pytest
import trio

from subagentd import protocol as p

from .conftest import DaemonProcess
from .helpers import Connect, RawConnection

#: Values no limit field takes: out of bounds, not finite, of the wrong type, empty (nil
#: is no limit of that kind: taken).
HOSTILE_LIMITS: dict[str, list[object]] = {
    "memory": [0, -1, 2**50 + 1, 2**64 - 1, 1.5, "2G", "", True, [], {}],
    "cpus": [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1025.0, "1.5", [], True],
    "pids": [0, -5, 4_194_305, 2**63, 2.5, "many", "", [], {}],
}
#: Values no pause target takes (an id is a non-empty string of bounded length).
HOSTILE_TARGETS: list[object] = [7, 1.5, True, [], {}, ["w-1"], "w" * 10_000, b"w-1"]


async def _refused(conn: RawConnection, body: bytes, field: str) -> None:
    await conn.stream.send_all(p.frame(body))
    reply = await conn.receive()
    assert isinstance(reply, p.Error), (body, reply)
    assert (reply.id, reply.code) == (9, "invalid"), reply
    assert field in reply.message, reply.message


@pytest.mark.parametrize("op", ["spawn", "new_run"])
async def test_hostile_limits_are_invalid_naming_the_field_and_make_nothing(
    daemon: DaemonProcess, connect: Connect, op: str
) -> None:
    with trio.fail_after(60):
        conn = await connect()
        base: dict[str, object] = {"op": op, "id": 9}
        if op == "spawn":
            base["argv"] = ["true"]
        for field, values in HOSTILE_LIMITS.items():
            for value in values:
                body = msgspec.msgpack.encode({**base, "limits": {field: value}})
                await _refused(conn, body, f"limits.{field}")
        for shape in ([], "64M", 5, [{"memory": 1 << 30}]):  # not a map at all
            await _refused(conn, msgspec.msgpack.encode({**base, "limits": shape}), "limits")
        await conn.send(p.ListWorkers(id=10, all=True))
        listed = await conn.receive()
        assert isinstance(listed, p.WorkerList)
        assert listed.workers == []  # nothing was spawned


@pytest.mark.parametrize("op", ["pause", "unpause"])
async def test_hostile_pause_targets_are_invalid_naming_the_field(
    daemon: DaemonProcess, connect: Connect, op: str
) -> None:
    with trio.fail_after(60):
        conn = await connect()
        for field in ("worker", "run"):
            for value in HOSTILE_TARGETS:
                body = msgspec.msgpack.encode({"op": op, "id": 9, field: value})
                await _refused(conn, body, field)
        await conn.send(p.Info(id=10))
        assert isinstance(await conn.receive(), p.InfoReply)  # and it serves on
