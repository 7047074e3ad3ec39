"""The thread a worker with limits is forked from.

A limited worker is born in its v1 limit nodes (`_controllers`): the thread that forks it
steps into them first (v1 moves a thread on its own). That thread is this one, never the
event loop's, which is the daemon's main thread, its thread group leader:

- a memory cgroup's OOM killer weighs processes by their leader only (the kernel's
  `mem_cgroup_scan_tasks` walks `CSS_TASK_ITER_PROCS`), so a daemon whose leader never
  stands in a worker's node is no candidate in it, whatever its size: a delegate spawned
  into a subtree at its memory limit can cost that subtree a process, never the daemon;
- a process's memory is charged to its leader's memory cgroup (`mm->owner`), so what the
  daemon allocates meanwhile is never charged to the worker.

The caller waits for the fork as a fork on the event loop does (a spawn blocks the loop
until the child has exec'd, `_spawn`): a job hands its result back, then its `after`
runs here while the caller goes on, so the thread's way back out of the nodes is no part
of the spawn's answer. Jobs run one at a time, in the order asked; `settle` returns once
every one asked before has finished, its `after` included.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._logging import get_logger

log = get_logger()

T = TypeVar("T")
#: The forker's thread's name (its /proc/PID/task/TID/comm).
THREAD_NAME = "sa-forker"
_PR_SET_NAME = 15


@dataclass
class _Job(Generic[T]):
    work: Callable[[], tuple[T, Callable[[], None] | None]]
    done: threading.Lock = field(default_factory=threading.Lock)
    result: T | None = None
    error: BaseException | None = None

    def run(self) -> None:
        after = None
        try:
            self.result, after = self.work()
        except BaseException as exc:  # handed to the caller, raised there
            self.error = exc
        finally:
            self.done.release()
        if after is not None:
            try:
                after()
            except Exception:
                log.exception("forker.after_failed")


class Forker:
    """One thread, started at the first job, running jobs for callers that wait."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job[object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def call(self, work: Callable[[], tuple[T, Callable[[], None] | None]]) -> T:
        """Run `work` in the thread and wait for it: its result (or its exception, raised
        here). `work` returns its result and what to do once the caller has it (None:
        nothing)."""
        job: _Job[T] = _Job(work)
        job.done.acquire()
        self._start()
        self._jobs.put(job)  # type: ignore[arg-type]
        job.done.acquire()  # released by the thread once the result is in
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def settle(self) -> None:
        """Wait until every job asked before has finished, its `after` included."""
        if self._thread is not None:
            self.call(lambda: (None, None))

    @property
    def thread_id(self) -> int | None:
        """The thread's id (`threading.get_native_id` of it); None before the first job."""
        return self._thread.native_id if self._thread is not None else None

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._starting:
            if self._thread is None:
                thread = threading.Thread(target=self._serve, name="subagentd-forker", daemon=True)
                thread.start()
                self._thread = thread

    def _serve(self) -> None:
        _name_thread(THREAD_NAME)
        while True:
            self._jobs.get().run()


def _name_thread(name: str) -> None:
    """Give the calling thread its name in /proc/PID/task/TID/comm (a bench finds it so)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)


#: The daemon's one forker.
FORKER = Forker()
