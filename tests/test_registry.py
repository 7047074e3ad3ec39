"""The registry core, called directly: spawn, stop and run rules, no processes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from subagentd.daemon.core._registry import Registry, WorkerRecord
from subagentd.protocol.errors import Invalid, NotFound, Refused, RunStopped


def _registry() -> Registry:
    counter = itertools.count(1)
    return Registry(make_id=lambda prefix: f"{prefix}-{next(counter)}")


def _spawn(reg: Registry, **kw: object) -> WorkerRecord:
    return reg.register(now=0.0, argv=["true"], cwd="/", archive_for=lambda i: f"/a/{i}", **kw)  # type: ignore[arg-type]


def test_spawn_without_run_starts_a_run_and_children_join_the_parents() -> None:
    reg = _registry()
    parent = _spawn(reg)
    child = _spawn(reg, parent=parent.id)
    assert reg.has_run(parent.run)
    assert child.run == parent.run
    assert child.parent == parent.id
    assert parent.token != child.token
    assert reg.worker_for_token(child.token) == child.id


def test_stop_takes_the_subtree_and_nothing_else() -> None:
    reg = _registry()
    a = _spawn(reg)
    a1 = _spawn(reg, parent=a.id)
    a11 = _spawn(reg, parent=a1.id)
    b = _spawn(reg, run=a.run)
    assert reg.stop(a.id) == sorted([a.id, a1.id, a11.id])
    assert not reg.stopping(b.id)
    assert reg.stop(a.id) == []  # one-way and idempotent


def test_a_worker_that_was_asked_to_stop_ends_stopped_whatever_its_code() -> None:
    reg = _registry()
    w = _spawn(reg)
    reg.stop(w.id)
    assert reg.ended(w.id, 0, 1.0).state == "stopped"
    x = _spawn(reg)
    assert reg.ended(x.id, 0, 1.0).state == "finished"
    y = _spawn(reg)
    assert reg.ended(y.id, -9, 1.0).state == "failed"


def test_timeout_marks_only_the_worker_timed_out() -> None:
    reg = _registry()
    w = _spawn(reg)
    child = _spawn(reg, parent=w.id)
    reg.stop(w.id, reason="timeout")
    assert reg.ended(w.id, -15, 1.0).state == "timed_out"
    assert reg.ended(child.id, -15, 1.0).state == "stopped"


def test_only_a_live_worker_or_a_result_owed_holds_the_park() -> None:
    reg = _registry()
    for reason in ("user", "cancel", "timeout", "reload"):
        asked = _spawn(reg)
        assert reg.holds_park()  # live
        reg.stop(asked.id, reason=reason)
        assert reg.stopping(asked.id)
        assert asked.view().stopping
        assert reg.holds_park()  # its tree still runs
        reg.ended(asked.id, -15, 1.0)
        assert not asked.view().stopping
        assert not reg.holds_park(), reason  # uncollected, but it owes no result
    failed = _spawn(reg)
    reg.ended(failed.id, 3, 1.0)  # on its own
    assert reg.holds_park()
    for due in reg.expired(1.0 + 60, ttl=60):  # as retention marks each
        reg.worker(due).expired = True
    assert failed.expired
    assert not reg.holds_park()  # past its TTL
    finished = _spawn(reg)
    reg.ended(finished.id, 0, 2.0)
    assert reg.holds_park()
    reg.collect(finished.id)
    assert not reg.holds_park()


def test_a_stop_or_cancel_names_what_is_already_stopping() -> None:
    reg = _registry()
    a = _spawn(reg)
    a1 = _spawn(reg, parent=a.id)
    b = _spawn(reg, run=a.run)
    reg.stop(a1.id)
    assert reg.stopping_among(reg.subtree(a.id)) == [a1.id]
    assert reg.stopping_among(reg.in_scope(f"run:{a.run}")) == [a1.id]
    assert reg.cancel(f"run:{a.run}") == sorted([a.id, b.id])  # a1 left as it is
    reg.ended(a1.id, -15, 1.0)
    assert reg.stopping_among(reg.in_scope("all")) == sorted([a.id, b.id])


def test_stopped_run_and_runs_nested_in_it_refuse_spawns() -> None:
    reg = _registry()
    outer = reg.new_run(0.0)
    inner = reg.new_run(0.0, outer=outer.id)
    w = _spawn(reg, run=inner.id)
    assert reg.stop_run(outer.id) == [w.id]
    with pytest.raises(RunStopped):
        _spawn(reg, run=inner.id)
    with pytest.raises(RunStopped):
        _spawn(reg, run=outer.id)
    with pytest.raises(RunStopped):
        reg.new_run(0.0, outer=outer.id)


def test_bad_requests_are_refused_with_the_reason() -> None:
    reg = _registry()
    with pytest.raises(NotFound):
        _spawn(reg, run="r-nope")
    with pytest.raises(NotFound):
        _spawn(reg, parent="w-nope")
    with pytest.raises(Invalid, match="grace"):
        _spawn(reg, grace=-1.0)
    with pytest.raises(NotFound):
        reg.stop("w-nope")
    other = _spawn(reg)
    with pytest.raises(Invalid, match="joins its parent's run"):
        _spawn(reg, parent=other.id, run=reg.new_run(0.0).id)


def test_holds_park_until_every_result_is_collected() -> None:
    reg = _registry()
    assert not reg.holds_park()
    w = _spawn(reg)
    assert reg.holds_park()
    reg.ended(w.id, 0, 1.0)
    assert reg.holds_park()
    reg.collect(w.id)
    assert not reg.holds_park()


class RegistryMachine(RuleBasedStateMachine):
    """Any interleaving of spawns, stops, run stops, endings, resumes and reopenings keeps
    the stop promises: nothing in a stopped scope is left running but what was resumed
    since (and what that delegated), nothing outside it is touched, and a stopped run takes
    no spawn but a resumed attempt's own delegations until `reopen_run`."""

    workers = Bundle("workers")
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.reg = _registry()
        self.stopped_roots: set[str] = set()
        self.stopped_runs: set[str] = set()
        #: Workers resumed (reopened) at some point, and what they delegated.
        self.carried_on: set[str] = set()

    @rule(target=runs, outer=st.none() | runs)
    def new_run(self, outer: str | None) -> str:
        if outer is not None and self.reg.run_stopped(outer):
            with pytest.raises(RunStopped):
                self.reg.new_run(0.0, outer=outer)
            return self.reg.new_run(0.0).id
        return self.reg.new_run(0.0, outer=outer).id

    @rule(target=workers, run=runs)
    def spawn_in_run(self, run: str) -> str:
        if self.reg.run_stopped(run):
            with pytest.raises(RunStopped):
                _spawn(self.reg, run=run)
            return _spawn(self.reg).id
        return _spawn(self.reg, run=run).id

    @rule(target=workers, parent=workers)
    def delegate(self, parent: str) -> str:
        record = self.reg.worker(parent)
        if record.ended or record.stop_reason is not None:
            with pytest.raises(RunStopped):
                _spawn(self.reg, parent=parent)
            return _spawn(self.reg).id
        if self.reg.run_stopped(record.run):
            # Live and not stopping in a stopped run: only a resumed attempt is.
            assert parent in self.carried_on
        child = _spawn(self.reg, parent=parent).id
        if parent in self.carried_on:
            self.carried_on.add(child)
        return child

    @rule(worker=workers, meanwhile=st.sampled_from([None, "run", "worker", "cancel"]))
    def resume(self, worker: str, meanwhile: str | None) -> None:
        """A resume, and maybe a stop that reaches the worker while it is under way: that
        stop, the later ask, refuses it, and the worker is left as it was."""
        record = self.reg.worker(worker)
        if not record.ended:
            return
        self.reg.begin_resume(record, None)
        with pytest.raises(Refused, match="being resumed already"):
            self.reg.begin_resume(record, None)
        if meanwhile == "run":
            self.stop_run(record.run)
        elif meanwhile == "worker":
            self.stop(worker)
        elif meanwhile == "cancel":
            self.reg.cancel(f"worker:{worker}")
        if meanwhile is not None:
            state, attempt = record.state, record.attempt
            with pytest.raises(RunStopped if meanwhile == "run" else Refused):
                self.reg.reopen(record, 2.0, None)
            assert (record.state, record.attempt) == (state, attempt)
            self.reg.begin_resume(record, None)  # no longer under way: it may be asked again
            self.reg.abandon_resume(worker)
            return
        stopped = self.reg.run_stopped(record.run)
        self.reg.reopen(record, 2.0, None)
        assert self.reg.run_stopped(record.run) == stopped  # a resume never opens a run
        self.carried_on.add(worker)

    @rule(run=runs)
    def reopen_run(self, run: str) -> None:
        outer = self.reg.run(run).outer
        if outer is not None and self.reg.run_stopped(outer):
            with pytest.raises(RunStopped):
                self.reg.reopen_run(run)
            return
        self.reg.reopen_run(run)
        for r in self.reg.runs_within(run):
            assert not self.reg.run_stopped(r)
            self.stopped_runs.discard(r)

    @rule(worker=workers)
    def stop(self, worker: str) -> None:
        before = self._stopping()
        newly = self.reg.stop(worker)
        subtree = set(self.reg.subtree(worker))
        assert set(newly) <= subtree
        assert self._stopping() - before == set(newly)
        self.stopped_roots.add(worker)

    @rule(run=runs)
    def stop_run(self, run: str) -> None:
        before = self._stopping()
        newly = self.reg.stop_run(run)
        scope = {w for r in self.reg.runs_within(run) for w in self.reg._run_members[r]}
        assert set(newly) <= scope
        assert self._stopping() - before == set(newly)
        self.stopped_runs.add(run)

    @rule(worker=consumes(workers), code=st.sampled_from([0, 1, -9, -15]))
    def end(self, worker: str, code: int) -> None:
        record = self.reg.worker(worker)
        was_ended, state = record.ended, record.state
        self.reg.ended(worker, code, 1.0)
        if was_ended:
            assert record.state == state  # terminal states are final

    @precondition(lambda self: self.reg.handles())
    @invariant()
    def nothing_in_a_stopped_scope_runs_on(self) -> None:
        for root in self.stopped_roots:
            for w in self.reg.subtree(root):
                record = self.reg.worker(w)
                assert record.ended or record.stop_reason is not None or w in self.carried_on
        for run in self.stopped_runs:
            for r in self.reg.runs_within(run):
                assert self.reg.run_stopped(r)
                for w in self.reg._run_members[r]:
                    record = self.reg.worker(w)
                    assert record.ended or record.stop_reason is not None or w in self.carried_on

    @invariant()
    def a_stopped_worker_never_ends_finished(self) -> None:
        for record in self.reg.handles():
            if record.ended and record.stop_reason not in (None,):
                assert record.state in ("stopped", "timed_out")

    def _stopping(self) -> set[str]:
        return {r.id for r in self.reg.handles() if r.stop_reason is not None}


TestRegistryMachine = RegistryMachine.TestCase


def test_a_named_run_outlives_its_collected_workers_and_an_implicit_one_does_not() -> None:
    reg = _registry()
    named = reg.new_run(0.0)
    w = _spawn(reg, run=named.id)
    lone = _spawn(reg)
    for record in (w, lone):
        reg.ended(record.id, 0, 1.0)
        reg.collect(record.id)
        assert reg.release(record.id) == [record.id]
    assert reg.has_run(named.id)
    assert not reg.has_run(lone.run)
    reg.stop_run(named.id)
    with pytest.raises(RunStopped):
        _spawn(reg, run=named.id)


def test_a_parent_is_released_only_after_its_children() -> None:
    reg = _registry()
    parent = _spawn(reg)
    child = _spawn(reg, parent=parent.id)
    reg.ended(parent.id, 0, 1.0)
    reg.collect(parent.id)
    assert reg.release(parent.id) == []  # its child still needs the tree above it
    reg.ended(child.id, 0, 1.0)
    reg.collect(child.id)
    assert reg.release(child.id) == [child.id, parent.id]


def test_a_run_nested_in_one_no_file_describes_is_still_nested_after_a_restore() -> None:
    # A lone spawn's run writes no file; a run nested in it does. Restored
    # from the files and archives, stopping the outer still takes the inner.
    before = _registry()
    lone = _spawn(before)
    inner = before.new_run(0.0, outer=lone.run)
    nested = _spawn(before, run=inner.id)
    after = _registry()
    after.restore(
        runs=[inner],
        records=[lone, nested],
        tombstones=[],
        turn=0,
        fence=None,
        fence_epochs=0,
    )
    assert sorted(after.stop_run(lone.run)) == sorted([lone.id, nested.id])
    assert after.run_stopped(inner.id)


def test_parents_and_outer_runs_that_loop_are_cut_when_restored() -> None:
    # Records restored from archives are in workers' reach: a worker may rewrite its
    # own so that its parent loops back to it. No walk may go round forever.
    before = _registry()
    a, b, c = _spawn(before), _spawn(before), _spawn(before)
    outer = before.new_run(0.0)
    inner = before.new_run(0.0, outer=outer.id)
    a.parent, b.parent, c.parent = b.id, a.id, a.id  # a <-> b loop; c hangs below a
    outer.outer = inner.id  # runs nested in each other
    after = _registry()
    after.restore(
        runs=[outer, inner],
        records=[a, b, c],
        tombstones=[],
        turn=0,
        fence=None,
        fence_epochs=0,
    )
    assert len(after.damage) == 2  # one link of each loop cut, no more
    assert any("loops back" in line for line in after.damage)
    # a's link was cut (the first found in a loop), b's stands: a is the top again.
    assert (after.worker(a.id).parent, after.worker(b.id).parent) == (None, a.id)
    assert set(after.subtree(a.id)) == {a.id, b.id, c.id}
    assert not after.run_stopped(inner.id)
    assert set(after.runs_within(outer.id)) <= {outer.id, inner.id}
