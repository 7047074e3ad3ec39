"""Group commit: the changes handed in during one scheduling batch go into the store in
one transaction. A run's hundred stops end their workers within a few batches; each
ending's own transaction (its record and its wake) cost 0.15 ms of the daemon's one
thread (bench/README.md).

A change is handed in as the step that makes it, run when the batch is written, with
no await between it and the commit: what it changes in memory (an ending's state, its
wake) is seen by no one before it is in the store, exactly as when each change was
made and committed at once. Its caller waits for the commit; a fault in one change (an
injected one) rolls back the batch, and each change is then tried again alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ._store import Change, Store


@dataclass(eq=False)
class _Handed:
    make: Callable[[], Change]
    before_commit: Callable[[], None] | None
    written: trio.Event = field(default_factory=trio.Event)
    error: Exception | None = None


class GroupCommit:
    """Makes and commits changes together with the others handed in in the same batch."""

    def __init__(self, store: Store, what: str) -> None:
        self._store = store
        self._what = what
        self._gathering: list[_Handed] = []

    async def commit(
        self, make: Callable[[], Change], before_commit: Callable[[], None] | None = None
    ) -> None:
        """Return once the change `make` makes is in the store; raise what `make`, or
        `Store.commit` for that change alone, raised (StoreWriteFailed: the change is kept
        for the next commit, as with `redo`). The first change of a batch waits one
        scheduling step for the rest, then makes and writes them all; no cancellation
        reaches a caller meanwhile, so none leaves its change unmade or unwritten."""
        handed = _Handed(make, before_commit)
        self._gathering.append(handed)
        if len(self._gathering) == 1:
            await trio.lowlevel.cancel_shielded_checkpoint()
            batch, self._gathering = self._gathering, []
            self._write(batch)
        else:
            with trio.CancelScope(shield=True):
                await handed.written.wait()
        if handed.error is not None:
            raise handed.error

    def _write(self, batch: list[_Handed]) -> None:
        try:
            made: list[tuple[_Handed, Change]] = []
            for handed in batch:
                try:
                    made.append((handed, handed.make()))
                except Exception as exc:
                    handed.error = exc
            try:
                self._store.commit_all(
                    [(change, handed.before_commit) for handed, change in made],
                    self._what,
                    redo=True,
                )
            except OSError as exc:  # the disk's: every change is kept, in order (redo)
                for handed, _ in made:
                    handed.error = exc
            except Exception as exc:
                if len(made) == 1:
                    made[0][0].error = exc
                else:  # one change's fault rolled back all: each again, alone
                    self._write_alone(made)
        finally:
            for handed in batch:
                handed.written.set()

    def _write_alone(self, made: list[tuple[_Handed, Change]]) -> None:
        for handed, change in made:
            try:
                self._store.commit(
                    change, self._what, before_commit=handed.before_commit, redo=True
                )
            except Exception as exc:
                handed.error = exc
