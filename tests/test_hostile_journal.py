"""Journals a worker tampers with: a planted length, a sparse gigabyte of zeros or a huge
file put in place of its journal costs the daemon neither its memory nor its event loop.

A worker knows its archive directory and runs as the same user, so each test has a
real worker rename a crafted file over its own journal, as a hostile or broken one would.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Refused

from .conftest import DaemonProcess
from .helpers import paged_stdout, sh

PY = sys.executable

#: Far below the gigabyte a planted journal costs if read whole.
RSS_BOUND_KB = 300 * 1024
#: How long `info` may take while a long journal is read: generous (~60 ms here);
#: verifying a million entries on the event loop held it 3.5 s and more.
INFO_BOUND = 1.5

_PLANT_HUGE_ENTRY = """
import os, struct, sys
archive = sys.argv[1]
tmp = os.path.join(archive, "planted")
with open(tmp, "wb") as f:
    f.write(struct.pack(">II", (1 << 30) - 1, 0))  # an entry claiming a 1 GiB body
    f.truncate((1 << 30) + 4096)  # sparse: costs the worker nothing
os.rename(tmp, os.path.join(archive, "journal"))
"""

_PLANT_ZEROS = """
import os, sys
archive = sys.argv[1]
tmp = os.path.join(archive, "planted")
with open(tmp, "wb") as f:
    f.truncate(1 << 30)  # a gigabyte of (sparse) zeros
os.rename(tmp, os.path.join(archive, "journal"))
"""


#: A million empty entries, each valid (32 MB): verifying them takes seconds.
_PLANT_MANY_ENTRIES = """
import os, struct, sys, zlib
import msgspec
archive = sys.argv[1]
encode = msgspec.msgpack.Encoder().encode
parts = []
for seq in range(1, 1_000_001):
    body = encode([seq, "stdout", 0.0, b""])
    parts.append(struct.pack(">II", len(body), zlib.crc32(body)) + body)
tmp = os.path.join(archive, "planted")
with open(tmp, "wb") as f:
    f.write(b"".join(parts))
os.rename(tmp, os.path.join(archive, "journal"))
"""

#: The same, then one entry of stdout: "bye".
_PLANT_MANY_THEN_BYE = _PLANT_MANY_ENTRIES.replace(
    "tmp = ",
    """body = encode([1_000_001, "stdout", 0.0, b"bye"])
parts.append(struct.pack(">II", len(body), zlib.crc32(body)) + body)
tmp = """,
    1,
)


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


def _planting(plant: str, output: str = "head -c 600000 /dev/zero | tr '\\0' a; ") -> list[str]:
    """A worker that writes `output` and then renames a crafted file over its journal."""
    return sh(f"{output}{PY} -c '{plant}' \"$SUBAGENTD_ARCHIVE\"")


async def test_a_planted_journal_entry_length_is_read_whole_by_a_page_read(
    daemon: DaemonProcess,
) -> None:
    """Pages come from the journal the daemon wrote, through its own descriptor: a file
    claiming a 1 GiB entry renamed over it is never read, so `watch` answers the
    worker's real output and the daemon's memory stays small."""
    assert daemon.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(_planting(_PLANT_HUGE_ENTRY))
            await client.wait(worker.id)
            assert await paged_stdout(client, worker.id, limit=10) == b"a" * 600_000
            assert (await client.info()).pid > 0
    assert _peak_rss_kb(daemon.proc.pid) < RSS_BOUND_KB


async def test_a_planted_journal_entry_length_is_damage_when_opened_after_a_restart(
    daemon: DaemonProcess,
) -> None:
    """The next daemon opens what the worker left by its name: an entry longer than any
    the daemon writes is damage, refused naming its offset, never a 1 GiB read."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(_planting(_PLANT_HUGE_ENTRY))
            await client.wait(worker.id)
        daemon.terminate()
        daemon.start()
        assert daemon.proc is not None
        async with AsyncClient(daemon.socket) as client:
            with pytest.raises(Refused, match="damaged at byte 0"):
                await client.watch_page(worker.id, since=0, limit=10)
            assert (await client.info()).pid > 0
    assert _peak_rss_kb(daemon.proc.pid) < RSS_BOUND_KB


async def test_a_sparse_zero_journal_is_copied_whole_when_opened(
    daemon: DaemonProcess,
) -> None:
    """A gigabyte of zeros is a torn tail (a crash extended the file, never filled it):
    found without reading it into memory, so the next daemon answers an empty page."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(_planting(_PLANT_ZEROS, output="echo hi; "))
            await client.wait(worker.id)
        daemon.terminate()
        daemon.start()
        assert daemon.proc is not None
        async with AsyncClient(daemon.socket) as client:
            page = await client.watch_page(worker.id, since=0, limit=10)
            assert (page.entries, page.complete) == ([], True)
            assert (await client.info()).pid > 0
    assert _peak_rss_kb(daemon.proc.pid) < RSS_BOUND_KB


async def test_a_long_journal_is_verified_while_the_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    """Opening an ended worker's journal verifies all of it, which takes as long as
    the worker made it: off the event loop, so `info` is answered meanwhile."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(_planting(_PLANT_MANY_ENTRIES, output=""))
            await client.wait(worker.id)
        daemon.terminate()
        daemon.start()
        slowest, answered = 0.0, 0
        async with (
            AsyncClient(daemon.socket) as watcher,
            AsyncClient(daemon.socket) as client,
            trio.open_nursery() as nursery,
        ):
            paged = trio.Event()

            async def page() -> None:
                first = await watcher.watch_page(worker.id, since=0, limit=3)
                assert [e.seq for e in first.entries] == [1, 2, 3]
                paged.set()

            nursery.start_soon(page)
            while not paged.is_set():
                asked = time.monotonic()
                await client.info()
                slowest = max(slowest, time.monotonic() - asked)
                answered += 1
    assert answered > 1  # the page took a while: its journal was long
    # A generous bound: ~60 ms here; verifying on the event loop held it 2.6 s.
    assert slowest < 1.5


async def _slowest_info_while(client: AsyncClient, done: trio.Event) -> tuple[float, int]:
    """Ask `info` over and over (`client`: a connection of its own) until `done`;
    (the slowest answer, how many)."""
    slowest, answered = 0.0, 0
    while not done.is_set():
        asked = time.monotonic()
        await client.info()
        slowest = max(slowest, time.monotonic() - asked)
        answered += 1
    return slowest, answered


async def test_a_resume_of_a_worker_with_a_long_journal_does_not_freeze_the_daemon(
    daemon: DaemonProcess,
) -> None:
    """A resume opens the journal for writing, verifying every entry: in a thread, so a
    worker that left a million valid entries delays its own resume, not everyone."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            # It plants a million valid entries over its journal, then fails: resumable.
            failing = await client.spawn(
                sh(_planting(_PLANT_MANY_ENTRIES, output="")[2] + "; exit 3")
            )
            ended = await client.wait(failing.id)
            assert ended.state == "failed", ended
            done = trio.Event()
            async with AsyncClient(daemon.socket) as pinger, trio.open_nursery() as nursery:

                async def resume() -> None:
                    try:
                        await client.resume(failing.id)
                    finally:
                        done.set()

                nursery.start_soon(resume)
                slowest, answered = await _slowest_info_while(pinger, done)
            # The resumed attempt journals after the million planted entries.
            resumed = await client.wait(failing.id)
            assert (resumed.state, resumed.attempt) == ("failed", 2), resumed
            page = await client.watch_page(failing.id, since=1_000_000, limit=10)
            assert b"attempt 2: resumed" in b"".join(e.data for e in page.entries), page
    assert answered >= 1
    assert slowest < INFO_BOUND, f"info waited {slowest:.1f} s while a resume verified a journal"


async def test_collecting_a_worker_with_a_long_journal_does_not_freeze_the_daemon(
    daemon: DaemonProcess,
) -> None:
    """collect of an ended worker with no result file answers the end of its stdout, read
    from the end of its journal after a restart: never the whole journal verified on the
    event loop (a million entries held every client 3.5 s)."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(_planting(_PLANT_MANY_THEN_BYE, output=""))
            await client.wait(worker.id)
        daemon.terminate()
        daemon.start()
        done = trio.Event()
        async with (
            AsyncClient(daemon.socket) as client,
            AsyncClient(daemon.socket) as pinger,
            trio.open_nursery() as nursery,
        ):
            collected: list[str] = []

            async def collect() -> None:
                try:
                    collected.append((await client.collect(worker.id)).result)
                finally:
                    done.set()

            nursery.start_soon(collect)
            slowest, answered = await _slowest_info_while(pinger, done)
    assert collected == ["bye"]  # the journal's last entry, read from its end
    assert answered >= 1
    assert slowest < INFO_BOUND, f"info waited {slowest:.1f} s while collect read a journal"


async def test_a_fault_at_the_ending_of_a_worker_with_a_long_journal_does_not_freeze_the_daemon(
    daemon_dirs: DaemonProcess,
) -> None:
    """A fault after an ending closed the journal notes the failure in it: through the
    descriptor the daemon holds, never by opening (and verifying) whatever file its
    worker left at the journal's name on the event loop."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "record:planter"})
    with trio.fail_after(120):
        async with (
            AsyncClient(daemon_dirs.socket) as client,
            AsyncClient(daemon_dirs.socket) as pinger,
            trio.open_nursery() as nursery,
        ):
            done = trio.Event()
            ended: list[str] = []  # its id

            async def plant_and_fail() -> None:
                try:
                    worker = await client.spawn(
                        _planting(_PLANT_MANY_ENTRIES, output="echo hi; "), name="planter"
                    )
                    assert (await client.wait(worker.id)).state == "failed"
                    ended.append(worker.id)
                finally:
                    done.set()

            nursery.start_soon(plant_and_fail)
            slowest, answered = await _slowest_info_while(pinger, done)
            # Noted in the journal the daemon wrote (kept open: its pages come from it).
            page = await client.watch_page(ended[0], since=0, limit=100)
    assert answered >= 1
    assert slowest < INFO_BOUND, f"info waited {slowest:.1f} s while a failure was noted"
    assert [e.data for e in page.entries if e.kind == "stdout"] == [b"hi\n"], page
    assert b"injected fault at record:planter" in b"".join(e.data for e in page.entries), page


async def test_two_resumes_of_a_worker_with_a_long_journal_start_one_attempt(
    daemon: DaemonProcess,
) -> None:
    """While a resume verifies the journal (in a thread, the daemon serving on) a second
    resume of the same worker is refused: one attempt starts, its journal opened once."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as other:
            failing = await client.spawn(
                sh(_planting(_PLANT_MANY_ENTRIES, output="")[2] + "; exit 3")
            )
            assert (await client.wait(failing.id)).state == "failed"
            outcomes: list[str] = []

            async def resume(by: AsyncClient) -> None:
                try:
                    outcomes.append(f"attempt {(await by.resume(failing.id)).attempt}")
                except Refused as exc:
                    outcomes.append(exc.message)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(resume, client)
                nursery.start_soon(resume, other)
            ended = await client.wait(failing.id)
            page = await client.watch_page(failing.id, since=1_000_000, limit=10)
    started, refused = sorted(outcomes)
    assert started == "attempt 2", outcomes
    assert refused == f"worker {failing.id} is being resumed already", outcomes
    assert ended.attempt == 2
    notes = [e.data for e in page.entries if e.kind == "note"]
    assert notes == [b"attempt 2: resumed"], page
