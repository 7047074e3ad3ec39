"""Journals end to end: long outputs paged and followed without gaps, a follower that
stops reading costs the daemon no memory, and a worker flooding its output neither
starves the daemon nor keeps the small pipe it started with."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.processes._process import PIPE_BYTES

from .conftest import DaemonProcess
from .helpers import RawConnection, paged_stdout
from .helpers import reload_on_own_connection as reload

LINES = 50_000


async def test_tens_of_thousands_of_lines_paged_and_followed_without_gaps(
    daemon: DaemonProcess,
) -> None:
    expected = "".join(f"{i}\n" for i in range(1, LINES + 1)).encode()
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["seq", "1", str(LINES)])
            followed, seqs = b"", []
            async for entry in client.watch(worker.id, follow=True):
                seqs.append(entry.seq)
                if entry.kind == "stdout":
                    followed += entry.data
            assert followed == expected
            assert seqs == list(range(1, len(seqs) + 1))
            paged = await paged_stdout(client, worker.id, limit=7)
            assert paged == expected


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_stalled_follower_does_not_grow_the_daemon(daemon: DaemonProcess) -> None:
    size = 300 * 1024 * 1024
    assert daemon.proc is not None
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["head", "-c", str(size), "/dev/zero"])
            stalled = await RawConnection.open(daemon.socket)
            await stalled.send(p.Watch(id=2, worker=worker.id, follow=True))
            before = _rss_bytes(daemon.proc.pid)
            await client.wait(worker.id)  # the worker writes everything while nobody reads
            grown = _rss_bytes(daemon.proc.pid) - before
            assert grown < 64 * 1024 * 1024, f"daemon grew by {grown} bytes"
            received, last_seq = 0, 0
            async with stalled.stream:
                while True:
                    page = await stalled.receive()
                    assert isinstance(page, p.Page)
                    for entry in page.entries:
                        assert entry.seq == last_seq + 1
                        last_seq = entry.seq
                        if entry.kind == "stdout":
                            received += len(entry.data)
                    if page.complete:
                        break
            assert received == size


async def test_a_worker_flooding_its_output_leaves_the_daemon_answering(
    daemon: DaemonProcess,
) -> None:
    """A worker that writes as fast as it can (its pump never finds its pipe empty)
    holds the daemon one chunk at a time: other requests are answered meanwhile, and
    what it wrote is journaled as it goes."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            flood = await client.spawn(["cat", "/dev/zero"])
            await client.watch_page(flood.id, 0, 1)  # its pump is under way
            for _ in range(20):
                with trio.fail_after(5):  # generous: a starved loop never answers
                    await client.info()
                    page = await client.watch_page(flood.id, 0, 1)
                assert page.entries
            await client.stop(flood.id)
            assert (await client.wait(flood.id)).state == "stopped"


async def test_a_worker_that_fills_its_pipe_gets_a_bigger_one(daemon: DaemonProcess) -> None:
    """A worker writing faster than its output is read finds its pipe grown (fewer,
    longer reads); one that writes a line keeps the kernel's default."""
    probe = (
        "import fcntl, os, sys;"
        "os.write(1, b'x' * (4 << 20) if sys.argv[1] == 'fast' else b'x\\n');"
        "print(fcntl.fcntl(1, fcntl.F_GETPIPE_SZ), file=sys.stderr)"
    )
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            sizes = {}
            for speed in ("fast", "slow"):
                worker = await client.spawn([sys.executable, "-c", probe, speed])
                await client.wait(worker.id)
                said = [e.data async for e in client.watch(worker.id) if e.kind == "stderr"]
                sizes[speed] = int(b"".join(said))
            assert sizes == {"fast": PIPE_BYTES, "slow": 64 * 1024}


async def test_a_flooded_journal_keeps_only_its_end_in_the_page_cache(
    daemon: DaemonProcess,
) -> None:
    """A journal a worker floods is written back and dropped from the page cache behind
    its end as it grows (no pile of dirty pages, no fresh memory for all of it), and
    still reads back whole, from disk."""
    size = 256 * 1024 * 1024
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["head", "-c", str(size), "/dev/zero"])
            ended = await client.wait(worker.id)
            fincore = await trio.run_process(
                ["fincore", "--bytes", "--noheadings", "--output", "RES",
                 str(Path(ended.archive) / "journal")],
                capture_stdout=True,
            )  # fmt: skip
            assert int(fincore.stdout) <= size // 2  # before: all of it (256 MiB and more)
            read, cursor = 0, 0
            while True:
                page = await client.watch_page(worker.id, cursor, 10_000)
                read += sum(len(e.data) for e in page.entries if e.kind == "stdout")
                cursor = page.next
                if page.complete:
                    break
            assert read == size


#: Numbered lines, ~75 KB a write (more than a pipe of the kernel's default size holds)
#: every 2 ms, until the gate is there: ~35 MB/s, so a reload's freeze fills its pipe.
FLOOD_UNTIL_GATE = """
import os, sys, time
gate, n, out = sys.argv[1], 0, sys.stdout.buffer
while not os.path.exists(gate):
    out.write(b"".join(b"%d\\n" % i for i in range(n, n + 10_000)))
    out.flush()
    n += 10_000
    time.sleep(0.002)
print(n, file=sys.stderr)
"""


async def test_a_reload_amid_a_flood_loses_and_doubles_no_byte(daemon: DaemonProcess) -> None:
    """A worker flooding its output (its pipe grown, its journal shed behind its end,
    its pipe full while the daemon is frozen) across a reload: every line it wrote is
    journaled once, in order."""
    gate = daemon.root / "gate"
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn([sys.executable, "-c", FLOOD_UNTIL_GATE, str(gate)])
            # Past the journal's cached end and a shed step: its older pages are shed.
            written = 0
            async with contextlib.aclosing(client.watch(worker.id, follow=True)) as entries:
                async for entry in entries:
                    written += len(entry.data)
                    if written > 56 * 1024 * 1024:
                        break
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply), reply
        assert reply.carried_live == 1
        gate.touch()
        async with AsyncClient(daemon.socket) as client:
            assert (await client.wait(worker.id)).state == "finished"
            expected, lines, said = _Numbered(), 0, b""
            async for entry in client.watch(worker.id):
                if entry.kind == "stdout":
                    assert entry.data == expected.take(len(entry.data)), entry.seq
                    lines += entry.data.count(b"\n")
                elif entry.kind == "stderr":
                    said += entry.data
            assert lines == int(said)  # as many as it wrote, the last one whole


class _Numbered:
    """The lines "0", "1", "2", ... as one stream, taken a piece at a time."""

    def __init__(self) -> None:
        self._next = 0
        self._pieces: list[bytes] = []
        self._buffer = b""

    def take(self, size: int) -> bytes:
        have = len(self._buffer)
        while have < size:
            block = b"".join(b"%d\n" % i for i in range(self._next, self._next + 10_000))
            self._pieces.append(block)
            self._next += 10_000
            have += len(block)
        whole = b"".join([self._buffer, *self._pieces])
        self._pieces.clear()
        piece, self._buffer = whole[:size], whole[size:]
        return piece
