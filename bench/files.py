"""Files and directories the daemon creates, renames and removes per spawn and per ending.

    .venv/bin/python bench/files.py [--repeats N] [--long-mib N] [--show]

Creating an inode costs 300-500 us of kernel time on this machine's ext4, so
this counts exactly what each operation makes the daemon do in its state dir
(archives, spare archives, the store's database and its WAL, temp files; before
the store also run files, records and stdout.tail): a private daemon is traced
with `strace -f --seccomp-bpf -z -y` (attached once it is ready, so start-up
is not counted; every thread and child followed), and each successful syscall
under the state dir is counted:

- files created: open/openat/creat with O_CREAT (every create of the daemon's
  is O_EXCL, so each one made a new file), mknod, symlink;
- dirs created: mkdir; renames: rename/renameat/renameat2; unlinks: unlink
  and unlinkat of a file; rmdirs: rmdir and unlinkat(AT_REMOVEDIR); links: link;
- net inodes: how many more inodes the state dir holds after than before
  (one lstat walk before and after): what stays behind on disk.

A temp file written and renamed over an old one, or one made and removed
within the operation, is a create and a rename (or an unlink) here, where a
before/after snapshot of the directory would see at most a changed inode:
that is why syscalls are counted, and the snapshot gives only the net figure.

Operations, each `--repeats` times, every one counted alone:

- `true` alone: a lone spawn of `true` (no run given: an implicit run) until
  `collect(id, wait=True)` answers: its spawn, its ending, its collect;
- spawn into a named run: `new_run()` and the run's first spawn of `sleep 3600`
  until its answer, counted together; then a second spawn into that same run;
  then `stop_run` of that run, its two workers running, until its answer;
- stop: `stop(id)` of a lone running `sleep 3600` (started before, not counted);
- ending, short / long journal: a worker that waits on a FIFO outside the state
  dir is spawned uncounted; the count is from opening the FIFO (the worker goes
  on, prints `ok`, or `--long-mib` MiB of zeros, and exits 0) until
  `collect(id, wait=True)` answers.

An operation's count closes once the daemon is quiet again: its spare
archives are all made again (a spawn renames one into place and a background
thread makes the next: that mkdir and its files count for the spawn that
used one), an `info` round trip has been answered, and the trace has had no
new line for 100 ms (the trace is written as it happens; every write the
operation caused in the event loop is done by then).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _harness import BenchDaemon, Figure, report, running_daemon

from subagentd.client import Client
from subagentd.daemon.store._archive import SpareArchives

#: What is counted, in table order: (key, column heading).
KINDS = [
    ("files", "files created"),
    ("dirs", "dirs created"),
    ("renames", "renames"),
    ("unlinks", "unlinks"),
    ("rmdirs", "dirs removed"),
    ("links", "links"),
    ("net", "net inodes"),
]
#: How a counted syscall is named in the notes.
VERBS = {
    "files": "create", "dirs": "mkdir", "renames": "rename",
    "unlinks": "unlink", "rmdirs": "rmdir", "links": "link",
}  # fmt: skip
SYSCALLS = (
    "open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,"
    "unlink,unlinkat,rmdir,link,linkat,symlink,symlinkat,mknod,mknodat"
)
#: How many spare archives the daemon keeps made ahead (SpareArchives.keep).
SPARES = 8
QUIET = 0.1

# -- the trace ---------------------------------------------------------------

_LINE = re.compile(r"^(?P<pid>\d+) +(?P<call>\w+)\((?P<args>.*)\) += (?P<ret>-?\d+)")
_RESUMED = re.compile(r"^(?P<pid>\d+) +<\.\.\. (?P<call>\w+) resumed>(?P<rest>.*)$")
_UNFINISHED = " <unfinished ...>"
#: An argument: a descriptor with its path (`3</a/b>`, `AT_FDCWD</a>`), a string, or a word.
_ARG = re.compile(r'(?:[\w-]+<(?P<fd>[^>]*)>|"(?P<str>(?:[^"\\]|\\.)*)"|(?P<word>[^,\s]+))')


@dataclass
class Op:
    """One successful syscall: what it did, and the paths it named (made absolute)."""

    kind: str
    paths: list[str]


@dataclass
class Counts:
    """What one operation made the daemon do in its state dir."""

    files: int = 0
    dirs: int = 0
    renames: int = 0
    unlinks: int = 0
    rmdirs: int = 0
    links: int = 0
    net: int = 0
    #: Each counted syscall, as `kind path` with ids and random names made generic.
    what: list[str] = field(default_factory=list)

    def get(self, kind: str) -> int:
        value: int = getattr(self, kind)
        return value


def _args(text: str) -> list[tuple[str, str]]:
    """(how, value) for each argument: ("fd", dir), ("str", s) or ("word", w)."""
    found = []
    for m in _ARG.finditer(text):
        how = next(k for k in ("fd", "str", "word") if m.group(k) is not None)
        found.append((how, m.group(how)))
    return found


def _path(dir_arg: tuple[str, str] | None, name: str) -> str:
    """`name` made absolute against the descriptor argument before it (or the cwd's)."""
    if name.startswith("/") or dir_arg is None or dir_arg[0] != "fd":
        return name
    return os.path.join(dir_arg[1], name)


def parse(line: str) -> Op | None:
    """The file operation a (successful, whole) trace line did, or None if it made nothing."""
    m = _LINE.match(line)
    if not m:
        return None
    call, args = m["call"], _args(m["args"])
    names = [i for i, (how, _) in enumerate(args) if how == "str"]
    if not names:
        return None

    def at(i: int) -> str:
        return _path(args[i - 1] if i > 0 else None, args[i][1])

    flags = args[names[0] + 1][1] if names[0] + 1 < len(args) else ""
    if call in ("open", "openat", "openat2"):
        return Op("files", [at(names[0])]) if "O_CREAT" in flags or "O_TMPFILE" in flags else None
    if call in ("creat", "mknod", "mknodat", "symlink", "symlinkat"):
        return Op("files", [at(names[-1])])
    if call in ("mkdir", "mkdirat"):
        return Op("dirs", [at(names[0])])
    if call in ("rename", "renameat", "renameat2"):
        return Op("renames", [at(i) for i in names])
    if call in ("link", "linkat"):
        return Op("links", [at(i) for i in names])
    if call == "rmdir" or (call == "unlinkat" and "AT_REMOVEDIR" in flags):
        return Op("rmdirs", [at(names[0])])
    if call in ("unlink", "unlinkat"):
        return Op("unlinks", [at(names[0])])
    return None


def whole_lines(lines: list[str]) -> Iterator[str]:
    """The trace's lines with each `<unfinished ...>` joined to its `<... resumed>`
    (two threads in a syscall at once), so every call is one line."""
    pending: dict[str, str] = {}
    for line in lines:
        if line.endswith(_UNFINISHED):
            pid = line.split(" ", 1)[0]
            pending[pid] = line[: -len(_UNFINISHED)]
            continue
        resumed = _RESUMED.match(line)
        if resumed:
            start = pending.pop(resumed["pid"], None)
            if start is not None:
                yield start + resumed["rest"]
            continue
        yield line


_GENERIC = [
    (re.compile(r"/w-[A-Za-z0-9_-]+"), "/<worker>"),
    (re.compile(r"(?<=[/.])r-[A-Za-z0-9_-]+?(?=\.json|/|$)"), "<run>"),
    (re.compile(r"\.spare-[0-9a-f]+"), ".spare-*"),
    (re.compile(r"\.[0-9a-f]{16}\.(tmp|planted)"), r".*.\1"),
]


def generic(path: str, state_dir: str) -> str:
    """`path` relative to the state dir, with worker and run ids and random names as patterns."""
    rel = os.path.relpath(path, state_dir)
    for pattern, replacement in _GENERIC:
        rel = pattern.sub(replacement, rel)
    return rel


def count(lines: list[str], state_dir: Path, net: int = 0) -> Counts:
    """What the traced lines did under `state_dir` (other paths, as a worker's, not counted)."""
    root = str(state_dir)
    counts = Counts(net=net)
    for line in whole_lines(lines):
        op = parse(line)
        if op is None or not any(p == root or p.startswith(root + "/") for p in op.paths):
            continue
        setattr(counts, op.kind, counts.get(op.kind) + 1)
        paths = " -> ".join(generic(p, root) for p in op.paths)
        counts.what.append(f"{VERBS[op.kind]} {paths}")
    return counts


class Trace:
    """strace attached to a running daemon (all its threads and children), written to a file."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self.read_to = 0
        self.proc = subprocess.Popen(
            ["strace", "-f", "--seccomp-bpf", "-qq", "-z", "-y", "-s", "4096",
             "-e", f"trace={SYSCALLS}", "-o", str(out), "-p", str(pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        self._wait_attached(pid)

    def _wait_attached(self, pid: int, deadline: float = 30) -> None:
        """Return once every thread of `pid` is traced (its TracerPid is strace)."""
        give_up = time.monotonic() + deadline
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"strace could not attach to {pid}: {err.strip()}")
            tasks = os.listdir(f"/proc/{pid}/task")
            if all(_tracer(pid, tid) == self.proc.pid for tid in tasks):
                return
            time.sleep(0.001)
        raise TimeoutError(f"strace did not attach to every thread of {pid}")

    def size(self) -> int:
        return self.out.stat().st_size if self.out.exists() else 0

    def take(self) -> list[str]:
        """The whole lines written since the last take."""
        with open(self.out, "rb") as f:
            f.seek(self.read_to)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.read_to += end
        return data[:end].decode(errors="replace").splitlines()

    def detach(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # strace detaches; the daemon runs on
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


def _tracer(pid: int, tid: str) -> int:
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return -1  # a thread gone meanwhile
    return int(status.split("TracerPid:", 1)[1].split()[0])


def inodes(state_dir: Path) -> int:
    """How many files and directories the state dir holds now (no link followed)."""
    total = 0
    for _, dirs, files in os.walk(state_dir):
        total += len(dirs) + len(files)
    return total


def spares_made(state_dir: Path) -> bool:
    """Whether all the spare archives are made again (each with its files)."""
    made = 0
    for spare in (state_dir / "archives").glob(".spare-*"):
        with contextlib.suppress(OSError):  # renamed into place meanwhile
            made += len(os.listdir(spare)) == len(SpareArchives.FILES)
    return made >= SPARES


class Counting:
    """Counts each operation alone on one traced daemon."""

    def __init__(self, daemon: BenchDaemon, client: Client, trace: Trace, deadline: float) -> None:
        self.state_dir = (daemon.root / "state").resolve()
        self.client = client
        self.trace = trace
        self.deadline = deadline

    def settle(self) -> None:
        """Wait until the daemon has done everything the last operation caused."""
        give_up = time.monotonic() + self.deadline
        while not spares_made(self.state_dir):
            if time.monotonic() > give_up:
                raise TimeoutError("the daemon did not make its spare archives again")
            time.sleep(0.001)
        self.client.info()
        size = self.trace.size()
        while True:
            time.sleep(QUIET)
            now = self.trace.size()
            if now == size:
                return
            size = now
            if time.monotonic() > give_up:
                raise TimeoutError("the daemon's trace did not go quiet")

    def count(self, operation: Callable[[], object]) -> Counts:
        """What `operation` made the daemon do in its state dir, alone."""
        self.settle()
        self.trace.take()
        before = inodes(self.state_dir)
        operation()
        self.settle()
        return count(self.trace.take(), self.state_dir, net=inodes(self.state_dir) - before)


@contextlib.contextmanager
def traced_daemon(timeout: float = 120) -> Iterator[Counting]:
    """A private daemon, ready and traced, and a client of it (`timeout` on each call)."""
    if shutil.which("strace") is None:
        raise RuntimeError("bench/files.py needs strace (Debian: apt-get install strace)")
    with (
        running_daemon() as daemon,
        Client(daemon.socket, timeout=timeout) as client,
        tempfile.TemporaryDirectory(prefix="sabf-") as scratch,
    ):
        trace = Trace(daemon.proc.pid, Path(scratch) / "trace")
        try:
            yield Counting(daemon, client, trace, deadline=timeout)
        finally:
            trace.detach()


# -- the operations ------------------------------------------------------------


def lone_true(c: Counting) -> Counts:
    def op() -> None:
        result = c.client.collect(c.client.spawn(["true"]).id, wait=True)
        assert (result.state, result.exit_code) == ("finished", 0), result

    return c.count(op)


def run_spawns(c: Counting) -> tuple[Counts, Counts, Counts]:
    """A new run and its first spawn, a second spawn into it, then `stop_run` of the two."""
    runs: list[str] = []
    ids: list[str] = []

    def first_spawn() -> None:
        runs.append(c.client.new_run())
        ids.append(c.client.spawn(["sleep", "3600"], run=runs[0]).id)

    first = c.count(first_spawn)
    second = c.count(lambda: ids.append(c.client.spawn(["sleep", "3600"], run=runs[0]).id))
    stopped: list[str] = []
    stop = c.count(lambda: stopped.extend(c.client.stop_run(runs[0])))
    assert sorted(stopped) == sorted(ids), (stopped, ids)
    return first, second, stop


def stop_lone(c: Counting) -> Counts:
    worker = c.client.spawn(["sleep", "3600"])
    return c.count(lambda: c.client.stop(worker.id))


def ending(c: Counting, fifo: Path, script: str) -> Counts:
    """The ending of a worker that runs `script` once the FIFO is opened."""
    os.mkfifo(fifo)
    worker = c.client.spawn(["sh", "-c", f"read _ < {fifo}; {script}"])

    def op() -> None:
        with open(fifo, "w") as f:
            f.write("go\n")
        result = c.client.collect(worker.id, wait=True)
        assert (result.state, result.exit_code) == ("finished", 0), result

    try:
        return c.count(op)
    finally:
        fifo.unlink()


OPERATIONS = [
    ("true", "lone spawn of `true` until collected"),
    ("run_first", "`new_run` and its first spawn (`sleep`)"),
    ("run_second", "second spawn into that run"),
    ("stop_run", "`stop_run` of that run (2 running)"),
    ("stop", "stop of a running lone worker"),
    ("end_short", "ending, short journal, until collected"),
    ("end_long", "ending, long journal, until collected"),
]


def count_all(repeats: int = 5, long_mib: int = 2) -> dict[str, list[Counts]]:
    """Every operation counted `repeats` times on one traced daemon: counts by operation."""
    counts: dict[str, list[Counts]] = {key: [] for key, _ in OPERATIONS}
    with traced_daemon() as c, tempfile.TemporaryDirectory(prefix="sabf-") as scratch:
        # Once uncounted first: what a daemon makes once in its life (the runs folder) is
        # not what every spawn costs.
        c.client.stop_run(c.client.new_run())
        for i in range(repeats):
            counts["true"].append(lone_true(c))
            first, second, stop = run_spawns(c)
            counts["run_first"].append(first)
            counts["run_second"].append(second)
            counts["stop_run"].append(stop)
            counts["stop"].append(stop_lone(c))
            fifo = Path(scratch) / f"go-{i}"
            counts["end_short"].append(ending(c, fifo, "echo ok"))
            long = f"head -c {long_mib * 1024 * 1024} /dev/zero"
            counts["end_long"].append(ending(c, fifo, long))
    return counts


# -- figures -------------------------------------------------------------------


def figures(counts: dict[str, list[Counts]], long_mib: int) -> list[Figure]:
    made = []
    for key, what in OPERATIONS:
        samples = counts[key]
        # Every repeat should do the same: the note names what one did, and any that differed.
        kinds = Counter(tuple(sorted(s.what)) for s in samples)
        usual = kinds.most_common(1)[0][0]
        note = "each repeat did: " + (
            ", ".join(f"{n}x {w}" for w, n in Counter(usual).items()) or "none"
        )
        if len(kinds) > 1:
            note += f" ({len(samples) - kinds[usual]} of {len(samples)} repeats differed)"
        what = what.replace("long journal", f"long journal ({long_mib} MiB)")
        for kind, heading in KINDS:
            made.append(
                Figure.of(
                    f"files.{key}.{kind}", f"{what}: {heading}", "count", "lower",
                    [float(s.get(kind)) for s in samples],
                    note=note if kind == "files" else "",
                )
            )  # fmt: skip
    return made


def table(figures: list[Figure]) -> str:
    """Operations down, what was counted across (medians of the repeats)."""
    heads = [heading for _, heading in KINDS]
    lines = ["| operation | " + " | ".join(heads) + " |", "| --- |" + " ---: |" * len(heads)]
    by_key = {f.key: f for f in figures}
    for key, _ in OPERATIONS:
        first = by_key.get(f"files.{key}.files")
        if first is None:
            continue
        cells = []
        for kind, _ in KINDS:
            stats = by_key[f"files.{key}.{kind}"].subagentd
            assert stats is not None
            cell = f"{stats['median']:g}"
            if stats["min"] != stats["max"]:
                cell += f" ({stats['min']:g}-{stats['max']:g})"
            cells.append(cell)
        lines.append(f"| {first.what.split(': ')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(repeats: int = 5, long_mib: int = 2) -> list[Figure]:
    return figures(count_all(repeats, long_mib), long_mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-mib", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="list every counted syscall")
    args = parser.parse_args()
    counts = count_all(args.repeats, args.long_mib)
    made = figures(counts, args.long_mib)
    report(made)
    print()
    print(table(made))
    if args.show:
        for key, what in OPERATIONS:
            print(f"\n{what}:")
            for i, c in enumerate(counts[key]):
                print(f"  repeat {i}: " + ", ".join(f"{k}={c.get(k)}" for k, _ in KINDS))
                for line in c.what:
                    print(f"    {line}")


if __name__ == "__main__":
    main()
