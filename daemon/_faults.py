"""Fault injection, for the tests of the fault boundaries: where SUBAGENTD_FAULT asks a
part to raise, to hold, or to do what a fault would. One `Faults`, built by the daemon
from the value read at start, is handed to each part that has a point; empty but in
tests. A leaf: it knows nothing of the parts that ask it."""

from __future__ import annotations

from pathlib import Path

import trio

#: Fault injection for the tests of the fault boundaries, read once at start:
#: SUBAGENTD_FAULT="point:target,...". `ending:N`, `pump:N` and `record:N` raise in the
#: supervision of a worker named N (as its ending begins, once a chunk of its output is
#: journaled, inside its ending's transaction: rolled back), `expire:N` as its handle expires,
#: `die-in-ending:N` kills the daemon (SIGKILL) inside the ending's transaction of the
#: Nth worker to end (counted from 1 in this daemon's life),
#: `resume:N` as a resume of it has reopened its record; `hold-resume:N` holds a resume
#: of it before its journal is verified (the await a stop may land in) until a writer of
#: the FIFO `hold-resume` in the state dir has opened and closed it;
#: `hold-pause:N` holds a pause of a worker named N (its lock held, as while the kernel
#: is slow to say its tree is frozen) until a writer of the FIFO `hold-pause` in the
#: state dir has opened and closed it;
#: `reload:early` raises as the first reload begins;
#: `lose-answer:N` reloads the daemon (SIGHUP to itself) once a spawn of a worker named N
#: is written down and started, and never sends that spawn's answer: the reload's pause
#: ends the request, as when an answer is lost in a reload;
#: `die-before-start-written:N` kills the daemon (SIGKILL) once a worker named N runs and
#: its spawn is answered, before its start (pid, journal entry) is written down;
#: `hold-in-nodes:N` holds the spawn of a worker named N with limits, its forking thread
#: standing in its limit nodes before the fork, until a writer of the FIFO `hold-in-nodes`
#: in the state dir has opened and closed it (the daemon's event loop waits meanwhile);
#: `check:hold` holds a reload's `--check` child until a writer of the FIFO `hold-check`
#: in the state dir has opened and closed it (a check under way, for the tests);
#: `check:reads-before-4` has `--check` say it reads checkpoint versions up to 3 (an
#: image before the memfd); `handoff:garbage` and `handoff:truncated` make a reload hand
#: over a checkpoint that does not decode; `handoff:keep` has the new image write the
#: checkpoint it was handed to `checkpoint.kept` in the state dir.
FAULT_ENV = "SUBAGENTD_FAULT"


def read_faults(spec: str) -> frozenset[tuple[str, str]]:
    """The (point, target) pairs of a SUBAGENTD_FAULT value."""
    pairs = (item.partition(":") for item in spec.split(","))
    return frozenset((point, target) for point, _, target in pairs if point)


class InjectedFault(Exception):
    """Raised where SUBAGENTD_FAULT asks: a stand-in for any unexpected exception."""


class Faults:
    """The (point, target) pairs SUBAGENTD_FAULT asked for, and what each point does."""

    def __init__(self, asked: frozenset[tuple[str, str]] = frozenset(), *, fifos: Path) -> None:
        """`fifos`: the directory of the FIFOs a hold waits on (the state dir)."""
        #: What is still armed: a fault raised `once` is taken out (a test may arm it again).
        self.asked = asked
        self._fifos = fifos

    def __contains__(self, point: tuple[str, str]) -> bool:
        return point in self.asked

    def raise_at(self, point: str, target: str, *, once: bool = False) -> None:
        """Raise InjectedFault if SUBAGENTD_FAULT asked for one here (`once`: the first time)."""
        if (point, target) in self.asked:
            if once:
                self.asked -= {(point, target)}
            raise InjectedFault(f"injected fault at {point}:{target}")

    async def hold_at(self, point: str, target: str) -> None:
        """Wait here if SUBAGENTD_FAULT asked to hold at this point: until a writer of the
        FIFO named `point` in the state dir has opened and closed it (for the tests: a
        request held where it awaits, deterministically, while another lands)."""
        if (point, target) in self.asked:
            fifo = self._fifos / point
            await trio.to_thread.run_sync(fifo.read_bytes, abandon_on_cancel=True)
