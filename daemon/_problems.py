"""What is wrong right now, for `info` to report: a failing disk, no descriptors left,
what crash recovery could not do. Every part of the daemon reports here; none keeps
its own copy."""

from __future__ import annotations

from ._logging import get_logger

log = get_logger()


class Problems:
    def __init__(self) -> None:
        #: The last failed write, while writes fail.
        self.disk: str | None = None
        #: What ran out of file descriptors, until a descriptor is had again.
        self.descriptors: str | None = None
        #: What crash recovery could not do for some worker.
        self.recovery: list[str] = []

    def disk_failed(self, what: str, exc: OSError) -> None:
        """A write failed (disk full, I/O error): reported, logged once per kind."""
        problem = f"cannot write the {what}: {exc.strerror or exc}"
        if problem != self.disk:
            log.error("disk.write_failed", problem=problem, errno=exc.errno)
        self.disk = problem

    def disk_ok(self) -> None:
        """A write went through: the disk trouble, if any, has passed."""
        self.disk = None

    def current(self) -> list[str]:
        return [p for p in (self.disk, self.descriptors) if p] + self.recovery
