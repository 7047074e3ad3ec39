"""The highest wake seq the store may have given, kept beside it, outside its WAL.

A commit the WAL lost (cut short, a frame corrupted: nothing may say so) can have held
wakes already handed out; the store's own floor would then give their seqs again, and a
subscriber that took one drops the new wake as the one it has. So before a commit holds
a seq above the mark, the mark is raised a block ahead (`SEQ_MARK_AHEAD`) in a file of
its own (`SEQ_MARK_NAME`, renamed into place), and an open starts seqs above it,
whatever the WAL kept: at most a block of seqs is skipped a start, none given twice.
Pure file work in the state dir; no trio, no sqlite.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .._logging import get_logger
from ._files import NotRegularFile, read_regular, replace_file

log = get_logger()

#: The file's name, beside the store's.
SEQ_MARK_NAME = "state.db.seq-mark"
#: How far ahead of the seq a commit needs the mark is raised: one write in this many.
SEQ_MARK_AHEAD = 1024
#: A mark is a decimal number and a newline; more than this is not one.
_MARK_READ_LIMIT = 64


class SeqMark:
    """The mark of one store: `read` as it opens, `cover` before each commit holding wakes."""

    def __init__(self, path: Path, marked: int, problems: list[str]) -> None:
        self.path = path
        #: No seq above this was given (as far as the file says).
        self.marked = marked
        #: The store's problems, where a mark that cannot be written is said.
        self._problems = problems
        #: What was said while writing it fails (gone once it is written again).
        self._failing: str | None = None

    @classmethod
    def read(cls, path: Path, floor: int, limit: int, problems: list[str]) -> SeqMark:
        """The mark at `path`, believed up to `floor + limit` (the file lies where any
        process of the user can write: a mark that far above what the store says cannot
        be the daemon's). Anything else there is reported and taken as no mark; a
        non-regular file is set aside, so the next mark can be written."""
        try:
            text = read_regular(path, _MARK_READ_LIMIT)
        except FileNotFoundError:
            return cls(path, 0, problems)
        except NotRegularFile:
            aside = path.with_name(f"{path.name}.not-ours-{int(time.time())}")
            try:
                os.replace(path, aside)
            except OSError as exc:
                said = f"and could not be set aside ({exc.strerror or exc})"
            else:
                said = f"set aside, unread, as {aside}"
            _problem(problems, f"the wake seq mark {path} was not a regular file: {said}")
            return cls(path, 0, problems)
        except OSError as exc:
            _problem(problems, f"the wake seq mark {path} could not be read ({exc}): ignored")
            return cls(path, 0, problems)
        words = text.split()
        marked = int(words[0]) if len(words) == 1 and words[0].isdigit() else None
        if marked is None:
            _problem(problems, f"the wake seq mark {path} does not read ({text[:32]!r}): ignored")
            return cls(path, 0, problems)
        if marked > floor + limit:
            _problem(
                problems,
                f"the wake seq mark {path} says {marked}, far above the store's {floor}: "
                f"not the daemon's, taken as {floor + limit}",
            )
            marked = floor + limit
        return cls(path, marked, problems)

    def cover(self, seq: int) -> None:
        """Make the mark at least `seq` before a commit holding it goes in: raised to a
        block ahead. A failure (a full disk, a directory planted at its name) is said in
        the problems until a later write goes in, and never fails the commit: the
        store's own floor still holds for every seq its WAL keeps."""
        if seq <= self.marked:
            return
        marked = seq + SEQ_MARK_AHEAD
        try:
            replace_file(self.path, f"{marked}\n".encode(), what="writing the wake seq mark")
        except OSError as exc:
            if self._failing is None:
                self._failing = (
                    f"the wake seq mark {self.path} cannot be written ({exc.strerror or exc}): "
                    "until it is, a WAL cut short could have a seq given twice"
                )
                _problem(self._problems, self._failing)
            return
        if self._failing is not None:
            log.info("store.seq_mark_written", path=str(self.path))
            if self._failing in self._problems:
                self._problems.remove(self._failing)
            self._failing = None
        self.marked = marked


def _problem(problems: list[str], problem: str) -> None:
    log.error("store.problem", problem=problem)
    problems.append(problem)
