"""Integers a message carries, checked against what msgpack can hold before it is encoded.

msgpack holds an integer from -2**63 to 2**64 - 1. Past that, msgspec's encoder fails
with OverflowError, which no caller is ready for: `subagentctl watch --since 2**70`
ended in a traceback, the library raised a generic error. `check_integers` names the
field instead, in the very words the daemon names a field out of its range with (a
cursor of 2**63 reaches the daemon, which says so), so a client sees `invalid` for a
cursor of 2**70 as it does for one of 2**63 or -1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgspec

from .errors import Invalid

#: What a msgpack integer can be: an int64's least, a uint64's most.
WIRE_MIN = -(2**63)
WIRE_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class IntegerField:
    """A field of a message that holds an integer (or a list of them: `many`), and the
    bounds its message type declares (None: the wire's own)."""

    name: str
    many: bool
    ge: int | None
    le: int | None
    #: nil is a value of it too (`int | None`: nil means none, as `max_running`'s).
    nullable: bool = False


@functools.cache
def integer_fields(kind: type[msgspec.Struct]) -> tuple[IntegerField, ...]:
    """The fields of message type `kind` that hold integers, from its declared types."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    found: list[IntegerField] = []
    for field in info.fields:
        many, inner = False, field.type
        if isinstance(inner, msgspec.inspect.ListType):
            many, inner = True, inner.item_type
        choices = inner.types if isinstance(inner, msgspec.inspect.UnionType) else (inner,)
        nullable = any(isinstance(choice, msgspec.inspect.NoneType) for choice in choices)
        found.extend(
            IntegerField(field.name, many, choice.ge, choice.le, nullable)
            for choice in choices
            if isinstance(choice, msgspec.inspect.IntType)
        )
    return tuple(found)


def check_integers(message: msgspec.Struct) -> None:
    """Invalid naming the first integer of `message` that msgpack cannot hold, as the
    daemon names a field out of range: "Expected `int` <= N - at `$.since`"."""
    for field in integer_fields(type(message)):
        value = getattr(message, field.name)
        values = enumerate(value) if field.many else ((None, value),)
        for index, item in values:
            if not isinstance(item, int) or WIRE_MIN <= item <= WIRE_MAX:
                continue
            if item > WIRE_MAX:
                expected = f"<= {field.le if field.le is not None else WIRE_MAX}"
            else:
                expected = f">= {field.ge if field.ge is not None else WIRE_MIN}"
            where = field.name if index is None else f"{field.name}[{index}]"
            raise Invalid(f"invalid request: Expected `int` {expected} - at `$.{where}`")
