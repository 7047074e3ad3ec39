"""Parallel caps and the queue, against a real daemon: a spawn over a cap is answered at
once `queued`, starts in its turn, and a stop ends it without ever starting it."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol import WorkerView
from subagentd.protocol.errors import Invalid

from .conftest import DaemonProcess
from .helpers import pending_wakes

#: A worker that notes its start and end in a shared log, holding its slot a moment.
NOTING = (
    "echo start $SUBAGENTD_WORKER_ID >> {log}; sleep {hold}; echo end $SUBAGENTD_WORKER_ID >> {log}"
)
#: The same, holding its slot until the file `go` is there.
GATED = (
    "echo start $SUBAGENTD_WORKER_ID >> {log}; while [ ! -e {go} ]; do sleep 0.01; done; "
    "echo end $SUBAGENTD_WORKER_ID >> {log}"
)


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


def started(log: Path) -> list[str]:
    """The ids of the workers that started, each as often as it did (in no order: two
    started a moment apart may write in either order)."""
    return [line.split()[1] for line in log.read_text().splitlines() if line.startswith("start")]


async def start_order(client: AsyncClient, ids: list[str]) -> list[str]:
    """`ids` in the order the daemon started them (by their start times)."""
    views = [await client.status(worker_id) for worker_id in ids]
    return [v.id for v in sorted(views, key=lambda v: v.started_at)]


def most_at_once(lines: list[str]) -> int:
    running = most = 0
    for line in lines:
        running += 1 if line.startswith("start ") else -1
        most = max(most, running)
    return most


async def wakes_for(
    client: AsyncClient, daemon: DaemonProcess, run: str, ids: list[str]
) -> list[str]:
    """Once each of `ids` has ended: the ids of the wakes `run` holds, in seq order."""
    for worker_id in ids:
        await client.wait(worker_id)
    return [wake.id for wake in await pending_wakes(daemon, run)]


async def test_forty_spawns_under_a_cap_of_four_never_run_more_than_four_and_end_in_order(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    log, go = daemon.root / "starts.log", daemon.root / "go"
    with trio.fail_after(120):
        run = await client.new_run(max_running=4)
        gated = ["sh", "-c", GATED.format(log=log, go=go)]
        spawned = [await client.spawn(gated, run=run) for _ in range(40)]
        # Answered at once, while the first four hold every slot: queued, in order.
        assert [v.queued for v in spawned] == [False] * 4 + [True] * 36
        assert [v.queue_position for v in spawned[4:]] == list(range(1, 37))
        assert all(v.state == "starting" and v.pid is None for v in spawned[4:])
        go.touch()
        ended = await wakes_for(client, daemon, run, [v.id for v in spawned])
    ids = [v.id for v in spawned]
    assert sorted(ended) == sorted(ids)  # each ended once
    lines = log.read_text().splitlines()
    assert most_at_once(lines) <= 4
    assert sorted(started(log)) == sorted(ids)  # each started once
    assert await start_order(client, ids) == ids  # first in, first out
    assert all(w.state == "finished" for w in await client.ls(all=True, run=run))


async def test_ls_and_status_show_the_queue_position(client: AsyncClient) -> None:
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        first = await client.spawn(["sleep", "30"], run=run)
        second = await client.spawn(["true"], run=run)
        third = await client.spawn(["true"], run=run)
        assert (first.queued, first.queue_position) == (False, None)
        assert (second.queued, second.queue_position) == (True, 1)
        assert (third.queued, third.queue_position) == (True, 2)
        listed = {v.id: v.queue_position for v in await client.ls(run=run)}
        assert listed == {first.id: None, second.id: 1, third.id: 2}
        await client.stop(second.id)
        assert (await client.status(third.id)).queue_position == 1
        await client.stop_run(run)


async def test_a_higher_priority_starts_first(client: AsyncClient, daemon: DaemonProcess) -> None:
    log = daemon.root / "starts.log"
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        holder = await client.spawn(["sh", "-c", NOTING.format(log=log, hold=0.5)], run=run)
        low = await client.spawn(["sh", "-c", NOTING.format(log=log, hold=0)], run=run)
        high = await client.spawn(["sh", "-c", NOTING.format(log=log, hold=0)], run=run, priority=5)
        assert high.queue_position == 1
        assert (await client.status(low.id)).queue_position == 2
        await wakes_for(client, daemon, run, [holder.id, low.id, high.id])
    assert sorted(started(log)) == sorted([holder.id, high.id, low.id])
    assert await start_order(client, [holder.id, low.id, high.id]) == [holder.id, high.id, low.id]


async def test_stop_run_with_thirty_queued_ends_them_all_unstarted_one_wake_each(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    log = daemon.root / "starts.log"
    with trio.fail_after(60):
        run = await client.new_run(max_running=2)
        spawned = [
            await client.spawn(["sh", "-c", NOTING.format(log=log, hold=30)], run=run)
            for _ in range(32)
        ]
        queued = {v.id for v in spawned if v.queued}
        assert len(queued) == 30
        stopped = await client.stop_run(run)
        assert set(stopped) == {v.id for v in spawned}
        ended = await wakes_for(client, daemon, run, [v.id for v in spawned])
        assert sorted(ended) == sorted(v.id for v in spawned)  # one wake each
    for worker_id in queued:
        view = await client.status(worker_id)
        assert (view.state, view.reason, view.pid, view.queued) == (
            "stopped",
            "never_started",
            None,
            False,
        )
    assert not queued & set(started(log))  # none of the queued ever started


async def test_a_stopped_queued_worker_ends_at_once_and_its_wait_answers(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        await client.spawn(["sleep", "30"], run=run)
        waiting = await client.spawn(["true"], run=run)
        async with trio.open_nursery() as nursery:
            results: list[WorkerView] = []

            async def wait() -> None:
                results.append(await client.wait(waiting.id))

            nursery.start_soon(wait)
            await trio.sleep(0.2)  # the wait is in the daemon (it is not a condition)
            assert not results
            await client.stop(waiting.id)
        assert results[0].state == "stopped"
        await client.stop_run(run)


@pytest.mark.parametrize("value", [0, -1, 100_001, 2**63, 1.5, "four", float("nan")])
async def test_a_hostile_max_running_is_invalid_naming_the_field(
    client: AsyncClient, value: object
) -> None:
    with trio.fail_after(10), pytest.raises(Invalid, match="max_running"):
        await client.new_run(max_running=value)  # type: ignore[arg-type]
    assert await client.new_run()  # the daemon serves on


@pytest.mark.parametrize("value", [1_000_001, -1_000_001, 2**63, 0.5, "high", float("inf")])
async def test_a_hostile_priority_is_invalid_naming_the_field(
    client: AsyncClient, value: object
) -> None:
    with trio.fail_after(10), pytest.raises(Invalid, match="priority"):
        await client.spawn(["true"], priority=value)  # type: ignore[arg-type]
    assert await client.spawn(["true"])


async def test_a_reload_in_the_middle_loses_and_duplicates_nothing(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    log, go = daemon.root / "starts.log", daemon.root / "go"
    with trio.fail_after(120):
        run = await client.new_run(max_running=3)
        gated = ["sh", "-c", GATED.format(log=log, go=go)]
        spawned = [await client.spawn(gated, run=run) for _ in range(12)]
        await client.reload()
        after = {v.id: v for v in await client.ls(run=run)}
        assert [after[v.id].queue_position for v in spawned] == [None] * 3 + list(range(1, 10))
        go.touch()
        ended = await wakes_for(client, daemon, run, [v.id for v in spawned])
    ids = [v.id for v in spawned]
    assert sorted(ended) == sorted(ids)
    lines = log.read_text().splitlines()
    assert most_at_once(lines) <= 3
    assert sorted(started(log)) == sorted(ids)
    assert await start_order(client, ids) == ids
    assert {w.state for w in await client.ls(all=True, run=run)} == {"finished"}


async def test_a_kill_9_keeps_the_queue_in_order_and_starts_none_twice(
    daemon: DaemonProcess,
) -> None:
    log, go = daemon.root / "starts.log", daemon.root / "go"
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run(max_running=2)
            gated = ["sh", "-c", GATED.format(log=log, go=go)]
            spawned = [await client.spawn(gated, run=run) for _ in range(10)]
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            after = {v.id: v for v in await client.ls(all=True, run=run)}
            # The two running were ended with the daemon (their slots free: the next two
            # took them); the rest wait as they were, in order.
            assert [after[v.id].state for v in spawned[:2]] == ["interrupted"] * 2
            positions = [after[v.id].queue_position for v in spawned[2:]]
            moved_on = positions.count(None)
            assert moved_on <= 2
            assert positions == [None] * moved_on + list(range(1, 9 - moved_on))
            go.touch()
            ended = await wakes_for(client, daemon, run, [v.id for v in spawned])
            states = [(await client.status(v.id)).state for v in spawned]
            order = await start_order(client, [v.id for v in spawned[2:]])
    ids = [v.id for v in spawned]
    assert sorted(ended) == sorted(ids)  # one wake each, none lost
    assert states == ["interrupted"] * 2 + ["finished"] * 8
    assert sorted(started(log)) == sorted(ids)  # each started once
    assert order == ids[2:]  # the queued in their order


async def test_a_queued_worker_whose_journal_cannot_be_opened_at_restore_wakes_once(
    daemon: DaemonProcess,
) -> None:
    """Its journal made a FIFO while the daemon was down (kill -9): it ends unstarted at
    the restart, said in the log, with the one wake every ending posts."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run(max_running=1)
            holder = await client.spawn(["sleep", "30"], run=run)
            queued = await client.spawn(["true"], run=run)
            assert queued.queued
        daemon.kill()
        journal = daemon.state_dir / "archives" / queued.id / "journal"
        journal.unlink()
        os.mkfifo(journal)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            view = await client.status(queued.id)
            assert (view.queue_position, view.pid, view.reason) == (None, None, "never_started")
            wakes = await wakes_for(client, daemon, run, [holder.id, queued.id])
    assert sorted(wakes) == sorted([holder.id, queued.id])  # one each, none lost
    assert "worker.queued_journal" in daemon.log()


async def _queued_behind(client: AsyncClient, run: str, count: int) -> list[WorkerView]:
    """`count` workers queued in `run` (capped at 1) behind one that holds its slot."""
    await client.spawn(["sleep", "30"], run=run)
    queued = [await client.spawn(["true"], run=run) for _ in range(count)]
    assert all(v.queued for v in queued)
    return queued


async def _never_started(client: AsyncClient, ids: list[str]) -> None:
    for worker_id in ids:
        view = await client.status(worker_id)
        assert (view.state, view.reason, view.pid) == ("stopped", "never_started", None)


async def test_a_turn_cancel_reaches_the_queued_of_that_turn_only(client: AsyncClient) -> None:
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        await client.spawn(["sleep", "30"], run=run)
        turn = await client.begin_turn()
        of_turn = [await client.spawn(["true"], run=run) for _ in range(2)]
        await client.begin_turn()
        later = await client.spawn(["true"], run=run)
        cancelled = await client.cancel(f"turn:{turn}")
        assert sorted(cancelled) == sorted(v.id for v in of_turn)
        await _never_started(client, cancelled)
        assert (await client.status(later.id)).queue_position == 1
        await client.stop_run(run)


async def test_a_cancelled_launch_fence_reaches_the_queued_under_it(client: AsyncClient) -> None:
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        epoch = await client.set_fence()
        queued = await _queued_behind(client, run, 3)
        cancelled = await client.cancel_fence(epoch)
        assert {v.id for v in queued} <= set(cancelled)
        await _never_started(client, [v.id for v in queued])


async def test_a_stopped_parent_ends_its_queued_delegates_unstarted(client: AsyncClient) -> None:
    with trio.fail_after(30):
        run = await client.new_run(max_running=1)
        parent = await client.spawn(["sleep", "30"], run=run)
        child = await client.spawn(["true"], parent=parent.id)
        assert child.queued
        await client.stop(parent.id)
        await _never_started(client, [child.id])


async def test_an_agents_cap_holds_across_runs(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.config.write_text(
        '[agents.gpu]\ncommand = ["sh", "-c", "echo up; exec sleep 30"]\nmax_running = 1\n'
    )
    daemon_dirs.start()
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            first = await client.spawn([], agent="gpu")
            second = await client.spawn([], agent="gpu", run=await client.new_run())
            other = await client.spawn(["sleep", "30"])
            assert (first.queued, second.queued, other.queued) == (False, True, False)
            # A wait for a queued worker's output waits for its start (its journal grows).
            waiting = await client.wait_for(second.id, "up", timeout=0.3)
            assert waiting.outcome == "timed_out"
            assert waiting.worker.queued
            await client.stop(first.id)
            assert (await client.wait_for(second.id, "up", timeout=10)).outcome == "matched"
            await client.stop(second.id)


@pytest.mark.parametrize("cap", ["0", "-1", "100001", "nan", "four", ""])
def test_subagentd_refuses_a_hostile_max_running(daemon_dirs: DaemonProcess, cap: str) -> None:
    import subprocess

    from .conftest import BIN

    done = subprocess.run(
        [str(BIN / "subagentd"), "--max-running", cap, "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--max-running" in done.stderr


@pytest.mark.parametrize("cap", ["0", "-3", "100001", "1.5", '"many"', "nan", "[]", '""'])
def test_agents_toml_refuses_a_hostile_max_running(daemon_dirs: DaemonProcess, cap: str) -> None:
    daemon_dirs.config.write_text(f'[agents.gpu]\ncommand = ["true"]\nmax_running = {cap}\n')
    from subagentd.daemon.workers._agents import ConfigError, load_agents

    with pytest.raises(ConfigError, match=r"agents\.gpu\.max_running"):
        load_agents(daemon_dirs.config)


async def test_the_daemons_cap_counts_every_run_and_outlives_a_reload(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--max-running", "2")
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            holding = ["sh", "-c", "echo up; exec sleep 30"]
            views = [await client.spawn(holding, run=await client.new_run()) for _ in range(3)]
            assert [v.queued for v in views] == [False, False, True]
            await client.reload()
            fourth = await client.spawn(["true"])
            assert fourth.queue_position == 2
            await client.stop(views[0].id)
            assert (await client.wait_for(views[2].id, "up", timeout=10)).outcome == "matched"
            assert (await client.status(fourth.id)).queue_position == 1


async def test_a_shutdown_ends_the_queued_unstarted_one_wake_each(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start()
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run(max_running=1)
            queued = await _queued_behind(client, run, 3)
        await trio.to_thread.run_sync(daemon_dirs.terminate)
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            await _never_started(client, [v.id for v in queued])
            everyone = [w.id for w in await client.ls(all=True, run=run)]
            assert len(everyone) == 4  # the one that ran, stopped, and the three queued
            ended = await wakes_for(client, daemon_dirs, run, everyone)
            assert sorted(ended) == sorted(everyone)  # one wake each


def test_subagentctl_caps_a_run_and_shows_the_queue(daemon: DaemonProcess) -> None:
    made = daemon.ctl("new-run", "--max-running", "1")
    assert made.returncode == 0, made.stderr
    run = made.stdout.split()[0]
    first = daemon.ctl("spawn", "--run", run, "--", "sleep", "30")
    assert first.returncode == 0, first.stderr
    assert "queued" not in first.stderr
    second = daemon.ctl("spawn", "--run", run, "--priority", "3", "--", "true")
    assert second.returncode == 0, second.stderr
    waiting = second.stdout.split()[0]
    assert f"{waiting} is queued #1" in second.stderr
    listed = daemon.ctl("ls", "--run", run)
    assert any(waiting in line and "queued #1" in line for line in listed.stdout.splitlines())
    status = json.loads(daemon.ctl("--json", "status", waiting).stdout)
    assert (status["state"], status["queued"], status["queue_position"]) == ("starting", True, 1)
    assert "queued #1" in daemon.ctl("status", waiting).stdout
    top = daemon.ctl("top", "--once", "--run", run)
    assert top.returncode == 0, top.stderr
    assert "queued #1" in top.stdout
    assert "1 running, 1 queued" in top.stdout
    document = json.loads(daemon.ctl("top", "--once", "--json", "--run", run).stdout)
    assert (document["running"], document["queued"]) == (1, 1)
    assert daemon.ctl("stop", "--run", run).returncode == 0
    assert "stopped (never_started)" in daemon.ctl("status", waiting).stdout


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["new-run", "--max-running", "0"], "max_running"),
        (["new-run", "--max-running", "100001"], "max_running"),
        (["new-run", "--max-running", "four"], "--max-running"),
        (["spawn", "--priority", "1000001", "--", "true"], "priority"),
        (["spawn", "--priority", "nan", "--", "true"], "--priority"),
    ],
)
def test_subagentctl_refuses_a_hostile_cap_or_priority_naming_it(
    daemon: DaemonProcess, args: list[str], field: str
) -> None:
    done = daemon.ctl(*args)
    assert done.returncode != 0
    assert field in done.stderr
    assert "Traceback" not in done.stderr
    assert daemon.ctl("info").returncode == 0  # the daemon serves on


def test_the_help_says_how_caps_queue(daemon: DaemonProcess) -> None:
    assert "--max-running" in daemon.ctl("new-run", "--help").stdout
    assert "--priority" in daemon.ctl("spawn", "--help").stdout
    import subprocess

    from .conftest import BIN

    helped = subprocess.run(
        [str(BIN / "subagentd"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert "--max-running" in helped.stdout


async def test_the_mcp_tools_show_the_queue_and_take_a_priority(daemon: DaemonProcess) -> None:
    from .test_mcp import call, mcp_server, refused

    with trio.fail_after(40):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run(max_running=1)
        async with mcp_server(daemon) as session:
            await call(session, "subagent_spawn", argv=["sleep", "30"], run=run)
            queued = await call(session, "subagent_spawn", argv=["true"], run=run, priority=2)
            assert (queued["state"], queued["queued"], queued["queue_position"]) == (
                "starting",
                True,
                1,
            )
            listed = await call(session, "subagent_list", run=run)
            assert [w["queue_position"] for w in listed["workers"]] == [None, 1]
            for priority in (1_000_001, -1_000_001, 1.5, "high", True):
                error = await refused(session, "subagent_spawn", argv=["true"], priority=priority)
                assert error["message"].startswith("priority: ")
            await call(session, "subagent_stop", worker=queued["id"])
            stopped = await call(session, "subagent_status", worker=queued["id"])
            assert (stopped["state"], stopped["reason"]) == ("stopped", "never_started")


async def test_info_counts_the_queue_and_says_the_daemons_cap(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start("--max-running", "1")
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.spawn(["sleep", "30"])
            await client.spawn(["true"])
            info = await client.info()
            assert (info.queued, info.max_running, info.workers) == (
                1,
                1,
                {"running": 1, "starting": 1},
            )
    shown = daemon_dirs.ctl("info").stdout
    assert "queued: 1" in shown
    assert "max_running: 1" in shown
