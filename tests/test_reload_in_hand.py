"""A reload does not stop supervision: it execs from where every task stands, once
none holds what the exec would lose. So a pump parked at any await holds no byte it
read, output a full disk holds back refuses the reload rather than vanish with it,
and output written fast across reloads is journaled whole, once."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.processes._process import pump

from .conftest import DaemonProcess
from .helpers import paged_stdout, sh, wait_output
from .helpers import reload_on_own_connection as reload

#: 100 numbered lines at a time, 2,000 times: long enough to write across reloads.
BURSTS = "i=0; while [ $i -lt 2000 ]; do seq $((i*100+1)) $((i*100+100)); i=$((i+1)); done"
ALL_LINES = b"".join(b"%d\n" % n for n in range(1, 200_001))


async def test_a_pump_parked_at_any_await_holds_no_byte_it_read() -> None:
    """The invariant a reload's exec relies on: cut a pump at any of its awaits (as the
    exec does, or a cancel) and what it read is delivered; the rest is in the pipe."""
    with trio.fail_after(30):
        for cut_after in range(60):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            delivered: list[bytes] = []

            async def deliver(chunk: bytes, got: list[bytes] = delivered) -> None:
                got.append(chunk)  # as the supervisor's: written before any await
                await trio.lowlevel.checkpoint()

            written = b""
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, read_end, deliver)
                for step in range(cut_after):
                    burst = b"%d\n" % step * (step % 7)
                    os.write(write_end, burst)
                    written += burst
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()
            rest = b""
            while chunk := _read_nowait(read_end):
                rest += chunk
            os.close(read_end)
            os.close(write_end)
            assert b"".join(delivered) + rest == written, cut_after


def _read_nowait(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


async def test_output_written_fast_across_reloads_is_journaled_whole_once(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(120):
        gate = daemon.root / "gate"
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(f"echo up; while [ ! -e {gate} ]; do :; done; {BURSTS}"))
            await wait_output(client, worker.id, b"up\n")
        gate.touch()
        for generation in (2, 3):
            reply = await reload(daemon)
            assert isinstance(reply, p.ReloadReply), reply
            assert (reply.image_generation, reply.carried_live) == (generation, 1)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.wait(worker.id)).state == "finished"
            assert await paged_stdout(client, worker.id) == b"up\n" + ALL_LINES


async def test_output_a_full_disk_holds_back_refuses_a_reload_and_is_not_lost(
    daemon_dirs: DaemonProcess, small_disk: Path
) -> None:
    daemon_dirs.start()
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            gate = daemon_dirs.root / "gate"
            # 1.3 MiB of numbered lines into a 2 MiB disk, with the store and its ballast.
            worker = await client.spawn(
                sh(f"while [ ! -e {gate} ]; do sleep 0.02; done; seq 1 200000")
            )
            ballast = small_disk / "ballast"
            with open(ballast, "wb") as f:  # noqa: ASYNC230 - a tmpfs: memory-fast
                f.write(b"\0" * (1536 * 1024))
            gate.touch()
            # No event says "the disk is now full": look until the daemon reports it.
            while not (info := await client.info()).problems:  # noqa: ASYNC110
                await trio.sleep(0.05)
            assert "No space left on device" in info.problems[0]
            refusal = await reload(daemon_dirs)
            assert isinstance(refusal, p.Error), refusal
            assert refusal.code == "refused"
            assert "the disk would not take" in refusal.message
            ballast.unlink()  # room again: the held output goes through, every line of it
            assert (await client.wait(worker.id)).state == "finished"
            assert await paged_stdout(client, worker.id) == ALL_LINES
            reply = await reload(daemon_dirs)
            assert isinstance(reply, p.ReloadReply), reply
