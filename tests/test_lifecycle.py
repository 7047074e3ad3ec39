"""The whole lifecycle of the daemon, as a state machine: any sequence of spawns,
endings, stops, run stops, collects, expiries, wake deliveries, reloads and crashes
keeps the daemon's promises.

The daemon runs in-process (tests/inprocess.py) with real workers, reloaded in place
and crashed and started again from its state dir; the test sees it only through
`AsyncClient`, as a user does, and keeps a model of what each worker and each
parent is owed. hypothesis' `RuleBasedStateMachine` is synchronous, so the machine
is a list of steps drawn by hypothesis and played in one trio run (on a MockClock)
per example, the model checked after each step; shrinking works on the list.

The promises checked:
- every worker's state is the model's: running until it ends, then what ended it
  (its exit, a stop, a crash: `interrupted`), never changing after;
- no wake twice, none lost: each ending is delivered exactly once to its parent (the
  parent worker, or its run), across reloads and crashes;
- no result lost before collect: a collect answers the result the worker wrote;
- every id answers after its release (collected, or past the TTL): status and
  collect say what they said before, and the listing no longer holds it;
- `holds_park` says whether stopping the daemon would cost something: a worker
  running, or a result owed by one that ended on its own (a stopped or interrupted
  worker owes none), neither collected nor past its TTL.
- a spawn sent again with its key (its answer lost, say) answers the worker it made,
  as it is now, across reloads, crashes and its release, and makes no other;
- a run with a cap (`max_running`) never runs more than it: a spawn over it is queued
  (`starting`, `queued`), started first in first out as slots free (a stop, an ending,
  a crash), across reloads and crashes; a stop ends a queued worker unstarted, with one
  wake; nothing starts after its run was stopped; no capped run ever has more running;
- a failing worker with retries (`retries`, no backoff) starts again, the same id, its
  `attempt` counted, back in its run's queue behind those already waiting; its parent
  is woken once, by its last attempt (whose `attempt` the wake says); a stop or a crash
  ends the retries;
- a worker spawned to start after others (`after`, `after_ok`) waits queued, held back,
  until they have all ended, then takes its place in the queue; an `after_ok` one whose
  worker ended other than `finished` ends `stopped`, unstarted, with one wake.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from hypothesis import (
    HealthCheck,
    Phase,
    currently_in_test_context,
    event,
    given,
    note,
    settings,
)
from hypothesis import strategies as st
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.daemon.core._request_keys import DEFAULT_REQUEST_KEY_TTL
from subagentd.protocol import WorkerView
from subagentd.protocol.errors import Busy, NotFound, RunStopped

from .helpers import sh, until_note
from .inprocess import InProcess, held, in_process, short_root

#: The finished TTL: an expiry step lets the mock clock run past it.
TTL = 60.0
#: A worker that ends at once, with this exit code and result.
QUICK = 'echo out; printf "R$1" > "$SUBAGENTD_RESULT"; exit $2'
#: A worker that ends once its FIFO is written to (the `End` step); it says `up-A` on
#: stderr as attempt A starts (what tells a queued one's start, and a retry's).
HELD = (
    'echo "up-${SUBAGENTD_RESUME:-1}" >&2; read x < "$3"; echo out; '
    'printf "R$1" > "$SUBAGENTD_RESULT"; exit $2'
)


# -- the steps -----------------------------------------------------------------


@dataclass(frozen=True)
class NewRun:
    cap: int | None = None  # its max_running


@dataclass(frozen=True)
class Spawn:
    held: bool  # runs until an End step (else ends at once)
    code: int
    parent: int | None  # among the running workers; None: top-level, in a run
    run: int  # among the runs
    retries: int = 0  # attempts more when it fails (each attempt exits `code`)
    after: tuple[int, ...] = ()  # among all workers: it starts once they have ended
    ok: bool = False  # `after_ok` instead: once they all finished, else it is skipped


@dataclass(frozen=True)
class End:
    pick: int  # among the held workers still running


@dataclass(frozen=True)
class Stop:
    pick: int  # among all workers


@dataclass(frozen=True)
class StopRun:
    pick: int  # among the runs


@dataclass(frozen=True)
class Collect:
    pick: int  # among all workers


@dataclass(frozen=True)
class Expire:
    pass


@dataclass(frozen=True)
class Drain:
    pass


@dataclass(frozen=True)
class Again:
    pick: int  # among all workers: its spawn sent again, with its key


@dataclass(frozen=True)
class Reload:
    pass


@dataclass(frozen=True)
class Crash:
    pass


Step = NewRun | Spawn | End | Stop | StopRun | Collect | Expire | Drain | Again | Reload | Crash

_pick = st.integers(0, 7)


def _spawn(held: bool) -> st.SearchStrategy[Spawn]:
    return st.builds(
        Spawn,
        held=st.just(held),
        code=st.sampled_from([0, 3]),
        parent=st.none() | st.integers(0, 3),
        run=st.integers(0, 2),
        retries=st.sampled_from([0, 0, 1, 2]),
        after=st.sampled_from([()] * 3 + [(0,), (1,)]) | st.tuples(_pick, _pick),
        ok=st.booleans(),
    )


#: Each kind of step, as many times as its weight (the first is what steps shrink to).
_WEIGHTED: list[st.SearchStrategy[Step]] = [
    *[_spawn(held=False)] * 2,
    *[_spawn(held=True)] * 3,
    *[st.builds(End, pick=_pick)] * 2,
    *[st.builds(Stop, pick=_pick)] * 2,
    st.builds(StopRun, pick=_pick),
    *[st.builds(Collect, pick=_pick)] * 2,
    st.builds(NewRun, cap=st.none() | st.integers(1, 2)),
    st.just(Expire()),
    st.just(Drain()),
    st.builds(Again, pick=_pick),
    *[st.just(Reload())] * 2,
    *[st.just(Crash())] * 2,
]
STEPS: st.SearchStrategy[Step] = st.sampled_from(_WEIGHTED).flatmap(lambda step: step)


# -- the model -----------------------------------------------------------------


@dataclass
class Worker:
    n: int
    id: str
    run: str
    parent: str | None
    code: int
    fifo: Path | None  # a held worker's
    #: What the daemon must say; "queued": `starting`, queued (its run at its cap, or
    #: waiting for those it starts after, or for its retry).
    state: str = "running"
    #: Its place in its run's queue: a spawn's, or a retry's (which goes to the back).
    order: int = 0
    retries: int = 0
    attempt: int = 1
    #: The workers it starts after, until it takes its place in the queue (or is skipped).
    after: list[str] = field(default_factory=list)
    ok: bool = False  # after them all finished (`after_ok`)
    #: An attempt of it ended on its own, writing its result: a failed attempt retried
    #: leaves its result file for the next, which a stop or a crash then does not clear.
    wrote: bool = False
    collected: bool = False
    expired: bool = False  # past its TTL uncollected
    woken: bool = False  # its wake was delivered (and acknowledged)
    carried: bool = False  # across a reload, live
    #: How it was spawned (its key among it), and when on trio's clock: to send it again.
    asked: dict[str, object] = field(default_factory=dict)
    asked_at: float = 0.0

    @property
    def ended(self) -> bool:
        return self.state not in ("running", "queued")

    @property
    def result(self) -> str:
        """What a collect answers: the result it wrote, or its stdout (none) if it did not."""
        return f"R{self.n}" if self.wrote or self.state in ("finished", "failed") else ""

    @property
    def key(self) -> tuple[str, str]:
        """The parent its wake goes to."""
        return ("worker", self.parent) if self.parent is not None else ("run", self.run)


@dataclass
class Model:
    root: Path
    workers: dict[str, Worker] = field(default_factory=dict)
    runs: dict[str, bool] = field(default_factory=dict)  # run: stopped
    caps: dict[str, int | None] = field(default_factory=dict)  # run: its max_running
    spawns: int = 0  # asked for, refused or not
    places: int = 0  # places taken in a queue: spawns, and retries

    def place(self) -> int:
        self.places += 1
        return self.places

    def full(self, run: str) -> bool:
        """Whether `run` runs as many workers as its cap lets it."""
        cap = self.caps.get(run)
        started = [w for w in self.workers.values() if w.run == run and w.state == "running"]
        return cap is not None and len(started) >= cap

    def start_due(self) -> list[Worker]:
        """The queued workers whose turn has come (first in, first out in each run), now
        running."""
        started = []
        for worker in sorted(self.workers.values(), key=lambda w: w.order):
            if worker.state == "queued" and not worker.after and not self.full(worker.run):
                worker.state = "running"
                started.append(worker)
        return started

    def running(self) -> list[Worker]:
        return [w for w in self.workers.values() if not w.ended]

    def unblock(self) -> tuple[list[Worker], list[Worker]]:
        """The workers waiting for others whose wait is over: those that take their place
        in the queue (each it starts after has ended), and those skipped, now ended
        `stopped` (`after_ok`, and one of them ended other than `finished`)."""
        placed, skipped = [], []
        for worker in self.workers.values():
            if worker.state != "queued" or not worker.after:
                continue
            named = [self.workers[i] for i in worker.after]
            if worker.ok and any(w.ended and w.state != "finished" for w in named):
                self.end(worker, "stopped")
                skipped.append(worker)
            elif all(w.ended for w in named):
                worker.after = []
                placed.append(worker)
        return placed, skipped

    def retried(self, worker: Worker) -> bool:
        """Whether `worker`'s attempt, ending as it does on its own, is retried."""
        return worker.code != 0 and worker.attempt <= worker.retries

    def subtree(self, worker_id: str) -> Iterator[Worker]:
        yield self.workers[worker_id]
        for child in self.workers.values():
            if child.parent == worker_id:
                yield from self.subtree(child.id)

    def held(self, worker: Worker) -> bool:
        """Whether the daemon still holds its handle: running, ended and neither
        collected nor past its TTL, or the parent of a worker it holds."""
        if not worker.ended or not (worker.collected or worker.expired):
            return True
        return any(self.held(c) for c in self.workers.values() if c.parent == worker.id)

    def holds_park(self) -> bool:
        """Whether stopping the daemon would cost a worker: one running, or a result owed."""
        return any(
            not w.ended or (w.state in ("finished", "failed") and not w.collected and not w.expired)
            for w in self.workers.values()
        )

    def end(self, worker: Worker, state: str) -> None:
        assert not worker.ended
        worker.state = state


# -- playing the steps ---------------------------------------------------------


class Player:
    def __init__(self, d: InProcess, clock: MockClock, model: Model) -> None:
        self.d = d
        self.clock = clock
        self.model = model
        self.log: list[str] = []

    async def play(self, step: Step) -> None:
        self.log.append(repr(step))
        if isinstance(step, Expire):
            await self.expire()
        else:
            with held(self.clock):  # real workers' waits must not let the clock jump
                await self._play(step)
        with held(self.clock):
            await self.settle()
            await self.check()

    async def _play(self, step: Step) -> None:
        model = self.model
        match step:
            case NewRun(cap):
                async with self.d.client() as client:
                    run = await client.new_run(max_running=cap)
                model.runs[run], model.caps[run] = False, cap
            case Spawn():
                await self.spawn(step)
            case End(pick):
                await self.end(pick)
            case Stop(pick):
                await self.stop(pick)
            case StopRun(pick):
                await self.stop_run(pick)
            case Collect(pick):
                await self.collect(pick)
            case Drain():
                await self.drain()
            case Again(pick):
                await self.again(pick)
            case Reload():
                _event("reload carrying live workers" if model.running() else "reload, none live")
                await self.d.reload_in_place()
                for worker in model.running():
                    worker.carried = True
            case Crash():
                _event("crash interrupting live workers" if model.running() else "crash, none live")
                await self.d.crash_and_restart()
                for worker in model.running():
                    if worker.state == "running":  # a queued one waits on, in its place
                        model.end(worker, "interrupted")

    async def spawn(self, step: Spawn) -> None:
        model = self.model
        running = model.running()
        parent = (
            running[step.parent % len(running)] if running and step.parent is not None else None
        )
        run = parent.run if parent is not None else list(model.runs)[step.run % len(model.runs)]
        n = model.spawns = model.spawns + 1
        fifo = None
        if step.held:
            fifo = model.root / f"go-{n}"
            os.mkfifo(fifo)
        argv = [*sh(HELD if step.held else QUICK), "sh", str(n), str(step.code), str(fifo)]
        everyone = list(model.workers.values())
        picks = step.after if everyone else ()
        after = list(dict.fromkeys(everyone[p % len(everyone)].id for p in picks))
        async with self.d.client() as client:
            if parent is None and model.runs[run]:
                with pytest.raises(RunStopped):
                    await client.spawn(argv, run=run)
                return
            asked: dict[str, object] = {"key": f"spawn-{n}"}
            asked |= {"parent": parent.id} if parent is not None else {"run": run}
            if step.retries:
                asked |= {"retries": step.retries, "backoff": 0.0}
            if after:
                asked |= {"after_ok" if step.ok else "after": after}
            queued = bool(after) or model.full(run)
            view = await client.spawn(argv, **asked)  # type: ignore[arg-type]
            assert (view.run, view.parent) == (run, parent.id if parent else None)
            assert view.queued == queued, (view, model.caps[run])
            worker = Worker(n, view.id, run, view.parent, step.code, fifo, order=model.place())
            worker.retries, worker.after, worker.ok = step.retries, after, step.ok and bool(after)
            worker.state = "queued" if queued else "running"
            if after:
                _event(
                    "a spawn waiting for others (after_ok)"
                    if step.ok
                    else "a spawn waiting (after)"
                )
            elif queued:
                _event("a spawn queued over its run's cap")
            worker.asked, worker.asked_at = {"argv": argv, **asked}, trio.current_time()
            model.workers[worker.id] = worker
            self.log.append(
                f"  -> {worker.id} (R{n}) in {run}, parent {worker.parent}, after {after}"
            )
            if not step.held and not queued:
                await self.attempt_ended(client, worker)

    async def attempt_ended(self, client: AsyncClient, worker: Worker) -> None:
        """`worker`'s attempt ends on its own (its exit): retried, it is back in its run's
        queue (once its journal says so); else it has ended, for good."""
        if self.model.retried(worker):
            await until_note(client, worker.id, f"attempt {worker.attempt} ended failed")
            _event("a failed attempt retried")
            worker.wrote = True
            worker.attempt += 1
            worker.state, worker.order = "queued", self.model.place()
            return
        ended = await client.wait(worker.id)
        assert ended.attempt == worker.attempt, (worker, ended)
        if worker.attempt > 1:
            _event("a retried worker ended for good")
        self.model.end(worker, "finished" if worker.code == 0 else "failed")

    async def again(self, pick: int) -> None:
        workers = [
            w
            for w in self.model.workers.values()
            if trio.current_time() - w.asked_at < DEFAULT_REQUEST_KEY_TTL - 1  # not forgotten
        ]
        if not workers:
            return
        worker = workers[pick % len(workers)]
        async with self.d.client() as client:
            view = await client.spawn(**worker.asked)  # type: ignore[arg-type]
        assert (view.id, _state(view)) == (worker.id, worker.state), (worker, view)
        _event("a spawn sent again after its worker ended" if worker.ended else "sent again")

    async def end(self, pick: int) -> None:
        candidates = [
            w for w in self.model.running() if w.fifo is not None and w.state == "running"
        ]
        if not candidates:
            return
        worker = candidates[pick % len(candidates)]
        assert worker.fifo is not None
        fifo = worker.fifo

        def go() -> None:
            with open(fifo, "w") as f:  # blocks until the worker opens it to read
                f.write("go\n")

        if worker.carried:
            _event("end of a worker carried by a reload")
        await trio.to_thread.run_sync(go)
        async with self.d.client() as client:
            await self.attempt_ended(client, worker)

    async def stop(self, pick: int) -> None:
        model = self.model
        if not model.workers:
            return
        worker = list(model.workers.values())[pick % len(model.workers)]
        async with self.d.client() as client:
            assert await client.stop(worker.id)  # found, even released
            for w in model.subtree(worker.id):
                if not w.ended:
                    await client.wait(w.id)
                    model.end(w, "stopped")

    async def stop_run(self, pick: int) -> None:
        model = self.model
        run = list(model.runs)[pick % len(model.runs)]
        async with self.d.client() as client:
            await client.stop_run(run)
            model.runs[run] = True
            for w in model.running():
                if w.run == run:
                    await client.wait(w.id)
                    model.end(w, "stopped")

    async def collect(self, pick: int) -> None:
        model = self.model
        if not model.workers:
            return
        worker = list(model.workers.values())[pick % len(model.workers)]
        async with self.d.client() as client:
            if not worker.ended:
                with pytest.raises(Busy, match=r"still (running|starting)"):
                    await client.collect(worker.id)
                return
            got = await client.collect(worker.id)
        assert (got.state, got.result) == (worker.state, worker.result), (worker, got)
        worker.collected = True

    async def expire(self) -> None:
        """Let the mock clock run past the TTL: every handle left uncollected goes."""
        await trio.sleep(TTL + 1)
        for worker in self.model.workers.values():
            if worker.ended and not worker.collected:
                worker.expired = True
                parent = self.model.workers.get(worker.parent or "")
                if parent is not None and not parent.ended:
                    _event("expiry making a tombstone (a live parent may still ask)")

    async def drain(self) -> None:
        """Take every wake pending for every parent: each is owed, and new."""
        model = self.model
        keys = {("run", r) for r in model.runs} | {w.key for w in model.workers.values()}
        async with self.d.client() as client:
            for kind, parent in sorted(keys):
                try:
                    if kind == "run":
                        wakes = [w async for w in client.events(run=parent)]
                    else:
                        wakes = [w async for w in client.events(worker=parent)]
                except NotFound:
                    owed = [w.id for w in model.workers.values() if w.key == (kind, parent)]
                    assert not any(model.workers[i].ended for i in owed), (kind, parent)
                    continue
                for wake in wakes:
                    worker = model.workers.get(wake.id)
                    assert worker is not None, f"a wake for a worker never spawned: {wake}"
                    assert worker.key == (kind, parent), (worker, wake)
                    assert worker.ended, f"a wake before the ending: {wake}"
                    assert not worker.woken, f"a wake delivered twice: {wake}"
                    assert wake.state == worker.state, (worker, wake)
                    assert wake.attempt == worker.attempt, (worker, wake)
                    worker.woken = True
        lost = [w.id for w in model.workers.values() if w.ended and not w.woken]
        assert not lost, f"endings whose wake was lost: {lost}"

    async def settle(self) -> None:
        """The queued workers whose turn came start (each seen to: a held one says `up`),
        and a quick one among them ends, which may start the next."""
        model = self.model
        async with self.d.client() as client:
            while True:
                placed, skipped = model.unblock()
                for worker in skipped:
                    _event("an after_ok worker skipped")
                    ended = await client.wait(worker.id)
                    assert (ended.state, ended.reason, ended.pid) == ("stopped", "skipped", None)
                started = model.start_due()
                if not (placed or skipped or started):
                    break
                for worker in started:
                    _event("a queued worker started in its turn")
                    if worker.fifo is None:
                        await self.attempt_ended(client, worker)
                    else:
                        up = f"^up-{worker.attempt}$"
                        waited = await client.wait_for(worker.id, up, timeout=60)
                        assert waited.outcome == "matched", (worker, waited)

    async def check(self) -> None:
        """What the daemon says of every worker is what the model says."""
        model = self.model
        async with self.d.client() as client:
            views = {}
            for worker in model.workers.values():
                view = views[worker.id] = await client.status(worker.id)
                assert _state(view) == worker.state, (worker, view)
                assert view.attempt == worker.attempt, (worker, view)
                if worker.ended and (worker.collected or worker.expired):
                    # Released (or about to be): a collect answers as it did, from the archive.
                    got = await client.collect(worker.id)
                    assert (got.state, got.result) == (worker.state, worker.result), (worker, got)
                    worker.collected = True
            listed = {w.id for w in await client.ls(all=True)}
            info = await client.info()
        assert info.holds_park == model.holds_park(), info.workers
        for run, cap in model.caps.items():
            running = [v for v in views.values() if v.run == run and v.state == "running"]
            assert cap is None or len(running) <= cap, (run, cap, running)
        for view in views.values():  # nothing starts, nor waits to, after its run stopped
            assert not (model.runs[view.run] and view.state in ("starting", "running")), view
        for worker in model.workers.values():
            assert (worker.id in listed) == model.held(worker), (worker, listed)
        assert listed <= set(model.workers), (
            f"workers nobody spawned: {listed - set(model.workers)}"
        )

    async def finish(self) -> None:
        """At the end: every wake delivered once, every result there to collect."""
        with held(self.clock):
            await self.drain()
            async with self.d.client() as client:
                for worker in self.model.workers.values():
                    if worker.ended:
                        got = await client.collect(worker.id)
                        assert (got.state, got.result) == (worker.state, worker.result), worker


def _state(view: WorkerView) -> str:
    """A view's state as the model says it: `queued` for one waiting in the queue."""
    if view.queued:
        assert view.state == "starting", view
        return "queued"
    return view.state


def _event(what: str) -> None:
    """Count `what` in hypothesis' statistics (how often the machine got there)."""
    if currently_in_test_context():
        event(what)


async def _play(root: Path, steps: list[Step], report: Callable[[str], None] = note) -> None:
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, MockClock)
    model = Model(root)
    async with in_process(root, finished_ttl=TTL, real_bound=60) as d:
        player = Player(d, clock, model)
        with held(clock):
            async with d.client() as client:
                model.runs[await client.new_run()] = False
                # And one capped at 1 from the start: the queue is in play in most examples.
                capped = await client.new_run(max_running=1)
                model.runs[capped], model.caps[capped] = False, 1
        try:
            for step in steps:
                await player.play(step)
            await player.finish()
        finally:
            report("\n".join(player.log))  # what was played, with the ids it made


@settings(
    max_examples=int(os.environ.get("LIFECYCLE_EXAMPLES", "100")),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no explain: slow
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(steps=st.lists(STEPS, min_size=4, max_size=24))
def test_the_lifecycle_keeps_every_promise(steps: list[Step]) -> None:
    with short_root() as root:
        trio.run(_play, root, steps, clock=MockClock(autojump_threshold=0))


def _play_steps(steps: list[Step]) -> None:
    with short_root() as root:
        trio.run(_play, root, steps, print, clock=MockClock(autojump_threshold=0))


def test_a_worker_carried_by_a_reload_then_crashed_is_interrupted_and_wakes_once() -> None:
    _play_steps([Spawn(True, 0, None, 0), Reload(), Crash(), Drain(), Collect(0)])


def test_a_worker_carried_by_two_reloads_ends_there_wakes_once_with_its_result() -> None:
    _play_steps([Spawn(True, 3, None, 0), Reload(), Reload(), End(0), Drain(), Collect(0)])


def test_an_expired_child_of_a_live_parent_answers_across_a_reload_and_a_crash() -> None:
    # Its handle becomes a tombstone while its parent runs; then the parent is interrupted.
    _play_steps(
        [
            Spawn(held=True, code=0, parent=None, run=0),
            Spawn(held=False, code=3, parent=0, run=0),
            Expire(),
            Reload(),
            Drain(),
            Crash(),
            Collect(pick=1),
            Stop(pick=0),
        ]
    )


def test_stopping_a_collected_parent_after_a_reload_still_stops_its_live_child() -> None:
    # Found by the machine: the store took back only the handles it held, not the
    # collected parent a live child keeps; after the reload, stopping it stopped nothing.
    parent, child = 0, 1
    _play_steps(
        [
            Spawn(held=True, code=0, parent=None, run=0),
            Spawn(held=True, code=0, parent=parent, run=0),
            End(pick=parent),
            Collect(pick=parent),
            Reload(),
            Stop(pick=parent),
            Collect(pick=child),
        ]
    )


def test_a_collected_parent_stays_listed_across_a_crash_while_its_child_is_held() -> None:
    _play_steps(
        [
            Spawn(held=True, code=0, parent=None, run=0),
            Spawn(held=False, code=0, parent=0, run=0),
            Crash(),
            Collect(pick=0),
            Reload(),
            Crash(),
        ]
    )
