"""The schedule: which workers may run now under the caps, and which wait their turn.

A sans-I/O core (no trio, no clock): it is told what was spawned, what started and what
ended, and answers what to start next. Three caps bound how many workers run at once:
the daemon's (`--max-running`), a run's (`new_run`'s `max_running`, its own workers, not
those of runs nested in it) and an agent's (agents.toml's `max_running`, across runs). A
spawn over any of them waits in the queue, first in, first out within one priority (a
higher `priority` first); each cap is filled in queue order by those it holds back, so a
worker held back by a full run never holds back one of another run.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: What a cap is counted by: ("run", run id), ("agent", name).
CapKey = tuple[str, str]


@dataclass(frozen=True)
class Queued:
    """A worker waiting: its place (higher priority first, then the order it came in)."""

    worker: str
    run: str
    agent: str | None
    priority: int
    seq: int
    #: Not before this time (a retry's backoff: seconds since the epoch); 0: at once.
    not_before: float = 0.0
    #: Held back until `unblock` (it starts after other workers).
    blocked: bool = False

    @property
    def place(self) -> tuple[int, int]:
        return -self.priority, self.seq


class Schedule:
    """Caps, the queue, and what runs under them.

    `run_cap` and `agent_cap` answer a run's and an agent's cap when asked (None: none),
    so a cap changed (an agents.toml reloaded) counts from the next decision on.
    """

    def __init__(
        self,
        *,
        daemon_cap: int | None = None,
        run_cap: Callable[[str], int | None] = lambda run: None,
        agent_cap: Callable[[str], int | None] = lambda agent: None,
    ) -> None:
        self.daemon_cap = daemon_cap
        self._run_cap = run_cap
        #: An agent's cap (agents.toml's, set again whenever it is loaded).
        self.agent_cap = agent_cap
        #: Running (started, or about to be) by worker id: the keys it counts against.
        self._running: dict[str, tuple[CapKey, ...]] = {}
        self._counts: dict[CapKey, int] = {}
        #: The queue, by worker id, and its places in order (for positions and the head).
        self._queued: dict[str, Queued] = {}
        self._order: list[tuple[int, int, str]] = []
        #: Queued workers of each run, in order: a run's head is found without a walk.
        self._by_run: dict[str, list[tuple[int, int, str]]] = {}
        #: The last seq handed out: each queued worker's is new, and kept in its record.
        self.last_seq = 0

    # -- what it is told ---------------------------------------------------------

    def admit(
        self, worker: str, run: str, agent: str | None, priority: int = 0, blocked: bool = False
    ) -> int | None:
        """A spawn: None if it may start now (counted as running from here), else the seq
        it waits under (its record keeps it, for the order across restarts). Whatever
        waits already is held back by a cap this one is not under (else the slot that
        freed would have started it), so one with room overtakes none it shares a cap with."""
        if not blocked and self._room(run, agent):
            self._count(worker, run, agent)
            return None
        self.last_seq += 1
        self.wait(Queued(worker, run, agent, priority, self.last_seq, blocked=blocked))
        return self.last_seq

    def blocked(self) -> list[str]:
        """The queued held back (`Queued.blocked`), in queue order."""
        return [w for w in self.queued() if self._queued[w].blocked]

    def unblock(self, worker: str) -> None:
        queued = self._queued.get(worker)
        if queued is not None and queued.blocked:
            self._queued[worker] = dataclasses.replace(queued, blocked=False)

    def retry(
        self, worker: str, run: str, agent: str | None, priority: int, not_before: float
    ) -> int:
        """A worker that ended, given another attempt: it waits in the queue, and starts
        no sooner than `not_before`; the seq it waits under."""
        self.last_seq += 1
        self.wait(Queued(worker, run, agent, priority, self.last_seq, not_before))
        return self.last_seq

    def next_due(self, now: float) -> float | None:
        """When the soonest retry still waiting out its backoff may start; None: none."""
        waiting = [q.not_before for q in self._queued.values() if q.not_before > now]
        return min(waiting, default=None)

    def wait(self, queued: Queued) -> None:
        """Put a worker in the queue at its place (a restored one under its own seq)."""
        if queued.worker in self._queued or queued.worker in self._running:
            return
        self._queued[queued.worker] = queued
        entry = (*queued.place, queued.worker)
        bisect.insort(self._order, entry)
        bisect.insort(self._by_run.setdefault(queued.run, []), entry)
        self.last_seq = max(self.last_seq, queued.seq)

    def running(self, worker: str, run: str, agent: str | None) -> None:
        """A worker runs whatever the caps say (adopted, recovered, resumed): counted."""
        if worker not in self._running:
            self._drop(worker)
            self._count(worker, run, agent)

    def ended(self, worker: str) -> None:
        """A worker ended (ran, or never started): its slot, or its place, is free."""
        keys = self._running.pop(worker, None)
        if keys is not None:
            for key in keys:
                left = self._counts[key] - 1
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]
        self._drop(worker)

    # -- what it answers ---------------------------------------------------------

    def to_start(self, most: int | None = None, now: float = math.inf) -> list[str]:
        """The queued workers that may start now (at most `most`; none waiting out its
        backoff past `now`), in the order to start them; each is counted as running from
        here (told `ended` if its start fails)."""
        started: list[str] = []
        while (
            self._queued
            and self._below(self.daemon_cap, len(self._running))
            and (most is None or len(started) < most)
        ):
            best: tuple[int, int, str] | None = None
            for run, entries in self._by_run.items():
                if not self._below(self._run_cap(run), self._counts.get(("run", run), 0)):
                    continue  # the run is full: none of its queue can go
                for entry in entries:
                    if best is not None and entry >= best:
                        break
                    if self._queued[entry[2]].not_before > now or self._queued[entry[2]].blocked:
                        continue  # a retry waiting out its backoff; one waiting for others
                    agent = self._queued[entry[2]].agent
                    if agent is None or self._below(
                        self.agent_cap(agent), self._counts.get(("agent", agent), 0)
                    ):
                        best = entry
                        break
            if best is None:
                break
            queued = self._queued[best[2]]
            self._drop(queued.worker)
            self._count(queued.worker, queued.run, queued.agent)
            started.append(queued.worker)
        return started

    def position(self, worker: str) -> int | None:
        """Its place in the queue, from 1 (the next to start as caps allow); None: not
        queued."""
        queued = self._queued.get(worker)
        if queued is None:
            return None
        return bisect.bisect_left(self._order, (*queued.place, worker)) + 1

    def queued_count(self) -> int:
        return len(self._queued)

    def is_queued(self, worker: str) -> bool:
        return worker in self._queued

    def queued(self) -> list[str]:
        """Every queued worker, in queue order."""
        return [entry[2] for entry in self._order]

    def running_count(self, key: CapKey | None = None) -> int:
        """How many run now: in all (None), or counted against `key`."""
        return len(self._running) if key is None else self._counts.get(key, 0)

    def restore(
        self, running: Iterable[tuple[str, str, str | None]], queued: Iterable[Queued]
    ) -> None:
        """Rebuild from the records (a restart, a reload): what runs, and the queue."""
        self._running.clear()
        self._counts.clear()
        self._queued.clear()
        self._order.clear()
        self._by_run.clear()
        for worker, run, agent in running:
            self._count(worker, run, agent)
        for entry in queued:
            self.wait(entry)

    # -- inside --------------------------------------------------------------------

    def _room(self, run: str, agent: str | None) -> bool:
        return (
            self._below(self.daemon_cap, len(self._running))
            and self._below(self._run_cap(run), self._counts.get(("run", run), 0))
            and (
                agent is None
                or self._below(self.agent_cap(agent), self._counts.get(("agent", agent), 0))
            )
        )

    @staticmethod
    def _below(cap: int | None, count: int) -> bool:
        return cap is None or count < cap

    def _count(self, worker: str, run: str, agent: str | None) -> None:
        keys: tuple[CapKey, ...] = (
            (("run", run),) if agent is None else (("run", run), ("agent", agent))
        )
        self._running[worker] = keys
        for key in keys:
            self._counts[key] = self._counts.get(key, 0) + 1

    def _drop(self, worker: str) -> None:
        queued = self._queued.pop(worker, None)
        if queued is None:
            return
        entry = (*queued.place, worker)
        del self._order[bisect.bisect_left(self._order, entry)]
        entries = self._by_run[queued.run]
        del entries[bisect.bisect_left(entries, entry)]
        if not entries:
            del self._by_run[queued.run]
