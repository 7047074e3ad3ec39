"""Journals a worker tampers with: a planted length, a sparse gigabyte of zeros or a huge
file put in place of its journal costs the daemon neither its memory nor its event loop.

A worker knows its archive directory and runs as the same user, so each test has a
real worker rename a crafted file over its own journal, as a hostile or broken one would.
"""

from __future__ import annotations

import sys
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
