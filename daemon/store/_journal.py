"""A worker's journal: an append-only file of checksummed, numbered entries.

Each entry is framed as ``length (u32 BE) | crc32 (u32 BE) | msgpack body``,
the body an array ``[seq, kind, at, data]`` with seq strictly increasing from 1.
An entry is written with one writev: its frame and the body's start (`_record_head`),
then the data where it lies, checksummed in place, never copied into a body first.
A torn tail (a crash mid-write) is detected by its length or checksum and cut
when the journal is next opened for writing; damage before the tail is
reported as `JournalCorrupt`, never skipped. The file is in its worker's reach,
so it is read through the descriptor opened once, by pread into a bounded buffer,
and no entry is believed longer than the daemon ever writes one. Plain
synchronous file I/O: the callers decide when to call it (a long journal's
scan is worth a thread). `read_tail` reads a journal's newest entries from its
end alone, however long the file: for what needs only the end of its stdout.
A journal that grows long keeps only its end in the page cache (`shed`). A reload
hands a live journal's descriptor and verified index to the next image (`carry`,
`adopt`), which checks them against the file rather than scanning it again.

At most OPEN_JOURNALS journals hold a descriptor at once (`_OpenJournals`): 10,000 live
workers that write now and then must not cost 10,000 of the daemon's descriptors. The
one used least recently is closed ("parked") when another needs one, and opened
again, by its path, when it is next written or read; what it opens then is checked to
be the very file the daemon wrote, as `adopt` checks a carried one (same device and
inode, one link, as long as the daemon wrote it, its last entry whole where the index
says). A file replaced or written into while its journal was parked is refused
(`JournalCorrupt`), never written after or read as the worker's.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import errno
import fcntl
import itertools
import os
import stat
import struct
import threading
import time
import weakref
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

import msgspec

from subagentd.protocol import Entry, EntryKind

from ._checksum import crc32
from ._files import SAFE_FLAGS, NotRegularFile, open_regular, short_write

if TYPE_CHECKING:
    from ..core._carrier import Carrier

ENTRY_HEADER: Final = struct.Struct(">II")
#: Every INDEX_STRIDE-th entry's offset is kept, so a page read seeks near its cursor.
INDEX_STRIDE: Final = 64
#: The newest entries (up to this much data) stay in memory, so followers that
#: keep up never touch the disk.
TAIL_BYTES: Final = 256 * 1024
#: A page stops growing past this many bytes of data (always at least one entry).
PAGE_BYTES: Final = 1024 * 1024
#: The most data one entry holds. The pump reads at most ENTRY_BYTES (512 KiB, in
#: _process) into one entry, a state or note is cut at NOTE_BYTES: the rest is
#: headroom. A longer entry on disk was not written by the daemon.
MAX_ENTRY_DATA: Final = 1024 * 1024
#: A state or note entry (the daemon's own prose) is cut to this many bytes.
NOTE_BYTES: Final = 16 * 1024
#: The longest body: the data and the msgpack around it (array, seq, kind, at: < 32 bytes).
MAX_ENTRY_BODY: Final = MAX_ENTRY_DATA + 64
#: What an entry costs the in-memory tail besides its data, so that a journal of
#: empty entries cannot grow the tail without bound.
ENTRY_COST: Final = 64
#: How much of the file one read takes while scanning it, and while reading a page.
SCAN_WINDOW: Final = 4 * 1024 * 1024
PAGE_WINDOW: Final = 256 * 1024
#: What `read_tail` reads from a journal's end: room for the newest entries an open
#: journal keeps in memory (TAIL_BYTES of them) and the longest entry besides.
TAIL_READ_BYTES: Final = TAIL_BYTES + ENTRY_HEADER.size + MAX_ENTRY_BODY
#: The work `read_tail` may do, in bytes checksummed (each entry start it tries counts
#: as TRY_COST): an honest journal's end costs under half; one crafted to make it
#: search gives up with what it found, in tens of milliseconds.
TAIL_READ_WORK: Final = 8 * TAIL_READ_BYTES
TRY_COST: Final = 256
#: A journal keeps about this much of its end in the page cache; what lies further
#: back is written back and dropped from it (`Journal.shed`), SHED_STEP at a time.
CACHED_BYTES: Final = 32 * 1024 * 1024
SHED_STEP: Final = 16 * 1024 * 1024
#: Every body begins so: msgpack's array of four ([seq, kind, at, data]).
_BODY_START: Final = b"\x94"
#: msgpack's empty bin, which ends a body encoded without its data (see _record_head).
_EMPTY_BIN: Final = b"\xc4\x00"
_BIN8: Final = struct.Struct(">BB")
_BIN16: Final = struct.Struct(">BH")
_BIN32: Final = struct.Struct(">BI")
#: How many journals hold a descriptor at once, the most recently used: a live worker's
#: journal costs the daemon no descriptor while it is idle (see `_OpenJournals`).
OPEN_JOURNALS: Final = 256
#: A parked journal whose file's ctime was this much older than its parking, and is the
#: same when it is opened again, was changed by no one meanwhile: any change would have
#: set a later ctime, even where the kernel keeps it to the coarse tick (a few ms). Its
#: last entry is then not read again to check it (a stop_run's 10,000 endings each
#: opened a parked journal: one pread and decode less each).
UNCHANGED_MARGIN_NS: Final = 50_000_000


class _OpenJournals:
    """The journals holding a descriptor now, at most `most` of them: past that, the
    least recently used that are not in use are parked (closed), down to 7/8 of
    `most` so that a trim comes once every few dozen opens, not at each. Shared by
    the event loop and the threads that open and shed journals: every step is taken
    under one lock, and a descriptor in use is never closed. A use costs the lock
    twice and a tick of the clock (an append's hot path); only a trim sorts. Held by
    weak reference: a journal dropped goes (its descriptor closed by its finalizer)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._open: dict[int, weakref.ref[Journal]] = {}  # by id(journal)
        self._lock = threading.Lock()
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._open)

    def acquire(self, journal: Journal) -> int:
        """`journal`'s descriptor, opened again if it was parked, held in use until
        `release_use`."""
        with self._lock:
            journal._uses += 1  # first: a trim made by this use never parks it
            journal._used = next(self._clock)
            fd = journal._box[0]
            if fd < 0:
                try:
                    fd = journal._reopen()
                except BaseException:
                    journal._uses -= 1
                    raise
                self._add(journal)
            return fd

    def release_use(self, journal: Journal) -> None:
        with self._lock:
            journal._uses -= 1

    def opened(self, journal: Journal) -> None:
        """A journal just made holds a descriptor: count it (parking others if need be)."""
        with self._lock:
            journal._used = next(self._clock)
            self._add(journal)

    def forget(self, journal: Journal) -> None:
        """A journal closed or handed on: it is no longer this image's to park."""
        with self._lock:
            self._open.pop(id(journal), None)

    def _add(self, journal: Journal) -> None:
        key = id(journal)
        if key not in self._open:
            self._open[key] = weakref.ref(journal, self._dropped(key))
        if len(self._open) > self.most:
            self._trim()

    def _dropped(self, key: int) -> Callable[[weakref.ref[Journal]], None]:
        def dropped(ref: weakref.ref[Journal]) -> None:
            # Without the lock: a journal may die while it is held (a local let go).
            # One dict step, atomic; a journal since made at the same id is not this one.
            if self._open.get(key) is ref:
                self._open.pop(key, None)

        return dropped

    def _trim(self) -> None:
        idle: list[tuple[int, int, Journal]] = []
        for key, ref in list(self._open.items()):
            journal = ref()
            if journal is None:
                self._open.pop(key, None)
            elif journal._uses == 0:
                idle.append((journal._used, key, journal))
        idle.sort(key=lambda entry: entry[0])
        for _, key, journal in idle[: max(0, len(self._open) - self.most * 7 // 8)]:
            journal._park()
            self._open.pop(key, None)


_OPEN = _OpenJournals(OPEN_JOURNALS)


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
        self.reason = reason


class JournalTooLong(Exception):
    """A journal longer than its opener would verify where it stands (see Journal.open)."""


class JournalNotAdopted(Exception):
    """A journal handed across a reload that does not check out (see Journal.adopt): the
    new image opens it from its path instead, verifying it whole."""


class JournalIndex(msgspec.Struct, kw_only=True, frozen=True):
    """What a verified journal knows of its file, handed to a reload's next image with
    its descriptor, so that the file is neither reopened nor scanned again there."""

    size: int
    last_seq: int
    #: Where the last entry begins (0 while there is none).
    last_offset: int
    #: The offset of seq 1, 1 + INDEX_STRIDE, 1 + 2 * INDEX_STRIDE, ...
    offsets: list[int]


class ParkedJournal(msgspec.Struct, kw_only=True, frozen=True):
    """A live worker's journal that was parked (its descriptor closed) when a reload's
    checkpoint was taken: which file it is and what the daemon wrote of it, so that the
    next image reopens that file, checked as this one would have, at its next use
    (`Journal.parked_from`), never whatever another process put at its path meanwhile."""

    dev: int
    ino: int
    index: JournalIndex


class Journal:
    """One worker's journal file. Open it with `create` or `open` (or `adopt`, across a
    reload).

    It holds a descriptor while it is among the OPEN_JOURNALS used last, and opens its
    file again, checked to be the same, when it is used after (see `_OpenJournals`):
    pages are read from the file the daemon verified, never from whatever a worker
    renamed over its name since. Closed when it is dropped, or by `release`.
    """

    def __init__(self, path: Path | str, fd: int, *, writable: bool) -> None:
        self._path = path  # a str where it is made a thousand at a time (adopt)
        #: Its descriptor (-1 while parked), in a box the finalizer can see change.
        self._box = [fd]
        self._release = weakref.finalize(self, _close_box, self._box)
        #: (device, inode) of its file, taken when it is parked, checked when reopened.
        self._identity: tuple[int, int] | None = None
        #: Its file's ctime when it was parked, if older than that by UNCHANGED_MARGIN_NS:
        #: found the same when reopened, its last entry need not be read again.
        self._parked_ctime: int | None = None
        self._uses = 0  # descriptor uses under way (`_OpenJournals.acquire`)
        self._used = 0  # when it was last used, on `_OpenJournals`' clock
        self._writable = writable
        self._opened_writable = writable
        self._size = 0
        self._last_seq = 0
        self._last_offset = 0  # where the last entry begins
        self._offsets = array("Q")  # offset of seq 1, 1 + STRIDE, 1 + 2*STRIDE, ...
        self._tail: collections.deque[Entry] = collections.deque()
        self._tail_bytes = 0
        self.torn_bytes = 0  # bytes cut from a torn tail when opened
        self._shed_to = 0  # what lies before this was shed from the page cache

    @classmethod
    def create(cls, path: Path) -> Journal:
        """A new, empty journal: the empty file made ahead (see SpareArchives), or a new one."""
        try:
            fd = open_regular(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | SAFE_FLAGS, 0o600)
        st = os.fstat(fd)
        if st.st_size or st.st_nlink != 1:
            os.close(fd)
            raise FileExistsError(errno.EEXIST, "a journal is already there", str(path))
        journal = cls(path, fd, writable=True)
        _OPEN.opened(journal)
        return journal

    @classmethod
    def open(cls, path: Path, *, writable: bool, most: int | None = None) -> Journal:
        """Open an existing journal, verifying every entry; a torn tail is cut if writable.

        It is in its worker's reach: a symlink or FIFO there is refused
        (NotRegularFile), and the file is written through the descriptor read.
        `most`: raise JournalTooLong, having read nothing, if the file is longer.
        """
        fd = open_regular(path, os.O_RDWR | os.O_APPEND if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if most is not None and st.st_size > most:
                raise JournalTooLong(path)
            if writable and st.st_nlink != 1:
                # A hard link to a file elsewhere: appending would write outside the archive.
                raise NotRegularFile(errno.EMLINK, "a journal with other links", str(path))
            journal = cls(path, fd, writable=writable)
        except BaseException:
            os.close(fd)
            raise
        try:
            good_end = journal._scan(st.st_size)
            journal.torn_bytes = st.st_size - good_end
            journal._shed_to = max(0, good_end - CACHED_BYTES)  # an earlier image shed it
            if writable and journal.torn_bytes:
                os.ftruncate(fd, good_end)
        except BaseException:
            journal.release()
            raise
        _OPEN.opened(journal)
        return journal

    @classmethod
    def adopt(cls, path: str, fd: int, index: JournalIndex) -> Journal:
        """The journal an earlier image held open for writing, handed across a reload's
        exec as its descriptor and verified `index` (`carry`): neither reopened nor
        scanned. The checkpoint that says so lies in the state dir, within a worker's
        reach, so it is believed only as far as it checks out: `fd` is the regular file
        at `path` (same device and inode; one link, open for appending), `index.size`
        long, and its last entry whole, where the index says, numbered as it says. Else
        JournalNotAdopted says why, and `fd` is closed if it is that file (else it is
        left alone: another part may own it). What lies before the last entry is
        verified as it is read, as for any open journal.

        Its in-memory tail starts empty (reads before the entries appended from now on
        are read from the file, verified): its stdout's end comes with the checkpoint.
        """
        try:
            st = os.fstat(fd)
            named = os.stat(path, follow_symlinks=False)
        except OSError as exc:
            raise JournalNotAdopted(
                f"descriptor {fd} or {path} cannot be looked at: {exc}"
            ) from None
        if (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino) or not stat.S_ISREG(st.st_mode):
            raise JournalNotAdopted(f"descriptor {fd} is not the file at {path} (left open)")
        journal = cls(path, fd, writable=True)
        try:  # from here it is this journal's file: ours to close, and opened again
            journal._take_index(st, index)
        except OSError as exc:
            journal.release()
            raise JournalNotAdopted(f"journal {path} cannot be read: {exc}") from None
        except BaseException:
            journal.release()
            raise
        _OPEN.opened(journal)
        return journal

    def _take_index(self, st: os.stat_result, index: JournalIndex) -> None:
        """Check `index` against the file (`st`) and its last entry, then take it."""
        size, last_seq, last, offsets = index.size, index.last_seq, index.last_offset, index.offsets
        flags = fcntl.fcntl(self._box[0], fcntl.F_GETFL)
        problem = None
        if st.st_nlink != 1:
            problem = f"it has {st.st_nlink} links"
        elif flags & (os.O_ACCMODE | os.O_APPEND) != os.O_RDWR | os.O_APPEND:
            problem = "it is not open for appending"
        elif st.st_size != size:
            problem = f"it is {st.st_size} bytes long, not {size} as handed over"
        elif not _index_fits(size, last_seq, last, offsets):
            problem = f"its index ({last_seq} entries, the last at {last}) does not fit its size"
        elif last_seq and not self._ends_with(last, size, last_seq):
            problem = f"no whole entry {last_seq} ends it at byte {last}"
        if problem is not None:
            raise JournalNotAdopted(f"journal {self._path}: {problem}")
        self._size, self._last_seq, self._last_offset = size, last_seq, last
        self._offsets = array("Q", offsets)
        self._shed_to = max(0, size - CACHED_BYTES)  # as `open` takes it

    def _ends_with(self, offset: int, size: int, seq: int) -> bool:
        """Whether one whole entry numbered `seq` lies from `offset` to `size`."""
        raw = os.pread(self._box[0], min(size - offset, ENTRY_HEADER.size + MAX_ENTRY_BODY), offset)
        if len(raw) < ENTRY_HEADER.size:
            return False
        length, crc = ENTRY_HEADER.unpack_from(raw)
        if ENTRY_HEADER.size + length != size - offset or len(raw) != size - offset:
            return False
        stored, _ = self._verify(memoryview(raw)[ENTRY_HEADER.size :], crc, seq)
        return stored is not None

    def carry(self, carried: Carrier) -> tuple[int, JournalIndex] | None:
        """Hand the descriptor and the index to a reload's exec (see `adopt`); None for a
        journal not open for writing (the next image opens it from its path)."""
        if not self._writable or self._box[0] < 0:
            return None  # parked: the next image opens it from its path, and verifies it
        # Held open from here to the exec: never parked (by a thread opening another)
        # while the checkpoint names its descriptor.
        fd = carried.carry(_OPEN.acquire(self), f"journal {self._path}")
        return fd, JournalIndex(
            size=self._size,
            last_seq=self._last_seq,
            last_offset=self._last_offset,
            offsets=self._offsets.tolist(),
        )

    def parked(self) -> ParkedJournal | None:
        """What a reload carries of this journal while it is parked and open for writing
        (`carry` has no descriptor to hand over then); None otherwise."""
        if not self._writable or self._box[0] >= 0 or self._identity is None:
            return None
        dev, ino = self._identity
        return ParkedJournal(
            dev=dev,
            ino=ino,
            index=JournalIndex(
                size=self._size,
                last_seq=self._last_seq,
                last_offset=self._last_offset,
                offsets=self._offsets.tolist(),
            ),
        )

    @classmethod
    def parked_from(cls, path: str, parked: ParkedJournal) -> Journal:
        """The journal an earlier image had parked when it reloaded, parked here too: no
        descriptor, the file it was and its index; at its first use it is opened again
        and refused (JournalCorrupt, as `_reopen` says) unless it is still that file, as
        long as written, its last entry whole. JournalNotAdopted if the index cannot be
        a journal's. Its in-memory tail starts empty, as an adopted one's."""
        index = parked.index
        if not _index_fits(index.size, index.last_seq, index.last_offset, index.offsets):
            raise JournalNotAdopted(f"journal {path}: the parked index does not fit its size")
        journal = cls(path, -1, writable=True)
        journal._identity = parked.dev, parked.ino
        journal._size, journal._last_seq = index.size, index.last_seq
        journal._last_offset = index.last_offset
        journal._offsets = array("Q", index.offsets)
        journal._shed_to = max(0, index.size - CACHED_BYTES)
        return journal

    def _scan(self, size: int) -> int:
        """Index the file's first `size` bytes; return where the last whole entry ends."""
        window = _Window(self._box[0], size, SCAN_WINDOW)
        offset = 0
        while offset < size:
            header = window.take(offset, ENTRY_HEADER.size)
            if len(header) < ENTRY_HEADER.size:
                break  # torn header (or the file cut short since its size was taken)
            length, crc = ENTRY_HEADER.unpack(header)
            if length > MAX_ENTRY_BODY:
                raise JournalCorrupt(self.path, offset, _too_long(length))
            end = offset + ENTRY_HEADER.size + length
            body = window.take(offset + ENTRY_HEADER.size, length)
            if end > size or len(body) < length:
                break  # torn body
            stored, problem = self._verify(body, crc, self._last_seq + 1)
            if stored is None:
                # The last entry half written, or a file extended by the crash
                # but never filled (zeros): a torn tail. Anything else is damage.
                if end == size or _zeros(self._box[0], offset, size):
                    break
                raise JournalCorrupt(self.path, offset, problem)
            self._note(offset, _entry(stored))
            offset = end
        self._size = offset
        return offset

    @staticmethod
    def _verify(body: bytes | memoryview, crc: int, seq: int | None) -> tuple[_Stored | None, str]:
        """The entry `body` holds if it is whole, and numbered `seq` (any, if None)."""
        if crc32(body) != crc:
            return None, "checksum mismatch"
        try:
            stored = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            return None, str(exc)
        misnumbered = stored.seq < 1 if seq is None else stored.seq != seq
        if misnumbered:
            return None, f"sequence {stored.seq} where {seq or 'one or more'} belongs"
        return stored, ""

    def _note(self, offset: int, entry: Entry) -> None:
        if (entry.seq - 1) % INDEX_STRIDE == 0:
            self._offsets.append(offset)
        self._last_seq = entry.seq
        self._last_offset = offset
        self._tail.append(entry)
        self._tail_bytes += len(entry.data) + ENTRY_COST
        while self._tail_bytes > TAIL_BYTES and len(self._tail) > 1:
            self._tail_bytes -= len(self._tail.popleft().data) + ENTRY_COST

    @property
    def path(self) -> Path:
        return Path(self._path)

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def size(self) -> int:
        return self._size

    @property
    def writable(self) -> bool:
        return self._writable

    def append(self, kind: EntryKind, data: bytes, at: float) -> Entry:
        """Write one entry. Raises OSError (ENOSPC, EIO) with nothing recorded.

        A state or note longer than NOTE_BYTES is cut; output longer than any
        entry may hold is a bug of the caller's (ValueError), never written.
        """
        if not self._writable:
            raise ValueError(f"journal {self.path} is not open for writing")
        if kind in ("state", "note") and len(data) > NOTE_BYTES:
            data = data[: NOTE_BYTES - 3] + b"..."
        if len(data) > MAX_ENTRY_DATA:
            raise ValueError(f"{len(data)} bytes for one journal entry, at most {MAX_ENTRY_DATA}")
        entry = Entry(seq=self._last_seq + 1, kind=kind, data=data, at=at)
        head = _record_head(entry.seq, kind, at, data)
        length = len(head) + len(data)
        # `_descriptor`, spelled out: the one step every byte of output takes.
        if not self._release.alive:
            raise ValueError(f"journal {self.path} was released")
        fd = _OPEN.acquire(self)
        try:
            written = os.writev(fd, (head, data))
            if written != length:
                # A short write to a regular file means the disk is full; cut it so
                # the file stays a sequence of whole entries.
                os.ftruncate(fd, self._size)
                raise short_write("to journal", str(self.path))
        finally:
            _OPEN.release_use(self)
        self._note(self._size, entry)
        self._size += length
        return entry

    def shed_range(self) -> tuple[int, int] | None:
        """What to `shed` now, taken as shed: (start, end), or None until SHED_STEP more
        than CACHED_BYTES was written since the last. From the step it reached the last
        time: its pages were under writeback then, and are written back by now."""
        end = self._size - CACHED_BYTES
        if end - self._shed_to < SHED_STEP:
            return None
        start, self._shed_to = max(0, self._shed_to - SHED_STEP), end
        return start, end

    def shed(self, start: int, end: int) -> None:
        """Have the kernel write back, and drop from the page cache, the bytes from
        `start` to `end` (a `shed_range`, CACHED_BYTES behind the journal's end). A
        journal its worker floods grows by GBs: kept whole in the page cache, its pages
        would pile up dirty (past the kernel's dirty limit, every write of the daemon's
        is throttled) and each would take fresh memory (slow in a VM whose host takes
        back free memory). Only advice, so nothing it fails at matters; it may wait
        for the disk's queue: call it in a thread, as appends go on. Readers still read
        it all, from disk.
        """
        with contextlib.suppress(OSError, JournalCorrupt), self._descriptor() as fd:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def read(self, since: int, limit: int, max_bytes: int = PAGE_BYTES) -> list[Entry]:
        """Entries with seq > since, at most `limit` of them and about `max_bytes` of data.

        Raises JournalCorrupt if what is read from disk is no longer what was
        verified (its worker wrote into the file since).
        """
        first = since + 1
        if first > self._last_seq or limit <= 0:
            return []
        if self._tail and self._tail[0].seq <= first:
            start = first - self._tail[0].seq
            return _bounded(
                (self._tail[i] for i in range(start, len(self._tail))), limit, max_bytes
            )
        with self._descriptor() as fd:
            return _bounded(self._read_disk(fd, first), limit, max_bytes)

    def _read_disk(self, fd: int, first: int) -> collections.abc.Iterator[Entry]:
        slot = (first - 1) // INDEX_STRIDE
        offset = self._offsets[slot]
        seq = slot * INDEX_STRIDE + 1
        window = _Window(fd, self._size, PAGE_WINDOW)
        skipped = 0  # the length of the entry before, if it was passed over unread
        while seq <= self._last_seq:
            # Past a long entry skipped, the next header alone is read: a page of a
            # journal of long entries (a flood's) passes over up to INDEX_STRIDE - 1 of
            # them to its first, and would read a window for each header.
            long_skip = skipped >= PAGE_WINDOW // 8
            header = (window.peek if long_skip else window.take)(offset, ENTRY_HEADER.size)
            if len(header) < ENTRY_HEADER.size:
                raise JournalCorrupt(self.path, offset, "the file was cut short")
            length, crc = ENTRY_HEADER.unpack(header)
            end = offset + ENTRY_HEADER.size + length
            if length > MAX_ENTRY_BODY or end > self._size:
                raise JournalCorrupt(self.path, offset, _too_long(length))
            if seq >= first:
                body = window.take(offset + ENTRY_HEADER.size, length)
                stored, problem = self._verify(body, crc, seq)
                if stored is None:
                    raise JournalCorrupt(self.path, offset, problem)
                yield _entry(stored)
                skipped = 0
            else:
                skipped = length
            offset = end
            seq += 1

    def tail_bytes(self, kind: EntryKind, limit: int) -> bytes:
        """The last `limit` bytes of `kind` among the entries still held in memory."""
        data = b"".join(e.data for e in self._tail if e.kind == kind)
        return data[-limit:]

    def close(self) -> None:
        """Stop writing; the journal stays readable."""
        self._writable = False

    def write_again(self) -> None:
        """Take writes again after `close` (a fault came after an ending closed it):
        through the descriptor verified at open, so nothing is read again, and never
        the file a worker may have put at its name since."""
        if not self._opened_writable or not self._release.alive:
            raise ValueError(f"journal {self.path} was not opened for writing, or was released")
        self._writable = True

    def release(self) -> None:
        """Close the descriptor now rather than when the journal is dropped."""
        self._writable = False
        _OPEN.forget(self)
        self._release()

    def detach(self) -> None:
        """Let go of the descriptor without closing it: a reload's exec carried it to the
        next image, which owns it now (the in-process tests' stand-in for the exec)."""
        self._writable = False
        _OPEN.forget(self)
        self._release.detach()

    @property
    def holds_descriptor(self) -> bool:
        """Whether it holds a descriptor now (False while parked, or once released)."""
        return self._release.alive and self._box[0] >= 0

    @contextlib.contextmanager
    def _descriptor(self) -> collections.abc.Iterator[int]:
        """Its descriptor for the body, opened again if it was parked; never parked
        meanwhile. Raises JournalCorrupt if the file at its path is no longer its own."""
        if not self._release.alive:
            raise ValueError(f"journal {self.path} was released")
        fd = _OPEN.acquire(self)
        try:
            yield fd
        finally:
            _OPEN.release_use(self)

    def _park(self) -> None:
        """Close the descriptor, remembering which file it was (`_OpenJournals._trim`)."""
        fd, self._box[0] = self._box[0], -1
        if fd < 0:
            return
        try:
            st = os.fstat(fd)
            self._identity = st.st_dev, st.st_ino
            ctime = st.st_ctime_ns
            self._parked_ctime = ctime if time.time_ns() - ctime > UNCHANGED_MARGIN_NS else None
        except OSError:  # no identity kept: opened again, it is refused, never trusted
            self._identity = None
        finally:
            os.close(fd)

    def _reopen(self) -> int:
        """Open the parked journal's file again, and check it is the one the daemon wrote:
        the same file, one link, as long as written, its last entry whole where the index
        says (as `adopt` checks a carried one). Anything else raises JournalCorrupt."""
        flags = os.O_RDWR | os.O_APPEND if self._opened_writable else os.O_RDONLY
        try:
            fd = open_regular(self._path, flags)
        except (FileNotFoundError, NotRegularFile) as exc:
            raise JournalCorrupt(
                self.path, self._size, f"its file is gone from its name while it was closed ({exc})"
            ) from None
        try:
            st = os.fstat(fd)
            problem = None
            if (st.st_dev, st.st_ino) != self._identity:
                problem = "another file was put at its name while it was closed"
            elif self._opened_writable and st.st_nlink != 1:
                problem = f"it has {st.st_nlink} links"
            elif st.st_size != self._size:
                problem = f"it is {st.st_size} bytes long, not the {self._size} the daemon wrote"
            elif (
                self._last_seq
                and st.st_ctime_ns != self._parked_ctime  # else unchanged since parked
                and not self._ends_with_at(fd, self._last_offset, self._size)
            ):
                problem = f"no whole entry {self._last_seq} ends it at byte {self._last_offset}"
            if problem is not None:
                raise JournalCorrupt(self.path, self._size, f"{problem}: it is not reopened")
        except BaseException:
            os.close(fd)
            raise
        self._box[0] = fd
        return fd

    def _ends_with_at(self, fd: int, offset: int, size: int) -> bool:
        was, self._box[0] = self._box[0], fd
        try:
            return self._ends_with(offset, size, self._last_seq)
        finally:
            self._box[0] = was


def _close_box(box: list[int]) -> None:
    """A dropped or released journal's descriptor, closed if it holds one."""
    fd, box[0] = box[0], -1
    if fd >= 0:
        os.close(fd)


def read_tail(path: Path, kind: EntryKind, limit: int) -> bytes:
    """The last `limit` bytes of `kind` among a journal's newest entries (those an
    open journal would keep in memory), read from its last TAIL_READ_BYTES alone.

    The journal is not verified: its entries are found walking back from the
    file's end, each where the next begins, and each believed only if its length
    ends it there and its checksum, body and number (one less than the next's)
    verify. The walk stops at the first that does not, or after TAIL_READ_WORK:
    a file that does not end with a whole entry (a torn tail, something planted)
    answers what was found before, maybe nothing. OSError if it cannot be read,
    NotRegularFile if it is no regular file.
    """
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - TAIL_READ_BYTES)
        end = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    found: list[bytes] = []  # newest first
    cost = length = 0
    for newer, stored in enumerate(_newest_first(end)):
        cost += len(stored.data) + ENTRY_COST
        if newer and cost > TAIL_BYTES:
            break  # an open journal's tail holds no more (but always its newest entry)
        if stored.kind == kind:
            found.append(stored.data)
            length += len(stored.data)
            if length >= limit:
                break
    return b"".join(reversed(found))[-limit:]


def _newest_first(end: bytes) -> collections.abc.Iterator[_Stored]:
    """The whole entries that `end` (a journal's end) ends with, newest first.

    Each is looked for by the start of its body, nearest its end first. Once the
    next entry's number is known, the body's start says its own too: a worker's
    output that holds what reads as whole entries (it printed a journal) is not
    taken for one unless it is so numbered and ends where an entry must. The
    newest, with no next, is the daemon's own note of its worker's ending when
    it ended, so no output of its comes after it.
    """
    work = TAIL_READ_WORK
    stop, seq = len(end), None  # where the entry looked for ends; the number after it
    while stop > 0 and seq != 1:
        marker = _BODY_START if seq is None else _BODY_START + _encoder.encode(seq - 1)
        lowest = max(0, stop - MAX_ENTRY_BODY - ENTRY_HEADER.size) + ENTRY_HEADER.size
        at, stored = stop, None
        while stored is None:
            at = end.rfind(marker, lowest, at)
            work -= TRY_COST
            if at < 0 or work < 0:
                return  # no whole entry ends there, or the end was made to keep the walk searching
            length, crc = ENTRY_HEADER.unpack_from(end, at - ENTRY_HEADER.size)
            if at + length == stop:
                work -= length
                body = memoryview(end)[at:stop]
                stored, _ = Journal._verify(body, crc, None if seq is None else seq - 1)
        yield stored
        stop, seq = at - ENTRY_HEADER.size, stored.seq


def _record_head(seq: int, kind: EntryKind, at: float, data: bytes) -> bytes:
    """An entry's frame (length, crc32) and its body up to the data: byte for byte what
    encoding the whole body would give, the data left out so that it is checksummed and
    written where it lies (a pump's entry is up to half a MiB: each copy of it costs)."""
    start = _encoder.encode(_Stored(seq, kind, at, b""))[: -len(_EMPTY_BIN)]
    size = len(data)
    if size < 1 << 8:
        start += _BIN8.pack(0xC4, size)
    elif size < 1 << 16:
        start += _BIN16.pack(0xC5, size)
    else:
        start += _BIN32.pack(0xC6, size)
    crc = crc32(data, crc32(start))
    return ENTRY_HEADER.pack(len(start) + size, crc) + start


class _Window:
    """Reads of a file's first `size` bytes, mostly forward, through one bounded buffer.

    By pread from a held descriptor: nothing is mapped (a mapping's pages count
    against the daemon as it touches them) and no read is longer than asked or
    `chunk`, whichever is more.
    """

    def __init__(self, fd: int, size: int, chunk: int) -> None:
        self._fd = fd
        self._size = size
        self._chunk = chunk
        self._buffer = b""
        self._start = 0

    def take(self, offset: int, length: int) -> memoryview:
        """`length` bytes from `offset`, fewer if the file was cut short meanwhile."""
        at = offset - self._start
        if at < 0 or at + length > len(self._buffer):
            want = min(max(length, self._chunk), self._size - offset)
            self._buffer = os.pread(self._fd, want, offset) if want > 0 else b""
            self._start, at = offset, 0
        return memoryview(self._buffer)[at : at + length]

    def peek(self, offset: int, length: int) -> memoryview:
        """As `take`, but what the buffer does not hold is read alone, the buffer kept."""
        at = offset - self._start
        if at < 0 or at + length > len(self._buffer):
            want = min(length, self._size - offset)
            return memoryview(os.pread(self._fd, want, offset) if want > 0 else b"")
        return memoryview(self._buffer)[at : at + length]


def _zeros(fd: int, offset: int, size: int) -> bool:
    """Whether the file holds only zeros from `offset` to `size`, without reading its holes."""
    while offset < size:
        try:
            offset = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return True  # a hole to the end
            raise
        data_end = min(os.lseek(fd, offset, os.SEEK_HOLE), size)
        while offset < data_end:
            chunk = os.pread(fd, min(SCAN_WINDOW, data_end - offset), offset)
            if not chunk:
                return True  # cut short meanwhile: nothing left that is not zero
            if chunk.count(0) != len(chunk):
                return False
            offset += len(chunk)
    return True


def _index_fits(size: int, last_seq: int, last: int, offsets: list[int]) -> bool:
    """Whether an index handed over could be a journal's of `size` bytes: one offset for
    each INDEX_STRIDE entries, the first 0, rising, the last entry after them all."""
    if last_seq <= 0:
        return last_seq == 0 and size == 0 and last == 0 and not offsets
    if len(offsets) != (last_seq - 1) // INDEX_STRIDE + 1 or offsets[0] != 0:
        return False
    if any(b <= a for a, b in itertools.pairwise(offsets)):
        return False
    return offsets[-1] <= last < size


def _too_long(length: int) -> str:
    return f"an entry of {length} bytes, past the file's end or longer than any the daemon writes"


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
