"""Retries: a worker that ends failed starts again (the same id, from its snapshot)
after a backoff that doubles to its most; its parent is woken once, by the last attempt;
a stop ends the retries; a timeout is retried only when asked."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.lowlevel
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Invalid

from .conftest import DaemonProcess
from .helpers import pending_wakes as _wakes
from .helpers import sh
from .helpers import until_note as _until_note
from .inprocess import at, held, in_process

#: Fails on its first two attempts, then finishes (SUBAGENTD_RESUME is the attempt).
FLAKY = (
    'a=${SUBAGENTD_RESUME:-1}; echo "attempt $a"; '
    '[ "$a" -ge 3 ] && echo done > "$SUBAGENTD_RESULT"; [ "$a" -ge 3 ]'
)


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def _notes(client: AsyncClient, worker_id: str) -> list[str]:
    entries = [e async for e in client.watch(worker_id)]
    return [e.data.decode() for e in entries if e.kind == "note"]


async def test_a_flaky_worker_under_three_retries_wakes_its_parent_once_with_attempt_3(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        worker = await client.spawn(sh(FLAKY), run=run, retries=3, backoff=0.05)
        ended = await client.wait(worker.id)
        assert (ended.state, ended.attempt, ended.exit_code, ended.retries) == ("finished", 3, 0, 3)
        wakes = await _wakes(daemon, run)
        assert [(w.id, w.attempt, w.state) for w in wakes] == [(worker.id, 3, "finished")]
        assert (await client.collect(worker.id)).result.strip() == "done"
        notes = await _notes(client, worker.id)
        assert [n for n in notes if "attempt" in n] == [
            "attempt 1 ended failed (exit_code=1): attempt 2 of 4 in 0.05 s",
            "attempt 2 ended failed (exit_code=1): attempt 3 of 4 in 0.1 s",
        ]
        stdout = b"".join([e.data async for e in client.watch(worker.id) if e.kind == "stdout"])
        assert stdout.decode().split() == ["attempt", "1", "attempt", "2", "attempt", "3"]


async def test_the_last_failure_wakes_once_when_retries_run_out(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        worker = await client.spawn(sh("exit 7"), run=run, retries=2, backoff=0)
        ended = await client.wait(worker.id)
        assert (ended.state, ended.attempt, ended.exit_code) == ("failed", 3, 7)
        assert [(w.attempt, w.state) for w in await _wakes(daemon, run)] == [(3, "failed")]


async def test_a_stop_while_it_waits_out_its_backoff_ends_the_retries(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        worker = await client.spawn(sh("echo up; exit 1"), run=run, retries=5, backoff=600)
        await _until_note(client, worker.id, "attempt 1 ended failed")
        waiting = await client.status(worker.id)
        assert (waiting.state, waiting.attempt, waiting.queued) == ("starting", 2, True)
        assert waiting.retry_at is not None
        assert waiting.retry_at > waiting.started_at + 500
        await client.stop(worker.id)
        ended = await client.wait(worker.id)
        assert (ended.state, ended.attempt, ended.pid) == ("stopped", 2, None)
        assert [(w.attempt, w.state) for w in await _wakes(daemon, run)] == [(2, "stopped")]


async def test_a_timeout_is_retried_only_when_asked(client: AsyncClient) -> None:
    with trio.fail_after(60):
        plain = await client.spawn(["sleep", "30"], timeout=0.2, retries=3, backoff=0)
        asked = await client.spawn(
            ["sleep", "30"], timeout=0.2, retries=1, backoff=0, retry_on=["timeout"]
        )
        assert ((await client.wait(plain.id)).state, (await client.status(plain.id)).attempt) == (
            "timed_out",
            1,
        )
        ended = await client.wait(asked.id)
        assert (ended.state, ended.attempt) == ("timed_out", 2)


async def test_a_retry_waiting_out_its_backoff_survives_a_kill_9(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(sh(FLAKY), run=run, retries=2, backoff=1.5)
            await _until_note(client, worker.id, "attempt 1 ended failed")
            assert (await client.status(worker.id)).retry_at is not None
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            ended = await client.wait(worker.id)
            assert (ended.state, ended.attempt) == ("finished", 3)
            assert [(w.attempt, w.state) for w in await _wakes(daemon, run)] == [(3, "finished")]


async def test_the_backoff_doubles_up_to_its_most_on_the_daemons_clock(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):
            worker = await client.spawn(["false"], retries=3, backoff=10, backoff_max=15)
        starts = []
        for delay in (10, 15, 15):
            with held(autojump_clock):
                with trio.fail_after(30):
                    while d.record(worker.id).retry_at is None:
                        await trio.lowlevel.checkpoint()
                record = d.record(worker.id)
                assert record.retry_at is not None
                due = d.wall.trio_time(record.retry_at)
                starts.append(due)
            async with at(autojump_clock, due - 0.01):  # not a moment early
                assert d.record(worker.id).queued is not None
            async with at(autojump_clock, due):
                with trio.fail_after(30):
                    while d.record(worker.id).retry_at is not None:
                        await trio.lowlevel.checkpoint()
            del delay
        with held(autojump_clock):
            ended = await client.wait(worker.id)
        assert (ended.state, ended.attempt) == ("failed", 4)
        with held(autojump_clock):
            notes = [n for n in await _notes(client, worker.id) if "ended failed" in n]
        assert [n.rsplit(" in ", 1)[1] for n in notes] == ["10 s", "15 s", "15 s"]
        assert [round(b - a, 3) for a, b in itertools.pairwise(starts)] == [
            pytest.approx(15, abs=0.5),
            pytest.approx(15, abs=0.5),
        ]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"retries": -1}, "retries"),
        ({"retries": 101}, "retries"),
        ({"retries": 1.5}, "retries"),
        ({"backoff": -1.0}, "backoff"),
        ({"backoff": math.nan}, "backoff"),
        ({"backoff": math.inf}, "backoff"),
        ({"backoff": 86_401.0}, "backoff"),
        ({"backoff_max": -1.0}, "backoff_max"),
        ({"backoff": 10.0, "backoff_max": 5.0}, "backoff_max"),
        ({"retry_on": ["failure"]}, "retry_on"),
        ({"retry_on": ["timeout", "timeout"]}, "retry_on"),
    ],
)
async def test_a_hostile_retry_field_is_invalid_naming_it(
    client: AsyncClient, fields: dict[str, object], named: str
) -> None:
    with trio.fail_after(10), pytest.raises(Invalid, match=named):
        await client.spawn(["true"], **fields)  # type: ignore[arg-type]
    assert await client.spawn(["true"])  # the daemon serves on


def test_subagentctl_retries_with_a_backoff(daemon: DaemonProcess) -> None:
    done = daemon.ctl("spawn", "--retries", "3", "--backoff", "0.05:1", "--", "sh", "-c", FLAKY)
    assert done.returncode == 0, done.stderr
    worker = done.stdout.split()[0]
    assert daemon.ctl("wait", worker).returncode == 0
    shown = daemon.ctl("status", worker).stdout
    assert "attempt: 3" in shown
    assert "state: finished" in shown
    bad = daemon.ctl("spawn", "--backoff", "soon", "--", "true")
    assert bad.returncode == 2
    assert "--backoff" in bad.stderr
    assert "--retries" in daemon.ctl("spawn", "--help").stdout


def test_an_agents_retry_policy_applies_unless_the_spawn_gives_its_own(
    daemon_dirs: DaemonProcess,
) -> None:
    script = daemon_dirs.root / "flaky.sh"
    script.write_text(FLAKY)
    daemon_dirs.config.write_text(
        f'[agents.flaky]\ncommand = ["sh", "{script}"]\nretries = 2\nbackoff = 0\n'
    )
    daemon_dirs.start()
    done = daemon_dirs.ctl("spawn", "--agent", "flaky")
    assert done.returncode == 0, done.stderr
    worker = done.stdout.split()[0]
    daemon_dirs.ctl("wait", worker)
    shown = daemon_dirs.ctl("status", worker).stdout
    assert "attempt: 3" in shown
    assert "state: finished" in shown
    own = daemon_dirs.ctl("spawn", "--agent", "flaky", "--retries", "1", "--backoff", "0")
    daemon_dirs.ctl("wait", own.stdout.split()[0])
    assert "state: failed" in daemon_dirs.ctl("status", own.stdout.split()[0]).stdout


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("retries = -1", "retries"),
        ("retries = 101", "retries"),
        ("backoff = -2", "backoff"),
        ("backoff = nan", "backoff"),
        ('retry_on = ["crash"]', "retry_on"),
        ("retry_on = []\nretries = 1.5", "retries"),
    ],
)
def test_agents_toml_refuses_a_hostile_retry_key(
    daemon_dirs: DaemonProcess, line: str, key: str
) -> None:
    from subagentd.daemon.workers._agents import ConfigError, load_agents

    daemon_dirs.config.write_text(f'[agents.a]\ncommand = ["true"]\n{line}\n')
    with pytest.raises(ConfigError, match=rf"agents\.a\.{key}"):
        load_agents(daemon_dirs.config)


async def test_the_mcp_spawn_retries(daemon: DaemonProcess) -> None:
    from .test_mcp import call, mcp_server, refused

    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            spawned = await call(session, "subagent_spawn", argv=sh(FLAKY), retries=3, backoff=0.05)
            assert spawned["retries"] == 3
            async with AsyncClient(daemon.socket) as client:
                await client.wait(spawned["id"])
            ended = await call(session, "subagent_status", worker=spawned["id"])
            assert (ended["state"], ended["attempt"], ended["retry_at"]) == ("finished", 3, None)
            for fields in ({"retries": 101}, {"backoff": -1}, {"retry_on": ["crash"]}):
                error = await refused(session, "subagent_spawn", argv=["true"], **fields)
                assert error["message"].startswith(f"{next(iter(fields))}")


def test_every_surface_shows_a_retry_waiting_and_the_attempt_that_woke(
    daemon: DaemonProcess,
) -> None:
    # ls and top say it waits to retry, and which attempt; its wake says the attempt that
    # ended it for good, in `events` (text and --json) and subagent_events.
    run = daemon.ctl("new-run").stdout.strip()
    spawned = daemon.ctl(
        "spawn", "--run", run, "--retries", "1", "--backoff", "600", "--", "sh", "-c", "exit 1"
    )
    assert spawned.returncode == 0, spawned.stderr
    worker = spawned.stdout.split()[0]
    daemon.ctl("wait", "--for", "attempt 1 ended failed", "--timeout", "20", worker)
    listed = [line for line in daemon.ctl("ls", "--run", run).stdout.splitlines() if worker in line]
    assert "retrying (attempt 2)" in listed[0]
    top = daemon.ctl("top", "--once", "--run", run)
    assert top.returncode == 0, top.stderr
    assert "retrying (attempt 2)" in top.stdout
    assert daemon.ctl("stop", worker).returncode == 0
    woken = daemon.ctl("events", "--run", run).stdout
    assert woken.startswith(f"{worker} stopped"), woken
    assert "attempt=2" in woken.split()
    # --json carries it too, as does subagent_events: a flaky worker's last attempt.
    other = daemon.ctl("new-run").stdout.strip()
    flaky = daemon.ctl(
        "spawn", "--run", other, "--retries", "2", "--backoff", "0", "--", "sh", "-c", FLAKY
    ).stdout.split()[0]
    daemon.ctl("wait", flaky)
    documents = [
        json.loads(line)
        for line in daemon.ctl("--json", "events", "--run", other).stdout.splitlines()
    ]
    assert [(d["id"], d["state"], d["attempt"]) for d in documents] == [(flaky, "finished", 3)]


async def test_subagent_events_says_the_attempt_that_woke(daemon: DaemonProcess) -> None:
    from .test_mcp import call, mcp_server

    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            run = (await call(session, "subagent_new_run"))["run"]
            spawned = await call(
                session, "subagent_spawn", argv=sh(FLAKY), run=run, retries=2, backoff=0
            )
            woken = await call(session, "subagent_events", run=run, timeout=30)
    assert [(w["id"], w["state"], w["attempt"]) for w in woken["wakes"]] == [
        (spawned["id"], "finished", 3)
    ]
