"""Per-worker cgroups: the kernel's own record of which processes are a worker's.

Where the daemon's cgroup (v2) is delegated to it (a user service with
Delegate=yes, or a daemon run as root), every worker gets a cgroup of its own,
``<the daemon's cgroup>/subagentd-<state dir hash>/<worker id>``. Whatever the
worker forks is born in it and stays there, double forks, setsid and a cleared
environment included. Finding a worker's processes is then one read of
``cgroup.procs``, and ``cgroup.kill`` ends what ignored TERM. Where there is no
such cgroup to use, the daemon says so and falls back to scanning /proc (see
_tree); the checks here never guess.

A worker is born in its cgroup (see `WorkerCgroup.born_in`), so not even
what it forks in its first microseconds escapes. The same record tells the daemon
which worker a connecting process belongs to (`Cgroups.worker_of`, `peer_cgroup`):
the kernel, not the process's environment, says whom it acts as.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import select
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from .._logging import get_logger
from ._tree import DESCRIPTOR_ERRNOS, Graces, patiently

log = get_logger()

#: Held while the daemon stands in a worker's cgroup to fork it (and in its limit nodes,
#: `_controllers`, entered inside it: so reentrant).
_FORK_LOCK = threading.RLock()
#: How much of cgroup.procs one read asks for (a pid and its newline take at most 8 bytes).
_PROCS_READ = 64 * 1024
#: The leaf of its delegated cgroup the daemon lives in (`Cgroups.find`): that cgroup may
#: then pass controllers on to the workers' cgroup (v2's no-internal-processes rule).
#: systemd's `DelegateSubgroup=subagentd-daemon` puts it there at start.
DAEMON_LEAF = "subagentd-daemon"
#: Below the workers' cgroup, where workers with cgroup v2 limits live (`_v2_nodes`):
#: `<base>/.limited/<run>/<worker>/.../self`. No worker's id begins with a dot.
LIMITED = ".limited"
#: The leaf a v2-limited worker's own processes live in, in its node (`_v2_limits.LEAF`).
LEAF = "self"


@contextlib.contextmanager
def outside_workers() -> Iterator[None]:
    """What a thread forks inside this block is born where the daemon lives: no worker's
    fork stands in its cgroup meanwhile (`WorkerCgroup.born_in` waits for it)."""
    with _FORK_LOCK:
        yield


class CgroupsUnavailable(Exception):
    """No cgroup of ours to put workers in; the message says why."""


class PeerUnplaced(Exception):
    """Where a connecting process runs could not be read; the message says why. The daemon
    refuses the connection rather than guess that it is no worker's."""


@dataclass(frozen=True)
class WorkerCgroup:
    """One worker's cgroup. Created for each attempt, removed once the attempt has ended."""

    path: Path
    #: The daemon's own cgroup, where it returns after a fork in this one.
    home: Path
    #: A v2-limited worker's leaf (`<its node>/self`, `_v2_nodes`): its worker is born in
    #: it by clone3(CLONE_INTO_CGROUP) (`_born_into`), never by the daemon stepping in.
    born_into: bool = False

    @property
    def name(self) -> str:
        """Its worker's id: the cgroup's name, or a leaf's node's."""
        return self.path.parent.name if self.born_into else self.path.name

    def create(self) -> None:
        # One left by an attempt that ended without removing it is reused: thawed, if a
        # pause left it frozen, since the daemon stands in it to fork (`born_in`).
        try:
            self.path.mkdir()
        except FileExistsError:
            with (
                contextlib.suppress(FileNotFoundError),
                open(self.path / "cgroup.freeze", "wb") as f,
            ):
                f.write(b"0")

    def exists(self) -> bool:
        return self.path.is_dir()

    @contextlib.contextmanager
    def born_in(self) -> Iterator[None]:
        """What forks inside this block is born in the cgroup: the daemon steps in for the fork.

        Python cannot fork straight into a cgroup (no CLONE_INTO_CGROUP), and
        moving a worker in after its exec is too late: a shell forks within
        microseconds. So the daemon moves itself in, forks, and moves back;
        one fork at a time. Nothing signals this cgroup meanwhile: a worker's
        cgroup is stopped only once its spawn has returned.
        """
        with _FORK_LOCK:
            # Made again if a removal took it after `create` (`remove_released`, in a
            # thread, under the same lock): never moved into a cgroup that is gone.
            self.create()
            _move(self.path, os.getpid())
            try:
                yield
            finally:
                try:
                    _move(self.home, os.getpid())
                except OSError as exc:
                    # Never a reason to lose the worker just forked. The daemon
                    # stays here until the next fork's return home; `kill` sees
                    # it and spares it, and `members` never lists it.
                    log.critical("cgroup.cannot_return", cgroup=str(self.path), error=str(exc))

    def members(self) -> list[int]:
        """The pids in the cgroup now (an exited process is not one); none once it is removed.

        Never the daemon, should it be caught standing in the cgroup to fork.
        """
        me = os.getpid()
        return [pid for pid in self._listed() if pid != me]

    def kill(self) -> None:
        """SIGKILL everything in the cgroup (and whatever it forks meanwhile), never the daemon."""
        listed = self._listed()
        if os.getpid() not in listed:
            if listed:
                with open(self.path / "cgroup.kill", "wb") as f:
                    f.write(b"1")
            return
        for pid in self.members():  # one by one, sparing the daemon caught in here
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(pid)
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)

    def _listed(self) -> list[int]:
        """The pids in the cgroup, and in any cgroup the worker made inside it (a process
        that moved itself in there is still the worker's: `cgroup.kill` ends it too)."""
        listed = _read_procs(self._procs)
        if not listed and self.populated():  # only what is nested: rare, so looked for last
            for nested in self._nested():
                listed += _read_procs(os.fsencode(nested / "cgroup.procs"))
        return listed

    def populated(self) -> bool:
        """Whether any process is in the cgroup or below it (`cgroup.events`); an exited
        process is not (a zombie has left its cgroup), nor one in a removed cgroup."""
        try:
            return "populated 1" in _read_small(self._events)
        except FileNotFoundError:
            return False

    def _nested(self) -> list[Path]:
        """The cgroups the worker made inside its own, deepest first."""
        return [
            Path(parent) / name
            for parent, dirs, _ in os.walk(self.path, topdown=False)
            for name in dirs
        ]

    @functools.cached_property
    def _events(self) -> str:
        return str(self.path / "cgroup.events")

    @functools.cached_property
    def _procs(self) -> bytes:
        return os.fsencode(self.path / "cgroup.procs")

    def remove(self) -> bool:
        """Remove the (empty) cgroup, and those the worker made inside it; False if
        something still lives in it."""
        try:
            try:
                os.rmdir(self._path_bytes)  # the common case: none nested, no walk of it
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
                for nested in self._nested():
                    with contextlib.suppress(FileNotFoundError):
                        nested.rmdir()
                self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True

    def remove_unless(self, wanted: Callable[[str], bool]) -> bool:
        """`remove`, unless `wanted(its name)` says a worker's attempt uses it again: for a
        thread, under the lock every fork into a cgroup takes, so the removal never comes
        between its new attempt's `create` and its fork (`born_in` makes it again). The
        cgroups nested in it are removed between two holds of the lock, never under it."""
        with _FORK_LOCK:
            if wanted(self.name):
                return True
            try:
                os.rmdir(self._path_bytes)  # the common case: none nested
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
        # Cgroups the worker left inside its own: removed outside the lock, each rmdir
        # ~0.1 ms, and a fork into a cgroup (on the event loop) waits for that lock.
        # Then its own, under the lock again, unless resumed meanwhile.
        for nested in self._nested():
            with contextlib.suppress(FileNotFoundError):
                try:
                    nested.rmdir()
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        return False
                    raise
        with _FORK_LOCK:
            return wanted(self.name) or self.remove()

    @functools.cached_property
    def _path_bytes(self) -> bytes:
        return os.fsencode(self.path)


class Cgroups:
    """The cgroup that holds this daemon's workers' cgroups."""

    def __init__(self, base: Path, home: Path, listed_as: str, lives_as: str = "") -> None:
        self.base = base
        #: Where the daemon lives (returns to after a fork in a worker's cgroup): the
        #: cgroup delegated to it, or its leaf there (`DAEMON_LEAF`).
        self.home = home
        #: `base` as /proc/PID/cgroup names it: its path from the hierarchy's root.
        self._listed_as = _parts(listed_as)
        #: `home` so named (by default the cgroup `base` is in).
        self._lives_as = _parts(lives_as) if lives_as else self._listed_as[:-1]

    @classmethod
    def find(cls, state_dir: Path) -> Cgroups:
        """The workers' cgroup for this state dir, made if need be; else CgroupsUnavailable."""
        mount = _cgroup2_mount()
        if mount is None:
            raise CgroupsUnavailable("no cgroup v2 hierarchy is mounted")
        own = _own_cgroup()
        if own is None:
            raise CgroupsUnavailable("this process is not in a cgroup v2 hierarchy")
        # An image in its leaf (moved there by the one before, or by systemd's
        # DelegateSubgroup=): the cgroup delegated to it is the one above.
        lives = _parts(own)
        delegated = lives[:-1] if lives[-1:] == (DAEMON_LEAF,) else lives
        parent = mount.joinpath(*delegated)
        if not os.access(parent / "cgroup.procs", os.W_OK):
            raise CgroupsUnavailable(
                f"the daemon's cgroup {parent} is not delegated to it "
                "(run it as a user service with Delegate=yes)"
            )
        digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        base = parent / f"subagentd-{digest}"
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupsUnavailable(f"cannot create {base}: {exc.strerror or exc}") from exc
        if not (base / "cgroup.kill").exists():
            raise CgroupsUnavailable("the kernel has no cgroup.kill (Linux 5.14 or later has)")
        if delegated and lives == delegated:
            lives = _into_leaf(parent, delegated)
        return cls(
            base,
            home=mount.joinpath(*lives),
            listed_as="/" + "/".join((*delegated, base.name)),
            lives_as="/" + "/".join(lives),
        )

    def worker(self, worker_id: str) -> WorkerCgroup:
        return WorkerCgroup(self.base / worker_id, self.home)

    def worker_of(self, listing: str) -> str | None:
        """The worker whose cgroup holds the process whose /proc/PID/cgroup reads `listing`;
        None if it is in no worker's. Raises PeerUnplaced if `listing` names no cgroup v2.

        Only the v2 line ("0::<path>") counts: a host with the v1 hierarchies mounted beside
        the v2 one ("unified") lists those too, and they say nothing of workers. A worker's
        cgroup is named after its id (`worker`); what the worker made below its own (a
        nested cgroup) is still its. The worker need not be live, nor known: a process
        lingering in the cgroup of a worker that has ended is still that worker's, never
        the user's.
        """
        for line in listing.splitlines():
            hierarchy, _, path = line.partition(":")
            controllers, _, path = path.partition(":")
            if hierarchy == "0" and controllers == "":
                break
        else:
            raise PeerUnplaced("its /proc/PID/cgroup names no cgroup v2")
        # A cgroup removed while a process is still listed in it (a zombie) may read
        # "<path> (deleted)": still where that process was.
        parts = _parts(path.removesuffix(" (deleted)"))
        depth = len(self._listed_as)
        if len(parts) <= depth or parts[:depth] != self._listed_as:
            return None  # outside the workers' cgroup (or standing in it, in no worker's)
        if parts[depth] != LIMITED:
            return parts[depth]
        # A v2-limited worker's: `.limited/<run>/<worker>/.../<worker>/self[/nested]`, the
        # worker the node its leaf is in; in no leaf (a node between), no worker's.
        below = parts[depth + 1 :]
        return below[below.index(LEAF) - 1] if LEAF in below[1:] else None

    def present(self) -> frozenset[str]:
        """The names (worker ids) of the workers' cgroups there now: one listing for all."""
        try:
            return frozenset(
                entry.name for entry in os.scandir(self.base) if entry.is_dir(follow_symlinks=False)
            )
        except FileNotFoundError:
            return frozenset()

    def leftovers(self) -> list[WorkerCgroup]:
        """Worker cgroups present now (at a clean start: those a dead daemon left)."""
        try:
            found = [WorkerCgroup(p, self.home) for p in self.base.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []
        # The v2-limited workers' leaves, each its worker's (their nodes, emptied, go with
        # the limit nodes' sweep, `Controllers.sweep`).
        return [g for g in found if g.path.name != LIMITED] + self.limited_leaves()

    def limited_leaves(self) -> list[WorkerCgroup]:
        """The leaves of the v2-limited workers present (`LIMITED`)."""
        leaves: list[WorkerCgroup] = []
        for parent, dirs, _ in os.walk(self.base / LIMITED):
            if LEAF in dirs:
                leaves.append(WorkerCgroup(Path(parent) / LEAF, self.home, born_into=True))
                dirs.remove(LEAF)  # what a worker made in its own leaf is its
        return leaves

    def all_below(self) -> list[WorkerCgroup]:
        """Every cgroup in the workers' cgroup, deepest first, then that cgroup itself (for
        the daemon's shutdown): workers' known or not, what a worker made beside its own or
        inside it. Itself only while the daemon stands where it lives (never caught in a
        worker's to fork, as `WorkerCgroup.born_in` leaves it on a failed return): its
        cgroup.kill would end the daemon too."""
        found: list[WorkerCgroup] = []
        for parent, dirs, _ in os.walk(self.base, topdown=False):
            found.extend(WorkerCgroup(Path(parent) / name, self.home) for name in dirs)
        own = _own_cgroup()
        if self.base.is_dir() and own is not None and _parts(own) == self._lives_as:
            found.append(WorkerCgroup(self.base, self.home))
        return found

    def remove(self) -> None:
        """Remove the workers' cgroup if it is empty (the daemon is stopping)."""
        # A worker cgroup left in it keeps it: the next start sweeps that.
        with contextlib.suppress(OSError):
            self.base.rmdir()


def _read_procs(procs: bytes) -> list[int]:
    """The pids a `cgroup.procs` lists (none if the cgroup is gone). Read twice a stop and
    once a spawn: bare system calls, at half the cost of a file object (about 15 us
    against 31 here, bench/README.md)."""
    try:
        fd = os.open(procs, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        listed = bytearray()
        while chunk := os.read(fd, _PROCS_READ):
            listed += chunk
    finally:
        os.close(fd)
    return [int(pid) for pid in listed.split()]


def _cgroup2_mount() -> Path | None:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                # "id parent dev root mountpoint options [optional...] - fstype source opts"
                fields = line.split()
                separator = fields.index("-")
                if fields[separator + 1] == "cgroup2":
                    return Path(fields[4])
    except OSError:
        return None
    return None


def _parts(path: str) -> tuple[str, ...]:
    """A cgroup path's names, root first. One outside this process's cgroup namespace reads
    "/../.."; its ".." are kept as names, so it matches no worker's."""
    return tuple(part for part in path.strip().split("/") if part)


#: SO_PEERPIDFD (Linux 6.5; not in Python's socket module): a pidfd of a Unix socket's
#: peer, which no recycled pid can stand in for.
SO_PEERPIDFD = 77


def peer_cgroup(pid: int, pidfd: int | None) -> str:
    """The text of /proc/`pid`/cgroup, for the peer of a connection, whose pid (and, where
    the kernel gives one, pidfd) the socket told. Raises PeerUnplaced if it cannot be had;
    OSError (EMFILE, say) if it could not be read.

    With its pidfd, the peer is known still to be alive once the text is read, so the pid
    read was its and no recycled one (a live process's pid is no one else's). Without
    (a kernel before 6.5), a peer that exited, and whose pid was given to another process
    in the moment since its connect, would be read as that process: the one race left.
    """
    if pid <= 0:  # SO_PEERCRED's word for a peer in a pid namespace the daemon cannot see
        raise PeerUnplaced("the process that connected has no pid in the daemon's pid namespace")
    try:
        listing = _read_small(f"/proc/{pid}/cgroup")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise PeerUnplaced(f"process {pid}, which connected, has exited") from exc
    if pidfd is not None and _exited(pidfd):
        raise PeerUnplaced(f"process {pid}, which connected, exited as its cgroup was read")
    return listing


def _read_small(path: str) -> str:
    """A small file's text by bare system calls: on every connection, where `open()`'s
    buffered text file costs twice the reading (20 us against 9)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd reads ready once it has)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def _into_leaf(delegated: Path, parts: tuple[str, ...]) -> tuple[str, ...]:
    """Move the daemon into its leaf of the cgroup delegated to it (`DAEMON_LEAF`), so that
    cgroup may pass controllers on to the workers' (v2 holds no process in a cgroup that
    does); where it lives now, as /proc/PID/cgroup names it. Left where it is if the leaf
    will not take it: its workers' cgroups work as before, and limits needing a v2
    controller are refused when its cgroup will not pass it on (`_v2_nodes`)."""
    leaf = delegated / DAEMON_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        _move(leaf, os.getpid())
    except OSError as exc:
        log.warning("cgroup.not_in_leaf", cgroup=str(leaf), error=str(exc))
        return parts
    return (*parts, DAEMON_LEAF)


def _move(cgroup: Path, pid: int) -> None:
    with open(cgroup / "cgroup.procs", "wb") as f:
        f.write(str(pid).encode())


def _own_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Leader:
    """A worker's own process, our unreaped child, as a stop of its cgroup knows it: its
    pid, which no other process can take until it is reaped (so it is signalled by pid,
    and pinned by no descriptor of its own), and the event its supervision sets once it
    has exited (the supervision waits on its pidfd: trio lets one task wait on a
    descriptor, and a dup of it for the stop cost a descriptor a stopped worker)."""

    pid: int
    exited: trio.Event


async def end_cgroup(
    group: WorkerCgroup,
    grace: float,
    graces: Graces | None = None,
    leader: Leader | None = None,
    *,
    leader_termed: bool = False,
    termed: set[int] | None = None,
) -> int:
    """TERM all in the cgroup, cgroup.kill what is left after `grace`; how many were killed.

    Reads the cgroup again once each wave has exited, so what was forked
    meanwhile is signalled too; returns once the cgroup is empty. `leader`: the
    worker's own process, our unreaped child (see `Leader`), told by its pid and
    waited for by its supervision's event; `leader_termed`: it has had its TERM
    (`LocalLauncher.term_leader`), and gets no second (to some programs a second means
    "quit now"). `termed`: where the pids sent a TERM are kept, so a search for what
    left the cgroup (`end_escaped`) sends them no second one.
    """
    termed_by_pid: set[int] = set()
    told: set[int] = set() if termed is None else termed
    if leader_termed and leader is not None:
        termed_by_pid.add(leader.pid)
        told.add(leader.pid)
    # `cgroup.events` first: in a stop_run of thousands, the leaders have their TERMs
    # (`term_leader`) before any stop's task runs, and most have exited by then, so one
    # read says so where a list of the members (empty), then its events, took two; and
    # no grace's cancel scope is made for a tree already gone.
    if not await _populated(group):
        return 0
    with (graces or Graces()).period(grace):
        pids = await _members(group)
        while pids:
            with _pinned(group, pids, leader) as (pinned, unpinned):
                told.update(pinned, unpinned)
                for pid, fd in pinned.items():
                    if pid not in termed_by_pid:
                        term(fd)
                for pid in unpinned:
                    if pid not in termed_by_pid:  # once each: a TERM is a request
                        termed_by_pid.add(pid)
                        _term_unpinned(pid)
                for fd in pinned.values():
                    await trio.lowlevel.wait_readable(fd)
                if leader is not None and leader.pid in unpinned:
                    await leader.exited.wait()
                elif not pinned:  # none could be pinned (out of fds?): never spin unyielding
                    await trio.sleep(0.01)
            # One read of `cgroup.events` says most waves were the last: no list of the
            # members (an empty one, then its events) for each of a stop_run's thousands.
            pids = await _members(group) if await _populated(group) else []
        return 0
    killed: set[int] = set()
    for _ in range(10):
        pids = await _members(group)
        if not pids:
            break
        try:
            group.kill()
        except OSError as exc:
            log.error("cgroup.kill_failed", cgroup=str(group.path), error=str(exc))
        killed.update(pids)
        with _pinned(group, pids, leader) as (pinned, unpinned):
            with trio.move_on_after(1.0):
                for fd in pinned.values():
                    await trio.lowlevel.wait_readable(fd)
                if leader is not None and leader.pid in unpinned:
                    await leader.exited.wait()
    return len(killed)


async def _members(group: WorkerCgroup) -> list[int]:
    """`group.members()`, read `patiently` while the daemon has no descriptor to read it
    with."""

    async def read() -> list[int]:
        return group.members()

    return await patiently(read)


async def _populated(group: WorkerCgroup) -> bool:
    """`group.populated()`, read `patiently` as `_members` is."""

    async def read() -> bool:
        return group.populated()

    return await patiently(read)


def term(pidfd: int) -> None:
    """TERM a process through its pidfd. Gone already, or not ours to signal (setuid):
    cgroup.kill is, after the grace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)


def _term_unpinned(pid: int) -> None:
    """TERM a member by its pid: the leader (our unreaped child, whose pid no one else can
    have), or another no pidfd could be opened for (the daemon is out of descriptors),
    read from the cgroup just now. Left without, it would get no TERM at all and be
    killed only when its grace ran out; the one risk, a pid freed and reused in the
    microseconds since that read, is taken only there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def _pinned(
    group: WorkerCgroup, pids: list[int], leader: Leader | None = None
) -> Iterator[tuple[dict[int, int], list[int]]]:
    """Pidfds (by pid) of `pids` still in the cgroup once opened (so none was recycled),
    and the pids signalled by pid: the leader's (never pinned: no other process can have
    it until it is reaped, so a stop of a lone worker, the common case, costs no
    descriptor and no second read of the cgroup), and those none could be opened for,
    for want of a descriptor (EMFILE, ENFILE)."""
    opened: dict[int, int] = {}
    unpinned: list[int] = []
    try:
        for pid in pids:
            if leader is not None and pid == leader.pid:
                unpinned.append(pid)
                continue
            try:
                opened[pid] = os.pidfd_open(pid)
            except OSError as exc:  # gone already (found next pass), or out of fds
                if exc.errno in DESCRIPTOR_ERRNOS:
                    unpinned.append(pid)
        while others := list(opened):
            try:
                still = set(group.members())
            except OSError as exc:
                if exc.errno not in DESCRIPTOR_ERRNOS:
                    still = set()  # pin none, look again
                else:  # no descriptor left to read it with: give one pin back, go by pid
                    os.close(opened.pop(others[-1]))
                    unpinned.append(others[-1])
                    continue
            for pid in [p for p in opened if p not in still]:
                os.close(opened.pop(pid))
            break
        yield opened, unpinned
    finally:
        for fd in opened.values():
            os.close(fd)
