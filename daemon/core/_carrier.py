"""What a part that owns a descriptor asks of a reload's inventory (lifecycle's `Carried`):
to carry one across the exec. The port stands here, below every part that carries
something (the store's lock, a journal, the state dir's lock, a worker's pipes, the
listening socket), so that none of them imports the reload that stands above them.
"""

from __future__ import annotations

from typing import Protocol


class Carrier(Protocol):
    def carry(self, fd: int, what: str) -> int:
        """Carry `fd` (`what` it is, for the log and a failed check) across the exec: it
        is left open in the new image, where the checkpoint names it; returns it."""
        ...

    def carry_if(self, fd: int | None, what: str) -> int | None:
        """As `carry`, for a descriptor the part may not have (None: nothing carried)."""
        ...
