"""The cost of posting a wake and of acknowledging it: the wake log (before) against the
store (after), in-process, no daemon, no socket.

    .venv/bin/python bench/store.py [--wakes N] [--rounds N] [--dir PATH]

Before: what `WakeLog` did per post and per ack (the image before the store): one
msgpack-framed, checksummed entry appended with one write(2) to an O_APPEND file, never
fsynced. After: `Store.post_wake` and `Store.ack_wakes`, each one `BEGIN IMMEDIATE`
transaction in sqlite's WAL, with `synchronous=NORMAL` (the daemon's choice: in the WAL
before it returns, so kill -9 loses none; fsynced at checkpoints) and, for comparison,
`synchronous=FULL` (an fsync per commit: survives the machine going down too). Each
figure is the median and p99 of N single operations, in microseconds, the median of them
over `--rounds` rounds that take turns (so a busy moment of the machine does not land on
one variant alone), measured on
`--dir` (default: a temporary directory beside the default state dir, so on the disk the
daemon uses, not a tmpfs). An ending costs one post and, later, one ack; since schema
v2 its post is one transaction with its record (the variant "ending (record + wake)").
Since schema v3 a spawn's registration also writes its idempotency key in its transaction:
the last line compares a registration without a key and with one, taking turns.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec

from subagentd.daemon.core._registry import WorkerRecord
from subagentd.daemon.core._request_keys import USER, KeyRecord
from subagentd.daemon.store._journal import ENTRY_HEADER
from subagentd.daemon.store._store import STORE_NAME, Change, Store
from subagentd.daemon.store._wake_log import _Ack, _Post
from subagentd.protocol import Wake, default_state_dir

PREVIEW = "x" * 200  # a wake's preview at its longest


def _wake(seq: int) -> Wake:
    return Wake(seq=seq, id=f"w-{seq:012x}", run="r-bench", state="finished", preview=PREVIEW)


def _timed(op: Callable[[int], None], n: int) -> list[float]:
    times = []
    for i in range(1, n + 1):
        start = time.perf_counter()
        op(i)
        times.append((time.perf_counter() - start) * 1e6)
    return times


def wake_log(directory: Path, n: int) -> tuple[list[float], list[float]]:
    encoder = msgspec.msgpack.Encoder()
    fd = os.open(directory / "wakes.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(record: _Post | _Ack) -> None:
        body = encoder.encode(record)
        data = ENTRY_HEADER.pack(len(body), zlib.crc32(body)) + body
        if os.write(fd, data) != len(data):
            raise OSError("short write")

    try:
        posts = _timed(lambda i: append(_Post(_wake(i))), n)
        acks = _timed(lambda i: append(_Ack([i])), n)
    finally:
        os.close(fd)
    return posts, acks


def store(directory: Path, n: int, synchronous: str) -> tuple[list[float], list[float]]:
    db = Store.open(directory / STORE_NAME)
    db._db.execute(f"PRAGMA synchronous = {synchronous}")
    try:
        posts = _timed(lambda i: db.post_wake(_wake(i)), n)
        acks = _timed(lambda i: db.ack_wakes([i]), n)
    finally:
        db.close()
    return posts, acks


def _record(seq: int, **fields: object) -> WorkerRecord:
    record: dict[str, object] = {
        "id": f"w-{seq:012x}", "run": "r-bench", "parent": None, "name": "", "state": "running",
        "argv": ["agent", "--task", "x" * 200], "cwd": "/home/user/project", "agent": None,
        "grace": 5.0, "timeout": None, "token": "t" * 43,
        "archive": f"/state/archives/w-{seq:012x}", "started_at": 1.0,
    }  # fmt: skip
    return WorkerRecord(**(record | fields))  # type: ignore[arg-type]


def endings(directory: Path, n: int) -> tuple[list[float], list[float]]:
    """An ending as the daemon writes it since schema v2: the worker's row (registered
    before, untimed) updated to its final state and its wake inserted, one transaction."""
    db = Store.open(directory / STORE_NAME)
    try:
        for i in range(1, n + 1):
            db.commit(Change(workers=[_record(i)]), "a spawn")
        ended = {"state": "finished", "exit_code": 0, "ended_at": 2.0}
        posts = _timed(
            lambda i: db.commit(
                Change(workers=[_record(i, **ended)], wakes=[_wake(i)]), "an ending"
            ),
            n,
        )
        acks = _timed(lambda i: db.ack_wakes([i]), n)
    finally:
        db.close()
    return posts, acks


def registrations(directory: Path, n: int) -> tuple[list[float], list[float]]:
    """A spawn's registration (the worker's row), without an idempotency key and with one
    (and a digest), alternately; each one transaction."""
    db = Store.open(directory / STORE_NAME)
    plain: list[float] = []
    keyed: list[float] = []
    try:
        for i in range(1, 2 * n + 1):
            change = Change(workers=[_record(i)])
            if i % 2:
                change.keys.append(KeyRecord(USER, f"{i:032x}", _record(i).id, b"d" * 16, 1.0))
            start = time.perf_counter()
            db.commit(change, "a spawn")
            (keyed if i % 2 else plain).append((time.perf_counter() - start) * 1e6)
    finally:
        db.close()
    return plain, keyed


def _p99(times: list[float]) -> float:
    return sorted(times)[int(len(times) * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wakes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    parent = args.dir or default_state_dir().parent
    parent.mkdir(parents=True, exist_ok=True)
    variants: dict[str, Callable[[Path], tuple[list[float], list[float]]]] = {
        "wake log (before)": lambda d: wake_log(d, args.wakes),
        "store, synchronous=NORMAL (after)": lambda d: store(d, args.wakes, "NORMAL"),
        "store, synchronous=FULL": lambda d: store(d, args.wakes, "FULL"),
        "ending (record + wake), NORMAL": lambda d: endings(d, args.wakes),
    }
    figures: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            directory = Path(tempfile.mkdtemp(prefix="bench-store-", dir=parent))
            try:
                posts, acks = run(directory)
            finally:
                shutil.rmtree(directory)
            figures[name].append(
                (statistics.median(posts), _p99(posts), statistics.median(acks), _p99(acks))
            )
    print(f"{args.wakes} wakes posted then acknowledged one at a time, {args.rounds} rounds, "
          f"on {parent}; us (median over rounds)")  # fmt: skip
    print(f"{'':36} {'post median':>12} {'post p99':>9} {'ack median':>11} {'ack p99':>8}")
    for name, rounds in figures.items():
        post, post99, ack, ack99 = (
            statistics.median(column) for column in zip(*rounds, strict=True)
        )
        print(f"{name:36} {post:12.1f} {post99:9.1f} {ack:11.1f} {ack99:8.1f}")
    directory = Path(tempfile.mkdtemp(prefix="bench-store-", dir=parent))
    try:
        plain, keyed = registrations(directory, args.wakes)
    finally:
        shutil.rmtree(directory)
    print(
        f"{'registration, without key / with':36} {statistics.median(plain):12.1f} "
        f"{_p99(plain):9.1f} {statistics.median(keyed):11.1f} {_p99(keyed):8.1f}"
    )
    print(f"python {sys.version.split()[0]}, sqlite {__import__('sqlite3').sqlite_version}")


if __name__ == "__main__":
    main()
