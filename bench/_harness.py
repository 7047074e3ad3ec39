"""What every benchmark shares: the two daemons under test, figures, statistics.

- `running_daemon()`: a private subagentd from this checkout's venv in a fresh
  temporary state dir, ready when it says READY=1 over sd_notify (as under
  systemd).
- `running_supervisord()`: a private supervisord (from the same venv, installed
  from PyPI by `make bench`) in a temporary dir, with a config written here:
  one `unix_http_server` socket, and program sections of `sleep 3600` that do
  not start by themselves (startsecs=0, so "started" means "forked"). It is
  driven with xmlrpc.client over that Unix socket (`UnixTransport`), on one
  kept-alive HTTP/1.1 connection per client, as subagentd's Client keeps one.
- `Figure`: one measured quantity for one or both systems, with the median,
  p99 and spread of its samples, the ratio between the two, and its target.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xmlrpc.client
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

BIN = Path(sys.executable).parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# -- subagentd -------------------------------------------------------------


@dataclass
class BenchDaemon:
    root: Path
    socket: Path
    proc: subprocess.Popen[bytes]


def daemon_command() -> list[str]:
    """How to start subagentd: this venv's `subagentd`, or $BENCH_SUBAGENTD (split on spaces).

    $BENCH_SUBAGENTD measures another build side by side, e.g. a checkout's
    `/path/.venv/bin/subagentd`, or a script that patches the daemon first.
    """
    return os.environ.get("BENCH_SUBAGENTD", str(BIN / "subagentd")).split()


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    """TERM a bench's daemon (subagentd or supervisord) and wait for it to stop its
    workers; KILL it if it has not within two minutes, and reap it either way."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_daemon(*args: str) -> Iterator[BenchDaemon]:
    root = Path(tempfile.mkdtemp(prefix="sab-", dir="/tmp"))
    notify_path = root / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.1)
    sock = root / "s.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBAGENTD_")}
    env["NOTIFY_SOCKET"] = str(notify_path)
    log = open(root / "daemon.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*daemon_command(), "--socket", str(sock), "--state-dir", str(root / "state"),
         "--config", str(root / "agents.toml"), *args],
        env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(notify, proc, root / "daemon.log")
        yield BenchDaemon(root=root, socket=sock, proc=proc)
    finally:
        stop_daemon(proc)
        notify.close()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def wait_ready(
    notify: socket.socket, proc: subprocess.Popen[bytes], log: Path, deadline: float = 60
) -> None:
    """Wait for READY=1 on `notify`; if the daemon exits or takes too long, say why."""
    give_up = time.monotonic() + deadline
    while time.monotonic() < give_up:
        try:
            if b"READY=1" in notify.recv(4096).split(b"\n"):
                return
        except TimeoutError:
            pass
        if proc.poll() is not None:
            break
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"subagentd did not get ready (exit status {proc.poll()}):\n{tail}")


# -- supervisord -----------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix socket (the host name is only for the Host header)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixTransport(xmlrpc.client.Transport):
    """xmlrpc.client's transport, over a Unix socket; keeps its connection alive."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__()
        self.unix_path = path
        self.timeout = timeout

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        if self._connection and host == self._connection[0]:
            return self._connection[1]
        connection = UnixHTTPConnection(self.unix_path, self.timeout)
        self._connection = host, connection
        return connection


@dataclass
class BenchSupervisord:
    root: Path
    socket: Path
    proc: subprocess.Popen[bytes]

    def rpc(self, timeout: float = 120) -> Any:
        """A new client (its own connection): `.supervisor.getState()` and so on."""
        transport = UnixTransport(str(self.socket), timeout)
        return xmlrpc.client.ServerProxy("http://localhost", transport=transport)


SUPERVISORD_CONF = """\
[unix_http_server]
file={root}/supervisor.sock
chmod=0700

[supervisord]
logfile={root}/supervisord.log
pidfile={root}/supervisord.pid
childlogdir={root}/logs
nodaemon=true

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{root}/supervisor.sock
"""

PROGRAM = """
[program:{name}]
command={command}
process_name=%(program_name)s_%(process_num)04d
numprocs={numprocs}
autostart=false
autorestart=false
startsecs=0
"""


@contextlib.contextmanager
def running_supervisord(
    programs: dict[str, int], command: str = "sleep 3600"
) -> Iterator[BenchSupervisord]:
    """supervisord with a group per entry of `programs` (name: how many processes).

    Process names are `NAME:NAME_0000`, `NAME:NAME_0001`, ... Everything else
    is supervisord's default (minfds 1024, stdout and stderr to AUTO log files).
    """
    root = Path(tempfile.mkdtemp(prefix="sup-", dir="/tmp"))
    (root / "logs").mkdir()
    conf = SUPERVISORD_CONF.format(root=root) + "".join(
        PROGRAM.format(name=name, command=command, numprocs=n) for name, n in programs.items()
    )
    (root / "supervisord.conf").write_text(conf)
    log = open(root / "stdout.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(BIN / "supervisord"), "-c", str(root / "supervisord.conf")],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=root,
    )  # fmt: skip
    daemon = BenchSupervisord(root=root, socket=root / "supervisor.sock", proc=proc)
    try:
        wait_serving(daemon)
        yield daemon
    finally:
        stop_daemon(proc)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def wait_serving(daemon: BenchSupervisord, deadline: float = 120) -> None:
    """Return once supervisord answers getState with RUNNING (not while it shuts down)."""
    give_up = time.monotonic() + deadline
    while True:
        try:
            if daemon.rpc(timeout=30).supervisor.getState()["statecode"] == 1:
                return
        except (OSError, xmlrpc.client.Fault, http.client.HTTPException):
            pass
        if time.monotonic() > give_up:
            raise TimeoutError("supervisord is not serving")
        time.sleep(0.001)


def running_pids(rpc: Any) -> dict[str, int]:
    """supervisord's processes in state RUNNING, by full name (group:name)."""
    return {
        f"{p['group']}:{p['name']}": p["pid"]
        for p in rpc.supervisor.getAllProcessInfo()
        if p["statename"] == "RUNNING"
    }


# -- processes -------------------------------------------------------------


def wait_exec(pids: Iterable[int], program: str = "sleep", deadline: float = 60) -> None:
    """Wait until every pid runs `program` (its exec is done).

    supervisord declares a process RUNNING (startsecs=0) as soon as it forked,
    possibly before the child exec'd; a TERM that lands in between is lost,
    and its stop then waits stopwaitsecs (10 s) for the KILL. Both systems'
    processes are waited for like this before being stopped or reloaded.
    """
    give_up = time.monotonic() + deadline
    for pid in pids:
        while True:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == program:
                    break
            except OSError:
                break  # gone already: nothing to wait for
            if time.monotonic() > give_up:
                raise TimeoutError(f"pid {pid} did not exec {program}")
            time.sleep(0.0005)


def process_count() -> int:
    """How many processes the machine has now (a /proc scan's cost grows with it)."""
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def parent_of(pid: int) -> int | None:
    """`pid`'s parent now, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rss(pid: int) -> int:
    """Resident set size of `pid` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` so far (utime + stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run_seconds(pid: int, tid: int | None = None) -> float:
    """Time `pid`'s threads (`tid`: that thread alone) have run on a CPU so far, to the
    nanosecond (the first field of /proc/PID/task/TID/schedstat): per request, where
    /proc/PID/stat counts ticks of 10 ms. A thread that has exited takes its share along."""
    tasks = [Path(f"/proc/{pid}/task/{tid}")] if tid else Path(f"/proc/{pid}/task").iterdir()
    total = 0
    for task in tasks:
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def thread_named(pid: int, name: str) -> int | None:
    """The id of `pid`'s thread whose comm is `name`; None if it has none."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == name:
                return int(task.name)
    return None


# -- figures ---------------------------------------------------------------


def summary(samples: list[float]) -> dict[str, float]:
    """n, median, p99, min, max and the spread (p90 - p10) of `samples`, in their unit."""
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p99": pct(99),
        "min": ordered[0],
        "max": ordered[-1],
        "spread": pct(90) - pct(10),
    }


@dataclass
class Figure:
    """One measured quantity; samples are in `unit` already (ms, calls/s, MB/s, ...).

    `ratio` is how many times better subagentd is than supervisord (their
    median over ours when lower is better, ours over theirs when higher is).
    `floor` is the floor measured in the same run (what the same job costs from
    Python with no supervisor: its own figure too), and `floor_ratio` how many
    times the floor's cost subagentd's is (ours over the floor's time, or the
    ceiling's rate over ours): 1 is the floor itself.
    `met` is decided by the bench that made the figure, against `target`.
    """

    key: str
    what: str
    unit: str
    better: Literal["lower", "higher"]
    subagentd: dict[str, float] | None = None
    supervisord: dict[str, float] | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""
    floor: dict[str, float] | None = None
    bench: str = field(default="")

    @classmethod
    def of(
        cls,
        key: str,
        what: str,
        unit: str,
        better: Literal["lower", "higher"],
        ours: list[float] | None,
        theirs: list[float] | None = None,
        **kw: Any,
    ) -> Figure:
        return cls(
            key=key, what=what, unit=unit, better=better,
            subagentd=summary(ours) if ours else None,
            supervisord=summary(theirs) if theirs else None, **kw,
        )  # fmt: skip

    @property
    def ratio(self) -> float | None:
        if not (self.subagentd and self.supervisord):
            return None
        ours, theirs = self.subagentd["median"], self.supervisord["median"]
        if self.better == "higher":
            ours, theirs = theirs, ours
        return theirs / ours if ours else None

    @property
    def floor_ratio(self) -> float | None:
        if not (self.subagentd and self.floor):
            return None
        ours, floor = self.subagentd["median"], self.floor["median"]
        if self.better == "higher":
            ours, floor = floor, ours
        return ours / floor if floor else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "floor_ratio": self.floor_ratio}


def number(x: float) -> str:
    """A figure for a table: three significant digits (whole numbers above 100), no exponent."""
    if x == 0:
        return "0"
    if abs(x) >= 100 or float(x).is_integer():
        return f"{x:,.0f}"
    decimals = 2 - math.floor(math.log10(abs(x)))
    return f"{x:.{decimals}f}"


def cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "—"
    if stats["n"] == 1:
        return number(stats["median"])
    return f"{number(stats['median'])} / {number(stats['p99'])} / ±{number(stats['spread'])}"


def table(figures: list[Figure]) -> str:
    """A Markdown table: each side's median / p99 / spread (p90 - p10), ratio, times the
    floor, target. A floor's own row has its figures in the first column."""
    lines = [
        "| figure | unit | subagentd median / p99 / spread | supervisord median / p99 / spread "
        "| ratio | x floor | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        ratio = f"{number(f.ratio)}x" if f.ratio is not None else "—"
        floor = f"{number(f.floor_ratio)}x" if f.floor_ratio is not None else "—"
        met = {True: "yes", False: "**no**", None: ""}[f.met]
        lines.append(
            f"| {f.what} | {f.unit} | {cell(f.subagentd)} | {cell(f.supervisord)} "
            f"| {ratio} | {floor} | {f.target} | {met} |"
        )
    return "\n".join(lines)


def report(figures: list[Figure]) -> None:
    """What a bench run alone prints: the machine, the table, and each figure's note."""
    print(f"machine: {machine()}")
    print(table(figures))
    for f in figures:
        if f.note:
            print(f"- {f.what}: {f.note}")


def machine() -> str:
    return f"{os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


Bench = Callable[..., list[Figure]]


def raise_fd_limit(wanted: int = 0) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, and the hard one to
    `wanted` where it is lower and this process may (root, CAP_SYS_RESOURCE). The
    daemons started after inherit it: each live worker holds descriptors in the daemon.
    The limits now (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < wanted:
        with contextlib.suppress(ValueError, OSError):  # not privileged: keep the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted, wanted
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard, hard
