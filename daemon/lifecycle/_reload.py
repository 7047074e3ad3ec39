"""Reload in place: check the new image, pause, checkpoint, exec; and, in the new
image, adopt everything the checkpoint carries.

The check runs `subagentd --check` in a child only when the image on disk may not
be the image running (`_image.RunningImage`): an unchanged image is this very code,
so the config and the state dir, all that can have changed, are checked in place.

The old image keeps every worker alive across the exec: their pipes and
journals, the listening socket, the state-dir lock and the connections that
asked are inherited descriptors, each handed in by its owner to one inventory
(`_carried.Carried`) and listed once in the checkpoint, with the daemon's
settings; the command line names only the checkpoint. Each pid stays our
child, so the new image waits on it through a fresh pidfd. Signals are blocked
from just before the exec until the new image's handlers are in place.

Supervision is not stopped for the exec (stopping a thousand workers' tasks one by
one cost more than everything else in the old image): once the server is paused and
no task holds what the exec would lose (`Supervisor.wait_nothing_in_hand`), the
checkpoint is taken and the exec made with no await between, so no task changes
what the checkpoint says, and every task parked in trio vanishes with the image.
If the check or the exec fails, the old image serves on, every worker still
supervised, having lost and withheld nothing, and holding exactly the descriptors
it held before.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from subagentd.protocol import Error, ReloadReply, Reply
from subagentd.protocol.errors import Busy, ErrorCode, Refused

from .._daemon import Daemon
from .._logging import get_logger
from .._settings import Settings
from ..processes._cgroup import outside_workers
from ..processes._process import WorkerProcess, reap
from ..serving._handover import Handover, owed_by_connection
from ..serving._listener import ControlSocket
from ..serving._notify import monotonic_usec, notify
from ..store._archive import STDOUT_TAIL_BYTES, Archive
from ..store._journal import Journal, JournalCorrupt, JournalNotAdopted
from ..store._legacy import import_checkpoint_v1
from ..store._statedir import ensure_private_dir
from ..workers._agents import ConfigError, load_agents
from ..workers._supervisor import LiveWorker
from ._carried import Carried
from ._checkpoint import (
    CHECKPOINT_VERSION,
    WRITES_VERSIONS,
    CarriedConnection,
    CarriedJournal,
    CarriedWorker,
    Checkpoint,
    carries_journals,
    carries_relays,
    carries_store_lock,
)
from ._image import RunningImage
from ._recovery import recover

log = get_logger()

#: Blocked from just before the exec until the new image can handle them.
RELOAD_SIGNALS = {signal.SIGHUP, signal.SIGTERM, signal.SIGINT}
#: The new image must pass `subagentd --check` within this.
CHECK_TIMEOUT = 60.0
#: What supervision holds that an exec would lose (a journal write the disk refuses, a
#: failed worker's ending) not put down within this refuses the reload.
IN_HAND_SECONDS = 5.0
#: The store's problems a reload hands on (the newest): what a person has still to see.
CARRIED_PROBLEMS = 100
#: Environment variable naming workers (by name, comma-separated) a reload must
#: not carry live: a fault-injection hook for tests of the stop-and-archive path.
NO_CARRY_ENV = "SUBAGENTD_FAULT_NO_CARRY"
#: SUBAGENTD_FAULT's (point, target) that makes the exec's image a file the kernel will
#: not run (the checkpoint itself), once: a real failed exec, everything carried.
UNEXECUTABLE_FAULT = ("reload", "unexecutable")


def image_command(*args: str) -> list[str]:
    """How to run the image installed now: this interpreter, the package on disk."""
    return [sys.executable, "-m", "subagentd.daemon", *args]


@dataclass(eq=False)
class _Attempt:
    requesters: list[tuple[object, int]] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    failure: Error | None = None
    stopped_by_reload: list[str] = field(default_factory=list)


class Reloader:
    """One reload at a time: a second request joins the one under way."""

    def __init__(
        self,
        daemon: Daemon,
        server: ServerLike,
        *,
        checkpoint_path: Path,
        control: ControlSocket,
        settings: Settings,
        no_carry: frozenset[str] = frozenset(),
        last_reload: float = -math.inf,
    ) -> None:
        self.daemon = daemon
        self.server = server
        self.checkpoint_path = checkpoint_path
        self.control = control
        #: Carried to every next image as they are: see `Checkpoint.settings`.
        self.settings = settings
        self.no_carry = no_carry
        self._attempt: _Attempt | None = None
        #: When the last reload ended, on trio's clock (so a test's mock clock rules the
        #: rate limit); a new image starts it when it serves.
        self._last = last_reload
        self.nursery: trio.Nursery | None = None  # where attempts run: set by the daemon
        #: This image's files as it starts serving: a reload into the same skips --check.
        self.image = RunningImage.stamped()
        #: The checkpoint version the next image reads (its --check says; this one's own
        #: when the image is unchanged).
        self.next_version = CHECKPOINT_VERSION

    async def reload(self, requester: object | None, request_id: int) -> Reply | None:
        """Reload, or join the reload under way; None once the exec has happened (the new
        image answers the requester), else the error that stopped it.

        The attempt runs in the daemon's own nursery, not in the requesting
        connection's task: pausing the server cancels every connection's tasks.
        """
        if self.daemon.spawner.shutting_down:
            raise Refused("the daemon is shutting down; it will not reload")
        attempt = self._attempt
        if attempt is None:
            interval = self.settings.reload_interval
            wait = self._last + interval - trio.current_time()
            if wait > 0:
                raise Busy(
                    f"the last reload ended {interval - wait:.1f} s ago; "
                    f"reload again in {wait:.1f} s",
                    retry_after=wait,
                )
            assert self.nursery is not None, "Reloader.nursery is not set"
            attempt = self._attempt = _Attempt()
            self.nursery.start_soon(self._run, attempt)
        if requester is not None:
            attempt.requesters.append((requester, request_id))
        await attempt.done.wait()
        return _answer(attempt.failure, request_id)

    async def _run(self, attempt: _Attempt) -> None:
        try:
            await self._reload(attempt)
        except Exception as exc:
            # Whatever was done has been undone on the way out (see _reload): serve on. What
            # cannot be undone is said: the workers it stopped, as it could not carry them.
            attempt.failure = _failure(exc, attempt.stopped_by_reload)
            if isinstance(exc, Refused | OSError):
                log.error("reload.failed", error=attempt.failure.message)
            else:
                log.exception("reload.failed")
        finally:
            self._attempt = None
            self._last = trio.current_time()
            attempt.done.set()

    async def _reload(self, attempt: _Attempt) -> None:
        """Check, pause, exec. Each step that changes something is a scope that undoes it
        if what follows fails, so a failure undoes exactly what was done."""
        daemon = self.daemon
        daemon.faults.raise_at("reload", "early", once=True)
        # Before the fence: the old image serves on, spawns too, while a changed image's
        # --check child runs (a few hundred ms).
        log.info("reload.checking")
        how = await self._check_new_image()
        daemon.spawner.reloading = True
        try:
            # Every launch in flight (a run's resume holds one for all its heads) is
            # waited for, however long: the fence refuses new ones meanwhile.
            await daemon.supervisor.launches_settled()
            if self.no_carry:
                attempt.stopped_by_reload = await self._stop_uncarriable()
            log.info("reload.checked", check=how)
            await self._wait_nothing_in_hand()  # refused here, if so, before anyone waits
            relays = daemon.launcher.relays
            if relays.streams() and not carries_relays(self.next_version):
                raise Refused(
                    f"the new image cannot carry the {relays.streams()} output streams its "
                    "relays hold (it reads checkpoints before version 5)"
                )
            # The relays' messages wait in their sockets from here: the next image reads
            # them (`_relay`); every one received before is journaled and credited first.
            with _reloading_told(), _collection_paused(), relays.reading_paused():
                async with self.server.paused(
                    attempt.requesters, lambda exc: _failure(exc, attempt.stopped_by_reload)
                ) as kept:
                    await self._wait_nothing_in_hand(relays=True)
                    # From here to the exec, no await: nothing else runs (bench/reload.py
                    # still names this `frozen`).
                    log.info("reload.frozen")
                    daemon.afterwards.now()  # the exec takes none with it
                    if daemon.spawner.shutting_down:  # SIGTERM came while we paused: stopping wins
                        raise Refused("the daemon is shutting down; it will not reload")
                    self._exec(attempt, kept)
        finally:
            daemon.spawner.reloading = False
            daemon.supervisor.handed_over = False  # the exec failed: this image supervises on

    async def _check_new_image(self) -> str:
        """Refuse the reload unless the image on disk now can take over with this config
        and state dir, reading this checkpoint format and store schema; how it was
        checked (said in `reload.checked`)."""
        changed = self.image.changed_on_disk()
        self.next_version = CHECKPOINT_VERSION
        if changed is None:
            self._check_in_place()
            return "image unchanged: config and state dir checked in place"
        await self._check_in_a_child()
        return f"--check in a child: {changed}"

    def _check_in_place(self) -> None:
        """What `subagentd --check` checks that can change while the image does not, by
        the same code (`_main.check`), refused in the same words."""
        problems = []
        try:
            load_agents(self.settings.config)
        except ConfigError as exc:
            problems.append(str(exc))
        try:
            ensure_private_dir(self.settings.state_dir)
        except OSError as exc:
            problems.append(f"state dir {self.settings.state_dir}: {exc}")
        if problems:
            raise Refused(f"the new image refuses this reload: {'; '.join(problems)}")

    async def _check_in_a_child(self) -> None:
        """Run the image on disk's `--check`: it must load, and read a checkpoint version
        this image writes (the newest it reads is written: `next_version`) and the
        store's schema in use."""
        settings = self.settings
        command = image_command(
            "--check",
            "--config",
            str(settings.config),
            "--state-dir",
            str(settings.state_dir),
            "--socket",
            str(settings.socket),
        )
        # Forked in a thread while spawns go on: never while the daemon stands in a
        # worker's cgroup to fork that worker (the check would be born in it).
        child = await trio.to_thread.run_sync(_start_check, command)
        try:
            with trio.move_on_after(CHECK_TIMEOUT) as timer:
                stdout, stderr = await trio.to_thread.run_sync(
                    child.communicate, abandon_on_cancel=True
                )
        finally:
            if child.returncode is None:
                child.kill()  # the abandoned communicate() then reaps it
        if timer.cancelled_caught:
            raise Refused(f"the new image's --check did not finish within {CHECK_TIMEOUT} s")
        if child.returncode != 0:
            said = stderr.decode(errors="replace").strip()
            errors = [
                line.removeprefix("error: ")
                for line in said.splitlines()
                if line.startswith("error: ")
            ]
            raise Refused(f"the new image refuses this reload: {'; '.join(errors) or said}")
        # The new image just reopens the store: it must read the schema in use.
        said = stdout.decode(errors="replace")
        refusal = image_refusal(said, self.daemon.store.version)
        if refusal is not None:
            raise Refused(refusal)
        self.next_version = max(set(WRITES_VERSIONS) & _versions_read(said, "checkpoint"))

    async def _wait_nothing_in_hand(self, *, relays: bool = False) -> None:
        """Return once no launch is in flight and supervision holds nothing an exec would
        lose (`relays`: nor the output relays' ports, once their reading is paused);
        refused if that takes over IN_HAND_SECONDS."""
        supervisor, ports = self.daemon.supervisor, self.daemon.launcher.relays
        with trio.move_on_after(IN_HAND_SECONDS):
            while True:  # each wait returns without an await once nothing is held
                await supervisor.launches_settled()  # none starts behind the fence
                await supervisor.wait_nothing_in_hand()
                if not relays or ports.nothing_in_hand():
                    return
                # That awaits: an ending or a chunk may come into supervision's hand
                # meanwhile (a Drop into a port's), so both are asked again.
                await ports.wait_nothing_in_hand()
        raise Refused(
            f"supervision still held, after {IN_HAND_SECONDS:g} s, a worker's output that "
            "the disk would not take (`subagentctl info` says why) or a failed worker's "
            "ending: the reload would lose it; reload again once there is room"
        )

    async def _stop_uncarriable(self) -> list[str]:
        """Stop, before the exec, the workers that cannot be carried live."""
        daemon = self.daemon
        ids = [w.record.id for w in daemon.supervisor.workers() if w.record.name in self.no_carry]
        stopped = sorted(i for w in ids for i in daemon.registry.stop(w, reason="reload"))
        daemon.supervisor.ask_stop(stopped)
        await daemon.supervisor.wait_ended(stopped)
        if stopped:
            log.warning("reload.stopped_uncarriable", workers=stopped)
        return stopped

    def _exec(self, attempt: _Attempt, kept: dict[object, Handover]) -> None:
        """Carry every descriptor, write the checkpoint, exec; if the exec fails, leaving
        `Carried` gives back all it took (the kept connections are resumed by the server)."""
        daemon = self.daemon
        with Carried() as carried:
            checkpoint = self.checkpoint(
                carried, kept, attempt.requesters, stopped_by_reload=attempt.stopped_by_reload
            )
            if carries_store_lock(checkpoint.version):
                handed = carried.hand_over(checkpoint, _mangled(daemon.faults.asked))
                command = image_command("--handoff-fd", str(handed), *self.settings.command_line())
            else:  # an image on disk that reads only a checkpoint file (before version 4)
                carried.write(self.checkpoint_path, checkpoint)
                command = image_command("--handoff", str(self.checkpoint_path))
            if UNEXECUTABLE_FAULT in daemon.faults:
                daemon.faults.asked -= {UNEXECUTABLE_FAULT}
                command[0] = str(self.settings.state_dir)  # a directory: execv fails, EACCES
            log.info(
                "reload.exec",
                workers=len(checkpoint.live),
                descriptors=len(carried.descriptors),
                command=command,
            )
            with _signals_blocked():
                os.execv(command[0], command)

    def checkpoint(
        self,
        carried: Carried,
        kept: dict[object, Handover],
        requesters: list[tuple[object, int]],
        *,
        stopped_by_reload: list[str],
    ) -> Checkpoint:
        """What the next image is handed, once paused, with nothing in hand: the live
        workers' records in the store, every descriptor it needs handed in to `carried` by its
        owner and listed. (The in-process tests build a reload from this, as the exec
        does: tests/inprocess.py.)"""
        daemon = self.daemon
        # A stop of many's notes left to the endings, written before the journals are
        # carried: the next image takes a stop asked for said in the journal.
        daemon.supervisor.hand_over()
        # The live workers' records as they stand now (a stop asked since their start is
        # known in memory alone, and a start whose commit failed on a full disk): the new
        # image takes every record from the store.
        daemon.store.commit_changed(
            [live.record for live in daemon.supervisor.workers()], "a reload"
        )
        lock_fd, lock_file_fd = daemon.state_dir.carry(carried)
        journals = carries_journals(self.next_version)
        store_lock = daemon.store.lock if carries_store_lock(self.next_version) else None
        return Checkpoint(
            version=self.next_version,
            image_generation=daemon.image_generation,
            reloads=daemon.reloads,
            listen_fd=self.control.carry(carried),
            listen_owned=self.control.owned,
            lock_fd=lock_fd,
            lock_file_fd=lock_file_fd,
            store_lock_fd=None if store_lock is None else store_lock.carry(carried),
            live=[_carried(live, carried, journals) for live in daemon.supervisor.workers()],
            problems=daemon.store.problems[-CARRIED_PROBLEMS:],
            requesters=[
                CarriedConnection(
                    fd=carried.carry(conn.fd, "a connection that asked for the reload"),
                    request_id=rids[0],
                    later_request_ids=rids[1:],
                    unread=conn.unread,
                    delivered=sorted(conn.delivered),
                    caller=conn.caller,
                )
                for conn, rids in owed_by_connection(requesters, kept)
            ],
            stopped_by_reload=stopped_by_reload,
            settings=self.settings,
            relays=daemon.launcher.relays.carry(carried.carry)
            if carries_relays(self.next_version)
            else [],
        )


def _mangled(faults: frozenset[tuple[str, str]]) -> Callable[[bytes], bytes]:
    """What SUBAGENTD_FAULT's `handoff:garbage` or `handoff:truncated` make of the
    checkpoint handed over (a test's stand-in for an image whose checkpoint is wrong)."""
    if ("handoff", "garbage") in faults:
        return lambda raw: b"\x93garbage" + raw[::-1]
    if ("handoff", "truncated") in faults:
        return lambda raw: raw[: len(raw) // 2]
    return bytes


class ServerLike(Protocol):
    """What the reloader needs of the server (the real one is `_server.Server`)."""

    def paused(
        self, requesters: list[tuple[object, int]], failure: Callable[[BaseException], Error]
    ) -> AbstractAsyncContextManager[dict[object, Handover]]:
        """Not serving for the body: every client told `reloading`, the requesters'
        connections kept (by connection), each other request in flight on them answered
        `reloading`. Serving again after it, each kept connection first answered
        `failure(exc)` for each of its requests if it raised."""


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block the reload's signals for an exec: the new image unblocks them once it can
    handle them; if the exec fails, unblocked again here."""
    signal.pthread_sigmask(signal.SIG_BLOCK, RELOAD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOAD_SIGNALS)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """No garbage collection from the pause to the exec, which frees everything anyway:
    the checkpoint of a thousand workers allocates thousands of objects among a heap of
    hundreds of thousands, and a collection among them costs more than the checkpoint
    (in-process, 1,000 workers, 5 each: checkpoint median 57 ms with it, one of them
    397 ms, 28 ms without). On again if the reload fails."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def _reloading_told() -> Iterator[None]:
    """The service manager hears RELOADING=1; READY=1 again if the reload fails (on
    success, the new image says it)."""
    notify("RELOADING=1", monotonic_usec(), "STATUS=reloading")
    try:
        yield
    except BaseException:
        notify("READY=1", "STATUS=serving (reload failed)")
        raise


def _failure(exc: BaseException, stopped: Sequence[str] = ()) -> Error:
    """What the requesters of a reload that failed with `exc` are told (with id 0), having
    stopped the workers `stopped` (which it could not carry) before it failed."""
    if isinstance(exc, Refused):
        code, message = ErrorCode.REFUSED, exc.message
    elif isinstance(exc, OSError):
        code, message = ErrorCode.REFUSED, f"exec failed: {exc}; the old image serves on"
    else:
        code, message = ErrorCode.INTERNAL, f"reload failed: {exc!r}; serving on"
    if stopped:
        message += (
            f"; before failing it stopped {', '.join(sorted(stopped))}, which it could not "
            "carry (stopped_by_reload: resume each by its id)"
        )
    return Error(id=0, code=code, message=message, stopped_by_reload=sorted(stopped))


def _carried(live: LiveWorker, carried: Carried, journals: bool) -> CarriedWorker:
    """A live worker as the checkpoint carries it; `journals`: with its journal (one
    the next image need not open and verify again: about half of adopting a thousand
    `sleep` workers, and seconds for a thousand long journals)."""
    process = live.process
    assert process is not None, "no spawn is in flight once launches settled"
    stdout, stderr, stdin = process.carry(carried)
    journal = live.journal.carry(carried) if journals else None
    relay, relayed, key = None, [], ""
    for kind, stream in (process.relayed or {}).items():
        if stream.relay is not None and not stream.eof:  # a relay lost: lost in the next too
            relay, key = stream.relay.pid, stream.worker
            relayed.append(kind)
    # A parked one is carried by what it is, so that the next image takes that file only.
    parked = live.journal.parked() if journals and journal is None else None
    return CarriedWorker(
        id=live.record.id,
        pid=process.pid,
        pid_start=process.starttime,
        stdout=stdout,
        stderr=stderr,
        stdin=stdin,
        journal=None if journal is None else CarriedJournal(fd=journal[0], index=journal[1]),
        stdout_tail=b"" if journal is None and parked is None else bytes(live.stdout_tail),
        parked=parked,
        relay=relay,
        relayed=relayed,
        relay_key=key,
    )


def _answer(failure: Error | None, request_id: int) -> Reply | None:
    if failure is None:
        return None
    return msgspec.structs.replace(failure, id=request_id)


def image_refusal(check_output: str, schema_in_use: int) -> str | None:
    """Why a new image whose --check said `check_output` cannot take over, if it cannot:
    it must read a checkpoint version this image writes and the store's schema version
    in use."""
    versions = _versions_read(check_output, "checkpoint")
    if not versions & set(WRITES_VERSIONS):
        return (
            f"the new image reads checkpoint versions {sorted(versions)}, none of "
            f"{list(WRITES_VERSIONS)}; stop the daemon to change to it"
        )
    schemas = _versions_read(check_output, "store schema")
    if schema_in_use not in schemas:
        return (
            f"the new image reads store schema versions {sorted(schemas)}, not "
            f"{schema_in_use} (the one in use); stop the daemon to change to it"
        )
    return None


def _versions_read(check_output: str, what: str) -> set[int]:
    """The versions of `what` the new image's --check says it reads."""
    for line in check_output.splitlines():
        if line.startswith(f"reads {what} versions:"):
            return {int(v) for v in line.split(":", 1)[1].replace(",", " ").split()}
    return set()


# -- the new image's side ------------------------------------------------------


async def adopt(
    daemon: Daemon, checkpoint: Checkpoint, unread: list[str] | None = None
) -> tuple[int, list[str]]:
    """Take over every live worker the checkpoint carries, and the rest from the store;
    (workers carried live, ids stopped). `unread`: as for `recover`.

    A worker with no readable record in the store, or whose pid is no longer it, is
    stopped (if alive), ended `stopped_by_reload`, and said loudly.
    """
    if checkpoint.v1_state is not None:  # an older image reloading into this one
        import_checkpoint_v1(daemon.store, checkpoint.v1_state, daemon.state_dir.archives)
    stopped = list(checkpoint.stopped_by_reload)
    adopted: list[tuple[CarriedWorker, WorkerProcess, Journal, bytes]] = []
    daemon.launcher.relays.adopt(checkpoint.relays)  # before the workers whose streams they hold
    # One query for every carried worker's record (each is held: it has not ended), not
    # one a worker; recovery takes the same rows, unless a stop below changed some.
    held = daemon.store.held_workers()
    readable = {record.id for record in held[0]}
    # Where each was placed in limit nodes (the kernel kept them, and their limits).
    limit_paths = {record.id: record.limit_path for record in held[0] if record.limit_path}
    journal_fds = _journal_descriptors(checkpoint)
    with daemon.launcher.adopting():
        for carried in checkpoint.live:
            process: WorkerProcess | None = None
            journal: Journal | None = None
            try:
                archive = daemon.state_dir.archive_at(carried.id)
                if archive is None:
                    raise _NoRecord(f"{carried.id!r} is not a worker id")
                path = f"{archive}{os.sep}{Archive.JOURNAL}"
                # First, so that whatever fails below closes its descriptor (as a journal's).
                journal = _carried_journal(carried, path, journal_fds)
                if carried.id not in readable:
                    raise _NoRecord(f"worker {carried.id} has no readable record in the store")
                process = daemon.launcher.adopt(
                    carried.id,
                    carried.pid,
                    carried.pid_start,
                    carried.stdout,
                    carried.stderr,
                    carried.stdin,
                    None
                    if carried.relay is None
                    else (carried.relay, carried.relay_key or carried.id, carried.relayed),
                    limit_path=limit_paths.get(carried.id, ""),
                )
                if journal is None and carried.parked is not None:
                    try:
                        journal = Journal.parked_from(path, carried.parked)
                    except JournalNotAdopted as exc:
                        log.warning("reload.journal_reopened", worker=carried.id, reason=str(exc))
                if journal is not None:
                    stdout_tail = carried.stdout_tail[-STDOUT_TAIL_BYTES:]
                else:
                    # Verified whole while clients wait in the backlog: a million entries
                    # cost seconds of this reload (what carrying the journal spares).
                    journal = await daemon.reader.open_journal(Path(path), writable=True)
                    stdout_tail = journal.tail_bytes("stdout", STDOUT_TAIL_BYTES)
            except (_NoRecord, OSError, JournalCorrupt) as exc:  # OSError: pid gone too
                log.error("reload.cannot_adopt", worker=carried.id, pid=carried.pid, error=str(exc))
                if process is not None:
                    process.unwatch()  # reaped there; its pipes closed there too
                if journal is not None:
                    journal.release()
                await _stop_unadoptable(daemon, carried)
                stopped.append(carried.id)
                continue
            adopted.append((carried, process, journal, stdout_tail))
    await recover(
        daemon,
        carried=frozenset(c.id for c, _, _, _ in adopted),
        unread=unread,
        held=held if stopped == checkpoint.stopped_by_reload else None,  # a stop writes
    )
    held_on: list[tuple[str, WorkerProcess]] = []
    let_go: list[tuple[str, WorkerProcess]] = []
    for carried, process, journal, stdout_tail in adopted:
        live = LiveWorker(
            record=daemon.registry.worker(carried.id), journal=journal, process=process
        )
        live.stdout_tail += stdout_tail
        if live.record.paused_since is not None:
            paused = _paused_as_the_kernel_says(daemon, live, process)
            (held_on if paused else let_go).append((carried.id, process))
        daemon.supervisor.add(live)
    if held_on or let_go:
        # What a pause or unpause the reload cut short left half done is finished.
        await daemon.launcher.carry_pauses(held_on, let_go)
    daemon.image_generation = checkpoint.image_generation + 1
    daemon.reloads = checkpoint.reloads + 1
    return len(daemon.supervisor), stopped


def _paused_as_the_kernel_says(daemon: Daemon, live: LiveWorker, process: WorkerProcess) -> bool:
    """A worker is paused across a reload if the kernel still holds it (its cgroup's
    `cgroup.freeze`, else its leader stopped): the record's word is checked, never taken
    alone, nor the kernel's (a leader that stopped itself is not paused: its timeout
    runs). Paused since the record says (its timeout's deadline moves from then). One the
    record says paused that the kernel no longer holds (let go behind the daemon's back:
    its cgroup thawed, its tree sent SIGCONT) is journaled `unpaused`, as its pause ended.
    Whether it is paused."""
    if live.record.paused_since is not None and daemon.launcher.paused_now(process):
        return True
    daemon.supervisor.unpaused(live)
    return False


def _start_check(command: list[str]) -> subprocess.Popen[bytes]:
    """The new image's --check, started (in a thread) outside every worker's cgroup."""
    with outside_workers():
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )


class _NoRecord(Exception):
    pass


def _journal_descriptors(checkpoint: Checkpoint) -> set[int]:
    """The journal descriptors the checkpoint lists once, and only as a journal: one it
    lists twice (a checkpoint rewritten in a worker's reach) is no journal's alone."""
    listed = collections.Counter(checkpoint.descriptors())
    return {
        w.journal.fd for w in checkpoint.live if w.journal is not None and listed[w.journal.fd] == 1
    }


def _carried_journal(carried: CarriedWorker, path: str, journal_fds: set[int]) -> Journal | None:
    """The worker's journal as the checkpoint carried it, if it checks out (`Journal.adopt`);
    None (said in the log) to have it opened from `path` and verified whole instead."""
    if carried.journal is None:
        return None  # an image before journals were carried, or one not open for writing
    fd = carried.journal.fd
    try:
        if fd not in journal_fds:
            raise JournalNotAdopted(f"descriptor {fd} is listed twice in the checkpoint")
        journal_fds.discard(fd)  # adopted once at most
        return Journal.adopt(path, fd, carried.journal.index)
    except JournalNotAdopted as exc:
        log.warning("reload.journal_reopened", worker=carried.id, reason=str(exc))
        return None


async def _stop_unadoptable(daemon: Daemon, carried: CarriedWorker) -> None:
    """End a carried worker the new image cannot supervise: its tree, then its ending
    (record and wake, one transaction) as `stopped_by_reload`."""
    for fd in (carried.stdout, carried.stderr, carried.stdin):
        if fd is not None:
            os.close(fd)
    await daemon.launcher.end_leftover_tree(carried.id, carried.pid, carried.pid_start, 0.5)
    await reap(carried.pid)
    record = daemon.store.worker(carried.id)
    if record is None:
        return  # recovery rebuilds it from its snapshot, if its row is there to say so
    record.state = "stopped_by_reload"
    record.ended_at = daemon.clock()
    daemon.endings.record(record)


def reload_reply(daemon: Daemon, request_id: int, carried: int, stopped: list[str]) -> Reply:
    return ReloadReply(
        id=request_id,
        image_generation=daemon.image_generation,
        carried_live=carried,
        stopped_by_reload=sorted(stopped),
    )
