"""Faults: a full disk under the state dir, and kill -9 of the daemon mid-work.

The full disk is real: the state dir lives on a small tmpfs the test mounts
(it needs root, which this project's machines and CI have).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Refused

from .conftest import DaemonProcess
from .helpers import alive, paged_stdout, sh, wait_output


async def test_a_full_disk_is_reported_holds_the_writer_and_loses_nothing(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    daemon_dirs.start()
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            gate = daemon_dirs.root / "gate"
            # 3 MiB of numbered lines into a 2 MiB disk, after the gate opens.
            script = f"while [ ! -e {gate} ]; do sleep 0.02; done; seq 1 400000"
            worker = await client.spawn(sh(script))
            gate.touch()
            # No event says "the disk is now full": look until the daemon reports it.
            while not (info := await client.info()).problems:  # noqa: ASYNC110
                await trio.sleep(0.05)
            assert "No space left on device" in info.problems[0]
            assert (await client.status(worker.id)).state == "running"  # held, not lost
            # Make room: the held output goes through, every line of it.
            await trio.run_process(["mount", "-o", "remount,size=64m", str(small_disk)])
            view = await client.wait(worker.id)
            assert view.state == "finished"
            lines = await paged_stdout(client, worker.id)
            assert lines == b"".join(b"%d\n" % i for i in range(1, 400_001))
            assert (await client.info()).problems == []


async def test_kill_9_mid_output_leaves_a_journal_readable_to_its_torn_tail(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("seq 1 10000000"))
            await wait_output(client, worker.id, b"\n100000\n")
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            view = await client.status(worker.id)
            assert view.state == "interrupted"
            assert view.pid is not None
            assert not alive(view.pid)
            text = await paged_stdout(client, worker.id)
            numbers = text.split(b"\n")[:-1]
            assert numbers == [b"%d" % i for i in range(1, len(numbers) + 1)]  # no gap, no junk
            assert len(numbers) >= 100_000


async def test_a_spawn_onto_a_full_disk_is_refused_saying_so(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    daemon_dirs.start()
    ballast = small_disk / "ballast"
    with trio.fail_after(30):
        # Filling a tmpfs is memory-fast: no need for a thread.
        with open(ballast, "wb") as f, contextlib.suppress(OSError):  # noqa: ASYNC230
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        async with AsyncClient(daemon_dirs.socket) as client:
            with pytest.raises(Refused, match="free some space"):
                await client.spawn(["true"])
            assert "No space left on device" in (await client.info()).problems[0]
            ballast.unlink()
            worker = await client.spawn(["echo", "room again"])
            assert (await client.collect(worker.id, wait=True)).result == "room again\n"
