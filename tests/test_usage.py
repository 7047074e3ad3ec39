"""What a worker takes (issue 26, item 3), checked against what the test made it do: a
real worker allocates and touches 100 MiB, spins a second of CPU, forks three children;
the daemon's figures (`status`, `ls` with usage, `info` totals) must say so, from its
cgroup's counters and, with `--cgroups off`, summed from /proc. Then the reader alone on
what vanishes as it reads, and a v1 memory cgroup made for real under this process's own.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Usage, WorkerView
from subagentd.daemon.processes._usage import (
    RECENT_AT_LEAST,
    UsageReader,
    WorkerTree,
    _Files,
    _memory,
    process_memory,
)

from .conftest import DaemonProcess
from .helpers import Connect, sh, wait_output

MIB = 1024 * 1024

#: A worker that does what it is told on its stdin: `alloc` touches 100 MiB (printing
#: "allocated"), `spin` burns one second of CPU ("spun"), `free` lets the memory go.
OBEDIENT = """
import sys, time
held = []
print("ready", flush=True)
for line in sys.stdin:
    what = line.strip()
    if what == "alloc":
        held.append(bytearray(100 * 1024 * 1024))
        for i in range(0, len(held[-1]), 4096):
            held[-1][i] = 1
        print("allocated", flush=True)
    elif what == "spin":
        start = time.process_time()
        while time.process_time() - start < 1.0:
            pass
        print("spun", flush=True)
    elif what == "free":
        held.clear()
        print("freed", flush=True)
"""

THREE_CHILDREN = "sleep 300 & sleep 300 & sleep 300 & echo ready; wait"


@pytest.fixture(params=["cgroup", "proc"])
def served(request: pytest.FixtureRequest, daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A daemon with its workers in cgroups (this machine: CPU from cpu.stat, memory from
    /proc, as v2 has no memory controller here), and one with `--cgroups off`."""
    if request.param == "proc":
        daemon_dirs.extra_args = [*daemon_dirs.extra_args, "--cgroups", "off"]
    daemon_dirs.start()
    return daemon_dirs


def cgroups_off(daemon: DaemonProcess) -> bool:
    return daemon.extra_args[-2:] == ["--cgroups", "off"]


@contextlib.asynccontextmanager
async def client_of(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def usage_of(client: AsyncClient, worker_id: str) -> Usage:
    view = await client.status(worker_id)
    assert view.usage is not None, view
    return view.usage


async def told(client: AsyncClient, worker: WorkerView, what: str, answer: bytes) -> None:
    """Tell the obedient worker `what`, and wait until it says it did it."""
    await client.send(worker.id, f"{what}\n")
    await wait_output(client, worker.id, answer)


async def test_memory_and_cpu_are_what_the_worker_made_them(served: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with client_of(served) as client:
            tracking = (await client.info()).tree_tracking
            worker = await client.spawn([sys.executable, "-c", OBEDIENT], stdin_open=True)
            await wait_output(client, worker.id, b"ready")
            before = await usage_of(client, worker.id)
            await told(client, worker, "alloc", b"allocated")
            allocated = await usage_of(client, worker.id)
            grown = allocated.memory - before.memory
            assert abs(grown - 100 * MIB) < 10 * MIB, (before, allocated)
            assert allocated.memory_peak is not None
            assert allocated.memory_peak >= allocated.memory
            assert allocated.processes == 1
            # From the cgroup where there is one (CPU: cpu.stat), else all from /proc.
            assert allocated.source == "proc"  # no v2 memory controller on this machine
            assert tracking.startswith("cgroup") != cgroups_off(served), tracking

            started = time.monotonic()
            await told(client, worker, "spin", b"spun")
            spun = await usage_of(client, worker.id)
            took = time.monotonic() - started
            spent = spun.cpu_seconds - allocated.cpu_seconds
            assert 0.8 <= spent <= 1.2, (allocated, spun)
            # Recent: over the second or so since the reading before, not since the start.
            assert took >= RECENT_AT_LEAST
            assert spun.cpu_percent is not None
            assert spun.cpu_percent == pytest.approx(spent / took * 100, rel=0.35), (spun, took)

            await told(client, worker, "free", b"freed")
            freed = await usage_of(client, worker.id)
            assert freed.memory < allocated.memory - 50 * MIB, freed
            assert freed.memory_peak is not None
            assert freed.memory_peak >= allocated.memory - MIB, freed  # the peak stands
            await client.stop(worker.id)
            ended = await client.status(worker.id)
            assert ended.usage is None  # ended: nothing to read


async def test_processes_count_the_worker_and_its_three_children(served: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with client_of(served) as client:
            worker = await client.spawn(sh(THREE_CHILDREN))
            await wait_output(client, worker.id, b"ready")
            assert (await usage_of(client, worker.id)).processes == 4
            await client.stop(worker.id)


async def test_a_listing_asked_for_usage_carries_it_for_live_workers_only(
    daemon: DaemonProcess, connect: Connect
) -> None:
    with trio.fail_after(30):
        async with client_of(daemon) as client:
            live = await client.spawn(sh("echo up; exec sleep 300"))
            ended = await client.spawn(sh("exit 0"), run=live.run)
            await client.wait(ended.id)
            await wait_output(client, live.id, b"up")
            listed = {v.id: v for v in await client.ls(all=True, usage=True)}
            assert listed[live.id].usage is not None
            assert listed[live.id].usage.processes == 1  # type: ignore[union-attr]
            assert listed[ended.id].usage is None
            assert all(v.usage is None for v in await client.ls(all=True))  # not asked
            # Page by page on the wire, each page's live workers with theirs.
            conn = await connect()
            await conn.send(p.ListWorkers(id=5, all=True, limit=1, usage=True))
            page = await conn.receive()
            assert isinstance(page, p.WorkerList), page
            assert not page.complete
            assert [v.id for v in page.workers] == [live.id]
            assert page.workers[0].usage is not None
            await client.stop(live.id)


async def test_info_totals_the_live_workers_usage(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with client_of(daemon) as client:
            assert (await client.info()).usage is None  # not asked
            empty = (await client.info(usage=True)).usage
            assert empty is not None
            assert (empty.processes, empty.memory) == (0, 0)
            one = await client.spawn(sh(THREE_CHILDREN))
            two = await client.spawn(sh("echo ready; exec sleep 300"), run=one.run)
            for worker in (one, two):
                await wait_output(client, worker.id, b"ready")
            each = [await usage_of(client, w.id) for w in (one, two)]
            total = (await client.info(usage=True)).usage
            assert total is not None
            assert total.processes == 5
            assert total.memory == pytest.approx(sum(u.memory for u in each), rel=0.2)
            assert total.cpu_seconds >= sum(u.cpu_seconds for u in each)
            for worker in (one, two):
                await client.stop(worker.id)


async def test_usage_read_as_workers_end_is_never_an_error(daemon: DaemonProcess) -> None:
    """Workers end (their processes reaped, their cgroups removed) while listings with
    usage read them: every answer is a listing, never an error."""
    with trio.fail_after(60):
        async with client_of(daemon) as client:
            spawned = [await client.spawn(sh("sleep 0.$RANDOM")) for _ in range(20)]
            while any(v.state in ("starting", "running") for v in await client.ls(usage=True)):
                assert (await client.info(usage=True)).usage is not None
            for worker in spawned:
                assert (await client.status(worker.id)).usage is None


async def test_a_hostile_usage_field_is_invalid_naming_it(
    daemon: DaemonProcess, connect: Connect
) -> None:
    with trio.fail_after(30):
        conn = await connect()
        hostile: list[object] = ["yes", "", 1, 0, -1, 2**64 - 1, None, [], {}, 1.5, float("nan")]
        for value in hostile:
            for op in ("list_workers", "info"):
                body = msgspec.msgpack.encode({"op": op, "id": 9, "usage": value})
                await conn.stream.send_all(p.frame(body))
                reply = await conn.receive()
                assert isinstance(reply, p.Error), (op, value, reply)
                assert (reply.id, reply.code) == (9, "invalid"), reply
                assert "usage" in reply.message, reply.message
        await conn.send(p.Info(id=10, usage=True))
        assert isinstance(await conn.receive(), p.InfoReply)  # and it serves on


# -- the reader alone ------------------------------------------------------------------


def _sleeper() -> subprocess.Popen[bytes]:
    """A process past its start: its memory no longer grows as an exec's loading does (a
    `sleep` read while the kernel still mapped it counted half its pages in one read)."""
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE,
    )
    assert sleeper.stdout is not None
    sleeper.stdout.readline()
    sleeper.stdout.close()  # it writes nothing more
    return sleeper


def _starttime(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def test_a_worker_that_vanished_reads_as_what_was_there() -> None:
    """Its process gone, its cgroup gone (never made): nothing, and no error; a list of
    pids read before one exited counts the one left."""
    gone = _sleeper()
    start = _starttime(gone.pid)
    gone.kill()
    gone.wait()
    reader = UsageReader()
    nowhere = Path("/sys/fs/cgroup/unified/subagentd-test-none/w-gone")
    read = reader.read([WorkerTree("w-gone", gone.pid, start, cgroup=nowhere)])["w-gone"]
    assert (read.processes, read.memory, read.cpu_seconds) == (0, 0, 0.0)
    read = reader.read([WorkerTree("w-gone2", gone.pid, start)])["w-gone2"]
    assert (read.processes, read.memory) == (0, 0)
    assert process_memory(gone.pid) is None
    left = _sleeper()
    try:
        memory, _, _ = _memory(_Files(), [gone.pid, left.pid])  # as if listed before it went
        found = process_memory(left.pid)
        assert found is not None
        assert memory == pytest.approx(found.rss, rel=0.1)
    finally:
        left.kill()
        left.wait()


def test_recent_cpu_is_kept_across_a_reading_too_soon_and_forgotten_once_ended() -> None:
    """On a fake clock: a reading within RECENT_AT_LEAST of the one before says again
    what that one measured; one over RECENT_AT_MOST after is since the start."""
    now = [0.0]
    reader = UsageReader(clock=lambda: now[0])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        tree = WorkerTree("w", spinner.pid, _starttime(spinner.pid))
        now[0] = time.clock_gettime(time.CLOCK_BOOTTIME)
        first = reader.read([tree])["w"]
        time.sleep(0.5)  # a real second half of CPU for it to spend
        now[0] += 0.5
        second = reader.read([tree])["w"]
        assert second.cpu_percent is not None
        assert second.cpu_percent > 20, second
        now[0] += 0.01
        assert reader.read([tree])["w"].cpu_percent == second.cpu_percent  # too soon
        assert second.cpu_seconds >= first.cpu_seconds
        assert len(reader) == 1
        reader.forget(tree.pid, tree.starttime)
        assert len(reader) == 0
    finally:
        spinner.kill()
        spinner.wait()


@contextlib.contextmanager
def v1_memory_cgroup() -> Iterator[Path]:
    """A v1 memory cgroup of our own under this process's (never at the root)."""
    own = next(
        line.split(":", 2)[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if line.split(":", 2)[1] == "memory"
    )
    parent = Path("/sys/fs/cgroup/memory") / own.lstrip("/")
    if not os.access(parent, os.W_OK):
        pytest.skip(f"no writable v1 memory cgroup here ({parent})")
    made = parent / f"sa-usage-{os.getpid()}"
    made.mkdir()
    try:
        yield made
    finally:
        for _ in range(100):  # its process is killed and reaped first: empty soon after
            try:
                made.rmdir()
                break
            except OSError:
                time.sleep(0.01)


def test_a_v1_memory_cgroup_named_gives_memory_and_its_peak() -> None:
    with (
        v1_memory_cgroup() as cgroup,
        subprocess.Popen(
            [sys.executable, "-c", OBEDIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        ) as holder,
    ):
        try:
            assert holder.stdout is not None
            assert holder.stdin is not None
            assert holder.stdout.readline() == b"ready\n"
            (cgroup / "cgroup.procs").write_text(str(holder.pid))
            holder.stdin.write(b"alloc\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == b"allocated\n"
            tree = WorkerTree("w", holder.pid, _starttime(holder.pid), v1_memory=cgroup)
            read = UsageReader().read([tree])["w"]
            assert read.source == "cgroup"
            counted = int((cgroup / "memory.usage_in_bytes").read_text())
            assert read.memory == pytest.approx(counted, rel=0.05)
            assert read.memory >= 90 * MIB  # what was touched after the move is charged
            assert read.memory_peak is not None
            assert read.memory_peak >= read.memory
            assert read.processes == 1
        finally:
            holder.kill()
            holder.wait()


def test_a_reader_with_no_descriptor_to_spare_leaves_the_worker_out_not_the_request() -> None:
    """Out of descriptors (EMFILE is no vanishing): the worker is answered without its
    usage, never with made-up figures, and the read raises nothing."""
    sleeper = _sleeper()
    tree = WorkerTree("w", sleeper.pid, _starttime(sleeper.pid))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        assert UsageReader().read([tree]) == {}
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sleeper.kill()
        sleeper.wait()
    back = UsageReader().read([WorkerTree("me", os.getpid(), _starttime(os.getpid()))])
    assert back["me"].processes == 1  # the limit back: it reads again
