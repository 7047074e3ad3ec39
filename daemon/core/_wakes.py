"""Wakes: one completion event per worker ending, kept until its parent acknowledges it.

`WakeQueue` is the sans-I/O core: it posts at most one wake per worker attempt
and holds each until acknowledged. The store makes it survive a crash: each post
and each ack is a transaction there, and `store._wake_log.open_wakes` loads the
queue from it at start.
"""

from __future__ import annotations

from typing import TypeVar

from subagentd.protocol import Wake, WorkerState

_K = TypeVar("_K")

#: A parent that wakes are for: ("run", run id) or ("worker", worker id).
WakeKey = tuple[str, str]


def key_of(wake: Wake) -> WakeKey:
    return ("worker", wake.parent) if wake.parent is not None else ("run", wake.run)


class WakeQueue:
    """Pending wakes by seq, and indexed by the parent they are for and by run: a
    subscriber's page, and the wakes a run takes along, cost that parent's or that
    run's wakes, not every wake pending (10,000 nobody acknowledged, say)."""

    def __init__(self) -> None:
        self.pending: dict[int, Wake] = {}
        self.last_seq = 0
        self._posted: set[tuple[str, int]] = set()  # (worker id, attempt)
        self._by_key: dict[WakeKey, dict[int, Wake]] = {}
        self._by_run: dict[str, dict[int, Wake]] = {}

    def post(
        self,
        *,
        worker: str,
        run: str,
        parent: str | None,
        state: WorkerState,
        exit_code: int | None,
        preview: str,
        attempt: int,
        reason: str = "",
    ) -> Wake | None:
        """The wake for this ending, or None if this attempt already posted one."""
        if (worker, attempt) in self._posted:
            return None
        self.last_seq += 1
        wake = Wake(
            seq=self.last_seq,
            id=worker,
            run=run,
            parent=parent,
            state=state,
            exit_code=exit_code,
            preview=preview,
            attempt=attempt,
            reason=reason,
        )
        self.restore(wake)
        return wake

    def restore(self, wake: Wake) -> None:
        """Take back a wake read from the store."""
        self._posted.add((wake.id, wake.attempt))
        if wake.seq in self.pending:  # the same seq again: the one before goes
            self.ack([wake.seq])
        self.pending[wake.seq] = wake
        self._by_key.setdefault(key_of(wake), {})[wake.seq] = wake
        self._by_run.setdefault(wake.run, {})[wake.seq] = wake
        self.last_seq = max(self.last_seq, wake.seq)

    def was_posted(self, worker: str, attempt: int) -> bool:
        return (worker, attempt) in self._posted

    def pending_for(self, key: WakeKey, after: int = 0) -> list[Wake]:
        """Unacknowledged wakes for `key` with seq > after, oldest first."""
        return sorted(
            (w for w in self._by_key.get(key, {}).values() if w.seq > after),
            key=lambda w: w.seq,
        )

    def ack(self, seqs: list[int]) -> None:
        for seq in seqs:
            wake = self.pending.pop(seq, None)
            if wake is not None:
                _unindex(self._by_key, key_of(wake), seq)
                _unindex(self._by_run, wake.run, seq)

    def of_run(self, run: str) -> list[int]:
        """The seqs of the unacknowledged wakes of `run`'s workers, whoever they are for."""
        return list(self._by_run.get(run, ()))


def _unindex(index: dict[_K, dict[int, Wake]], key: _K, seq: int) -> None:
    wakes = index.get(key)
    if wakes is not None:
        wakes.pop(seq, None)
        if not wakes:
            del index[key]
