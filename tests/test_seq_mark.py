"""The wake seq mark beside the store (`store/_seq_mark.py`): a WAL that loses the commits
which gave seqs gives none of them again, and whatever is planted at the mark's name
costs a problem said, never a seq given twice nor a commit."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from subagentd import protocol as p
from subagentd.daemon.store._seq_mark import SEQ_MARK_AHEAD, SEQ_MARK_NAME
from subagentd.daemon.store._store import SEQ_MARK_BELIEVED, STORE_NAME, Store

_WAKES_LEFT_IN_THE_WAL = """
import os, pathlib
from subagentd import protocol as p
from subagentd.daemon.store._store import Store
path = pathlib.Path({path!r})
Store.open(path).close()  # the schema, checkpointed into the database
store = Store.open(path)
for seq in range(1, {count} + 1):
    store.post_wake(p.Wake(seq=seq, id=f"w-{{seq}}", run="r-1", state="finished"))
os._exit(0)  # as a kill -9 leaves it: every commit in the WAL
"""


def _wake(seq: int) -> p.Wake:
    return p.Wake(seq=seq, id=f"w-{seq}", run="r-1", state="finished")


def _commit_frames_end(wal: bytes) -> list[int]:
    """Where each commit of the WAL's current generation ends (its commit frame's end)."""
    page_size, salts = struct.unpack(">I", wal[8:12])[0], wal[16:24]
    frame = 24 + page_size
    return [
        at + frame
        for at in range(32, len(wal) - frame + 1, frame)
        if wal[at + 8 : at + 16] == salts and struct.unpack(">I", wal[at + 4 : at + 8])[0]
    ]


def test_wakes_whose_commits_a_wal_lost_at_a_frames_end_give_no_seq_again(tmp_path: Path) -> None:
    """A WAL cut exactly where a commit ends leaves nothing to tell what followed: the
    last two posts are gone from the store, yet their seqs were given (and handed out),
    so the next seq the store gives lies above them."""
    path = tmp_path / STORE_NAME
    script = _WAKES_LEFT_IN_THE_WAL.format(path=str(path), count=5)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    wal = Path(f"{path}-wal")
    ends = _commit_frames_end(wal.read_bytes())
    assert len(ends) >= 5, ends
    os.truncate(wal, ends[-3])  # the posts of seqs 4 and 5 cut away, at a frame's end
    store = Store.open(path)
    try:
        wakes, floor = store.wakes()
        assert [w.seq for w in wakes] == [1, 2, 3]  # sqlite lost them, and said nothing
        assert floor >= 5, floor  # but no seq up to 5 is given again
        assert not store.problems
    finally:
        store.close()


@pytest.mark.parametrize(
    "planted",
    [b"", b"not a number\n", b"-5\n", b"nan\n", b"inf\n", b"1e9\n", b"12 34\n", b"\xff\xfe"],
    ids=["empty", "text", "negative", "nan", "inf", "float", "two", "bytes"],
)
def test_a_mark_that_does_not_read_is_said_and_seqs_go_on_from_the_stores(
    tmp_path: Path, planted: bytes
) -> None:
    path = tmp_path / STORE_NAME
    store = Store.open(path)
    store.post_wake(_wake(1))
    store.close()
    (tmp_path / SEQ_MARK_NAME).write_bytes(planted)
    store = Store.open(path)
    try:
        assert store.wakes()[1] == 1  # the store's own floor
        assert any("seq mark" in p and "does not read" in p for p in store.problems), store.problems
        store.post_wake(_wake(2))  # and the mark is written again, whole
        assert (tmp_path / SEQ_MARK_NAME).read_bytes() == f"{2 + SEQ_MARK_AHEAD}\n".encode()
    finally:
        store.close()


def test_a_mark_far_above_the_stores_floor_is_believed_only_so_far(tmp_path: Path) -> None:
    """A planted 2^63 - 1 (or 60 digits) would end numbering at once: taken as the
    store's floor plus what a damaged WAL could have lost, and said."""
    path = tmp_path / STORE_NAME
    Store.open(path).close()
    for huge in (2**63 - 1, 10**60):
        (tmp_path / SEQ_MARK_NAME).write_bytes(f"{huge}\n".encode())
        store = Store.open(path)
        try:
            assert store.wakes()[1] == SEQ_MARK_BELIEVED
            assert any("far above" in p for p in store.problems), store.problems
        finally:
            store.close()
        (tmp_path / SEQ_MARK_NAME).unlink()


@pytest.mark.parametrize("planted", ["directory", "fifo", "symlink"])
def test_a_mark_that_is_no_regular_file_is_set_aside_unfollowed(
    tmp_path: Path, planted: str
) -> None:
    path = tmp_path / STORE_NAME
    store = Store.open(path)
    store.post_wake(_wake(1))
    store.close()
    mark = tmp_path / SEQ_MARK_NAME
    mark.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"99999\n")
    if planted == "directory":
        mark.mkdir()
    elif planted == "fifo":
        os.mkfifo(mark)  # read, it would block the open for good
    else:
        mark.symlink_to(elsewhere)
    store = Store.open(path)
    try:
        assert store.wakes()[1] == 1  # the symlink's target is not read
        assert any("not a regular file" in p and "set aside" in p for p in store.problems), (
            store.problems
        )
        store.post_wake(_wake(2))
        assert mark.read_bytes() == f"{2 + SEQ_MARK_AHEAD}\n".encode()
        assert elsewhere.read_bytes() == b"99999\n"  # never written through
        assert len(list(tmp_path.glob(f"{SEQ_MARK_NAME}.not-ours-*"))) == 1
    finally:
        store.close()


def test_a_mark_that_cannot_be_written_costs_no_commit_and_is_said_until_it_is(
    tmp_path: Path,
) -> None:
    path = tmp_path / STORE_NAME
    store = Store.open(path)
    try:
        mark = tmp_path / SEQ_MARK_NAME
        mark.mkdir()  # after the open: nothing renames over a directory
        store.post_wake(_wake(1))
        store.post_wake(_wake(2))
        assert [w.seq for w in store.wakes()[0]] == [1, 2]  # every commit went in
        said = [p for p in store.problems if "cannot be written" in p]
        assert len(said) == 1, store.problems
        mark.rmdir()
        store.post_wake(_wake(3))
        assert mark.read_bytes() == f"{3 + SEQ_MARK_AHEAD}\n".encode()
        assert not any("seq mark" in p for p in store.problems), store.problems
    finally:
        store.close()
