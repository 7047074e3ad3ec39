"""The wake log of images before the store: read once at start, its wakes imported into
the store, and renamed aside so it is never read again; and `open_wakes`, which loads the
queue from the store. A damaged entry costs only itself, and seqs skip past any it may
hide, so none is given twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from subagentd.protocol import Wake

from .._logging import get_logger
from ..core._wakes import WakeQueue
from ._checksum import crc32
from ._files import NotRegularFile, read_regular
from ._journal import ENTRY_HEADER
from ._store import SEQ_SKIP_WITHOUT_FLOOR, Store

#: Far above any old wake log (compaction kept it near what was pending).
WAKE_LOG_READ_LIMIT = 1024 * 1024 * 1024
#: Past damage, replay looks for the next entry no longer than this (a post or an ack is far
#: smaller), so that garbage claiming a huge length is not checksummed at every offset.
RESYNC_ENTRY_LIMIT = 1024 * 1024

log = get_logger()


class _Post(msgspec.Struct, tag="post"):
    wake: Wake


class _Ack(msgspec.Struct, tag="ack"):
    seqs: list[int]


class _Floor(msgspec.Struct, tag="floor"):
    """Written by compaction: seqs up to here were used, even if none is pending."""

    last_seq: int


_Record = _Post | _Ack | _Floor
_decoder = msgspec.msgpack.Decoder(_Record)


def open_wakes(store: Store, old_log: Path) -> WakeQueue:
    """The queue as the store holds it, after taking in `old_log` (the wake log of an
    image before the store) once: its pending wakes keep their seqs, its floor stays the
    floor, and it is renamed `<name>.imported` so that it is never read again."""
    try:
        _import_old_log(store, old_log)
    except OSError as exc:  # the store is still whole: the daemon serves, and says so
        problem = (
            f"the wake log {old_log} of an earlier version could not be imported "
            f"({exc.strerror or exc}): its wakes are not delivered until it is"
        )
        log.error("wakes.log_not_imported", problem=problem)
        store.problems.append(problem)
    queue = WakeQueue()
    wakes, floor = store.wakes()
    for wake in wakes:
        queue.restore(wake)
    queue.last_seq = max(queue.last_seq, floor)
    return queue


def _import_old_log(store: Store, old_log: Path) -> None:
    try:
        blob = read_regular(old_log, WAKE_LOG_READ_LIMIT)
    except FileNotFoundError:
        return
    except NotRegularFile:
        # Planted (a symlink, a FIFO): moved aside as it is, never followed or read.
        aside = old_log.with_name(f"{old_log.name}.not-ours")
        os.replace(old_log, aside)
        store.problems.append(
            f"the wake log {old_log} was not a regular file: set aside, unread, as {aside}"
        )
        return
    replayed, problems = _replay(blob, old_log)
    taken = store.import_wakes(
        sorted(replayed.pending.values(), key=lambda w: w.seq), replayed.last_seq
    )
    imported = old_log.with_name(f"{old_log.name}.imported")
    os.replace(old_log, imported)
    log.info("wakes.log_imported", log=str(imported), wakes=len(taken))
    for problem in problems:
        store.problems.append(f"{problem}; it is kept as {imported}")


def _replay(blob: bytes, path: Path) -> tuple[WakeQueue, list[str]]:
    """The queue a wake log (of an image before the store) leaves, and what was damaged.

    A torn tail is cut: the post or ack it held never completed. Damage
    before the tail (an entry whose checksum fails, or whose body does not
    decode) skips only that entry: replay goes on from the next one that
    verifies, and the next seq skips past any the damage may have hidden.
    """
    queue = WakeQueue()
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
    if not damaged:
        return queue, []
    problem = (
        f"the wake log {path} was damaged at byte(s) {', '.join(map(str, damaged))}: "
        f"{len(damaged)} entr{'y' if len(damaged) == 1 else 'ies'} skipped (a wake, or an "
        "acknowledgement, may be lost there; every other was kept)"
    )
    log.error("wakes.log_damaged", problem=problem, offsets=damaged)
    return queue, [problem]


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
    if crc32(body) != crc:
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
