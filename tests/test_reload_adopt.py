"""The new image's side of a reload: what it adopts, and what happened meanwhile.

In-process (tests/inprocess.py): the old image's real checkpoint and descriptors, adopted
by a new `Daemon` as `_serve` does; only the exec is left out.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.daemon.lifecycle import _reload
from subagentd.daemon.workers import _supervisor
from subagentd.protocol import TERMINAL_STATES

from . import inprocess
from .helpers import RawConnection
from .inprocess import held, in_process


async def test_a_worker_that_exits_during_the_exec_is_reaped_and_wakes_once(
    autojump_clock: MockClock, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process(short_tmp) as d:
        async with d.client() as client:
            with held(autojump_clock):
                run = await client.new_run()
                workers = [await client.spawn(["sleep", "100000"], run=run) for _ in range(3)]
        gone = workers[1]
        pid = gone.pid
        assert pid is not None
        real_adopt = _reload.adopt  # what tests/inprocess.py adopts with

        async def adopt_after_an_exit(*args: Any) -> Any:
            # Frozen, checkpointed, "exec'd": the worker dies before the new image adopts it.
            pidfd = os.pidfd_open(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                await trio.lowlevel.wait_readable(pidfd)  # a zombie now, unreaped
            finally:
                os.close(pidfd)
            return await real_adopt(*args)

        monkeypatch.setattr(inprocess, "adopt", adopt_after_an_exit)
        # Supervision starts a worker at a time, the server answering in between.
        monkeypatch.setattr(_supervisor, "SUPERVISION_BATCH", 1)
        with held(autojump_clock):
            d = await d.reload_in_place()
            async with d.client() as client:
                ended = await client.wait(gone.id)
                assert ended.state in TERMINAL_STATES
                assert ended.exit_code == -signal.SIGKILL
                for other in (workers[0], workers[2]):
                    assert (await client.status(other.id)).state == "running"
            with pytest.raises(ChildProcessError):  # reaped: no longer our child
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - no wait
            conn = await RawConnection.open(d.socket)
            async with conn.stream:
                await conn.send(p.Subscribe(id=2, run=run))
                page = await conn.receive()
                assert isinstance(page, p.Wakes)
                assert [w.id for w in page.wakes] == [gone.id]  # once
            async with d.client() as client:
                for other in (workers[0], workers[2]):
                    await client.stop(other.id)
