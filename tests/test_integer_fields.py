"""Every integer field of every request, given what no field of it may hold: 2**63, 2**64,
-2**63 - 1, 2**70, floats, nan. Sent raw to the daemon (what msgpack can carry) and
through the client (what it cannot, as well), each is answered `invalid` naming its
field, and the connection serves on: a watch cursor of 2**70 is no generic error."""

from __future__ import annotations

import math
import typing
from typing import Any

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol import _messages
from subagentd.protocol._integers import WIRE_MAX, WIRE_MIN, IntegerField, integer_fields
from subagentd.protocol.errors import Invalid

from .conftest import DaemonProcess
from .helpers import Connect

REQUESTS: tuple[type[p.Request[p.Reply]], ...] = typing.get_args(_messages.ClientMessage)
#: Every (request type, integer field) of the protocol, found from the declared types.
FIELDS = [(kind, field) for kind in REQUESTS for field in integer_fields(kind)]
#: What no integer field takes, as msgpack carries it (a float, a bool, text, nil, ints
#: past the field's bounds) and, from a client, past what msgpack can carry at all.
ON_THE_WIRE: list[Any] = [2**63, WIRE_MAX, WIRE_MIN, -1, 1.5, math.nan, math.inf, True, "5", None]
PAST_THE_WIRE = [2**64, 2**70, -(2**63) - 1, -(2**70)]


def _beyond(field: IntegerField, value: Any) -> bool:
    """Whether `value` is not what `field` takes (an int within its bounds, or nil where
    nil means none)."""
    if value is None and field.nullable:
        return False
    if not isinstance(value, int) or isinstance(value, bool):
        return True
    low = field.ge if field.ge is not None else WIRE_MIN
    high = field.le if field.le is not None else WIRE_MAX
    return not low <= value <= high


def _where(field: IntegerField) -> str:
    return f"`$.{field.name}[0]`" if field.many else f"`$.{field.name}`"


def _placeholder(kind: msgspec.inspect.Type) -> Any:
    """A value of a required field's type that its message takes."""
    match kind:
        case msgspec.inspect.StrType():
            return "x"
        case msgspec.inspect.IntType():
            return kind.ge if kind.ge is not None else 1
        case msgspec.inspect.FloatType():
            return 1.0
        case msgspec.inspect.ListType() | msgspec.inspect.DictType():
            return [] if isinstance(kind, msgspec.inspect.ListType) else {}
        case msgspec.inspect.LiteralType():
            return kind.values[0]
        case msgspec.inspect.UnionType():
            return _placeholder(kind.types[0])
    raise AssertionError(f"no placeholder for {kind}")


def _request(kind: type[p.Request[p.Reply]], field: IntegerField, value: Any) -> dict[str, Any]:
    """`kind` as a raw message (its required fields filled in) with `field` set to `value`."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    raw = {"op": p.op(kind), "id": 7}
    raw |= {f.name: _placeholder(f.type) for f in info.fields if f.required and f.name != "id"}
    raw[field.name] = [value] if field.many else value
    return raw


def test_the_fields_looked_at_are_every_integer_field_of_the_protocol() -> None:
    found = {(p.op(kind), field.name) for kind, field in FIELDS}
    for op in ("watch", "grep"):
        assert {(op, "since"), (op, "limit"), (op, "max_bytes")} <= found
    assert {("watch", "offset"), ("grep", "before"), ("grep", "after")} <= found
    assert {("list_workers", "limit"), ("ack", "wakes"), ("cancel_fence", "epoch")} <= found
    assert {("abort", "request"), ("hello", "version")} <= found
    assert {p.op(kind) for kind, field in FIELDS if field.name == "id"} == {
        p.op(kind) for kind in REQUESTS
    }


@pytest.mark.parametrize("value", PAST_THE_WIRE)
def test_an_integer_msgpack_cannot_carry_is_invalid_naming_its_field(value: int) -> None:
    for kind, field in FIELDS:
        request = msgspec.convert(_request(kind, field, 1 if field.ge is None else field.ge), kind)
        hostile = msgspec.structs.replace(request, **{field.name: [value] if field.many else value})
        with pytest.raises(
            Invalid, match=r"invalid request: Expected `int` [<>]= -?\d+ - at "
        ) as e:
            p.encode(hostile)
        assert str(e.value).endswith(_where(field)), (p.op(kind), field.name)


async def test_the_daemon_answers_every_hostile_integer_invalid_naming_its_field(
    connect: Connect,
) -> None:
    with trio.fail_after(60):
        conn = await connect()
        for kind, field in FIELDS:
            for value in ON_THE_WIRE:
                if not _beyond(field, value):
                    continue
                raw = _request(kind, field, value)
                first = await connect(hello=False) if kind is p.Hello else conn
                await first.stream.send_all(p.frame(msgspec.msgpack.encode(raw)))
                reply = await first.receive()
                assert isinstance(reply, p.Error), (raw, reply)
                assert reply.code == "invalid", (raw, reply)
                assert reply.message.endswith(_where(field)), (raw, reply.message)
        await conn.send(p.Info(id=8))
        assert isinstance(await conn.receive(), p.InfoReply)


async def test_a_client_request_with_a_hostile_integer_is_invalid_naming_its_field(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            for kind, field in FIELDS:
                if field.name == "id" or kind is p.Hello:
                    continue  # the client's own to give
                for value in [*PAST_THE_WIRE, 2**63, 1.5, math.nan, -math.inf]:
                    raw = _request(kind, field, value)
                    hostile = kind(**{k: v for k, v in raw.items() if k != "op"})
                    with pytest.raises(Invalid) as refused:
                        await client.request(hostile)
                    assert str(refused.value).endswith(_where(field)), (raw, refused.value)
            # A watch cursor of 2**70, as the issue found it, and the client serves on.
            worker = await client.spawn(["true"])
            with pytest.raises(Invalid, match=r"<= 9223372036854775807 - at `\$.since`"):
                await client.watch_page(worker.id, since=2**70)
            assert (await client.status(worker.id)).id == worker.id


def test_subagentctl_says_which_flag_is_out_of_range_without_a_traceback(
    daemon: DaemonProcess,
) -> None:
    spawned = daemon.ctl("--json", "spawn", "--", "true")
    assert spawned.returncode == 0, spawned.stderr
    worker = msgspec.json.decode(spawned.stdout)["id"]
    for args, where in [
        (["watch", worker, "--since", str(2**70)], "since"),
        (["grep", worker, "x", "-B", str(2**64)], "before"),
        (["grep", worker, "x", "-A", str(-(2**63) - 1)], "after"),
        (["fence", "--cancel", str(2**70)], "epoch"),
    ]:
        said = daemon.ctl(*args)
        assert said.returncode == 1, (args, said.stderr)
        assert "Traceback" not in said.stderr
        assert said.stderr.startswith("subagentctl: invalid: "), (args, said.stderr)
        assert f"`$.{where}`" in said.stderr, (args, said.stderr)
