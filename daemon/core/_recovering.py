"""A restart's recovery as the server sees it while it runs: how far it has come, and the
`recovering` answer owed to a request that needs what it is taking back.

The daemon serves from the moment it listens; until recovery has rebuilt the registry, only
what needs none of it is answered (protocol/README.md, Recovery). Pure: the caller passes
`now` (trio's clock) and moves the progress on as recovery goes.
"""

from __future__ import annotations

import math

from subagentd.protocol import ClientMessage, Recovery, op
from subagentd.protocol.errors import Recovering

#: The bounds of a `recovering` answer's `retry_after`: often enough that a client is served
#: soon after recovery ends, seldom enough that a thousand waiting clients cost nothing.
RETRY_AFTER_MIN = 0.05
RETRY_AFTER_MAX = 1.0
#: Before recovery has taken any worker back there is no rate to go by.
RETRY_AFTER_FIRST = 0.2


class RecoveryProgress:
    """What recovery does now, and how many of the workers it found it has taken back."""

    def __init__(self, now: float) -> None:
        self.started_at = now
        self.phase = "reading the store"
        self.done = 0
        self.total = 0
        self._counted_from = now
        self._counted = 0
        #: Requests answered `recovering` so far (said in `info`).
        self.answered = 0

    def begin(self, phase: str, total: int, now: float) -> None:
        """A new phase, over `total` workers (the rate of the last is forgotten)."""
        self.phase, self.total, self.done = phase, total, 0
        self._counted_from, self._counted = now, 0

    def took(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        self._counted += count

    def view(self, now: float) -> Recovery:
        return Recovery(
            phase=self.phase,
            done=self.done,
            total=self.total,
            seconds=round(max(0.0, now - self.started_at), 3),
            answered=self.answered,
        )

    def retry_after(self, now: float) -> float:
        """When to ask again: the time this phase's rate says is left, within bounds."""
        elapsed = now - self._counted_from
        if self._counted <= 0 or elapsed <= 0:
            return RETRY_AFTER_FIRST
        left = (self.total - self.done) * elapsed / self._counted
        if not math.isfinite(left):
            return RETRY_AFTER_MAX
        return round(min(max(left, RETRY_AFTER_MIN), RETRY_AFTER_MAX), 3)

    def refusal(self, request: ClientMessage | None, now: float) -> Recovering:
        """The answer to `request` (None: a hello's worker token) while recovery runs."""
        self.answered += 1
        what = f"{op(request)} needs" if request is not None else "a worker's token needs"
        return Recovering(
            f"the daemon is recovering its workers after a restart ({self.phase}: "
            f"{self.done} of {self.total}, {max(0.0, now - self.started_at):.1f} s so far) "
            f"and {what} what it is taking back; nothing was done: send it again after "
            "retry_after seconds",
            retry_after=self.retry_after(now),
        )
