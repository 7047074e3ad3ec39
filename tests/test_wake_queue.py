"""The wake queue and its log, called directly: no wake lost, none posted twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from subagentd.daemon._wakes import WakeLog, WakeQueue, key_of
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


def test_torn_log_tail_loses_only_the_unfinished_record(tmp_path: Path) -> None:
    log = WakeLog(tmp_path / "wakes.log")
    queue = log.open()
    for i in range(3):
        wake = _post(queue, f"w-{i}", 1, PARENTS[0])
        log.posted(wake)  # type: ignore[arg-type]
    log.close()
    with open(tmp_path / "wakes.log", "ab") as f:
        f.write(b"\x00\x00\x00\x40half")
    assert sorted(WakeLog(tmp_path / "wakes.log").open().pending) == [1, 2, 3]


def _log_that_gave_out_seqs(path: Path, *, appended: bool) -> tuple[bytes, int]:
    """A wake log compacted after seqs 1 to 6 were given and 2-6 acknowledged: its floor
    (6) is all that says they were used, the pending post (1) is far below. `appended`:
    then 7 and 8 given, 8 acknowledged. The log, and the highest seq given."""
    log = WakeLog(path)
    queue = log.open()
    for i in range(6):
        log.posted(_post(queue, f"w-{i}", 1, PARENTS[0]))  # type: ignore[arg-type]
    queue.ack([2, 3, 4, 5, 6])
    log.acked([2, 3, 4, 5, 6])
    log.close()
    log = WakeLog(path)
    queue = log.open()  # compacts
    if appended:
        for i in (6, 7):
            log.posted(_post(queue, f"w-{i}", 1, PARENTS[0]))  # type: ignore[arg-type]
        queue.ack([8])
        log.acked([8])
    log.close()
    return path.read_bytes(), queue.last_seq


def _next_seq_after_damage(path: Path, damaged: bytes) -> int:
    path.write_bytes(damaged)
    log = WakeLog(path)
    wake = _post(log.open(), "w-new", 1, PARENTS[0])
    log.close()
    assert isinstance(wake, Wake)
    return wake.seq


@pytest.mark.parametrize("appended", [False, True], ids=["compacted", "appended_to"])
def test_no_damaged_byte_of_the_wake_log_lets_a_seq_be_given_again(
    tmp_path: Path, appended: bool
) -> None:
    """Whichever byte is damaged (a floor's, a pending post's, an appended post's or
    ack's, a length or a checksum), the next wake's seq is above every one given."""
    path = tmp_path / "wakes.log"
    blob, given = _log_that_gave_out_seqs(path, appended=appended)
    reused = []
    for at in range(len(blob)):
        damaged = bytearray(blob)
        damaged[at] ^= 0x01
        seq = _next_seq_after_damage(path, bytes(damaged))
        if seq <= given:
            reused.append((at, seq))
    assert reused == []


def _entry_bounds(blob: bytes) -> list[tuple[int, int]]:
    found, offset = [], 0
    while offset < len(blob):
        length = int.from_bytes(blob[offset : offset + 4], "big")
        found.append((offset, offset + 8 + length))
        offset += 8 + length
    return found


def test_with_every_floor_of_the_wake_log_damaged_seqs_skip_far_ahead(tmp_path: Path) -> None:
    """Nothing left says which seqs the floors covered: they may lie far above every
    pending one, so the next seq skips further than any daemon gives out between two
    compactions."""
    path = tmp_path / "wakes.log"
    blob, _ = _log_that_gave_out_seqs(path, appended=False)
    damaged = bytearray(blob)
    bounds = _entry_bounds(blob)
    for index in (0, 2):  # Floor(6), Post(1), Floor(6)
        _, end = bounds[index]
        damaged[end - 1] ^= 0x01
    assert _next_seq_after_damage(path, bytes(damaged)) > 2**32


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
    def open_log(self, tmp: Path) -> None:
        self.log = WakeLog(tmp / "wakes.log")
        self.queue = self.log.open()

    @rule(worker=st.sampled_from(["w-a", "w-b", "w-c", "w-d"]), attempt=st.integers(1, 3),
          parent=st.sampled_from(PARENTS))  # fmt: skip
    def worker_ends(self, worker: str, attempt: int, parent: tuple[str, str]) -> None:
        if (worker, attempt) in self.endings:
            # Never posted twice: the queue refuses while it remembers the post;
            # after a compaction, the daemon's worker record (which says the
            # wake was posted) stops the ending from being reported again.
            if self.queue.was_posted(worker, attempt):
                assert _post(self.queue, worker, attempt, parent) is None
            return
        wake = _post(self.queue, worker, attempt, parent)
        assert wake is not None
        self.log.posted(wake)  # type: ignore[arg-type]
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
        self.log.acked(seqs)
        self.acked.update(seqs)
        self.delivered.difference_update(seqs)

    @rule()
    def disconnect(self) -> None:
        self.delivered.clear()

    @rule()
    def crash_and_restart(self) -> None:
        self.log.close()
        self.log = WakeLog(self.log.path)
        last = self.queue.last_seq
        self.queue = self.log.open()
        assert self.queue.last_seq == last  # numbering never goes back
        self.delivered.clear()
        # A worker that already posted stays posted: the daemon's records carry
        # that across compaction; the log itself keeps what is pending.
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
