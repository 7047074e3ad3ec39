"""What a connection carries from one serving of it to the next: across a reload's exec
into the new image, or back to the old image when the reload fails. The server makes
them when it pauses and takes them when it resumes or adopts; a reload only carries
them (their descriptors in its inventory, the rest in its checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from subagentd.protocol import Reply


@dataclass(frozen=True)
class Handover:
    """A connection handed from one serving of it to the next: across a reload's exec, or
    back to the old image when the reload fails."""

    fd: int
    owed: list[Reply] = field(default_factory=list)  # answers it gets before anything
    unread: bytes = b""  # read from it but not yet taken as requests: read before the socket
    delivered: frozenset[int] = frozenset()  # wakes delivered on it, not yet acknowledged
    #: Whom it acts as, as its hello settled it (None: the user): never decided again, so
    #: never widened by the handing over.
    caller: str | None = None


def owed_by_connection(
    requesters: list[tuple[object, int]], kept: dict[object, Handover]
) -> list[tuple[Handover, list[int]]]:
    """Each kept connection, once, with the ids of every reload it asked."""
    return [(held, [rid for c, rid in requesters if c is conn]) for conn, held in kept.items()]
