"""The new image's side of a reload: what it adopts, and what happened meanwhile.

In-process (tests/inprocess.py): the old image's real checkpoint and descriptors, adopted
by a new `Daemon` as `_serve` does; only the exec is left out.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.daemon.lifecycle import _reload
from subagentd.daemon.lifecycle._checkpoint import Checkpoint
from subagentd.daemon.workers import _supervisor
from subagentd.protocol import TERMINAL_STATES

from . import inprocess
from .helpers import RawConnection, paged_stdout, wait_output
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


def misdescribe(how: str, handoff: Checkpoint, archives: Path) -> int:
    """Rewrite what the checkpoint says of the journals, as a worker could between its
    write and the exec, or make it stale; how many workers' journals it misdescribes
    (the first ones)."""
    first, second = handoff.live[0], handoff.live[1]
    assert first.journal is not None
    assert second.journal is not None
    index = first.journal.index
    if how == "longer":  # the file is shorter than it says
        first.journal.index = msgspec.structs.replace(index, size=index.size + 1)
    elif how == "renumbered":  # its last entry is not numbered so
        first.journal.index = msgspec.structs.replace(index, last_seq=index.last_seq + 1)
    elif how == "swapped":  # each descriptor the other worker's journal
        first.journal.fd, second.journal.fd = second.journal.fd, first.journal.fd
        return 2
    elif how == "a pipe":  # its stdout pipe, listed twice now
        assert first.stdout is not None
        first.journal.fd = first.stdout
    elif how == "grown since":  # its worker wrote into it (half an entry): stale
        with (archives / first.id / "journal").open("ab") as journal:
            journal.write(b"\x00\x00\x00\x40torn")
    return 1


@pytest.mark.parametrize("how", ["longer", "renumbered", "swapped", "a pipe", "grown since"])
async def test_a_journal_the_checkpoint_misdescribes_is_opened_again_and_nothing_is_lost(
    autojump_clock: MockClock, short_tmp: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # The checkpoint lies in the state dir, in a worker's reach: a journal it carries is
    # taken only if it is the file at its path, as long as it says, ending as it says.
    async with in_process(short_tmp) as d:
        with held(autojump_clock):
            async with d.client() as client:
                workers = [
                    await client.spawn(["sh", "-c", "echo before; cat"], stdin_open=True)
                    for _ in range(3)
                ]
                for worker in workers:
                    await wait_output(client, worker.id, b"before\n")
            real_adopt, real_warning = _reload.adopt, _reload.log.warning
            warned: list[tuple[str, dict[str, Any]]] = []
            misdescribed = 0

            async def adopt_misdescribed(daemon: Any, handoff: Checkpoint, *rest: Any) -> Any:
                nonlocal misdescribed
                misdescribed = misdescribe(how, handoff, daemon.state_dir.archives)
                return await real_adopt(daemon, handoff, *rest)

            def warning(event: str, **kw: Any) -> None:
                warned.append((event, kw))
                real_warning(event, **kw)

            monkeypatch.setattr(inprocess, "adopt", adopt_misdescribed)
            monkeypatch.setattr(_reload.log, "warning", warning)
            d = await d.reload_in_place()
            reopened = [kw["worker"] for event, kw in warned if event == "reload.journal_reopened"]
            assert reopened == [w.id for w in workers[:misdescribed]], warned
            async with d.client() as client:
                for worker in workers:  # every one carried live, its output whole
                    view = await client.status(worker.id)
                    assert (view.state, view.pid) == ("running", worker.pid)
                    await client.send(worker.id, "after\n", eof=True)
                for worker in workers:
                    result = await client.collect(worker.id, wait=True)
                    assert (result.state, result.result) == ("finished", "before\nafter\n")
                    assert await paged_stdout(client, worker.id) == b"before\nafter\n"


async def test_a_reload_into_an_image_that_reads_checkpoint_version_2_carries_no_journal(
    autojump_clock: MockClock, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Such an image (its --check said so) lists no journal among the descriptors it takes
    # back: a journal carried to it would stay inheritable, in every worker it spawns.
    async with in_process(short_tmp) as d:
        with held(autojump_clock):
            async with d.client() as client:
                worker = await client.spawn(["sh", "-c", "echo before; cat"], stdin_open=True)
                await wait_output(client, worker.id, b"before\n")
            real_adopt = _reload.adopt
            handed: list[Checkpoint] = []

            async def adopt_seen(daemon: Any, handoff: Checkpoint, *rest: Any) -> Any:
                handed.append(handoff)
                return await real_adopt(daemon, handoff, *rest)

            monkeypatch.setattr(inprocess, "adopt", adopt_seen)
            d.reloader.next_version = 2  # as `_check_in_a_child` takes it from such an image
            d = await d.reload_in_place()
            assert [(h.version, [w.journal for w in h.live]) for h in handed] == [(2, [None])]
            async with d.client() as client:
                await client.send(worker.id, "after\n", eof=True)
                result = await client.collect(worker.id, wait=True)
                assert result.result == "before\nafter\n"
