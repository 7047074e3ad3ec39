"""The inventory of descriptors a reload's exec carries: each part that owns one
(the listener, the state dir's lock, each live worker's pipes, each requester's
connection) hands it in here, and only here is it made inheritable, checked
against the checkpoint and, if the exec fails, given back as it was."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ._checkpoint import Checkpoint, encode_checkpoint, sealed_checkpoint, write_checkpoint


class Carried:
    """The descriptors one exec carries, and how to undo carrying each.

    Leaving the block gives back everything it took, in reverse: an exec that
    works never returns, so leaving it means the exec failed (or never came).
    Nothing is closed: each descriptor still belongs to the part that handed it in.
    """

    def __init__(self) -> None:
        self._undo = contextlib.ExitStack()
        self._owners: dict[int, str] = {}  # descriptor: what it is, for the errors
        #: Each descriptor carried and whether it was inheritable: given back last, at
        #: once (a thousand workers' pipes, each its own callback, cost a reload ms).
        self._was: list[tuple[int, bool]] = []
        self._undo.callback(self._give_back)

    def __enter__(self) -> Carried:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return bool(self._undo.__exit__(kind, exc, tb))

    def carry(self, fd: int, what: str) -> int:
        """Let `fd` (`what`, in the owner's words) survive the exec; its number."""
        if fd in self._owners:
            raise ValueError(f"descriptor {fd} ({what}) is carried already, as {self._owners[fd]}")
        self._was.append((fd, os.get_inheritable(fd)))
        os.set_inheritable(fd, True)
        self._owners[fd] = what
        return fd

    def _give_back(self) -> None:
        for fd, was in reversed(self._was):
            os.set_inheritable(fd, was)

    def carry_if(self, fd: int | None, what: str) -> int | None:
        """`carry` for a descriptor its owner may not have (a pipe already at its end)."""
        return None if fd is None else self.carry(fd, what)

    def on_failure(self, undo: Callable[..., Any], *args: Any) -> None:
        """Undo something else that the exec needed, if it fails (before what came before)."""
        self._undo.callback(undo, *args)

    @property
    def descriptors(self) -> list[int]:
        return sorted(self._owners)

    def write(self, path: Path, checkpoint: Checkpoint) -> None:
        """Write `checkpoint` to `path` (removed again if the exec fails), once it lists
        exactly the descriptors carried, each once (for an image before version 4)."""
        self._check_listed(checkpoint)
        self.on_failure(path.unlink, True)  # missing_ok: the write may not have got there
        write_checkpoint(path, checkpoint)

    def hand_over(self, checkpoint: Checkpoint, mangle: Callable[[bytes], bytes] = bytes) -> int:
        """`checkpoint` in a sealed memfd, carried (closed if the exec fails), once it lists
        exactly the descriptors carried, each once; its number, for the command line.
        `mangle`: what a test's fault makes of the bytes (garbage, cut short)."""
        self._check_listed(checkpoint)
        fd = sealed_checkpoint(mangle(encode_checkpoint(checkpoint)))
        # Closed if the exec fails, so not given back as the others are (after this).
        self.on_failure(os.close, fd)
        os.set_inheritable(fd, True)
        self._owners[fd] = "the checkpoint"
        return fd

    def _check_listed(self, checkpoint: Checkpoint) -> None:
        listed = Counter(checkpoint.descriptors())
        twice = sorted(fd for fd, n in listed.items() if n > 1)
        unlisted = sorted(set(self._owners) - set(listed))
        uncarried = sorted(set(listed) - set(self._owners))
        if twice or unlisted or uncarried:
            raise RuntimeError(
                f"the checkpoint disagrees with the descriptors carried: listed twice {twice}, "
                f"carried but not listed {[(fd, self._owners[fd]) for fd in unlisted]}, "
                f"listed but not carried {uncarried}"
            )


def take_back(checkpoint: Checkpoint) -> list[int]:
    """In the new image: every descriptor the checkpoint lists is close-on-exec again,
    so none leaks into a worker or the next image unlisted; those not open, listed."""
    missing = []
    for fd in checkpoint.descriptors():
        try:
            os.set_inheritable(fd, False)
        except OSError:
            missing.append(fd)
    return missing
