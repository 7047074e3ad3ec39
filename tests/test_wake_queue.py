"""The wake queue and its log, called directly: no wake lost, none posted twice."""

from __future__ import annotations

from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from subagentd.daemon._wakes import WakeLog, WakeQueue, key_of

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
