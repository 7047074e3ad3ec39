"""Journals end to end: long outputs paged and followed without gaps, and a follower
that stops reading costs the daemon no memory."""

from __future__ import annotations

from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, paged_stdout

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
