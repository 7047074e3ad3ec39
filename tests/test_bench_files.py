"""The files bench (bench/files.py) counts right, and still runs on a real daemon."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def files_bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the bench's own imports (_harness) are beside it
    try:
        return importlib.import_module("files")
    finally:
        sys.path.remove(str(BENCH))


def test_trace_lines_count_what_was_made_in_the_state_dir_only(files_bench: ModuleType) -> None:
    lines = [
        '10 mkdir("/s/archives/.spare-0123456789ab", 0700) = 0',
        '10 mkdir("/sx/archives", 0700) = 0',
        '11 openat(3</s/archives/w-abc>, ".stdout.tail.0123456789abcdef.tmp", '
        "O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW, 0600 <unfinished ...>",
        '12 openat(AT_FDCWD</home>, "/usr/lib/x.so", O_RDONLY|O_CLOEXEC) = 3</usr/lib/x.so>',
        "11 <... openat resumed>) = 7</s/archives/w-abc/.stdout.tail.0123456789abcdef.tmp>",
        '11 renameat(3</s/archives/w-abc>, ".stdout.tail.0123456789abcdef.tmp", '
        '3</s/archives/w-abc>, "stdout.tail") = 0',
        '13 openat(AT_FDCWD</tmp>, "/tmp/elsewhere", O_WRONLY|O_CREAT|O_EXCL, 0600) = 4</tmp/x>',
        '13 unlinkat(5</s/archives>, "w-old", AT_REMOVEDIR) = 0',
        '13 unlinkat(6</s/archives/w-old>, "journal", 0) = 0',
        '14 openat(AT_FDCWD</s>, "record.json", O_WRONLY|O_NOFOLLOW) = 3</s/record.json>',
    ]
    counts = files_bench.count(lines, Path("/s"))
    assert (counts.files, counts.dirs, counts.renames, counts.unlinks, counts.rmdirs) == (
        1, 1, 1, 1, 1,
    )  # fmt: skip
    assert "rename archives/<worker>/.stdout.tail.*.tmp -> archives/<worker>/stdout.tail" in (
        counts.what
    )


def test_a_lone_spawn_is_counted_on_a_real_daemon(files_bench: ModuleType) -> None:
    with files_bench.traced_daemon(timeout=30) as counting:
        counts = files_bench.lone_true(counting)
    # Whatever the store: a spawn gives its worker an archive directory (made ahead by
    # the spare maker, or not) holding at least its snapshot and its journal.
    assert counts.dirs >= 1, counts.what
    assert counts.files >= 2, counts.what
    assert any("archives/<worker>" in line for line in counts.what), counts.what
