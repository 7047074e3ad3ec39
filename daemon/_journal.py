"""A worker's journal: an append-only file of checksummed, numbered entries.

Each entry is framed as ``length (u32 BE) | crc32 (u32 BE) | msgpack body``,
the body an array ``[seq, kind, at, data]`` with seq strictly increasing from 1.
A torn tail (a crash mid-write) is detected by its length or checksum and cut
when the journal is next opened for writing; damage before the tail is
reported as `JournalCorrupt`, never skipped. Plain synchronous file I/O: the
callers decide when to call it.
"""

from __future__ import annotations

import collections
import collections.abc
import errno
import mmap
import os
import struct
import zlib
from array import array
from pathlib import Path
from typing import Final

import msgspec

from subagentd.protocol import Entry, EntryKind

from ._files import SAFE_FLAGS, NotRegularFile, open_regular, short_write

ENTRY_HEADER: Final = struct.Struct(">II")
#: Every INDEX_STRIDE-th entry's offset is kept, so a page read seeks near its cursor.
INDEX_STRIDE: Final = 64
#: The newest entries (up to this much data) stay in memory, so followers that
#: keep up never touch the disk.
TAIL_BYTES: Final = 256 * 1024
#: A page stops growing past this many bytes of data (always at least one entry).
PAGE_BYTES: Final = 1024 * 1024


class _Stored(msgspec.Struct, array_like=True):
    seq: int
    kind: EntryKind
    at: float
    data: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Stored)


class JournalCorrupt(Exception):
    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"journal {path} is corrupt at byte {offset}: {reason}")
        self.path = path
        self.offset = offset


class Journal:
    """One worker's journal file. Open it with `create` or `open`."""

    def __init__(self, path: Path, write_fd: int | None) -> None:
        self.path = path
        self._write_fd = write_fd
        self._size = 0
        self._last_seq = 0
        self._offsets = array("Q")  # offset of seq 1, 1 + STRIDE, 1 + 2*STRIDE, ...
        self._tail: collections.deque[Entry] = collections.deque()
        self._tail_bytes = 0
        self.torn_bytes = 0  # bytes cut from a torn tail when opened

    @classmethod
    def create(cls, path: Path) -> Journal:
        """A new, empty journal: the empty file made ahead (see SpareArchives), or a new one."""
        try:
            fd = open_regular(path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | SAFE_FLAGS, 0o600
            )
        st = os.fstat(fd)
        if st.st_size or st.st_nlink != 1:
            os.close(fd)
            raise FileExistsError(errno.EEXIST, "a journal is already there", str(path))
        return cls(path, fd)

    @classmethod
    def open(cls, path: Path, *, writable: bool) -> Journal:
        """Open an existing journal, verifying every entry; a torn tail is cut if writable.

        It is in its worker's reach: a symlink or FIFO there is refused
        (NotRegularFile), and the file is written through the descriptor read.
        """
        journal = cls(path, None)
        fd = open_regular(path, os.O_RDWR | os.O_APPEND if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if writable and st.st_nlink != 1:
                # A hard link to a file elsewhere: appending would write outside the archive.
                raise NotRegularFile(errno.EMLINK, "a journal with other links", str(path))
            size = st.st_size
            if size:
                with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as blob:
                    good_end = journal._scan(blob)
            else:
                good_end = 0
            journal.torn_bytes = size - good_end
            if writable and journal.torn_bytes:
                os.ftruncate(fd, good_end)
        except BaseException:
            os.close(fd)
            raise
        if writable:
            journal._write_fd = fd
        else:
            os.close(fd)
        return journal

    def _scan(self, blob: mmap.mmap) -> int:
        """Index `blob`; return where the last whole entry ends."""
        offset = 0
        while offset < len(blob):
            if len(blob) - offset < ENTRY_HEADER.size:
                break  # torn header
            length, crc = ENTRY_HEADER.unpack_from(blob, offset)
            end = offset + ENTRY_HEADER.size + length
            if end > len(blob):
                break  # torn body
            stored, problem = self._verify(blob[offset + ENTRY_HEADER.size : end], crc)
            if stored is None:
                # The last entry half written, or a file extended by the crash
                # but never filled (zeros): a torn tail. Anything else is damage.
                if end == len(blob) or not blob[offset:].strip(b"\0"):
                    break
                raise JournalCorrupt(self.path, offset, problem)
            self._note(offset, _entry(stored))
            offset = end
        self._size = offset
        return offset

    def _verify(self, body: bytes, crc: int) -> tuple[_Stored | None, str]:
        if zlib.crc32(body) != crc:
            return None, "checksum mismatch"
        try:
            stored = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            return None, str(exc)
        if stored.seq != self._last_seq + 1:
            return None, f"sequence {stored.seq} follows {self._last_seq}"
        return stored, ""

    def _note(self, offset: int, entry: Entry) -> None:
        if (entry.seq - 1) % INDEX_STRIDE == 0:
            self._offsets.append(offset)
        self._last_seq = entry.seq
        self._tail.append(entry)
        self._tail_bytes += len(entry.data)
        while self._tail_bytes > TAIL_BYTES and len(self._tail) > 1:
            self._tail_bytes -= len(self._tail.popleft().data)

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def size(self) -> int:
        return self._size

    @property
    def writable(self) -> bool:
        return self._write_fd is not None

    def append(self, kind: EntryKind, data: bytes, at: float) -> Entry:
        """Write one entry. Raises OSError (ENOSPC, EIO) with nothing recorded."""
        if self._write_fd is None:
            raise ValueError(f"journal {self.path} is not open for writing")
        entry = Entry(seq=self._last_seq + 1, kind=kind, data=data, at=at)
        body = _encoder.encode(_Stored(entry.seq, kind, at, data))
        record = ENTRY_HEADER.pack(len(body), zlib.crc32(body)) + body
        written = os.write(self._write_fd, record)
        if written != len(record):
            # A short write to a regular file means the disk is full; cut it so
            # the file stays a sequence of whole entries.
            os.ftruncate(self._write_fd, self._size)
            raise short_write("to journal", str(self.path))
        self._note(self._size, entry)
        self._size += len(record)
        return entry

    def read(self, since: int, limit: int, max_bytes: int = PAGE_BYTES) -> list[Entry]:
        """Entries with seq > since, at most `limit` of them and about `max_bytes` of data."""
        first = since + 1
        if first > self._last_seq or limit <= 0:
            return []
        if self._tail and self._tail[0].seq <= first:
            start = first - self._tail[0].seq
            return _bounded(
                (self._tail[i] for i in range(start, len(self._tail))), limit, max_bytes
            )
        return _bounded(self._read_disk(first), limit, max_bytes)

    def _read_disk(self, first: int) -> collections.abc.Iterator[Entry]:
        slot = (first - 1) // INDEX_STRIDE
        offset = self._offsets[slot]
        seq = slot * INDEX_STRIDE + 1
        with open(open_regular(self.path), "rb") as f:
            f.seek(offset)
            while seq <= self._last_seq:
                header = f.read(ENTRY_HEADER.size)
                if len(header) < ENTRY_HEADER.size:
                    return
                length, _crc = ENTRY_HEADER.unpack(header)
                if seq < first:
                    f.seek(length, os.SEEK_CUR)
                else:
                    yield _entry(_decoder.decode(f.read(length)))
                seq += 1

    def tail_bytes(self, kind: EntryKind, limit: int) -> bytes:
        """The last `limit` bytes of `kind` among the entries still held in memory."""
        data = b"".join(e.data for e in self._tail if e.kind == kind)
        return data[-limit:]

    def close(self) -> None:
        """Stop writing; the journal stays readable."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None


def _entry(stored: _Stored) -> Entry:
    return Entry(seq=stored.seq, kind=stored.kind, data=stored.data, at=stored.at)


def _bounded(entries: collections.abc.Iterable[Entry], limit: int, max_bytes: int) -> list[Entry]:
    page: list[Entry] = []
    size = 0
    for entry in entries:
        if page and (len(page) >= limit or size + len(entry.data) > max_bytes):
            break
        page.append(entry)
        size += len(entry.data)
    return page
