"""What the garbage collector is kept from seeing while a burst of work runs over a large
heap: everything that stood before the burst.

A full collection walks every object the collector tracks: with 10,000 live workers
about 1.3 million (~130 each: their tasks, events, records, journals), ~0.6 s at 5,000
on this machine's core. It comes whenever the objects that lived through a young
collection since the last one reach a quarter of what that one found, and a stop_run of
thousands makes about that many (a task, a cancel scope and its events a worker, alive
until the worker's ending): three full collections in one stop_run of 5,000 (1.7 s of
its 4.7 s of CPU), each walking all that the run's workers and every other worker
hold. The cost of each ending grew with the number of workers (0.61 ms a stopped worker
at 2,000, 1.41 at 9,500; bench/results/2026-12-02-stoprun.md). `gc.freeze` moves what
exists into a generation no collection walks, in one step (a list splice); what the
burst makes is still collected as ever, young or old. Given back (`gc.unfreeze`, one
step too) when the last hold ends, so a cycle among the older objects is still freed,
one collection later.

Held by start-up for its first seconds of serving (lifecycle/_serve.py) and by a stop of
many (workers/_supervisor.py); one count for both, so neither gives back what the other
still hides.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class UnseenHeap:
    """Holds on `gc.freeze`: what stood when a hold was taken stays out of the
    collector's sight until the last hold is let go. A hold may also `pause` collection
    (a stop of many: what it makes lives until its workers end, so a collection during
    it frees next to nothing), off until the last pausing hold is let go."""

    def __init__(self) -> None:
        self.holds = 0
        self.pauses = 0
        #: Holds taken in this image's life (for tests: a stop of many takes one).
        self.taken = 0
        #: Whether collection was on when the first pause took it off.
        self._was_on = False

    def hold(self, *, pause: bool = False) -> None:
        """Hide from the collector every object there is now (those a hold already hid,
        and what was made since); with `pause`, make no collection until let go."""
        self.holds += 1
        self.taken += 1
        gc.freeze()
        if pause:
            if self.pauses == 0:
                self._was_on = gc.isenabled()
                gc.disable()
            self.pauses += 1

    def let_go(self, *, pause: bool = False) -> None:
        """One hold less (`pause`: one that paused); the last gives the hidden objects back
        to the collector, the last pausing one turns collection on again if it was."""
        if self.holds <= 0 or (pause and self.pauses <= 0):
            raise RuntimeError("UnseenHeap.let_go without its hold")
        self.holds -= 1
        if pause:
            self.pauses -= 1
            if self.pauses == 0 and self._was_on:
                gc.enable()
        if self.holds == 0:
            gc.unfreeze()

    @contextlib.contextmanager
    def held(self, *, pause: bool = False) -> Iterator[None]:
        self.hold(pause=pause)
        try:
            yield
        finally:
            self.let_go(pause=pause)


#: The daemon's one: `gc.freeze` is the interpreter's, not an object's.
UNSEEN = UnseenHeap()
