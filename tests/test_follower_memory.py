"""What followers cost the daemon: one that does not read holds no page (a few KiB for its
connection), readers share the page budget, and whoever reads, slowly, in bursts or after
a long stall, gets every byte of the journal in order, once.

Issue 24: each idle `watch --follow` held a page of up to 1 MiB and its encoding, about
2 MiB (200 idle followers: the daemon's RSS 32 -> 438 MiB), and kept it for as long as
it stayed connected.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection

MIB = 1024 * 1024
#: A flood: the pump's entries are half a MiB, longer than a socket takes at once.
FLOOD = ["head", "-c", str(24 * MIB), "/dev/zero"]
#: Numbered lines of every length, so that a byte lost, repeated or swapped shows.
LINES = (
    "import sys\n"
    "for i in range(20000):\n"
    "    sys.stdout.write(f'{i} ' + 'x' * (i * 7919 % 400) + '\\n')\n"
)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _expected_lines() -> bytes:
    return "".join(f"{i} " + "x" * (i * 7919 % 400) + "\n" for i in range(20000)).encode()


@contextlib.asynccontextmanager
async def _stalled(
    daemon: DaemonProcess, worker: str, count: int
) -> AsyncIterator[list[RawConnection]]:
    """`count` connections following `worker` from its start, never reading, each once
    the daemon began sending to it; closed after."""
    followers: list[RawConnection] = []
    try:
        for _ in range(count):
            conn = await RawConnection.open(daemon.socket)
            followers.append(conn)
            await conn.send(p.Watch(id=2, worker=worker, follow=True))
        for conn in followers:
            await trio.lowlevel.wait_readable(conn.stream.socket)
        yield followers
    finally:
        for conn in followers:
            await trio.aclose_forcefully(conn.stream)


async def _read_all(
    conn: RawConnection, rid: int = 2, *, chunk: int = 65536, pause: float = 0.0
) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Everything a followed watch sends under `rid`, `chunk` bytes a read and `pause`
    seconds between reads: its stdout, and each entry's (seq, offset into it, length)."""
    stdout, pieces, into = b"", [], 0
    while True:
        while (body := conn.decoder.next_frame()) is None:
            data = await conn.stream.receive_some(chunk)
            assert data, "the daemon closed the connection"
            conn.decoder.feed(data)
            if pause:
                await trio.sleep(pause)
        page = p.daemon_decoder.decode(body)
        assert isinstance(page, p.Page), page
        assert page.id == rid
        for entry in page.entries:
            pieces.append((entry.seq, into, len(entry.data)))
            if entry.kind == "stdout":
                stdout += entry.data
            into = page.next_offset if entry is page.entries[-1] else 0
        if page.complete:
            return stdout, pieces


def _in_order(pieces: list[tuple[int, int, int]]) -> None:
    """Each entry once, from seq 1 on, its pieces (if any) one after the other."""
    seq, end = 0, 0
    for got, at, length in pieces:
        if at:
            assert (got, at) == (seq, end), f"piece of {got} at {at} after {seq} up to {end}"
        else:
            assert got == seq + 1, f"entry {got} after {seq}"
        seq, end = got, at + length


async def test_idle_followers_cost_the_daemon_a_few_kib_each(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    count = 150
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
            await client.watch_page(worker.id)  # its journal opened, verified and kept
            before = _rss(daemon.proc.pid)
            async with _stalled(daemon, worker.id, count):
                await client.info()  # each follower's first page was read and sent by now
                grown = _rss(daemon.proc.pid) - before
            # Before issue 24: about 2 MiB each, here 200 to 300 MiB.
            assert grown < 40 * MIB, f"{count} idle followers grew the daemon {grown} bytes"


async def test_readers_get_every_byte_while_hundreds_do_not_read(daemon: DaemonProcess) -> None:
    """Followers that never read hold none of the page budget: readers after them (and
    one of them once it reads) still get the whole journal."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
            async with (
                _stalled(daemon, worker.id, 200) as followers,
                trio.open_nursery() as readers,
            ):
                for _ in range(4):
                    reader = await RawConnection.open(daemon.socket)
                    followers.append(reader)  # closed with them
                    await reader.send(p.Watch(id=2, worker=worker.id, follow=True))
                    readers.start_soon(_reads_the_flood, reader)
                readers.start_soon(_reads_the_flood, followers[0])


async def _reads_the_flood(conn: RawConnection) -> None:
    stdout, pieces = await _read_all(conn)
    assert len(stdout) == 24 * MIB
    assert stdout.count(0) == len(stdout)
    _in_order(pieces)
    assert all(at == 0 for _, at, _ in pieces), "no entry is cut unless the client asks"


async def test_slow_readers_get_every_line_in_order_once(daemon: DaemonProcess) -> None:
    """Readers at different paces (a few KiB a read, a pause between; pieces asked for
    with a small max_bytes) of a worker still writing, beside followers that never read."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["python3", "-c", LINES])
            results: list[tuple[bytes, list[tuple[int, int, int]]]] = []

            async def follow(max_bytes: int, chunk: int, pause: float) -> None:
                conn = await RawConnection.open(daemon.socket)
                async with conn.stream:
                    await conn.send(
                        p.Watch(id=2, worker=worker.id, follow=True, max_bytes=max_bytes)
                    )
                    results.append(await _read_all(conn, chunk=chunk, pause=pause))

            async with _stalled(daemon, worker.id, 20), trio.open_nursery() as readers:
                readers.start_soon(follow, p.DEFAULT_ANSWER_BYTES, 65536, 0.0)
                readers.start_soon(follow, p.DEFAULT_ANSWER_BYTES, 4096, 0.001)
                readers.start_soon(follow, 1024, 4096, 0.0)
                readers.start_soon(follow, 5000, 20000, 0.002)
            expected = _expected_lines()
            for stdout, pieces in results:
                assert stdout == expected
                _in_order(pieces)


async def test_a_follower_stalled_mid_page_then_reading_gets_the_rest(
    daemon: DaemonProcess,
) -> None:
    """A follower that stops reading mid-page for longer than the daemon keeps a page for it
    (the page is let go, then read again to send its rest), while its worker writes on
    and then ends, gets every byte once it reads again."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            script = "head -c 8388608 /dev/zero; read line; head -c 8388608 /dev/zero"
            worker = await client.spawn(["sh", "-c", script], stdin_open=True)
            async with _stalled(daemon, worker.id, 1) as (follower,):
                data = await follower.stream.receive_some(100_000)  # part of a page, no more
                follower.decoder.feed(data)
                # The stall is the point (past HOLD_SECONDS the page is let go), and the
                # daemon's clock is its own: a real one.
                await trio.sleep(1.5)
                await client.send(worker.id, b"go on\n", eof=True)
                await client.wait(worker.id)
                await trio.sleep(1.5)  # and again, with the worker ended
                stdout, pieces = await _read_all(follower, chunk=8192)
            assert len(stdout) == 16 * MIB
            assert stdout.count(0) == len(stdout)
            _in_order(pieces)
            assert pieces[0][0] == 1


async def test_two_follows_on_one_connection_both_get_everything(
    daemon: DaemonProcess,
) -> None:
    """Two followed watches on one connection, its socket full between them: each page
    whole and in its own stream (one frame at a time on the wire), both complete."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            flood = await client.spawn(FLOOD)
            lines = await client.spawn(["python3", "-c", LINES])
            await client.wait(flood.id)
            await client.wait(lines.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Watch(id=2, worker=flood.id, follow=True))
            await conn.send(p.Watch(id=3, worker=lines.id, follow=True))
            await trio.sleep(1.0)  # neither read meanwhile: both let go of their pages
            got: dict[int, bytes] = {2: b"", 3: b""}
            done: set[int] = set()
            while done != {2, 3}:
                page = await conn.receive()
                assert isinstance(page, p.Page), page
                got[page.id] += b"".join(e.data for e in page.entries if e.kind == "stdout")
                if page.complete:
                    done.add(page.id)
            assert len(got[2]) == 24 * MIB
            assert got[3] == _expected_lines()


async def test_an_abort_of_a_follow_half_sent_ends_its_stream_there(
    daemon: DaemonProcess,
) -> None:
    """Its client stopped reading mid-page, aborts, then reads: the stream ends with
    whole frames (the page finished, then `done` for the abort), or the connection is
    closed in the page; never a torn frame with another after it. Others are served."""
    assert daemon.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(FLOOD)
            await client.wait(worker.id)
            async with _stalled(daemon, worker.id, 1) as (follower,):
                # Into a page of half a MiB by a few KiB: more than its socket holds is
                # still to be sent.
                decoder = follower.decoder
                while (decoder.incomplete_length or 0) < 256 * 1024:
                    decoder.feed(await follower.stream.receive_some(4096))
                    while decoder.next_frame() is not None:
                        pass
                await follower.send(p.Abort(id=3, request=2))
                before_done: list[p.Reply] = []
                while (reply := await follower.receive()) is not None:
                    if isinstance(reply, p.Done):
                        break
                    before_done.append(reply)
                if reply is None:
                    assert decoder.incomplete_length, "closed, yet no page was left torn"
                else:
                    assert reply.id == 3
                    assert all(isinstance(r, p.Page) and r.id == 2 for r in before_done)
            assert (await client.info()).pid == daemon.proc.pid
