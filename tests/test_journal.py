"""The journal file format: numbering, paging, torn tails and corruption."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from subagentd.daemon.lifecycle._carried import Carried
from subagentd.daemon.processes._process import ENTRY_BYTES
from subagentd.daemon.store._checksum import crc32
from subagentd.daemon.store._journal import (
    CACHED_BYTES,
    INDEX_STRIDE,
    MAX_ENTRY_BODY,
    MAX_ENTRY_DATA,
    NOTE_BYTES,
    SHED_STEP,
    TAIL_BYTES,
    TAIL_READ_BYTES,
    Journal,
    JournalCorrupt,
    JournalIndex,
    JournalNotAdopted,
    read_tail,
)


def _fill(path: Path, count: int, size: int = 20) -> Journal:
    journal = Journal.create(path)
    for i in range(count):
        journal.append("stdout", f"{i:0{size}d}\n".encode(), float(i))
    return journal


def test_entries_are_numbered_from_one_and_paged_by_cursor(tmp_path: Path) -> None:
    journal = _fill(tmp_path / "j", 1000)
    seen: list[int] = []
    cursor = 0
    while page := journal.read(cursor, 77):
        seen.extend(e.seq for e in page)
        cursor = page[-1].seq
    assert seen == list(range(1, 1001))
    assert journal.read(1000, 10) == []
    assert journal.read(5000, 10) == []


def test_pages_from_disk_match_pages_from_memory(tmp_path: Path) -> None:
    # Enough data that the early entries have left the in-memory tail.
    journal = _fill(tmp_path / "j", 3000, size=400)
    assert TAIL_BYTES < 3000 * 400
    reopened = Journal.open(tmp_path / "j", writable=False)
    for since in (0, 1, INDEX_STRIDE - 1, INDEX_STRIDE, 2999):
        assert journal.read(since, 50) == reopened.read(since, 50)
    assert [e.seq for e in reopened.read(130, 3)] == [131, 132, 133]


def test_page_is_bounded_by_bytes_but_holds_at_least_one_entry(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path / "j")
    big = b"x" * 700_000
    journal.append("stdout", big, 0.0)
    journal.append("stdout", big, 1.0)
    page = journal.read(0, 100)
    assert [e.seq for e in page] == [1]
    assert page[0].data == big


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_torn_tail_is_cut_on_open_and_numbering_continues(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "j"
    _fill(path, 10).close()
    whole = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 40)  # a header and part of a body that never finished
    os.truncate(path, whole + cut)
    journal = Journal.open(path, writable=True)
    assert journal.torn_bytes == cut
    assert path.stat().st_size == whole
    assert journal.append("stdout", b"after\n", 11.0).seq == 11
    assert [e.seq for e in Journal.open(path, writable=False).read(0, 100)] == list(range(1, 12))


def test_half_written_last_entry_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _fill(path, 5).close()
    size = path.stat().st_size
    os.truncate(path, size - 3)
    journal = Journal.open(path, writable=True)
    assert journal.last_seq == 4
    assert journal.torn_bytes > 0


def test_corruption_before_the_tail_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _fill(path, 5).close()
    with open(path, "r+b") as f:
        f.seek(12)  # inside the first entry's body
        f.write(b"\xff")
    with pytest.raises(JournalCorrupt, match="byte 0"):
        Journal.open(path, writable=True)


@pytest.mark.parametrize("body_there", [False, True])
def test_an_entry_longer_than_any_the_daemon_writes_is_damage_at_its_offset(
    tmp_path: Path, body_there: bool
) -> None:
    """No crash leaves such a length (a header is written whole with its body): it
    was planted, and is neither cut as a torn tail nor read (a sparse body costs
    its planter nothing and the reader its length)."""
    path = tmp_path / "j"
    _fill(path, 5).close()
    whole = path.stat().st_size
    with open(path, "ab") as f:
        f.write(struct.pack(">II", MAX_ENTRY_BODY + 1, 0))
    if body_there:
        os.truncate(path, whole + 8 + MAX_ENTRY_BODY + 1)
    with pytest.raises(JournalCorrupt, match=f"byte {whole}:"):
        Journal.open(path, writable=True)
    assert path.stat().st_size > whole  # nothing cut


def test_a_page_read_from_disk_checks_each_entry_it_meets(tmp_path: Path) -> None:
    """A worker can write into the file the daemon holds: a length planted there
    since it was verified is damage at its offset, not a read of that length."""
    path = tmp_path / "j"
    journal = _fill(path, 3000, size=400)  # the first entries are read from disk
    with open(path, "r+b") as f:
        f.write(struct.pack(">II", (1 << 32) - 1, 0))
    with pytest.raises(JournalCorrupt, match="byte 0:"):
        journal.read(0, 10)


def test_every_entry_the_daemon_writes_fits_the_cap(tmp_path: Path) -> None:
    """The pump's largest chunk fits with room to spare; a longer note is cut rather
    than written past the cap, and output past it is refused, never written."""
    assert 2 * ENTRY_BYTES <= MAX_ENTRY_DATA
    path = tmp_path / "j"
    journal = Journal.create(path)
    journal.append("stdout", b"x" * ENTRY_BYTES, 0.0)
    journal.append("note", b"n" * (MAX_ENTRY_DATA + 1), 1.0)
    with pytest.raises(ValueError, match="at most"):
        journal.append("stderr", b"e" * (MAX_ENTRY_DATA + 1), 2.0)
    entries = Journal.open(path, writable=True).read(0, 10)
    assert [(e.kind, len(e.data)) for e in entries] == [
        ("stdout", ENTRY_BYTES),
        ("note", NOTE_BYTES),
    ]


@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.binary(min_size=0, max_size=3000), max_size=60), limit=st.integers(1, 9))
def test_any_chunks_read_back_in_order(
    tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes], limit: int
) -> None:
    path = tmp_path_factory.mktemp("j") / "journal"
    journal = Journal.create(path)
    for i, chunk in enumerate(chunks):
        journal.append("stderr" if i % 3 else "stdout", chunk, float(i))
    for source in (journal, Journal.open(path, writable=False)):
        got: list[bytes] = []
        cursor = 0
        while page := source.read(cursor, limit):
            got.extend(e.data for e in page)
            cursor = page[-1].seq
        assert got == chunks


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 255, 256, 65535, 65536, 70_000, ENTRY_BYTES]), min_size=1, max_size=4
    ),
    kind=st.sampled_from(["stdout", "stderr", "stdin"]),
    at=st.floats(allow_nan=False),
)
def test_an_entry_is_written_byte_for_byte_as_its_whole_body_encodes(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], kind: str, at: float
) -> None:
    """The writer frames an entry around its data rather than encoding a body: the file
    holds exactly what encoding each whole body gives (msgpack's bin8, bin16 and bin32
    lengths alike), so older images and older journals read as before."""
    path = tmp_path_factory.mktemp("j") / "journal"
    journal = Journal.create(path)
    expected = b""
    for seq, size in enumerate(sizes, start=1):
        data = bytes([seq]) * size
        journal.append(kind, data, at)  # type: ignore[arg-type]
        body = msgspec.msgpack.encode([seq, kind, at, data])
        expected += struct.pack(">II", len(body), zlib.crc32(body)) + body
    assert path.read_bytes() == expected


@given(head=st.binary(max_size=300), data=st.binary(max_size=70_000))
def test_the_journals_checksum_is_zlibs_crc32(head: bytes, data: bytes) -> None:
    """ISA-L's sum (where installed) gives zlib's numbers, continued from a start as
    `_record_head` continues it: journals written by either verify with the other."""
    assert crc32(data, crc32(head)) == zlib.crc32(head + data)


def test_without_isal_the_checksum_is_zlibs() -> None:
    """The `fast` extra is optional: without python-isal the journal sums with zlib."""
    probe = (
        "import sys, zlib; sys.modules['isal'] = None; "
        "from subagentd.daemon.store._checksum import crc32; "
        "assert crc32 is zlib.crc32, crc32"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_a_shed_journal_reads_back_whole(tmp_path: Path) -> None:
    """Shedding drops pages from the page cache, never a byte: pages read from disk,
    and a journal opened again, give every entry as written."""
    journal = Journal.create(tmp_path / "journal")
    chunks = [
        bytes([i]) * ENTRY_BYTES for i in range((CACHED_BYTES + 3 * SHED_STEP) // ENTRY_BYTES)
    ]
    for i, chunk in enumerate(chunks):
        journal.append("stdout", chunk, float(i))
        if shed := journal.shed_range():
            journal.shed(*shed)
    assert journal.shed_range() is None
    for source in (journal, Journal.open(journal.path, writable=False)):
        got: list[bytes] = []
        cursor = 0
        while page := source.read(cursor, 10):
            got.extend(e.data for e in page)
            cursor = page[-1].seq
        assert got == chunks


def _open_tail(path: Path, limit: int) -> bytes:
    return Journal.open(path, writable=False).tail_bytes("stdout", limit)


@settings(max_examples=50, deadline=None)
@given(
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=3000),
            st.integers(0, 3000).map(lambda n: b"\x94" * n),  # each byte an entry's first
            st.just(b"journal"),  # stands for the journal so far, printed whole (cat)
        ),
        max_size=60,
    ),
    limit=st.integers(1, 5000),
)
def test_the_tail_read_from_the_end_is_the_tail_an_open_journal_keeps(
    tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes], limit: int
) -> None:
    path = tmp_path_factory.mktemp("j") / "journal"
    journal = Journal.create(path)
    for i, chunk in enumerate(chunks):
        data = path.read_bytes()[: 64 * 1024] if chunk == b"journal" else chunk
        journal.append("stderr" if i % 3 == 2 else "stdout", data, float(i))
    journal.append("state", b"finished exit_code=0", 0.0)  # as every ending does
    assert read_tail(path, "stdout", limit) == _open_tail(path, limit)


def test_the_tail_read_from_the_end_holds_what_an_open_journal_keeps_however_long(
    tmp_path: Path,
) -> None:
    """Past TAIL_BYTES of newest entries an open journal keeps none: neither does the
    read from the end, whether the entries are many and small or few and large."""
    many = _fill(tmp_path / "many", 20_000, size=3)
    for i in range(5000):
        many.append("stderr", b"", float(i))
    large = Journal.create(tmp_path / "large")
    for i in range(8):
        large.append("stdout" if i % 2 else "stderr", bytes([i]) * ENTRY_BYTES, 0.0)
    for journal in (many, large):
        for limit in (1, 4096, 32 * 1024, 4 * TAIL_BYTES):
            assert read_tail(journal.path, "stdout", limit) == _open_tail(journal.path, limit)


def test_the_tail_is_read_from_the_end_alone(tmp_path: Path) -> None:
    """Damage far from the end is not read (the whole journal is no longer verified to
    answer its end): only the last TAIL_READ_BYTES are."""
    journal = _fill(tmp_path / "j", 200_000)
    with open(journal.path, "r+b") as f:
        f.write(b"\xff" * (journal.size - TAIL_READ_BYTES))
    with pytest.raises(JournalCorrupt):
        Journal.open(journal.path, writable=False)
    assert read_tail(journal.path, "stdout", 42) == b"".join(
        f"{i:020d}\n".encode() for i in (199_998, 199_999)
    )


@pytest.mark.parametrize(
    "end",
    [
        pytest.param(b"\x94" * TAIL_READ_BYTES, id="every-byte-a-body-start"),
        pytest.param(b"\0\0\0\x05\0\0\0\0\x94" * (TAIL_READ_BYTES // 9), id="headers"),
    ],
)
def test_a_crafted_end_answers_nothing_and_soon(tmp_path: Path, end: bytes) -> None:
    """A file made to send the walk back from the end searching gives up after
    TAIL_READ_WORK: nothing found, in milliseconds (a generous bound here)."""
    path = tmp_path / "j"
    path.write_bytes(os.urandom(4096) + end)
    began = time.monotonic()
    assert read_tail(path, "stdout", 32 * 1024) == b""
    assert time.monotonic() - began < 1.0


def test_a_torn_tail_answers_no_tail_without_reading_the_rest(tmp_path: Path) -> None:
    """The walk begins at the file's end: with no whole entry there, it finds nothing
    (recovery cuts a torn tail when it opens the journal for writing)."""
    journal = _fill(tmp_path / "j", 10)
    with open(journal.path, "ab") as f:
        f.write(b"\0\0\0\x30torn")
    assert read_tail(journal.path, "stdout", 100) == b""


def _handed_over(journal: Journal) -> tuple[int, JournalIndex]:
    """What a reload's exec would carry of `journal`: a descriptor of its own, its index."""
    with Carried() as carried:  # left at once: given back, as a failed exec would
        handed = journal.carry(carried)
    assert handed is not None
    return os.dup(handed[0]), handed[1]


def test_a_journal_handed_over_with_its_index_reads_and_appends_as_if_opened(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    count = 3 * INDEX_STRIDE + 5  # an index of several offsets
    before = _fill(path, count)
    fd, index = _handed_over(before)
    before.release()
    journal = Journal.adopt(str(path), fd, index)
    assert (journal.last_seq, journal.size) == (count, path.stat().st_size)
    assert [e.seq for e in journal.read(0, 1000)] == list(range(1, count + 1))  # from the file
    assert (
        journal.read(2 * INDEX_STRIDE + 1, 1)[0].data == f"{2 * INDEX_STRIDE + 1:020d}\n".encode()
    )
    journal.append("stdout", b"after\n", 1000.0)
    assert [e.data for e in journal.read(count, 10)] == [b"after\n"]
    journal.release()
    reopened = Journal.open(path, writable=False)  # verified whole: numbered on, undamaged
    assert reopened.last_seq == count + 1


@pytest.mark.parametrize(
    "wrong", ["longer", "renumbered", "index", "last entry elsewhere", "linked", "read-only"]
)
def test_a_journal_handed_over_that_does_not_check_out_is_refused_and_closed(
    tmp_path: Path, wrong: str
) -> None:
    path = tmp_path / "journal"
    before = _fill(path, INDEX_STRIDE + 3)
    fd, index = _handed_over(before)
    before.release()
    if wrong == "longer":
        index = msgspec.structs.replace(index, size=index.size + 1)
    elif wrong == "renumbered":
        index = msgspec.structs.replace(index, last_seq=index.last_seq + 1)
    elif wrong == "index":
        index = msgspec.structs.replace(index, offsets=[0, 0])
    elif wrong == "last entry elsewhere":
        index = msgspec.structs.replace(index, last_offset=index.offsets[-1])
    elif wrong == "linked":
        os.link(path, tmp_path / "elsewhere")  # appending would write there too
    else:
        os.close(fd)
        fd = os.open(path, os.O_RDONLY)
    with pytest.raises(JournalNotAdopted, match=str(path)):
        Journal.adopt(str(path), fd, index)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # it was that journal's: closed (the caller opens it again)


def test_a_descriptor_handed_over_that_is_not_the_journal_is_refused_and_left_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    before = _fill(path, 3)
    fd, index = _handed_over(before)
    before.release()
    os.replace(_fill(tmp_path / "planted", 3).path, path)  # a worker renamed a file over it
    with pytest.raises(JournalNotAdopted, match="is not the file at"):
        Journal.adopt(str(path), fd, index)
    os.fstat(fd)  # not this journal's: maybe another part's, so not closed
    os.close(fd)
