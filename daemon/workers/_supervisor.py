"""Supervision of live workers: one task per worker, from its launch until it has ended.

The supervisor owns what is live (each worker's process, pipes and journal while it
runs), starts and ends trees through the launcher port, enforces timeouts, and hands
each ending to the daemon, which writes it down. A supervise task is a fault boundary:
an exception in it ends that worker `failed`, never the daemon. A reload does not stop
supervision: it execs from where every task stands, once none holds what the exec would
lose (`wait_nothing_in_hand`), and the tasks vanish with the image.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import trio

from subagentd.protocol import EntryKind
from subagentd.protocol.errors import Busy, Refused

from .._collector import UNSEEN
from .._faults import Faults
from .._logging import get_logger
from ..core._registry import Registry, WorkerRecord
from ..processes._controllers import LimitsHit
from ..processes._launcher import Launcher
from ..processes._process import Deliver, WorkerProcess, write_nowait
from ..processes._reaper import REAPER
from ..processes._relay import RelayLost
from ..store._archive import STDOUT_TAIL_BYTES
from ..store._journal import Journal, JournalCorrupt

log = get_logger()

#: After the tree is gone, how long the pipes may take to give up what they hold.
PIPE_DRAIN_SECONDS = 1.0
#: How many windows of PIPE_DRAIN_SECONDS a relayed worker's drain goes on while its relay
#: says its pipes still hold output.
RELAY_DRAIN_ROUNDS = 30
#: The pipes a worker's output comes on, each pumped into its journal by a task of its own.
_PIPES: tuple[EntryKind, ...] = ("stdout", "stderr")
#: Supervision of adopted workers begins once the image serves, this many at a time,
#: letting others run between: the first clients need not wait for the first steps of a
#: thousand adopted workers' 3,000 tasks (~80 ms). Until its turn, a worker's output
#: waits in its pipe, its exit as a zombie, and a stop asked is acted on when it comes.
SUPERVISION_BATCH = 100
#: A write that failed (disk full, EIO) is tried again after this, doubling up to the max.
DISK_RETRY_FIRST = 0.1
DISK_RETRY_MAX = 5.0
#: A stop of this many workers or more pauses garbage collection, and hides the heap that
#: stood before it from the collector, until they have all ended (`_collector.UNSEEN`).
UNSEEN_STOP_FROM = 100
#: At most this long, and as much again for each worker: a stop whose workers take their
#: grace and more (a TERM ignored) lets the collector free what others make meanwhile; a
#: stop_run of 10,000 (~10 s of the daemon's work on a loaded machine) keeps it paused.
UNSEEN_STOP_MOST = 10.0
UNSEEN_STOP_MOST_A_WORKER = 0.003
#: In a stop of UNSEEN_STOP_FROM workers or more, a worker's `stopping` note is written
#: with its ending (one opening of its parked journal, not two), or this long after the
#: stop was asked for a tree still not gone (and before a reload's exec).
STOPPING_NOTE_LATE = 5.0
#: When to offer a worker's full stdin more (`busy`'s retry_after): it reads when it will.
STDIN_RETRY = 0.1


#: A pause's journal note names at most this many pids it held outside a cgroup.
HELD_PIDS_NOTED = 16


class Tally:
    """How many of something are in hand, and a wait until none is."""

    def __init__(self) -> None:
        self.count = 0
        self._put_down = trio.Event()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Count one in hand for the body."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            put_down, self._put_down = self._put_down, trio.Event()
            put_down.set()

    async def none_held(self) -> None:
        """Return once none is in hand (at once, if none is)."""
        while self.count:
            await self._put_down.wait()


@dataclass(eq=False)
class LiveWorker:
    """A worker not yet ended, with what supervises it. ``process`` is None while starting."""

    record: WorkerRecord
    journal: Journal
    process: WorkerProcess | None = None
    stop_asked: bool = False
    #: The nursery of its supervision while one runs: where a stop asked is carried out.
    watch: trio.Nursery | None = None
    ended: trio.Event = field(default_factory=trio.Event)
    grown: trio.Event = field(default_factory=trio.Event)
    terminated: trio.Event = field(default_factory=trio.Event)
    #: Its own process has exited (seen by its supervision, which waits on its pidfd):
    #: what a stop of its cgroup waits on for it (`Launcher.end_tree`'s leader_exited).
    exited: trio.Event = field(default_factory=trio.Event)
    terminating: bool = False
    #: Its own process has had the TERM of the stop asked (`Supervisor._begin_stop`).
    leader_termed: bool = False
    stdout_tail: bytearray = field(default_factory=bytearray)
    returncode: int | None = None  # once reaped
    #: A thread is shedding its journal's older pages from the page cache.
    shedding: bool = False
    #: Its journal says a stop is in flight. A stop asked before this was made (an
    #: image before a reload) was said there by the image that was asked.
    stop_journaled: bool = False
    #: Stopped as one of a stop of many (UNSEEN_STOP_FROM or more): its `stopping` note
    #: waits for its ending (STOPPING_NOTE_LATE), and its ending logs no line of its own
    #: (the stop's `stop.many_ended` counts them).
    in_many: bool = False
    #: Chunks read from its pipes that the disk has not taken yet (each retried).
    chunks_held: Tally = field(default_factory=Tally)
    #: What its start leaves to do once the spawn is answered (written down, logged):
    #: run first by its supervision, before any of its output is journalled.
    after_start: Callable[[], None] | None = None
    #: The wait for its timeout while one runs: its deadline moves while it is paused
    #: (`Supervisor.paused`, `unpaused`).
    timing: trio.CancelScope | None = None

    def __post_init__(self) -> None:
        self.stop_journaled = self.record.stop_reason is not None

    def reset_supervision(self) -> None:
        """Fresh per-supervision state for a (re)adopted worker; a stop asked before stands."""
        self.terminated = trio.Event()
        self.exited = trio.Event()
        self.terminating = False
        self.leader_termed = False
        self.watch = None
        if self.record.stop_reason is not None:
            self.stop_asked = True


class Ending(Protocol):
    """How the supervisor hands an ending to the daemon, which writes it down.
    `failure`: supervision failed (and says why), so the worker ends `failed`."""

    def __call__(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        failure: str | None = None,
    ) -> None: ...


class EndingTogether(Protocol):
    """`Ending`, written with the others reached in the same scheduling batch; returns
    once it is in the store. `note`: a state entry its journal takes first (a stop of
    many's `stopping`, left to the ending)."""

    async def __call__(
        self,
        record: WorkerRecord,
        journal: Journal,
        returncode: int | None,
        stdout_tail: bytes,
        hit: LimitsHit | None = None,
        note: bytes | None = None,
    ) -> None: ...


class Supervisor:
    def __init__(
        self,
        launcher: Launcher,
        registry: Registry,
        *,
        ending: Ending,
        ending_together: EndingTogether,
        clock: Callable[[], float],
        faults: Faults,
        disk_trouble: Callable[[str, OSError], None],
        disk_ok: Callable[[], None],
        later: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._launcher = launcher
        #: Runs what an answer need not wait for (a log line, an empty cgroup's removal)
        #: after it; else at once.
        self._later = later or (lambda step: step())
        self._registry = registry
        self._ending = ending
        self._ending_together = ending_together
        self._clock = clock
        self._faults = faults
        self._disk_trouble = disk_trouble
        self._disk_ok = disk_ok
        self._live: dict[str, LiveWorker] = {}
        #: Queued workers (`_queue.py`): not live, no process; held here to be waited for.
        self._queued: dict[str, LiveWorker] = {}
        #: Told the ids of every stop asked: the queue ends those of them it holds.
        self.queued_stopped: Callable[[list[str]], None] = lambda ids: None
        self._nursery: trio.Nursery | None = None
        self._background: trio.Nursery | None = None  # the reaper
        #: Tasks holding what an exec would lose (see `wait_nothing_in_hand`).
        self._in_hand = Tally()
        self._launches = Tally()  # between registration and their supervise task
        #: Set when an ended worker's cgroup is left to remove (`_remove_released`).
        self._some_released = trio.Event()
        #: Set once the image serves: adopted workers' supervision waits for it.
        self._serving = trio.Event()
        #: A reload's checkpoint was taken (`hand_over`): the next image ends the workers.
        self.handed_over = False

    # -- what is live ----------------------------------------------------------

    def get(self, worker_id: str) -> LiveWorker | None:
        """A worker not yet ended: live, or queued (no process, as one starting)."""
        return self._live.get(worker_id) or self._queued.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def workers(self) -> list[LiveWorker]:
        """Every live worker, in the order they came."""
        return list(self._live.values())

    def ids(self) -> list[str]:
        return list(self._live)

    def add(self, live: LiveWorker) -> None:
        """A worker registered, its process about to be launched (or adopted)."""
        self._live[live.record.id] = live

    def supervise(
        self,
        live: LiveWorker,
        process: WorkerProcess,
        *,
        after_start: Callable[[], None] | None = None,
    ) -> None:
        """Supervise a worker whose process has just started; before anything else can
        fail: a process nobody reaps is lost. A stop asked meanwhile is acted on at once.
        `after_start` runs first in its supervision task: after the spawn's answer."""
        assert self._nursery is not None, "Supervisor.run is not running"
        live.process = process
        live.after_start = after_start
        self._nursery.start_soon(self._supervise, live)

    def end_unstarted(self, live: LiveWorker) -> None:
        """A worker whose process never started (or never will): no longer live."""
        self._live.pop(live.record.id, None)
        self._queued.pop(live.record.id, None)

    def hold_queued(self, live: LiveWorker) -> None:
        """A queued worker: waited for (`wait_ended`) but not live, until `take_queued`."""
        self._queued[live.record.id] = live

    def take_queued(self, worker_id: str) -> LiveWorker | None:
        return self._queued.pop(worker_id, None)

    def queued(self) -> list[LiveWorker]:
        """The queued workers held (their journals open), in the order they came."""
        return list(self._queued.values())

    async def wait_serving(self) -> None:
        """Return once the image serves (supervision hosted: a launch may be supervised)."""
        await self._serving.wait()

    def serving(self) -> None:
        """The image serves (READY=1 sent): supervision of the adopted workers begins."""
        self._serving.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the workers' supervise tasks until cancelled, the adopted ones from the
        moment the image serves (`serving`): a reload's answer, and the connects waiting
        in the backlog, wait for no adopted worker's first steps (1,000 workers' 3,000
        tasks, ~30 ms). A reload leaves them as they stand: see `wait_nothing_in_hand`."""
        async with trio.open_nursery() as background:
            self._background = background
            # The workers' exits, told by SIGCHLD: what exited before (during a reload's
            # exec) is found by its first look, before any supervision waits.
            await background.start(REAPER.run)
            background.start_soon(self._remove_released)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                unsupervised = list(self._live.values())  # spawns from now: supervised
                task_status.started()
                if unsupervised:
                    await self._serving.wait()
                for n, live in enumerate(unsupervised):
                    if n and n % SUPERVISION_BATCH == 0:
                        # Serving goes on between batches: the reload's answer and the
                        # connects waiting do not wait for every worker's first steps.
                        await trio.lowlevel.checkpoint()
                    live.reset_supervision()
                    nursery.start_soon(self._supervise, live)
                await trio.sleep_forever()

    async def launches_settled(self) -> None:
        """Return once no spawn or resume is in flight (the caller fences new ones)."""
        await self._launches.none_held()

    async def wait_nothing_in_hand(self) -> None:
        """Return once no task holds what an exec would lose: output read from a pipe
        and not yet journaled (a write the disk refused, being tried again), an ending
        waiting for its batch's transaction (its process reaped already), or the ending
        of a worker whose supervision failed.

        Every other supervision task parked at an await holds nothing that the
        journals, the store and the kernel do not (a pump journals what it read
        with no await between the read and the write), so a reload execs from
        where they all stand, with no await between this and the exec.
        """
        await self._in_hand.none_held()

    def _holding(self) -> contextlib.AbstractContextManager[None]:
        """The body holds what an exec would lose: a reload waits for it."""
        return self._in_hand.holding()

    def launching(self) -> contextlib.AbstractContextManager[None]:
        """Count a launch in flight, so a reload waits for it to finish."""
        return self._launches.holding()

    async def _supervise(self, live: LiveWorker) -> None:
        """Supervise one worker until it has ended: a fault boundary. An exception in
        here ends this worker `failed` (its whole tree with it), saying why in its
        journal, and reaches no other worker and not the daemon."""
        try:
            await self._watch(live)
        except* Exception as faults:
            # Shielded like any cleanup, and held: a reload waits for it to finish.
            with self._holding(), trio.CancelScope(shield=True):
                await self._fail(live, _first(faults))

    async def _watch(self, live: LiveWorker) -> None:
        """Pump its pipes, end its tree once it exits (or is asked to stop, or times
        out), then write its ending. Three tasks a worker (this one and a pump per
        pipe) and one nursery: a reload freezes and adopts a thousand of them, so
        each task saved here is saved a thousand times on its critical path."""
        record, process = live.record, live.process
        assert process is not None
        if (after_start := live.after_start) is not None:
            # Before a checkpoint: a freeze's cancel cannot come between it and the start.
            live.after_start = None
            after_start()
        # Each a pipe it reads, or a stream an output relay forwards (`_relay`).
        pipes = process.outputs()
        pipes_closed = trio.Event()
        async with trio.open_nursery() as nursery:
            live.watch = nursery
            try:
                for kind, source in pipes.items():
                    nursery.start_soon(self._pump, live, source, kind, pipes, pipes_closed)
                if not pipes:
                    pipes_closed.set()
                if live.stop_asked:  # asked before this supervision began (or a reload)
                    nursery.start_soon(self._stop, live)
                await self._wait_exited(live, process)
                live.exited.set()
                # Whatever is left of its tree goes with it: TERM, grace, KILL.
                await self._terminate(live)
                await self._drain(live, process, pipes_closed)
                nursery.cancel_scope.cancel()
            finally:
                # From here the nursery takes no new task (it only waits for its pumps):
                # a stop asked now finds its tree ended, or waits for the next supervision.
                live.watch = None
        if self.handed_over:
            # Woken before a checkpoint that carries it (an in-process reload's image
            # ends so, tests/inprocess.py; an exec runs nothing after it): the next
            # image reaps it and writes its ending, its pipes carried open.
            await trio.sleep_forever()
        live.returncode = returncode = process.reap()
        # Read from its limit nodes before they go: whether the kernel OOM-killed it.
        hit = self._launcher.limits_hit(process)
        process.close()
        # A pause that came as its tree ended ends with it: said before its ending.
        self.unpaused(live)
        # A stop of many's note, left to the ending: written first, in the same opening.
        note = None
        if live.stop_asked and not live.stop_journaled:
            live.stop_journaled = True
            note = self._stopping_note(live)
        # Live until its ending is written, so whoever waits for it (a stop's answer, a
        # wait, a reload's exec) waits for the write too.
        with self._holding(), trio.CancelScope(shield=True):
            await self._ending_together(
                record, live.journal, returncode, bytes(live.stdout_tail), hit, note
            )
        self._let_go(live)
        live.ended.set()
        live.grown.set()
        # Its tree is reaped, its cgroup empty: removing that waits for no answer.
        self._later(functools.partial(self._release, record.id, process))
        if not live.in_many:  # a stop of many's are counted by its `stop.many_ended`
            self._later(
                functools.partial(
                    log.info,
                    "worker.ended",
                    worker=record.id,
                    state=record.state,
                    exit_code=record.exit_code,
                )
            )

    def _let_go(self, live: LiveWorker) -> None:
        """No longer live: unless a resume made it live again already (its ending written,
        the worker may be resumed before this supervision's last step), as a new attempt."""
        if self._live.get(live.record.id) is live:
            del self._live[live.record.id]

    def _release(self, worker_id: str, process: WorkerProcess) -> None:
        """Give back what an ended worker's launch took (its cgroup), unless the worker
        was resumed meanwhile: its new attempt has the same cgroup, and removes it when it
        ends. A crash before this leaves an empty cgroup, which the next start sweeps."""
        if worker_id not in self._live:
            self._released(process)

    def _released(self, process: WorkerProcess) -> None:
        """`Launcher.released`; what that leaves to remove goes in the next batch."""
        self._launcher.released(process)
        self._some_released.set()

    async def _remove_released(self) -> None:
        """Remove ended workers' cgroups, those released since the last batch in a thread
        together (`Launcher.remove_released`). Held while it runs: a reload's exec waits
        for the batch under way, then removes what is left on its way out."""
        while True:
            await self._some_released.wait()
            self._some_released = trio.Event()
            with self._holding():
                await self._launcher.remove_released(self.__contains__)

    async def _drain(
        self, live: LiveWorker, process: WorkerProcess, pipes_closed: trio.Event
    ) -> None:
        """Journal what its pipes still hold, until they close or stay quiet for
        PIPE_DRAIN_SECONDS (a leftover of its tree holding a pipe open). Time a full disk
        keeps a chunk in hand does not count: the chunk is written, then the pipes get
        their time again, so output the worker wrote before it ended is never dropped.

        A relayed worker's quiet is the relay's to tell (it holds the pipes; a relay behind,
        stalled or starved, forwards nothing for a while): asked, it says what the pipes
        still have, and the drain goes on while they have some (at most RELAY_DRAIN_ROUNDS
        windows: a writer that escaped its tree does not hold the ending for ever). A relay
        that does not answer is taken at its silence, and the journal says so."""
        rounds = 0
        while not pipes_closed.is_set():
            with trio.move_on_after(PIPE_DRAIN_SECONDS):
                await pipes_closed.wait()
            if live.chunks_held.count:
                await live.chunks_held.none_held()
                continue
            if pipes_closed.is_set():
                return
            if process.relayed:
                log.info("worker.drain_asks_relay", worker=live.record.id, round=rounds)
            pending = await process.output_pending()
            if pending is None:
                log.warning("worker.relay_silent", worker=live.record.id)
                self._journal_extra(
                    live,
                    "note",
                    b"its output relay did not say what it still held of this worker's "
                    b"output: the last of it may be missing",
                )
                return
            rounds += 1
            if not pending or rounds > RELAY_DRAIN_ROUNDS:
                return

    async def _wait_exited(self, live: LiveWorker, process: WorkerProcess) -> None:
        """Until the process exits; past its timeout, first stop it (and what it
        delegated), counted from its start, not from this supervision's: a reload does
        not reset it. The time it spends paused does not count (its deadline moves by
        it: `WorkerRecord.timeout_left`)."""
        timeout = live.record.timeout
        if timeout is not None:
            with trio.CancelScope() as timing:
                live.timing = timing
                self._time(live)
                try:
                    await process.wait_exited()
                finally:
                    live.timing = None
            if not timing.cancelled_caught:
                return
            log.info("worker.timed_out", worker=live.record.id, timeout=timeout)
            self.ask_stop(self._registry.stop(live.record.id, reason="timeout"))
        await process.wait_exited()

    def _time(self, live: LiveWorker) -> None:
        """Set its timeout's deadline from its record: none while it is paused."""
        if live.timing is not None:
            left = live.record.timeout_left(self._clock())
            live.timing.deadline = (
                trio.current_time() + max(0.0, left) if left is not None else math.inf
            )

    def paused(self, live: LiveWorker) -> None:
        """It is being paused: so its record says from now, and its timeout stops."""
        live.record.pause(self._clock())
        self._time(live)
        self._journal_extra(live, "state", b"paused")

    def held_outside(self, live: LiveWorker, pids: list[int]) -> None:
        """Its pause held processes of its tree outside its cgroup (moved out of it): its
        journal says how many and which (the first `HELD_PIDS_NOTED`)."""
        shown = ", ".join(str(pid) for pid in pids[:HELD_PIDS_NOTED])
        more = f" and {len(pids) - HELD_PIDS_NOTED} more" if len(pids) > HELD_PIDS_NOTED else ""
        said = "process" if len(pids) == 1 else "processes"
        note = f"paused: {len(pids)} {said} outside its cgroup held by SIGSTOP (pid {shown}{more})"
        self._journal_extra(live, "note", note.encode())

    def unpaused(self, live: LiveWorker) -> None:
        """Paused no longer: its timeout runs again, its deadline later by the pause."""
        if live.record.paused_since is None:
            return
        live.record.unpause(self._clock())
        self._time(live)
        self._journal_extra(live, "state", b"unpaused")

    def _thaw_to_end(self, live: LiveWorker) -> None:
        """A paused worker is being ended: its tree must take the TERM (a frozen cgroup
        would hold it until its grace ran out, then be killed)."""
        if live.record.paused_since is not None and live.process is not None:
            self._launcher.thaw_now(live.process)
            self.unpaused(live)

    async def _fail(self, live: LiveWorker, error: Exception) -> None:
        """End a worker whose supervision raised: its tree, its process, then its ending,
        as `failed`. Each step stands alone, so one that fails again skips no other."""
        record, process = live.record, live.process
        why = f"supervision failed ({type(error).__name__}: {error}); the worker was ended"
        log.error("worker.supervision_failed", worker=record.id, error=why, exc_info=error)
        try:
            if process is not None and not process.reaped:  # its tree may run on
                await self._end_tree_after_fault(live, process)
                live.returncode = await _reap_after_fault(process)
                process.abandon()  # not exited yet: the reaper reaps it when it does
                process.close()
                self._released(process)
            elif process is not None:
                process.close()  # the pipes, if the fault came between the reap and their close
        except Exception:
            log.exception("worker.not_reaped", worker=record.id)
        self._let_go(live)
        if live.stop_asked:  # a stop of many's note, left to the ending
            self._journal_stopping(live)
        try:
            self.unpaused(live)  # its pause ends with it
            self._ending(
                record, live.journal, live.returncode, bytes(live.stdout_tail), failure=why
            )
        except Exception:
            log.exception("worker.ending_not_recorded", worker=record.id)
        live.ended.set()
        live.grown.set()

    async def _end_tree_after_fault(self, live: LiveWorker, process: WorkerProcess) -> None:
        """End the whole tree at once, without its grace: with its supervision failed, its
        output may no longer be drained (a TERM it handles could block on a full pipe),
        and a reload's freeze, and so every client, would wait out that grace."""
        try:
            await self._launcher.end_tree(live.record.id, process, 0.0, hurried=False)
        except Exception:
            log.exception("worker.tree_not_ended", worker=live.record.id)

    async def _terminate(self, live: LiveWorker) -> None:
        """End the worker's whole process tree, once, however many ask."""
        if live.terminating:
            if not live.terminated.is_set():  # ended by the stop's task: no switch for it
                await live.terminated.wait()
            return
        live.terminating = True
        process = live.process
        assert process is not None
        self._thaw_to_end(live)
        try:
            killed = await self._launcher.end_tree(
                live.record.id,
                process,
                live.record.grace,
                leader_termed=live.leader_termed,
                leader_exited=live.exited,
            )
            if killed:
                log.info("worker.killed", worker=live.record.id, processes=killed)
        finally:
            live.terminated.set()

    async def _pump(
        self,
        live: LiveWorker,
        source: Callable[[Deliver], Awaitable[None]],
        kind: str,
        pipes: dict[str, Callable[[Deliver], Awaitable[None]]],
        closed: trio.Event,
    ) -> None:
        """Journal one pipe until its end of file; the last pipe to end sets `closed`."""
        assert kind in _PIPES
        try:
            await source(self._deliverer(live, kind))
        except RelayLost as exc:
            self._relay_lost(live, str(exc))
        del pipes[kind]
        if not pipes:
            closed.set()

    def _deliverer(self, live: LiveWorker, kind: EntryKind) -> Callable[[bytes], Awaitable[None]]:
        async def deliver(chunk: bytes) -> None:
            # A full or failing disk holds this chunk (and, through the pipe,
            # the worker) until the write goes through: nothing is dropped.
            delay = DISK_RETRY_FIRST
            while True:
                try:
                    live.journal.append(kind, chunk, self._clock())
                    break
                except OSError as exc:
                    self._disk_trouble(f"journal of {live.record.id}", exc)
                    # The chunk: a reload, and the end of this supervision, wait for its write.
                    with self._holding(), live.chunks_held.holding():
                        await trio.sleep(delay)
                    delay = min(delay * 2, DISK_RETRY_MAX)
            self._disk_ok()
            if kind == "stdout":  # only the end of a long chunk is copied
                live.stdout_tail += memoryview(chunk)[-STDOUT_TAIL_BYTES:]
                del live.stdout_tail[:-STDOUT_TAIL_BYTES]
            grown, live.grown = live.grown, trio.Event()
            grown.set()
            self._faults.raise_at("pump", live.record.name)
            if not live.shedding and live.watch is not None:
                shed = live.journal.shed_range()
                if shed is not None:  # a flood: its page cache is kept bounded meanwhile
                    live.shedding = True
                    live.watch.start_soon(self._shed, live, *shed)

        return deliver

    def _relay_lost(self, live: LiveWorker, why: str) -> None:
        """The output relay holding its pipes is gone: what they would carry is lost, so
        the worker is said so in its journal, its tree stopped, and it ends `interrupted`
        (resumable by its id), as a worker a crash took."""
        if live.record.stop_reason != "relay":
            self._journal_extra(
                live,
                "note",
                f"{why}; its output from here is lost: the worker is ended "
                "interrupted, and can be resumed by its id".encode(),
            )
        self.ask_stop(self._registry.interrupt(live.record.id))

    async def _shed(self, live: LiveWorker, start: int, end: int) -> None:
        """Shed a flooded journal's older pages from the page cache (`Journal.shed`), in
        a thread while its pump goes on; one at a time a worker."""
        try:
            await trio.to_thread.run_sync(live.journal.shed, start, end)
        finally:
            live.shedding = False

    async def _stop(self, live: LiveWorker) -> None:
        """Carry out a stop asked: said in its journal, then its whole tree ended."""
        self._begin_stop(live)
        await self._terminate(live)

    def _begin_stop(self, live: LiveWorker) -> None:
        """What a stop does at once, in the request that asks it (no task switch first):
        say so in its journal, then TERM its own process where the launcher finds the rest
        of its tree without it. The rest are found and TERMed while it exits: a run's
        hundred stops have all their leaders exiting before the first tree is searched.
        In a stop of many, the journal's note waits for the ending (`STOPPING_NOTE_LATE`)."""
        if not live.in_many:
            self._journal_stopping(live)
        self._thaw_to_end(live)
        process = live.process
        if not live.terminating and not live.leader_termed and process is not None:
            live.leader_termed = self._launcher.term_leader(process)

    def write_stdin(self, live: LiveWorker, data: bytes, *, eof: bool) -> int:
        """Write what the worker's stdin pipe takes of `data` now, never waiting for room
        (a worker that does not read its stdin must not hold the daemon); journal it as a
        `stdin` entry; with `eof`, close the pipe once all of `data` went in. Refusals
        raise: Refused (no open stdin, or its reader gone), Busy (the pipe took nothing)."""
        worker_id, process = live.record.id, live.process
        if process is None or process.stdin is None:
            why = (
                "its stdin is closed (an eof was sent, or the worker closed it)"
                if process is not None and process.stdin_closed
                else "it was not spawned with stdin_open (nothing holds its stdin open)"
            )
            raise Refused(f"cannot send to worker {worker_id}: {why}")
        try:
            written = write_nowait(process.stdin, data)
        except BrokenPipeError:
            process.close_stdin()
            self._journal_extra(live, "note", b"stdin closed: the worker closed its end")
            raise Refused(
                f"cannot send to worker {worker_id}: it closed its stdin (or is exiting)"
            ) from None
        if written:
            self._journal_extra(live, "stdin", data[:written])
        if data and not written:
            raise Busy(
                f"worker {worker_id}'s stdin is full (it is not reading it): nothing was "
                "written; send again later",
                retry_after=STDIN_RETRY,
            )
        if eof and written == len(data):
            process.close_stdin()
            self._journal_extra(live, "note", b"stdin closed: eof sent")
        return written

    def _journal_extra(self, live: LiveWorker, kind: EntryKind, data: bytes) -> None:
        """Journal what the daemon did to a worker (not its output), waking its followers;
        on a failing disk, said in info and left out: what was done is done."""
        try:
            live.journal.append(kind, data, self._clock())
        except OSError as exc:
            self._disk_trouble(f"journal of {live.record.id}", exc)
            return
        except JournalCorrupt as exc:  # its file replaced while closed: refused, said here
            log.error("worker.journal_refused", worker=live.record.id, error=str(exc))
            return
        grown, live.grown = live.grown, trio.Event()
        grown.set()

    @staticmethod
    def _stopping_note(live: LiveWorker) -> bytes:
        return f"stopping reason={live.record.stop_reason}".encode()

    def _journal_stopping(self, live: LiveWorker) -> None:
        """Say in its journal, once, that its stop is in flight: a watch shows it."""
        if live.stop_journaled or not live.journal.writable:
            return
        live.stop_journaled = True
        try:
            live.journal.append("state", self._stopping_note(live), self._clock())
        except OSError as exc:  # the stop goes ahead unsaid: it matters more
            self._disk_trouble(f"journal of {live.record.id}", exc)
            return
        except JournalCorrupt as exc:  # its file replaced while closed: the stop goes ahead
            log.error("worker.journal_refused", worker=live.record.id, error=str(exc))
            return
        grown, live.grown = live.grown, trio.Event()
        grown.set()

    def hand_over(self) -> None:
        """A reload's checkpoint is taken (`handed_over` until the reload fails): write
        every stop of many's note still left to its ending, since the next image takes a
        stop asked for said, and end no worker from here."""
        self.handed_over = True
        for live in self._live.values():
            if live.stop_asked:
                self._journal_stopping(live)

    async def _note_stopping_late(self, asked: list[LiveWorker]) -> None:
        """A stop of many's note, for the trees still not gone STOPPING_NOTE_LATE after
        it was asked: a watch of one that takes its grace shows its stop in flight."""
        await trio.sleep(STOPPING_NOTE_LATE)
        for live in asked:
            if not live.ended.is_set():
                self._journal_stopping(live)

    def ask_stop(self, ids: list[str]) -> None:
        asked = [
            live
            for worker_id in dict.fromkeys(ids)  # each once, in order
            if (live := self._live.get(worker_id)) is not None and not live.stop_asked
        ]
        if len(asked) >= UNSEEN_STOP_FROM and self._background is not None:
            for live in asked:
                live.in_many = True
            self._background.start_soon(self._note_stopping_late, asked)
            # From before the first TERM until they have all ended (or for
            # UNSEEN_STOP_MOST...), no collection, and what stood before is out of the
            # collector's sight after: else each full collection the stop's own objects
            # bring (its tasks, made right here, are the first) walks every worker's
            # (`_collector`), a cost each ending paid by the number of workers.
            UNSEEN.hold(pause=True)
            self._background.start_soon(self._let_go_once_ended, asked, _collections())
        for live in asked:
            live.stop_asked = True
            if live.watch is not None:  # else its supervision, when it starts, stops it
                self._begin_stop(live)
                live.watch.start_soon(self._stop, live)
        if self._queued:
            self.queued_stopped(ids)

    @staticmethod
    async def _let_go_once_ended(asked: list[LiveWorker], collections: int) -> None:
        """Give the heap back to the collector once every worker `asked` has ended; say
        how many collections came since the stop was asked (`collections` then): none,
        unless something else turned collection on. The figure the tests read, since a
        full one walks every worker's objects."""
        ended = False
        try:
            with trio.move_on_after(UNSEEN_STOP_MOST + UNSEEN_STOP_MOST_A_WORKER * len(asked)):
                for live in asked:
                    if not live.ended.is_set():  # else no checkpoint each: done in one step
                        await live.ended.wait()
                ended = True
        finally:
            # Counted before collection may come back: the log line's own making could
            # bring one, which would be no stop's.
            made = _collections() - collections
            UNSEEN.let_go(pause=True)
        states: dict[str, int] = {}
        for live in asked:
            if live.ended.is_set():
                states[live.record.state] = states.get(live.record.state, 0) + 1
        # The one line for them all: their endings log none of their own (`in_many`).
        log.info(
            "stop.many_ended" if ended else "stop.many_still_ending",
            workers=len(asked),
            states=states,
            collections=made,
        )

    async def wait_ended(self, ids: list[str]) -> None:
        for worker_id in ids:
            live = self.get(worker_id)
            # Not a checkpoint for each ended already: a stop_run's wait for its 10,000
            # wakes once for each worker still live when it comes back, not for all.
            if live is not None and not live.ended.is_set():
                await live.ended.wait()


def _collections() -> int:
    """How many garbage collections, of any generation, this image has made."""
    return sum(generation["collections"] for generation in gc.get_stats())


def _first(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first exception a group holds, at any depth: what a failure is told by."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    assert isinstance(found, Exception)
    return found


async def _reap_after_fault(process: WorkerProcess) -> int | None:
    """Reap a process whose tree was just ended; None if it has not exited (yet)."""
    with trio.move_on_after(PIPE_DRAIN_SECONDS * 5):
        await process.wait_exited()
        return process.reap()
    log.error("worker.not_exited", pid=process.pid, then="reaped when it exits")
    return None
