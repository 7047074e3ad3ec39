"""What the store's own files say about their damage, before and after sqlite opens them.

SQLite itself is silent about some damage: it deletes a WAL beside an empty database,
stops replaying a WAL at the first frame that does not verify (every later commit
dropped), and keeps writing into a database or WAL whose name was unlinked or replaced.
These checks find each, cheaply (a stat, a read of the WAL's frame headers), so that the
store can say so and recovery can rebuild from the archives what was lost. Pure file
work on the state dir's `state.db` and its companions; no trio, no daemon.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

#: The WAL's header and each frame's: sqlite's wal.c.
_WAL_HEADER = struct.Struct(">IIIIIIII")  # magic, version, page size, ckpt seq, salts, sums
_FRAME_HEADER = struct.Struct(">IIII")  # page, size after commit (0: not a commit), salts
_FRAME_HEADER_BYTES = 24
_WAL_MAGICS = (0x377F0682, 0x377F0683)
#: The WAL's frame headers are read at most this far (a WAL is cut back to 4 MiB after
#: each checkpoint; one that grew past this is read this far, the rest not looked at).
WAL_SCAN_LIMIT = 64 * 1024 * 1024


def empty_beside_wal(path: Path) -> int | None:
    """The WAL's size, if the database at `path` is empty (0 bytes) beside a WAL that
    holds frames: sqlite would delete that WAL, and every commit in it, unsaid."""
    try:
        db = os.stat(path, follow_symlinks=False)
        wal = os.stat(f"{path}-wal", follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(db.st_mode) and stat.S_ISREG(wal.st_mode)):
        return None
    return wal.st_size if db.st_size == 0 and wal.st_size > _WAL_HEADER.size else None


@dataclass(frozen=True)
class WalTail:
    """What the WAL holds past the frames sqlite verified."""

    #: Commits there that sqlite dropped (0 where one alone could be a kill -9's).
    dropped: int = 0
    #: Whether anything of the WAL's current generation lies there, a partial frame
    #: included: its last commit may have been cut or torn (a kill -9 mid-write leaves
    #: the same), so a commit that returned may be lost, though nothing says which.
    unsure: bool = False


def wal_tail(path: Path, db: sqlite3.Connection) -> WalTail:
    """What the WAL at `path`-wal holds past the frames sqlite took (`db` just opened it):
    the commits there it dropped, and whether its last commit may be lost. A frame cut
    short or corrupted stops sqlite's replay there, and every commit after it is dropped.
    Frames of the WAL's current generation (its salts) marked as a commit, past the last
    frame sqlite verified, are such commits; frames of an uncommitted transaction (a kill
    -9 mid-write) carry no commit mark, and stale frames of an earlier generation other
    salts. One such commit alone is no sign of damage: sqlite writes a frame as two
    writes (its header, then its page), and a kill -9 between them, in a WAL's space
    reused after a checkpoint, leaves the in-flight commit's header over a stale page (a
    torn write is only ever the last transaction's). A WAL cut exactly at a frame's end,
    or damaged in its last commit alone, leaves nothing to count: recovery's
    reconciliation with the archives finds what it cost; and where a frame of the current
    generation, or a partial one, follows the verified ones (`WalTail.unsure`: a cut
    through the last commit, or a torn write) recovery takes the journals' endings over
    `interrupted`."""
    try:
        fd = os.open(f"{path}-wal", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return WalTail()
    try:
        head = os.pread(fd, _WAL_HEADER.size, 0)
        if len(head) < _WAL_HEADER.size:
            return WalTail()
        magic, _, page_size, _, salt1, salt2, *sums = _WAL_HEADER.unpack(head)
        whole = magic in _WAL_MAGICS and _checksum(head[:24], magic & 1) == tuple(sums)
        if not whole:  # the database's page size is its WAL's
            (page_size,) = db.execute("PRAGMA page_size").fetchone()
        if page_size < 512 or page_size & (page_size - 1):
            return WalTail()
        # The number of frames sqlite verified (its mxFrame): a passive checkpoint says it.
        _, verified, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if verified < 0:
            return WalTail()
        if not whole:
            # SQLite takes no frame of a WAL whose header does not verify, silently: the
            # salts of its generation are then its first frame's, written after it.
            first = os.pread(fd, _FRAME_HEADER.size, _WAL_HEADER.size)
            if len(first) < _FRAME_HEADER.size:
                return WalTail()
            _, _, salt1, salt2 = _FRAME_HEADER.unpack(first)
        frame = _FRAME_HEADER_BYTES + page_size
        end = os.fstat(fd).st_size
        size = min(end, WAL_SCAN_LIMIT)
        salts = _frame_salts(salt1, salt2)
        dropped, current = 0, 0
        offset = _WAL_HEADER.size + verified * frame
        follows = True  # whether the next frame follows a verified one or one of ours
        while offset < size:
            header = os.pread(fd, _FRAME_HEADER.size, offset)
            ours = len(header) < _FRAME_HEADER.size or header[8:16] == salts
            if offset + frame > size:
                # A partial frame: the WAL ends inside what was being written, or was cut
                # there (one after stale frames, or stale itself, says nothing).
                current += follows and ours and size == end
                break
            current += ours
            dropped += ours and bool(_FRAME_HEADER.unpack(header)[1])
            follows = ours
            offset += frame
        return WalTail(dropped if dropped > 1 else 0, current > 0)
    finally:
        os.close(fd)


def _frame_salts(salt1: int, salt2: int) -> bytes:
    """The salts as a frame header holds them (its bytes 8 to 16)."""
    return struct.pack(">II", salt1, salt2)


def _checksum(data: bytes, big_endian: int) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (a multiple of 8 bytes), its words read in the byte
    order the WAL's magic names (wal.c's walChecksumBytes)."""
    s1 = s2 = 0
    for x1, x2 in struct.iter_unpack(">II" if big_endian else "<II", data):
        s1 = (s1 + x1 + s2) & 0xFFFFFFFF
        s2 = (s2 + x2 + s1) & 0xFFFFFFFF
    return s1, s2


@dataclass(frozen=True)
class FileIdentity:
    """Which file a name held when the store opened it: (device, inode)."""

    dev: int
    ino: int

    @classmethod
    def of(cls, path: str) -> FileIdentity | None:
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def relinked_why(path: str, opened: FileIdentity) -> str | None:
    """Why the name `path` no longer links the file the store has open (None: it does).
    The store holds that file open, so its inode cannot be reused by another meanwhile."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return "was unlinked"
    if (st.st_dev, st.st_ino) != (opened.dev, opened.ino):
        return "was replaced by another file"
    return None


def copy_whole(db: sqlite3.Connection, directory: Path, name: str) -> Path:
    """A whole copy of the open database `db` (its WAL's commits included), made with
    sqlite's backup API into a new file of unpredictable name in `directory`, fsynced:
    what is renamed over a store whose name was unlinked or replaced."""
    target = directory / f".{name}.put-back-{secrets.token_hex(8)}"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    try:
        copy = sqlite3.connect(target, isolation_level=None)
        try:
            db.backup(copy)
        finally:
            copy.close()
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        for leftover in (target, Path(f"{target}-journal")):
            leftover.unlink(missing_ok=True)
        raise
    return target
