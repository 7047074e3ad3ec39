"""Pause and unpause (issue 26, item 5): a worker's subtree or a run held still by the
kernel (cgroup.freeze) or by SIGSTOP over its scanned tree, across a reload, a stop and a
crash, its timeout not running meanwhile. Real processes, each way of tracking trees."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol.errors import Invalid, NotFound, Refused

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, follow_stdout, pending_wakes, sh, wait_output
from .inprocess import at, held, in_process
from .pausing import COUNTER, cgroup_of, kernel_holds
from .test_top import once, row


@pytest.fixture
async def client(tracking: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(tracking.socket) as client:
        yield client


def _counted(stdout: bytes) -> list[int]:
    return [int(line) for line in stdout.decode().split("\n") if line]


async def _stdout(client: AsyncClient, worker_id: str) -> list[p.Entry]:
    entries: list[p.Entry] = []
    since = 0
    while True:
        page = await client.watch_page(worker_id, since=since)
        entries += [e for e in page.entries if e.kind == "stdout"]
        if not page.truncated and (page.complete or page.next == since):
            return entries
        since = page.next


async def _witness(client: AsyncClient, seconds: float) -> None:
    """Let real time pass by something awaited: a worker that takes `seconds`, waited for."""
    steps = max(1, int(seconds / 0.05))
    done = await client.spawn(sh(f"for i in $(seq {steps}); do sleep 0.05; done"))
    assert (await client.wait(done.id)).state == "finished"


async def test_pause_stops_its_output_and_unpause_carries_it_on_losing_no_line(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        worker = await client.spawn(sh(COUNTER))
        await follow_stdout(client, worker.id, lambda out: len(_counted(out)) > 5)
        answer = await client.pause(worker=worker.id)
        assert (answer.paused, answer.already_paused) == ([worker.id], [])
        assert worker.pid is not None
        assert kernel_holds(info, worker.id, worker.pid)  # held once answered: awaited, not slept
        paused_at = time.time()
        assert (await client.status(worker.id)).paused
        await _witness(client, 1.0)
        # What was in its pipe as it froze came at once (a loaded machine's moment); nothing
        # after, for a second of a counter that writes a line every 10 ms.
        late = [e for e in await _stdout(client, worker.id) if e.at > paused_at + 0.2]
        assert late == []
        again = await client.pause(worker=worker.id)
        assert (again.paused, again.already_paused) == ([], [worker.id])

        unpaused_at = time.time()
        answer_un = await client.unpause(worker=worker.id)
        assert (answer_un.unpaused, answer_un.already_unpaused) == ([worker.id], [])
        assert not (await client.status(worker.id)).paused
        before = len(_counted(b"".join(e.data for e in await _stdout(client, worker.id))))
        out = await follow_stdout(client, worker.id, lambda o: len(_counted(o)) > before + 10)
        counted = _counted(out)
        assert counted == list(range(len(counted)))  # none lost, none doubled
        assert any(e.at >= unpaused_at for e in await _stdout(client, worker.id))
        states = [e.data for e in (await client.watch_page(worker.id)).entries if e.kind == "state"]
        assert states[1:] == [b"paused", b"unpaused"]
        assert (await client.unpause(worker=worker.id)).already_unpaused == [worker.id]


async def test_pause_then_reload_then_unpause_keeps_its_pid_and_every_line(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(40):
        info = await client.info()
        worker = await client.spawn(sh(COUNTER))
        assert worker.pid is not None
        await follow_stdout(client, worker.id, lambda out: len(_counted(out)) > 5)
        await client.pause(worker=worker.id)
        await client.reload()
        after = await client.status(worker.id)
        assert (after.pid, after.paused, after.state) == (worker.pid, True, "running")
        assert kernel_holds(info, worker.id, worker.pid)  # still held by the kernel
        listed = {w.id: w for w in await client.ls()}
        assert listed[worker.id].paused
        row = next(
            line.split()
            for line in (await trio.to_thread.run_sync(tracking.ctl, "ls")).stdout.splitlines()
            if line.startswith(worker.id)
        )
        assert row[2] == "paused"
        shown = await trio.to_thread.run_sync(tracking.ctl, "--json", "status", worker.id)
        assert json.loads(shown.stdout)["paused"] is True

        un = await trio.to_thread.run_sync(tracking.ctl, "unpause", worker.id)
        assert (un.returncode, un.stdout) == (0, f"{worker.id}\n")
        before = len(_counted(b"".join(e.data for e in await _stdout(client, worker.id))))
        out = await follow_stdout(client, worker.id, lambda o: len(_counted(o)) > before + 10)
        counted = _counted(out)
        assert counted == list(range(len(counted)))
        assert (await client.status(worker.id)).pid == worker.pid


async def test_a_stop_of_a_paused_worker_ends_it_at_once_with_one_wake(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    # Its TERM is handled, not fatal: frozen (a fatal signal ends even a frozen process),
    # or stopped, the handler would not run until the 600 s grace gave way to a KILL.
    with trio.fail_after(20):
        worker = await client.spawn(sh(f"trap 'echo TERM; exit 0' TERM; {COUNTER}"), grace=600)
        child = await client.spawn(["sleep", "600"], parent=worker.id, grace=600)
        await wait_output(client, worker.id, b"3\n")
        assert sorted((await client.pause(worker=worker.id)).paused) == sorted(
            [worker.id, child.id]
        )
        assert await client.stop(worker.id)
        ended = await client.status(worker.id)
        assert (ended.state, ended.paused, ended.exit_code) == ("stopped", False, 0)
        assert (await client.status(child.id)).state == "stopped"
        assert worker.pid is not None
        assert child.pid is not None
        assert not alive(worker.pid)
        assert not alive(child.pid)
        wakes = [w for w in await pending_wakes(tracking, worker.run) if w.id == worker.id]
        assert len(wakes) == 1


async def test_pause_a_run_holds_every_live_worker_of_it(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        run = await client.new_run()
        workers = [await client.spawn(sh(COUNTER), run=run) for _ in range(3)]
        done = await client.spawn(["true"], run=run)
        await client.wait(done.id)
        other = await client.spawn(sh(COUNTER))
        for w in workers:
            await wait_output(client, w.id, b"2\n")
        paused = await trio.to_thread.run_sync(tracking.ctl, "--json", "pause", "--run", run)
        assert paused.returncode == 0, paused.stderr
        assert json.loads(paused.stdout) == {
            "paused": sorted(w.id for w in workers),
            "already_paused": [],
            "held_outside": {},
        }
        for w in workers:
            assert w.pid is not None
            assert kernel_holds(info, w.id, w.pid)
            assert (await client.status(w.id)).paused
        assert not (await client.status(other.id)).paused
        top = await trio.to_thread.run_sync(lambda: once(tracking))
        assert top.returncode == 0, top.stderr
        assert {row(top.stdout, w.id).split()[0] for w in workers} == {"paused"}
        assert row(top.stdout, other.id).split()[0] == "running"
        assert other.pid is not None
        assert not kernel_holds(info, other.id, other.pid)
        unpaused = await client.unpause(run=run)
        assert unpaused.unpaused == sorted(w.id for w in workers)
        for w in workers:
            assert w.pid is not None
            assert not kernel_holds(info, w.id, w.pid)


async def test_a_subtree_pause_covers_a_delegated_child_and_not_a_sibling(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        parent = await client.spawn(["sleep", "600"])
        child = await client.spawn(sh(COUNTER), parent=parent.id)
        grandchild = await client.spawn(["sleep", "600"], parent=child.id)
        sibling = await client.spawn(["sleep", "600"], run=parent.run)
        await wait_output(client, child.id, b"2\n")
        answer = await client.pause(worker=parent.id)
        assert answer.paused == sorted([parent.id, child.id, grandchild.id])
        for w in (parent, child, grandchild):
            assert w.pid is not None
            assert kernel_holds(info, w.id, w.pid)
        assert sibling.pid is not None
        assert not kernel_holds(info, sibling.id, sibling.pid)
        # Only the child's subtree let go: the parent stays paused.
        assert (await client.unpause(worker=child.id)).unpaused == sorted([child.id, grandchild.id])
        assert (await client.status(parent.id)).paused
        assert not (await client.status(child.id)).paused
        # A worker spawned into a paused subtree runs.
        late = await client.spawn(sh("echo up; exec sleep 600"), parent=parent.id)
        await wait_output(client, late.id, b"up\n")
        assert not (await client.status(late.id)).paused


async def test_a_workers_token_may_pause_only_its_own_subtree(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        boss = await client.spawn(sh('echo "token=$SUBAGENTD_TOKEN"; exec sleep 600'))
        mine = await client.spawn(["sleep", "600"], parent=boss.id)
        sibling = await client.spawn(["sleep", "600"], run=boss.run)
        printed = await wait_output(client, boss.id, b"\n")
        token = printed.decode().split("token=", 1)[1].split()[0]
        conn = RawConnection(await trio.open_unix_socket(str(tracking.socket)))
        try:
            await conn.send(p.Hello(id=1, token=token))
            assert isinstance(await conn.receive(), p.Welcome)
            answers = []
            for request in [
                p.Pause(id=2, worker=sibling.id),
                p.Pause(id=3, run=boss.run),
                p.Unpause(id=4, worker=sibling.id),
                p.Pause(id=5, worker=mine.id),
                p.Unpause(id=6, worker=mine.id),
            ]:
                await conn.send(request)
                answers.append(await conn.receive())
        finally:
            await conn.stream.aclose()
    sibling_pause, run_pause, sibling_unpause, mine_pause, mine_unpause = answers
    for refused in (sibling_pause, run_pause, sibling_unpause):
        assert isinstance(refused, p.Error)
        assert refused.code == "forbidden"
    assert isinstance(sibling_pause, p.Error)
    assert sibling.id in sibling_pause.message
    assert isinstance(run_pause, p.Error)
    assert "not a run" in run_pause.message
    assert isinstance(mine_pause, p.Paused)
    assert mine_pause.paused == [mine.id]
    assert isinstance(mine_unpause, p.Unpaused)
    assert mine_unpause.unpaused == [mine.id]
    assert not (await client.status(sibling.id)).paused


async def test_a_crash_with_a_paused_worker_ends_it_and_leaves_nothing_frozen(
    tracking: DaemonProcess,
) -> None:
    with trio.fail_after(40):
        async with AsyncClient(tracking.socket) as client:
            info = await client.info()
            # A TERM it handles: recovery must thaw it, or wait out the 600 s grace.
            handled = f"trap 'exit 0' TERM; {COUNTER}"
            worker = await client.spawn(sh(handled), grace=600)
            await wait_output(client, worker.id, b"2\n")
            await client.pause(worker=worker.id)
        assert worker.pid is not None
        group = cgroup_of(info, worker.id)
        members = [int(x) for x in (group / "cgroup.procs").read_text().split()] if group else []
        await trio.to_thread.run_sync(tracking.kill)
        if group is not None:  # a dead daemon leaves its workers as they are: frozen
            assert alive(worker.pid)
            assert "frozen 1" in (group / "cgroup.events").read_text()
        # Stopped by SIGSTOP, the worker's process group is orphaned by the daemon's death,
        # and the kernel sends an orphaned group with a stopped member SIGHUP and SIGCONT:
        # it may be gone already. Either way, recovery leaves nothing of it.
        await trio.to_thread.run_sync(tracking.start)
        async with AsyncClient(tracking.socket) as client:
            ended = await client.status(worker.id)
        assert (ended.state, ended.paused) == ("interrupted", False)
        assert not alive(worker.pid)
        assert not any(alive(pid) for pid in members)
        assert group is None or not group.exists()


async def test_hostile_pauses_are_refused_by_name(
    client: AsyncClient, tracking: DaemonProcess
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(["sleep", "600"])
        ended = await client.spawn(["true"])
        await client.wait(ended.id)
        for verb in (client.pause, client.unpause):
            with pytest.raises(Invalid, match=r"exactly one of worker .* both given"):
                await verb(worker=worker.id, run=worker.run)
            with pytest.raises(Invalid, match="neither given"):
                await verb()
            with pytest.raises(NotFound):
                await verb(worker="w-nobody")
            with pytest.raises(NotFound):
                await verb(run="r-nobody")
            with pytest.raises(Refused, match=r"nothing running .* finished"):
                await verb(worker=ended.id)
            with pytest.raises(Invalid):
                await verb(worker="w" * 10_000)
            with pytest.raises(NotFound):
                await verb(worker="")
        assert not (await client.status(worker.id)).paused
        both = await trio.to_thread.run_sync(tracking.ctl, "pause", worker.id, "--run", worker.run)
        assert both.returncode == 2
        assert "not allowed with argument" in both.stderr
        neither = await trio.to_thread.run_sync(tracking.ctl, "unpause")
        assert neither.returncode == 2
        helped = await trio.to_thread.run_sync(tracking.ctl, "pause", "--help")
        assert helped.returncode == 0
        assert "SIGSTOP" in helped.stdout


async def test_the_timeout_of_a_paused_worker_does_not_run(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    timeout, paused_for = 600.0, 5000.0
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):  # real starts and a real freeze: no deadline meanwhile
            worker = await client.spawn(["sleep", "100000"], timeout=timeout)
        started = d.wall.trio_time(d.record(worker.id).started_at)
        async with at(autojump_clock, started + 100):
            assert (await client.pause(worker=worker.id)).paused == [worker.id]
        async with at(autojump_clock, started + 100 + paused_for):  # long past its timeout
            assert (await client.status(worker.id)).state == "running"
            await client.unpause(worker=worker.id)
        resumed = trio.current_time()
        # 500 s of its 600 were left: the deadline moved by the time it was paused.
        async with at(autojump_clock, resumed + 500 - 0.5):
            assert d.record(worker.id).stop_reason is None
        async with at(autojump_clock, resumed + 500 + 0.5):
            assert (await client.wait(worker.id)).state == "timed_out"


async def test_a_paused_timeout_is_kept_across_a_reload(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    timeout = 600.0
    async with in_process(short_tmp) as d:
        with held(autojump_clock):
            async with d.client() as client:
                worker = await client.spawn(["sleep", "100000"], timeout=timeout)
        started = d.wall.trio_time(d.record(worker.id).started_at)
        async with at(autojump_clock, started + 100), d.client() as client:
            await client.pause(worker=worker.id)
        async with at(autojump_clock, started + 2000):
            await d.reload_in_place()
            async with d.client() as client:
                assert (await client.status(worker.id)).paused
                await client.unpause(worker=worker.id)
        resumed = trio.current_time()
        async with at(autojump_clock, resumed + 500 - 0.5):
            assert d.record(worker.id).stop_reason is None
        async with at(autojump_clock, resumed + 500 + 0.5), d.client() as client:
            assert (await client.wait(worker.id)).state == "timed_out"


def test_pause_takes_exactly_one_target_on_the_wire() -> None:
    for message in (p.Pause(id=1), p.Unpause(id=1, worker="w", run="r")):
        raw = p.encode(message)
        assert p.client_decoder.decode(raw[4:]) == message  # decoded; the daemon refuses it
    assert p.Pause.for_workers
    assert p.Unpause.for_workers
    assert p.WorkerView(id="w", run="r", state="running", started_at=0).paused is False
