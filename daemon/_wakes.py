"""Wakes: one completion event per worker ending, kept until its parent acknowledges it.

`WakeQueue` is the sans-I/O core: it posts at most one wake per worker attempt
and holds each until acknowledged. `WakeLog` makes it survive a crash: posts
and acks are appended to a checksummed log (the journal's framing), replayed
on start, and compacted to what is still pending. A damaged entry costs only
itself: replay skips to the next entry that verifies, says so, and keeps the
damaged log aside before compacting it. A seq is never given twice, whatever
entry is damaged: past damage, the next seq skips ahead (gaps are harmless).
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import msgspec
import structlog

from subagentd.protocol import Wake, WorkerState

from ._files import read_regular, replace_file, short_write
from ._journal import ENTRY_HEADER

#: Far above any wake log (compaction keeps it near what is pending).
WAKE_LOG_READ_LIMIT = 1024 * 1024 * 1024
log = structlog.get_logger("subagentd")

#: Past damage, replay looks for the next entry no longer than this (a post or an ack is far
#: smaller), so that garbage claiming a huge length is not checksummed at every offset.
RESYNC_ENTRY_LIMIT = 1024 * 1024
#: How far seqs skip ahead when damage hid the floor: the seqs given out before the last
#: compaction are then unknown (they may lie far above every pending one), and no daemon
#: gives out this many wakes between two compactions of its log.
SEQ_SKIP_WITHOUT_FLOOR = 2**32
#: A parent that wakes are for: ("run", run id) or ("worker", worker id).
WakeKey = tuple[str, str]


def key_of(wake: Wake) -> WakeKey:
    return ("worker", wake.parent) if wake.parent is not None else ("run", wake.run)


class WakeQueue:
    def __init__(self) -> None:
        self.pending: dict[int, Wake] = {}
        self.last_seq = 0
        self._posted: set[tuple[str, int]] = set()  # (worker id, attempt)

    def post(
        self,
        *,
        worker: str,
        run: str,
        parent: str | None,
        state: WorkerState,
        exit_code: int | None,
        preview: str,
        attempt: int,
    ) -> Wake | None:
        """The wake for this ending, or None if this attempt already posted one."""
        if (worker, attempt) in self._posted:
            return None
        self.last_seq += 1
        wake = Wake(
            seq=self.last_seq,
            id=worker,
            run=run,
            parent=parent,
            state=state,
            exit_code=exit_code,
            preview=preview,
            attempt=attempt,
        )
        self.restore(wake)
        return wake

    def restore(self, wake: Wake) -> None:
        """Take back a wake read from the log."""
        self._posted.add((wake.id, wake.attempt))
        self.pending[wake.seq] = wake
        self.last_seq = max(self.last_seq, wake.seq)

    def was_posted(self, worker: str, attempt: int) -> bool:
        return (worker, attempt) in self._posted

    def pending_for(self, key: WakeKey, after: int = 0) -> list[Wake]:
        """Unacknowledged wakes for `key` with seq > after, oldest first."""
        return sorted(
            (w for w in self.pending.values() if w.seq > after and key_of(w) == key),
            key=lambda w: w.seq,
        )

    def ack(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.pending.pop(seq, None)

    def of_run(self, run: str) -> list[int]:
        """The seqs of the unacknowledged wakes of `run`'s workers, whoever they are for."""
        return [seq for seq, wake in self.pending.items() if wake.run == run]


class _Post(msgspec.Struct, tag="post"):
    wake: Wake


class _Ack(msgspec.Struct, tag="ack"):
    seqs: list[int]


class _Floor(msgspec.Struct, tag="floor"):
    """Written by compaction: seqs up to here were used, even if none is pending."""

    last_seq: int


_Record = _Post | _Ack | _Floor
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record)


class WakeLog:
    """The queue's file: every post and ack appended, so a crash loses none."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._records = 0
        self._size = 0
        #: What replay found damaged, for a person to see (`info.problems`).
        self.problems: list[str] = []

    def open(self) -> WakeQueue:
        """Replay the log into a queue, then compact it.

        A torn tail is cut: the post or ack it held never completed. Damage
        before the tail (an entry whose checksum fails, or whose body does not
        decode) skips only that entry: replay goes on from the next one that
        verifies, and the damaged log is kept aside before compaction.
        """
        queue = WakeQueue()
        try:
            blob = read_regular(self.path, WAKE_LOG_READ_LIMIT)
        except FileNotFoundError:
            blob = b""
        damaged: list[int] = []  # offsets where replay skipped
        skipped = 0  # bytes not replayed: damaged entries and a torn tail
        floor_seen = False
        offset = 0
        while offset + ENTRY_HEADER.size <= len(blob):
            record, end, whole = _entry_at(blob, offset)
            if record is None:
                following = _next_entry(blob, end if whole else offset + 1)
                if following is None:
                    if whole:
                        damaged.append(offset)
                    break  # the rest is damaged, or a torn tail: counted below
                damaged.append(offset)
                skipped += following - offset
                offset = following
                continue
            match record:
                case _Post(wake=wake):
                    queue.restore(wake)
                case _Ack(seqs=seqs):
                    queue.ack(seqs)
                    queue.last_seq = max([queue.last_seq, *seqs])  # each was given out
                case _Floor(last_seq=last_seq):
                    queue.last_seq = max(queue.last_seq, last_seq)
                    floor_seen = True
            offset = end
        skipped += len(blob) - offset
        queue.last_seq += _seqs_maybe_hidden(skipped, floor_seen)
        if damaged:
            self._keep_damaged(damaged)
        self.compact(queue)
        return queue

    def _keep_damaged(self, offsets: list[int]) -> None:
        """Keep the damaged log beside the new one, and say what was skipped."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}-{os.getpid()}")
        try:
            os.link(self.path, aside)  # the compaction renames a new file over the old name
        except OSError as exc:
            aside_note = f"it could not be kept aside ({exc.strerror or exc})"
        else:
            aside_note = f"the damaged log is kept as {aside}"
        problem = (
            f"the wake log {self.path} was damaged at byte(s) {', '.join(map(str, offsets))}: "
            f"{len(offsets)} entr{'y' if len(offsets) == 1 else 'ies'} skipped (a wake, or an "
            f"acknowledgement, may be lost there; every other was kept); {aside_note}"
        )
        log.error("wakes.log_damaged", problem=problem, offsets=offsets)
        self.problems.append(problem)

    def compact(self, queue: WakeQueue) -> None:
        """Rewrite the log as just what is pending, atomically.

        The floor goes first and last: the pending posts between may be far older than
        it, so one damaged copy must not be all that said which seqs were used.
        """
        records: list[_Record] = [_Floor(queue.last_seq)]
        records += [_Post(w) for w in sorted(queue.pending.values(), key=lambda w: w.seq)]
        records.append(_Floor(queue.last_seq))
        data = b"".join(_frame(r) for r in records)
        replace_file(self.path, data, what="compacting the wake log", durable=True)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._records = len(records)
        self._size = len(data)

    def posted(self, wake: Wake) -> None:
        self._append(_Post(wake))

    def acked(self, seqs: list[int]) -> None:
        self._append(_Ack(seqs))

    def should_compact(self, queue: WakeQueue) -> bool:
        return self._records > 1000 and self._records > 4 * (len(queue.pending) + 1)

    def _append(self, record: _Record) -> None:
        assert self._fd is not None, "WakeLog.open was not called"
        data = _frame(record)
        if os.write(self._fd, data) != len(data):
            # Cut the partial record, or every later one would follow garbage.
            os.ftruncate(self._fd, self._size)
            raise short_write("to the wake log", str(self.path))
        self._records += 1
        self._size += len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _entry_at(
    blob: bytes, offset: int, limit: int | None = None
) -> tuple[_Record | None, int, bool]:
    """The record framed at `offset`, where it ends, and whether its checksum verified
    (a whole entry whose body does not decode is damage, not a torn tail)."""
    length, crc = ENTRY_HEADER.unpack_from(blob, offset)
    end = offset + ENTRY_HEADER.size + length
    if end > len(blob) or length == 0 or (limit is not None and length > limit):
        return None, end, False
    body = blob[offset + ENTRY_HEADER.size : end]
    if zlib.crc32(body) != crc:
        return None, end, False
    try:
        return _decoder.decode(body), end, True
    except msgspec.DecodeError:  # a valid checksum over a body this image cannot read
        return None, end, True


def _seqs_maybe_hidden(skipped: int, floor_seen: bool) -> int:
    """How far past the highest seq replay saw a seq given out may lie, when `skipped`
    bytes of the log were not replayed. With a floor read, only posts appended since the
    compaction can be hidden, one per entry at most, and an entry takes a header and a
    byte at least; without one, the seqs the lost floor covered are unknown."""
    if not skipped:
        return 0
    if not floor_seen:
        return SEQ_SKIP_WITHOUT_FLOOR
    return skipped // (ENTRY_HEADER.size + 1) + 1


def _next_entry(blob: bytes, start: int) -> int | None:
    """The offset of the next entry that verifies and decodes, scanning forward from `start`."""
    for offset in range(start, len(blob) - ENTRY_HEADER.size + 1):
        if _entry_at(blob, offset, RESYNC_ENTRY_LIMIT)[0] is not None:
            return offset
    return None


def _frame(record: _Record) -> bytes:
    body = _encoder.encode(record)
    return ENTRY_HEADER.pack(len(body), zlib.crc32(body)) + body
