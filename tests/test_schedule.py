"""The schedule (`core/_schedule.py`) through the registry that owns it, by calling it:
caps per run, per agent and for the daemon, the queue's order, and a restart's restore.

The state machine's promises: never above a cap; nothing starts twice; nothing starts
after its run (or itself) was stopped; within one run, agent and priority, first in is
first out; no worker waits while a slot it fits is free; a restart keeps the queue in
order."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from subagentd.daemon.core._registry import Registry, RunRecord, WorkerRecord
from subagentd.daemon.core._schedule import Queued, Schedule
from subagentd.protocol.errors import RunStopped

AGENT_CAPS = {"coder": 2, "tester": 1}


def _registry(daemon_cap: int | None, ids: Iterator[int] | None = None) -> Registry:
    """A registry with the agents' caps; `ids`: numbers its ids in order (the same ids
    each time hypothesis runs a case again), else random ones."""
    registry = Registry() if ids is None else Registry(lambda prefix: f"{prefix}-{next(ids)}")
    registry.schedule.daemon_cap = daemon_cap
    registry.schedule.agent_cap = AGENT_CAPS.get
    return registry


def _spawn(
    registry: Registry, run: str, agent: str | None = None, priority: int = 0
) -> WorkerRecord:
    record = registry.register(
        now=1.0, argv=["true"], cwd="/", archive_for=str, run=run, agent=agent, priority=priority
    )
    registry.admit(record)
    return record


def test_a_spawn_over_the_run_cap_waits_and_starts_as_a_slot_frees() -> None:
    registry = _registry(None)
    run = registry.new_run(0.0, max_running=2).id
    first, second, third, fourth = (_spawn(registry, run) for _ in range(4))
    assert [r.queued is None for r in (first, second, third, fourth)] == [True, True, False, False]
    assert (third.queue_position, fourth.queue_position) == (1, 2)
    assert registry.dequeue(2.0) == []  # both slots taken
    registry.ended(first.id, 0, 2.0)
    assert registry.dequeue(3.0) == [third]
    assert (third.queued, third.started_at, fourth.queue_position) == (None, 3.0, 1)


def test_a_full_run_holds_back_none_of_another_run() -> None:
    registry = _registry(None)
    full = registry.new_run(0.0, max_running=1).id
    other = registry.new_run(0.0).id
    _spawn(registry, full)
    waiting = _spawn(registry, full)
    free = _spawn(registry, other)
    assert waiting.queued is not None
    assert free.queued is None


def test_the_daemon_cap_counts_every_run_and_the_agent_cap_every_agents_worker() -> None:
    registry = _registry(3)
    runs = [registry.new_run(0.0).id for _ in range(4)]
    records = [_spawn(registry, run) for run in runs]
    assert [r.queued is None for r in records] == [True, True, True, False]
    registry = _registry(None)
    runs = [registry.new_run(0.0).id for _ in range(2)]
    testers = [_spawn(registry, run, "tester") for run in runs]
    assert [r.queued is None for r in testers] == [True, False]


def test_a_higher_priority_goes_first_then_first_in() -> None:
    registry = _registry(1)
    run = registry.new_run(0.0).id
    holder = _spawn(registry, run)
    low, high, high_later = (_spawn(registry, run, priority=p) for p in (0, 5, 5))
    assert [r.queue_position for r in (low, high, high_later)] == [3, 1, 2]
    order = []
    current = holder
    for _ in range(3):
        registry.ended(current.id, 0, 2.0)
        (current,) = registry.dequeue(2.0)
        order.append(current)
    assert order == [high, high_later, low]


def test_a_stopped_queued_worker_is_never_dequeued() -> None:
    registry = _registry(1)
    run = registry.new_run(0.0).id
    holder = _spawn(registry, run)
    stopped, waiting = _spawn(registry, run), _spawn(registry, run)
    registry.stop(stopped.id)
    assert registry.queued_among([stopped.id, waiting.id]) == [stopped, waiting]
    registry.ended(holder.id, 0, 2.0)
    assert registry.dequeue(2.0) == [waiting]


def test_a_bare_schedule_restores_its_queue_in_place() -> None:
    schedule = Schedule(daemon_cap=1)
    schedule.restore(
        [("w-run", "r", None)], [Queued("w-b", "r", None, 0, 9), Queued("w-a", "r", None, 0, 4)]
    )
    assert schedule.queued() == ["w-a", "w-b"]
    assert schedule.admit("w-c", "r", None) == 10  # seqs go on above the restored
    schedule.ended("w-run")
    assert schedule.to_start() == ["w-a"]


class ScheduleMachine(RuleBasedStateMachine):
    """Spawns, endings, stops and restarts in any order, against a registry."""

    def __init__(self) -> None:
        super().__init__()
        self.daemon_cap: int | None = None
        self.ids = itertools.count()
        self.registry = _registry(None, self.ids)
        self.runs: list[str] = []
        self.caps: dict[str, int | None] = {}
        self.running: set[str] = set()
        #: (worker, attempt) of every start.
        self.started_ever: set[tuple[str, int]] = set()
        self.stopped_runs: set[str] = set()
        #: Each queued worker's seq, as it was given (its record forgets it once started).
        self.seqs: dict[str, int] = {}
        #: When each retried worker's next attempt may start (its backoff over).
        self.due: dict[str, float] = {}
        self.now = 1.0

    @rule(cap=st.none() | st.integers(1, 4))
    @precondition(lambda self: not self.runs)
    def daemon(self, cap: int | None) -> None:
        self.daemon_cap = cap
        self.registry.schedule.daemon_cap = cap

    @rule(cap=st.none() | st.integers(1, 3))
    @precondition(lambda self: len(self.runs) < 3)
    def new_run(self, cap: int | None) -> None:
        run = self.registry.new_run(self.now, max_running=cap).id
        self.runs.append(run)
        self.caps[run] = cap

    @rule(
        which=st.integers(0, 2),
        agent=st.sampled_from([None, "coder", "tester"]),
        priority=st.integers(-1, 1),
        retries=st.integers(0, 2),
        backoff=st.sampled_from([0.0, 1.0, 2.5]),
    )
    @precondition(lambda self: bool(self.runs))
    def spawn(
        self, which: int, agent: str | None, priority: int, retries: int, backoff: float
    ) -> None:
        run = self.runs[which % len(self.runs)]
        try:
            record = _spawn(self.registry, run, agent, priority)
        except RunStopped:
            assert run in self.stopped_runs
            return
        record.retries, record.backoff = retries, backoff
        if record.queued is None:
            self._started(record)
        else:
            self.seqs[record.id] = record.queued
        self._dequeue()

    @rule(data=st.data())
    @precondition(lambda self: bool(self.running))
    def end(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.running)))
        self.running.discard(worker)
        self.now += 1
        self.registry.ended(worker, 0, self.now)
        self._dequeue()

    @rule(data=st.data())
    @precondition(lambda self: bool(self.running))
    def fail(self, data: st.DataObject) -> None:
        """A running worker fails: retried (back in the queue until its backoff is over)
        while it has attempts left, else ended."""
        worker = data.draw(st.sampled_from(sorted(self.running)))
        self.running.discard(worker)
        self.now += 1
        record = self.registry.ended(worker, 1, self.now)
        attempt = record.attempt
        if self.registry.retry(record, self.now) is not None:
            assert record.attempt == attempt + 1 <= record.retries + 1
            assert record.queued is not None
            assert record.retry_at is not None
            self.seqs[worker], self.due[worker] = record.queued, record.retry_at
        else:
            assert record.ended
        self._dequeue()

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, seconds: float) -> None:
        """Time passes: retries whose backoff is over may start."""
        self.now += seconds
        self._dequeue()

    @rule(data=st.data())
    @precondition(lambda self: bool(self.registry.schedule.queued()))
    def stop_queued(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.registry.schedule.queued()))
        self._stopped(self.registry.stop(worker))

    @rule(which=st.integers(0, 2))
    @precondition(lambda self: bool(self.runs))
    def stop_run(self, which: int) -> None:
        run = self.runs[which % len(self.runs)]
        self.stopped_runs.add(run)
        self._stopped(self.registry.stop_run(run))

    @rule()
    def restart(self) -> None:
        """A new registry from the records and runs as the store holds them."""
        old = self.registry
        records = [msgspec.convert(msgspec.to_builtins(r), WorkerRecord) for r in old.handles()]
        runs = [msgspec.convert(msgspec.to_builtins(old.run(r)), RunRecord) for r in self.runs]
        before = old.schedule.queued()
        self.registry = _registry(self.daemon_cap, self.ids)
        self.registry.restore(
            runs=runs, records=records, tombstones=[], turn=0, fence=None, fence_epochs=0
        )
        assert self.registry.schedule.queued() == before
        self._dequeue()

    def _stopped(self, ids: list[str]) -> None:
        """What the shell does with a stop: the queued among `ids` end, never started."""
        for record in self.registry.queued_among(ids):
            self.registry.ended(record.id, None, self.now)
        self._dequeue()

    def _started(self, record: WorkerRecord) -> None:
        assert (record.id, record.attempt) not in self.started_ever, "started twice"
        assert self.now >= self.due.get(record.id, 0.0), "a retry started before its backoff"
        assert record.stop_reason is None, "started after a stop"
        assert not self.registry.run_stopped(record.run), "started after its run stopped"
        self.started_ever.add((record.id, record.attempt))
        self.running.add(record.id)

    def _dequeue(self) -> None:
        for record in self.registry.dequeue(self.now):
            waiting = [
                w
                for w in map(self.registry.worker, self.registry.schedule.queued())
                if (w.retry_at or 0) <= self.now  # a retry not yet due holds no place
            ]
            ahead = [
                w
                for w in waiting
                if (w.run, w.agent) == (record.run, record.agent)
                and (-w.priority, w.queued or 0) < (-record.priority, self.seqs[record.id])
            ]
            assert not ahead, "an earlier worker of the same run and agent still waits"
            self._started(record)

    @invariant()
    def never_above_a_cap(self) -> None:
        live = [self.registry.worker(w) for w in self.running]
        if self.daemon_cap is not None:
            assert len(live) <= self.daemon_cap
        for run, cap in self.caps.items():
            assert cap is None or sum(r.run == run for r in live) <= cap
        for agent, cap in AGENT_CAPS.items():
            assert sum(r.agent == agent for r in live) <= cap
        assert self.registry.schedule.running_count() == len(self.running)

    @invariant()
    def nobody_waits_while_a_slot_it_fits_is_free(self) -> None:
        live = [self.registry.worker(w) for w in self.running]
        if self.daemon_cap is not None and len(live) >= self.daemon_cap:
            return
        for worker in self.registry.schedule.queued():
            record = self.registry.worker(worker)
            if (record.retry_at or 0) > self.now:
                continue  # waiting out its backoff
            run_cap, agent_cap = self.caps.get(record.run), AGENT_CAPS.get(record.agent or "")
            run_full = run_cap is not None and sum(r.run == record.run for r in live) >= run_cap
            agent_full = agent_cap is not None and (
                sum(r.agent == record.agent for r in live) >= agent_cap
            )
            assert run_full or agent_full, f"{worker} waits with room for it"

    @invariant()
    def positions_count_from_one(self) -> None:
        queued = self.registry.schedule.queued()
        positions = [self.registry.worker(w).queue_position for w in queued]
        assert positions == list(range(1, len(queued) + 1))


TestScheduleMachine = ScheduleMachine.TestCase
TestScheduleMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_dequeue_of_at_most_one_leaves_the_rest_queued_in_order() -> None:
    registry = _registry(None)
    run = registry.new_run(0.0, max_running=1).id
    holder, *waiting = (_spawn(registry, run) for _ in range(3))
    registry.stop(waiting[0].id)  # met first: its slot goes to the next in the same call
    registry.ended(holder.id, 0, 2.0)
    assert registry.dequeue(2.0, most=1) == [waiting[1]]
    assert registry.dequeue(2.0, most=1) == []


def test_a_worker_that_starts_after_others_waits_held_back_until_unblocked() -> None:
    schedule = Schedule()
    assert schedule.admit("w-after", "r", None, blocked=True) == 1  # room, but held back
    assert schedule.admit("w-next", "r", None) is None  # held back: it holds nobody back
    assert schedule.to_start() == []
    assert schedule.blocked() == ["w-after"]
    schedule.unblock("w-after")
    assert (schedule.blocked(), schedule.to_start()) == ([], ["w-after"])
