"""The idempotency keys of spawns and resumes: which worker each recent key made, so a
request sent again after its answer was lost answers that worker instead of a second one.

Pure: no trio, no I/O, no clock (callers pass `now`, the daemon's wall clock, which the
in-process tests make follow trio's MockClock). The store keeps the same rows, written in
the transaction that records the worker, so the keys outlive a reload and a crash.

A key belongs to its caller: the user (every connection without a token: the daemon is
one uid's, and a request sent again comes on a new connection) or the worker whose token
a connection presented. A worker cannot read the answer to a key it did not send.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from subagentd.protocol import Resume, Spawn

#: How long a key is remembered by default: far longer than a reload or a restart takes.
DEFAULT_REQUEST_KEY_TTL = 600.0
#: Keys remembered for one caller at most; past that its oldest are forgotten early (a
#: key is needed only for the seconds a lost answer takes to be asked again).
MAX_KEYS_PER_CALLER = 4096
#: The caller namespace of connections that presented no token: the user's.
USER = ""

_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key, in its caller's namespace, the worker its request made (or resumed), what
    that request asked (a digest) and when (the daemon's wall clock)."""

    caller: str
    key: str
    worker: str
    digest: bytes
    at: float


@dataclass(frozen=True, slots=True)
class AskedKey:
    """The key a request came with, before it is known whether it was seen."""

    caller: str
    key: str
    digest: bytes

    def made(self, worker_id: str, now: float) -> KeyRecord:
        return KeyRecord(self.caller, self.key, worker_id, self.digest, now)


def asked_key(request: Spawn | Resume, caller: str | None) -> AskedKey | None:
    """The key `request` carries, in the namespace of `caller` (a worker id, or None for
    the user), with a digest of everything else it asks; None without a key."""
    if request.key is None:
        return None
    # Its id is the connection's and its key is the key: neither is what it asks. Its
    # input (up to 8 MiB) is hashed as it is, after the rest, not copied into an encoding.
    given = request.input
    rest = msgspec.structs.replace(request, id=1, key=None, input=None if given is None else b"")
    digest = hashlib.sha256(_encoder.encode(_asked(rest)))  # sha256: the fastest here (SHA-NI)
    if given is not None:
        digest.update(given)
    return AskedKey(caller or USER, request.key, digest.digest()[:16])


def _asked(request: Spawn | Resume) -> tuple[str, dict[str, object]]:
    """What `request` asks: its op and the fields it gives other than their defaults. A
    field left at its default is not part of the digest, so a field a later version adds
    (with a default, as every new field has) changes no digest: a keyed request sent again
    across an upgrade reload still matches the key its first sending made."""
    given = {}
    for field in _fields(type(request)):
        value = getattr(request, field.name)
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            given[field.name] = value
            continue
        if value != default:
            given[field.name] = value
    return str(request.__struct_config__.tag), given


@functools.cache
def _fields(kind: type[Spawn | Resume]) -> tuple[msgspec.structs.FieldInfo, ...]:
    """`msgspec.structs.fields` of a request type, worked out once: it resolves the
    type's annotations each time (5% of a keyed spawn's cost in the daemon)."""
    return msgspec.structs.fields(kind)


class RequestKeys:
    """Recent keys, oldest first: each forgotten `ttl` seconds after its request, or
    earlier once its caller has `per_caller` newer ones."""

    def __init__(self, ttl: float = DEFAULT_REQUEST_KEY_TTL, per_caller: int = MAX_KEYS_PER_CALLER):
        self.ttl = ttl
        self.per_caller = per_caller
        self._keys: OrderedDict[tuple[str, str], KeyRecord] = OrderedDict()
        self._callers: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def find(self, caller: str, key: str, now: float) -> KeyRecord | None:
        """What `key` made for `caller`, unless forgotten or older than the ttl."""
        known = self._keys.get((caller, key))
        if known is None or now - known.at >= self.ttl:
            return None
        return known

    def remember(self, record: KeyRecord, now: float) -> list[tuple[str, str]]:
        """Take in a key (its request was just written down); the keys forgotten to make
        room or because their time is up, for the store to drop too."""
        name = (record.caller, record.key)
        self._forget(name)
        dropped = self._expire(now)
        if now - record.at >= self.ttl:  # read back from the store past its time
            return [*dropped, name]
        self._keys[name] = record
        mine = self._callers.setdefault(record.caller, OrderedDict())
        mine[record.key] = None
        while len(mine) > self.per_caller:
            oldest = next(iter(mine))
            self._forget((record.caller, oldest))
            dropped.append((record.caller, oldest))
        return dropped

    def forget(self, caller: str, key: str) -> None:
        """Forget a key whose request was refused after all: sent again, it is tried again."""
        self._forget((caller, key))

    def load(self, records: list[KeyRecord], now: float) -> list[tuple[str, str]]:
        """Take in what the store kept, oldest first; the keys it should drop."""
        dropped = []
        for record in sorted(records, key=lambda r: r.at):
            dropped += self.remember(record, now)
        dropped += self._expire(now)
        return dropped

    def _expire(self, now: float) -> list[tuple[str, str]]:
        dropped = []
        while self._keys:
            name, oldest = next(iter(self._keys.items()))
            if now - oldest.at < self.ttl:
                break
            self._forget(name)
            dropped.append(name)
        return dropped

    def _forget(self, name: tuple[str, str]) -> None:
        if self._keys.pop(name, None) is None:
            return
        caller, key = name
        mine = self._callers[caller]
        del mine[key]
        if not mine:
            del self._callers[caller]
