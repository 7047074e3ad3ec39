"""The wake queue's indexes (by parent, by run) always answer what a walk of every
pending wake would: any sequence of posts, acks and restores."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from subagentd.daemon.core._wakes import WakeKey, WakeQueue, key_of
from subagentd.protocol import Wake

RUNS = ["r-1", "r-2", "r-3"]
PARENTS = [None, "w-p1", "w-p2"]


class WakeQueueIndexes(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = WakeQueue()
        self.workers = 0

    @rule(run=st.sampled_from(RUNS), parent=st.sampled_from(PARENTS))
    def post(self, run: str, parent: str | None) -> None:
        self.workers += 1
        self.queue.post(
            worker=f"w-{self.workers}", run=run, parent=parent, state="finished",
            exit_code=0, preview="", attempt=1,
        )  # fmt: skip

    @rule(picks=st.lists(st.integers(0, 50), max_size=4))
    def ack(self, picks: list[int]) -> None:
        seqs = list(self.queue.pending)
        if seqs:
            self.queue.ack([seqs[p % len(seqs)] for p in picks] + [10_000])  # one unknown

    @rule(run=st.sampled_from(RUNS))
    def ack_run(self, run: str) -> None:
        self.queue.ack(self.queue.of_run(run))

    @rule(pick=st.integers(0, 50), run=st.sampled_from(RUNS))
    def restore_again(self, pick: int, run: str) -> None:
        """A wake read back from the store under a seq already held (a replay): it
        replaces the one before, in every index."""
        seqs = list(self.queue.pending)
        if seqs:
            old = self.queue.pending[seqs[pick % len(seqs)]]
            self.queue.restore(
                Wake(seq=old.seq, id=old.id, run=run, parent=old.parent, state=old.state,
                     exit_code=old.exit_code, preview="", attempt=old.attempt)
            )  # fmt: skip

    @invariant()
    def indexes_are_a_walks(self) -> None:
        pending = list(self.queue.pending.values())
        for run in RUNS:
            assert sorted(self.queue.of_run(run)) == sorted(w.seq for w in pending if w.run == run)
        keys: list[WakeKey] = [("run", r) for r in RUNS] + [("worker", p) for p in PARENTS if p]
        for key in keys:
            for after in (0, self.queue.last_seq // 2):
                walked = sorted(
                    (w for w in pending if key_of(w) == key and w.seq > after), key=lambda w: w.seq
                )
                assert self.queue.pending_for(key, after) == walked


TestWakeQueueIndexes = WakeQueueIndexes.TestCase
TestWakeQueueIndexes.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
