"""The checkpoint a reload hands to the next image: what the store cannot hold (each
live worker's pid, start time, pipe descriptors and journal (its descriptor and
verified index, and its stdout's end), the listening socket, the lock, the
connections that asked: each listed once, `Checkpoint.descriptors`) and the daemon's
settings, versioned and written atomically, 0600.

Everything else the daemon knows (records, runs, wakes, tombstones, turn, fence) is in
the store (`_store.py`), which the new image opens again; the old image writes its live
workers' records there just before the checkpoint. Version 1, written by images before
the store held them, carried the whole registry: still read, and what it carried taken
into the store (`_legacy.import_checkpoint_v1`). Version 3 added the journals: an image
that reads only 2 is handed a version 2 checkpoint, without them (`carries_journals`),
as an image that knew nothing of them would leave their descriptors inheritable.
Version 4 added the store's lock (`store_lock_fd`), and is handed over in a sealed
memfd (`sealed_checkpoint`) named on the command line with the settings, rather than
in a file in the state dir, where any process of the user could rewrite it: an image
that reads only 3 is handed a version 3 checkpoint in the file, as before.
Version 5 added the output relays (`relays`, and each relayed worker's `relay` and
`relayed` streams): an image that reads only 4 is refused a reload while any worker is
relayed (it would hold none of their output), and handed a version 4 checkpoint otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import msgspec

from .._settings import Settings, decode_path, encode_path
from ..processes._relay import CarriedRelay
from ..store._files import read_regular, replace_file
from ..store._journal import JournalIndex, ParkedJournal
from ..store._legacy import CheckpointV1State

#: The format written here. Bump on an incompatible change and keep reading the old.
CHECKPOINT_VERSION = 5
#: The format written for an image that does not read this one: the same, less what
#: it added (see `carries_journals`, `carries_store_lock`).
WRITES_VERSIONS = (2, 3, 4, 5)
#: Every format this image reads (announced by `subagentd --check`).
READS_VERSIONS = (1, 2, 3, 4, 5)
#: Far above any real checkpoint (about a kilobyte a worker); a larger file is no checkpoint.
CHECKPOINT_READ_LIMIT = 1024 * 1024 * 1024


class CarriedJournal(msgspec.Struct, kw_only=True):
    """A live worker's journal, open for appending: checked, not trusted (`Journal.adopt`)."""

    fd: int
    index: JournalIndex


class CarriedWorker(msgspec.Struct, kw_only=True):
    """A live worker: its record is in the store, under its id."""

    id: str
    pid: int
    pid_start: int
    stdout: int | None  # descriptor numbers, valid across the exec
    stderr: int | None
    #: The write end of its stdin, for a worker spawned with stdin open (None: an image
    #: before `send`, or a worker without one).
    stdin: int | None = None
    #: Its journal (None: a version 2 checkpoint, or a journal not open for writing: the
    #: new image opens it from its path and verifies it whole).
    journal: CarriedJournal | None = None
    #: The end of its stdout as supervision holds it (with `journal` or `parked` alone:
    #: else the journal opened again gives it).
    stdout_tail: bytes = b""
    #: The pid of the output relay holding its streams (`stdout`/`stderr` None then), and
    #: which of them are still open there (version 5; None: not relayed).
    relay: int | None = None
    relayed: list[str] = []
    #: What the relay names those streams by (this attempt's key: `_relay.stream_key`).
    relay_key: str = ""
    #: Its journal while parked (no descriptor held): the file it is, what was written of
    #: it. None: one carried, or an image before this; taken from a sealed memfd alone.
    parked: ParkedJournal | None = None


class CarriedConnection(msgspec.Struct, kw_only=True):
    """A connection that asked for the reload, answered by the new image: one
    descriptor, however many reloads it asked (each is owed its own answer)."""

    fd: int
    request_id: int  # the first it asked
    later_request_ids: list[int] = []
    #: Bytes the old image read from it but had not taken as requests: read first.
    unread: bytes = b""
    #: Wakes delivered on it and not yet acknowledged: an `ack` of them stays valid.
    delivered: list[int] = []
    #: Whom it acts as (a worker's id; None: the user), as its hello settled it.
    caller: str | None = None

    @property
    def request_ids(self) -> list[int]:
        return [self.request_id, *self.later_request_ids]


class Checkpoint(msgspec.Struct, kw_only=True):
    version: int = CHECKPOINT_VERSION
    image_generation: int
    reloads: int
    listen_fd: int
    #: False when the service manager made the socket file (activation): never unlink it.
    listen_owned: bool = True
    lock_fd: int
    live: list[CarriedWorker]
    #: The connections that asked for this reload, each owed an answer.
    requesters: list[CarriedConnection] = []
    #: Workers the old image had to stop rather than carry.
    stopped_by_reload: list[str] = []
    #: What the old image's store found wrong (`info.problems`), still to be seen after
    #: the reload: a store put back just before the exec says so only there.
    problems: list[str] = []
    #: Read from a version 1 checkpoint: the registry it carried (None in what this image
    #: writes: the store holds it).
    v1_state: CheckpointV1State | None = None
    #: The daemon's settings, which the new image serves with (its own defaults do not
    #: apply). None: an image that passed them on the command line instead.
    settings: Settings | None = None
    #: The flocked file `lock`, which images from before the lock moved to the directory
    #: take; None: not held, or an image that did not say (the new image looks for it).
    lock_file_fd: int | None = None
    #: The store's lock (`StoreLock`), held across the exec; None: a version before 4, or
    #: a store opened without one (the new image takes it afresh).
    store_lock_fd: int | None = None
    #: The output relays, their sockets carried (version 5; none before).
    relays: list[CarriedRelay] = []

    def descriptors(self) -> list[int]:
        """Every descriptor this checkpoint carries, each where the new image finds it."""
        fds = [self.listen_fd, self.lock_fd]
        if self.lock_file_fd is not None:
            fds.append(self.lock_file_fd)
        if self.store_lock_fd is not None:
            fds.append(self.store_lock_fd)
        for worker in self.live:
            fds += (fd for fd in (worker.stdout, worker.stderr, worker.stdin) if fd is not None)
            if worker.journal is not None:
                fds.append(worker.journal.fd)
        fds += (conn.fd for conn in self.requesters)
        fds += (relay.fd for relay in self.relays)
        return fds


def carries_journals(version: int) -> bool:
    """Whether a checkpoint of `version` carries the live workers' journals."""
    return version >= 3


def carries_relays(version: int) -> bool:
    """Whether a checkpoint of `version` carries the output relays and relayed workers."""
    return version >= 5


def carries_store_lock(version: int) -> bool:
    """Whether a checkpoint of `version` carries the store's lock, and is handed over in a
    memfd named on the command line with the settings, not in a file."""
    return version >= 4


class _Version(msgspec.Struct):
    version: int


class CheckpointUnreadable(Exception):
    pass


_encoder = msgspec.msgpack.Encoder(enc_hook=encode_path)
_decoder = msgspec.msgpack.Decoder(Checkpoint, dec_hook=decode_path)


#: What a handed-over checkpoint's memfd is sealed with: nothing can change it once written.
HANDED_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    return _encoder.encode(checkpoint)


def sealed_checkpoint(raw: bytes) -> int:
    """A memfd holding `raw`, sealed (no process can write, grow or shrink it), close-on-
    exec until carried: what a reload hands the next image, named by number on its
    command line. Unlike a file in the state dir, no other process can replace it."""
    fd = os.memfd_create("subagentd-checkpoint", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, HANDED_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_handed(fd: int) -> Checkpoint:
    """The checkpoint in the sealed memfd `fd` a reload handed over (closed after)."""
    what = f"the checkpoint handed over as descriptor {fd}"
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
            if seals & HANDED_SEALS != HANDED_SEALS:
                raise CheckpointUnreadable(f"{what} is not sealed (seals {seals:#x})")
            if size > CHECKPOINT_READ_LIMIT:
                raise CheckpointUnreadable(f"{what} is {size} bytes: no checkpoint")
            raw = os.pread(fd, size, 0)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    except OSError as exc:
        raise CheckpointUnreadable(f"cannot read {what}: {exc.strerror}") from exc
    return decode_checkpoint(raw, what)


#: SUBAGENTD_FAULT's (point, target) that has the new image write the checkpoint it was
#: handed to KEPT_CHECKPOINT in the state dir, for a test to read what was carried.
KEEP_HANDED_FAULT = ("handoff", "keep")
KEPT_CHECKPOINT = "checkpoint.kept"


def keep_handed(state_dir: Path, checkpoint: Checkpoint) -> None:
    """For a test (`KEEP_HANDED_FAULT`): the checkpoint handed over, as a file to read."""
    replace_file(state_dir / KEPT_CHECKPOINT, encode_checkpoint(checkpoint), what="kept")


def write_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Not fsynced: only the image exec'd a moment later reads it (`--handoff` names it,
    and nothing else does), from the page cache; a machine that goes down leaves no
    process to adopt, and the next start recovers from the store (about 5 ms of a
    reload's critical path on ext4, in-process at 1,000 workers)."""
    replace_file(path, _encoder.encode(checkpoint), what="of the checkpoint")


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in the file at `path` (an image before version 4 wrote it there)."""
    try:
        raw = read_regular(path, CHECKPOINT_READ_LIMIT)
    except OSError as exc:
        raise CheckpointUnreadable(f"cannot read checkpoint {path}: {exc.strerror}") from exc
    return decode_checkpoint(raw, f"checkpoint {path}")


def decode_checkpoint(raw: bytes, what: str) -> Checkpoint:
    """The checkpoint `raw` holds, or CheckpointUnreadable saying why not (`what` it is)."""
    try:
        version = msgspec.msgpack.decode(raw, type=_Version).version
    except msgspec.DecodeError as exc:
        raise CheckpointUnreadable(f"{what} is not a checkpoint: {exc}") from exc
    if version not in READS_VERSIONS:
        raise CheckpointUnreadable(
            f"{what} has version {version}; this image reads {list(READS_VERSIONS)}"
        )
    try:
        checkpoint = _decoder.decode(raw)
        if version == 1:
            checkpoint.v1_state = msgspec.msgpack.decode(raw, type=CheckpointV1State)
    except msgspec.DecodeError as exc:
        raise CheckpointUnreadable(f"{what} does not decode: {exc}") from exc
    return checkpoint
