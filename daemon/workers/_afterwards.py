"""What a request's answer need not wait for: a log line, an ended worker's empty
cgroup's removal, done once the answer has been sent. A crash first loses the line, or
leaves the empty cgroup to the next start's sweep; nothing else."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import trio

from .._logging import get_logger
from ..processes._launcher import Launcher

log = get_logger()


class Afterwards:
    """The steps waiting for the answer being made to go out, and the task that does them."""

    def __init__(self, launcher: Launcher) -> None:
        self._launcher = launcher
        self._steps: list[Callable[[], None]] = []
        self._wanted = trio.Event()

    def later(self, step: Callable[[], None]) -> None:
        """Do `step` (a log line, an empty cgroup's removal) once the answer being made
        has been sent: a stop's TERM and its answer wait for no log line. One written to
        stderr costs 0.05 to 0.17 ms, a third of a stop's path in the daemon."""
        # In the context it was asked in: the line keeps its bound `conn`.
        self._steps.append(functools.partial(contextvars.copy_context().run, step))
        self._wanted.set()

    async def do_after_answers(self) -> None:
        """The task: each batch of steps, once the handler that asked has answered."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            # Woken with the handler whose answer this waits for: let it send first.
            await trio.lowlevel.checkpoint()
            self._do_steps()

    def now(self) -> None:
        """Do every step still waiting for an answer to go out: the image is about to
        end (an exec, a stop), and takes no step with it, nor a cgroup left to remove."""
        self._do_steps()
        self._launcher.remove_released_now()  # ended workers' cgroups, else in a thread

    def _do_steps(self) -> None:
        """The steps waiting; an ended worker's cgroup they release is removed in a
        thread (`Supervisor._remove_released`), never here on the event loop: an rmdir
        costs 40-90 us, and one a worker left full of nested cgroups ~0.1 ms each."""
        steps, self._steps = self._steps, []
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("daemon.after_answer_failed")
