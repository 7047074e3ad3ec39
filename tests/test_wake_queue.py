"""The wake queue and its store, called directly: no wake lost, none posted twice, no
seq given twice; and the wake log of an image before the store, imported once."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from subagentd.daemon.core._wakes import WakeQueue, key_of
from subagentd.daemon.store._store import STORE_NAME, Store
from subagentd.daemon.store._wake_log import open_wakes
from subagentd.protocol import Wake

PARENTS = [("run", "r-1"), ("run", "r-2"), ("worker", "w-p")]


def _post(queue: WakeQueue, worker: str, attempt: int, parent: tuple[str, str]) -> object:
    kind, ident = parent
    return queue.post(
        worker=worker,
        run=ident if kind == "run" else "r-1",
        parent=ident if kind == "worker" else None,
        state="finished",
        exit_code=0,
        preview="",
        attempt=attempt,
    )


def test_one_wake_per_worker_attempt() -> None:
    queue = WakeQueue()
    first = _post(queue, "w-1", 1, PARENTS[0])
    assert first is not None
    assert _post(queue, "w-1", 1, PARENTS[0]) is None
    assert _post(queue, "w-1", 2, PARENTS[0]) is not None


def _frame(record: dict[str, object]) -> bytes:
    """One entry of the wake log of an image before the store: u32 length, u32 crc32, body."""
    body = msgspec.msgpack.encode(record)
    return struct.pack(">II", len(body), zlib.crc32(body)) + body


def _wake(seq: int) -> Wake:
    return Wake(seq=seq, id=f"w-{seq}", run="r-1", state="finished", attempt=1)


def _posted(seq: int) -> bytes:
    return _frame({"type": "post", "wake": msgspec.to_builtins(_wake(seq))})


def _acked(*seqs: int) -> bytes:
    return _frame({"type": "ack", "seqs": list(seqs)})


def _floor(seq: int) -> bytes:
    return _frame({"type": "floor", "last_seq": seq})


def _open(state: Path) -> tuple[Store, WakeQueue]:
    store = Store.open(state / STORE_NAME)
    return store, open_wakes(store, state / "wakes.log")


def test_an_old_wake_log_is_imported_once_with_its_seqs_and_floor(tmp_path: Path) -> None:
    """An image upgraded in place loses no wake: the log's pending ones keep their seqs,
    its floor stays the floor, and the log is set aside so nothing comes back later."""
    log = tmp_path / "wakes.log"
    log.write_bytes(_floor(9) + _posted(3) + _posted(7) + _floor(9) + _posted(10) + _acked(7))
    store, queue = _open(tmp_path)
    assert sorted(queue.pending) == [3, 10]
    assert queue.pending[3] == _wake(3)
    assert not log.exists()
    assert (tmp_path / "wakes.log.imported").exists()
    queue.ack([3])
    store.ack_wakes([3])
    store.close()
    store, queue = _open(tmp_path)
    assert sorted(queue.pending) == [10]
    wake = _post(queue, "w-new", 1, PARENTS[0])
    assert isinstance(wake, Wake)
    assert wake.seq == 11
    # Imported again (a crash between the import's commit and the rename): nothing back.
    os.replace(tmp_path / "wakes.log.imported", log)
    store.close()
    _, queue = _open(tmp_path)
    assert sorted(queue.pending) == [10]


def test_torn_log_tail_loses_only_the_unfinished_record(tmp_path: Path) -> None:
    (tmp_path / "wakes.log").write_bytes(
        _posted(1) + _posted(2) + _posted(3) + b"\x00\x00\x00\x40half"
    )
    assert sorted(_open(tmp_path)[1].pending) == [1, 2, 3]


def _log_that_gave_out_seqs(*, appended: bool) -> tuple[bytes, int]:
    """A wake log compacted after seqs 1 to 6 were given and 2-6 acknowledged: its floor
    (6) is all that says they were used, the pending post (1) is far below. `appended`:
    then 7 and 8 given, 8 acknowledged. The log, and the highest seq given."""
    blob = _floor(6) + _posted(1) + _floor(6)
    if not appended:
        return blob, 6
    return blob + _posted(7) + _posted(8) + _acked(8), 8


def _next_seq_after_damage(state: Path, damaged: bytes) -> int:
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir()
    (state / "wakes.log").write_bytes(damaged)
    store, queue = _open(state)
    wake = _post(queue, "w-new", 1, PARENTS[0])
    store.close()
    assert isinstance(wake, Wake)
    return wake.seq


@pytest.mark.parametrize("appended", [False, True], ids=["compacted", "appended_to"])
def test_no_damaged_byte_of_an_old_wake_log_lets_a_seq_be_given_again(appended: bool) -> None:
    """Whichever byte is damaged (a floor's, a pending post's, an appended post's or
    ack's, a length or a checksum), the next wake's seq is above every one given."""
    blob, given = _log_that_gave_out_seqs(appended=appended)
    reused = []
    # A store per damaged byte: in memory-backed files where there are (no disk to wait on).
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        for at in range(len(blob)):
            damaged = bytearray(blob)
            damaged[at] ^= 0x01
            seq = _next_seq_after_damage(Path(d) / "state", bytes(damaged))
            if seq <= given:
                reused.append((at, seq))
    assert reused == []


def test_with_every_floor_of_an_old_wake_log_damaged_seqs_skip_far_ahead(tmp_path: Path) -> None:
    """Nothing left says which seqs the floors covered: they may lie far above every
    pending one, so the next seq skips further than any daemon gives out."""
    floor, post = _floor(6), _posted(1)
    damaged = floor[:-1] + bytes([floor[-1] ^ 1]) + post + floor[:-1] + bytes([floor[-1] ^ 1])
    assert _next_seq_after_damage(tmp_path / "state", damaged) > 2**32


class WakeMachine(RuleBasedStateMachine):
    """Posts, deliveries, acks, disconnects and crashes in any order: every wake
    not acknowledged is still there, none acknowledged comes back, none is posted twice."""

    def __init__(self) -> None:
        super().__init__()
        self.acked: set[int] = set()
        self.posted: dict[int, tuple[str, int]] = {}
        self.endings: set[tuple[str, int]] = set()
        self.delivered: set[int] = set()  # on the subscriber's current connection

    @initialize(tmp=st.builds(lambda: Path(__import__("tempfile").mkdtemp())))
    def open_store(self, tmp: Path) -> None:
        self.state = tmp
        self.store, self.queue = _open(tmp)

    @rule(worker=st.sampled_from(["w-a", "w-b", "w-c", "w-d"]), attempt=st.integers(1, 3),
          parent=st.sampled_from(PARENTS))  # fmt: skip
    def worker_ends(self, worker: str, attempt: int, parent: tuple[str, str]) -> None:
        if (worker, attempt) in self.endings:
            # Never posted twice: the queue refuses while it remembers the post;
            # once acknowledged, the daemon's worker record (which says the
            # wake was posted) stops the ending from being reported again.
            if self.queue.was_posted(worker, attempt):
                assert _post(self.queue, worker, attempt, parent) is None
            return
        wake = _post(self.queue, worker, attempt, parent)
        assert wake is not None
        self.store.post_wake(wake)  # type: ignore[arg-type]
        self.endings.add((worker, attempt))
        self.posted[wake.seq] = (worker, attempt)  # type: ignore[attr-defined]

    @rule(parent=st.sampled_from(PARENTS))
    def deliver(self, parent: tuple[str, str]) -> None:
        for wake in self.queue.pending_for(parent):
            assert key_of(wake) == parent
            self.delivered.add(wake.seq)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        if not self.delivered:
            return
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.delivered)), min_size=1, unique=True))
        self.queue.ack(seqs)
        self.store.ack_wakes(seqs)
        self.acked.update(seqs)
        self.delivered.difference_update(seqs)

    @rule()
    def disconnect(self) -> None:
        self.delivered.clear()

    @rule()
    def crash_and_restart(self) -> None:
        self.store.close()
        last = self.queue.last_seq
        self.store, self.queue = _open(self.state)
        # Numbering never goes back; it may skip ahead (the seq mark, `store/_seq_mark.py`,
        # is kept up to 1,024 past what was given, so no seq is given twice after a crash).
        assert self.queue.last_seq >= last
        self.delivered.clear()
        # A worker that already posted stays posted: the daemon's records carry
        # that past its ack; the store itself keeps what is pending.
        for seq, ending in self.posted.items():
            if seq not in self.acked:
                assert self.queue.was_posted(*ending)

    @invariant()
    def nothing_lost_nothing_resurrected(self) -> None:
        if not hasattr(self, "queue"):
            return
        pending = set(self.queue.pending)
        assert pending == set(self.posted) - self.acked


TestWakeMachine = WakeMachine.TestCase
TestWakeMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
