"""Endings, recovery and resume meet files a worker planted and errors nobody expects:
nothing keeps the daemon from starting, no wake is lost, nothing is left `starting`,
and no worker escapes recovery by damaging its record.

Workers run as the same user and are told their archive directory, so each test
has a real worker do the planting, the way a hostile or broken one would.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, sh, wait_output


async def _wakes(daemon: DaemonProcess, run: str) -> list[p.Wake]:
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Subscribe(id=2, run=run))
        reply = await conn.receive()
        assert isinstance(reply, p.Wakes)
        return reply.wakes


async def _until(condition: Callable[[], object], what: str) -> None:
    """Poll for a condition no event announces (a file a worker writes, a log line)."""
    while not condition():  # noqa: ASYNC110  nothing to wait on but the condition: `what`
        await trio.sleep(0.02)


async def test_a_planted_directory_does_not_keep_the_daemon_from_starting_after_a_crash(
    daemon: DaemonProcess,
) -> None:
    """A worker that made `stdout.tail` a directory (a rename onto it fails EISDIR)
    does not turn a daemon crash into a daemon that never starts again: the directory
    is moved aside, the tail written, and every interrupted worker gets its wake."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            planter = await client.spawn(
                sh('mkdir "$SUBAGENTD_ARCHIVE/stdout.tail"; echo planted; sleep 600'), run=run
            )
            other = await client.spawn(sh("echo other; sleep 600"), run=run)
            await wait_output(client, planter.id, b"planted\n")
            await wait_output(client, other.id, b"other\n")
        daemon.kill()  # a crash (OOM, a bug): both are found interrupted at the next start
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            for worker in (planter, other):
                assert (await client.status(worker.id)).state == "interrupted"
            assert (await client.collect(planter.id)).result == "planted\n"
        woken = sorted((w.id, w.state) for w in await _wakes(daemon, run))
        assert woken == sorted([(planter.id, "interrupted"), (other.id, "interrupted")])
