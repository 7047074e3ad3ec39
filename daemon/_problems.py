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
        #: Whether that write was the store's (what `store_written` clears).
        self._disk_is_store = False
        #: What ran out of file descriptors, until a descriptor is had again.
        self.descriptors: str | None = None
        #: What crash recovery could not do for some worker.
        self.recovery: list[str] = []
        #: The last output relay that died holding workers' streams (kept: what it cost).
        self.relay: str | None = None

    def disk_failed(self, what: str, exc: OSError) -> None:
        """A write failed (disk full, I/O error): reported, logged once per kind. `what`
        names what was written: the store's is "store" or "store (what for)"."""
        problem = f"cannot write the {what}: {exc.strerror or exc}"
        if problem != self.disk:
            log.error("disk.write_failed", problem=problem, errno=exc.errno)
        self.disk = problem
        self._disk_is_store = what == "store" or what.startswith("store (")

    def disk_ok(self) -> None:
        """A write went through: the disk trouble, if any, has passed."""
        self.disk = None

    def store_written(self) -> None:
        """The store took a write and holds every change a failing disk kept out of it:
        its trouble has passed (a worker's file still failing is not the store's)."""
        if self._disk_is_store:
            self.disk = None

    def current(self) -> list[str]:
        return [p for p in (self.disk, self.descriptors, self.relay) if p] + self.recovery
