"""Wakes through the clients and subagentctl, against a real daemon: each wake is handed over
once and acknowledged as it is, and one never handed over waits for the next subscriber."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import pytest
import trio

from subagentd.client import AsyncClient, Client, Wake, WorkerView

from .conftest import BIN, DaemonProcess
from .helpers import sh

#: The `events --json` shape (a wake as on the wire): exactly these fields today.
WAKE_FIELDS = {"id", "run", "parent", "state", "exit_code", "preview", "attempt", "reason"}


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def _ended_run(client: AsyncClient, count: int) -> tuple[str, list[WorkerView]]:
    """A run whose `count` top-level workers have all ended, each printing its index."""
    run = await client.new_run()
    workers = [await client.spawn(sh(f"echo {i}"), run=run) for i in range(count)]
    for worker in workers:
        await client.wait(worker.id)
    return run, workers


def _ids(wakes: list[Wake]) -> set[str]:
    return {wake.id for wake in wakes}


async def test_the_async_client_acknowledges_only_what_it_handed_over(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run, workers = await _ended_run(client, 5)
        handed: list[Wake] = []
        async with contextlib.aclosing(client.events(run=run)) as wakes:
            async for wake in wakes:
                handed.append(wake)
                if len(handed) == 2:
                    break
        # A second subscriber, on another connection, gets the three never handed over.
        async with AsyncClient(daemon.socket) as other:
            rest = [wake async for wake in other.events(run=run)]
        assert len(rest) == 3
        assert _ids(handed).isdisjoint(_ids(rest))
        assert _ids(handed + rest) == {w.id for w in workers}
        assert {(w.state, w.exit_code) for w in rest} == {("finished", 0)}
        # That one read to the end: every wake is acknowledged now.
        assert [wake async for wake in client.events(run=run)] == []


async def test_the_blocking_client_acknowledges_only_what_it_handed_over(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run, workers = await _ended_run(client, 5)

        def break_after_two() -> list[Wake]:
            handed: list[Wake] = []
            with Client(daemon.socket, timeout=10) as blocking:
                for wake in blocking.events(run=run):
                    handed.append(wake)
                    if len(handed) == 2:
                        break
                # The same connection subscribes again: the three left, and the connection
                # is still good after leaving a stream early.
                rest = list(blocking.events(run=run))
                assert list(blocking.events(run=run)) == []
            return handed + rest

        wakes = await trio.to_thread.run_sync(break_after_two)
        assert len(wakes) == 5
        assert _ids(wakes) == {w.id for w in workers}
        assert sorted(int(w.preview) for w in wakes) == [0, 1, 2, 3, 4]
        assert [wake async for wake in client.events(run=run)] == []


async def test_a_wake_is_delivered_again_until_it_is_acknowledged(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run, (worker,) = await _ended_run(client, 1)
        unacknowledged = [wake async for wake in client.events(run=run, ack=False)]
        assert [w.id for w in unacknowledged] == [worker.id]
        async with AsyncClient(daemon.socket) as other:
            again = [wake async for wake in other.events(run=run, ack=False)]
            assert again == unacknowledged
            await other.ack(w.seq for w in again)
        assert [wake async for wake in client.events(run=run)] == []


async def test_following_delivers_a_wake_posted_after_subscribing(client: AsyncClient) -> None:
    with trio.fail_after(20):
        run, (first,) = await _ended_run(client, 1)
        later = await client.spawn(["sleep", "60"], run=run)
        async with contextlib.aclosing(client.events(run=run, follow=True)) as wakes:
            # The first wake proves the subscription is in place before `later` ends.
            assert (await anext(wakes)).id == first.id
            assert await client.stop(later.id)
            wake = await anext(wakes)
        assert (wake.id, wake.run, wake.state, wake.exit_code) == (later.id, run, "stopped", -15)
        assert [wake async for wake in client.events(run=run)] == []


async def test_the_blocking_client_follows_and_stops_from_inside_its_loop(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        run, (first,) = await _ended_run(client, 1)
        later = await client.spawn(["sleep", "60"], run=run)

        def follow() -> list[Wake]:
            got: list[Wake] = []
            with (
                Client(daemon.socket, timeout=10) as blocking,
                contextlib.closing(blocking.events(run=run, follow=True)) as wakes,
            ):
                for wake in wakes:
                    got.append(wake)
                    if wake.id == first.id:
                        assert blocking.stop(later.id)
                    else:
                        break
            return got

        wakes = await trio.to_thread.run_sync(follow)
        assert [(w.id, w.state) for w in wakes] == [(first.id, "finished"), (later.id, "stopped")]
        assert [wake async for wake in client.events(run=run)] == []


async def test_a_delegated_workers_wake_goes_to_its_parent_worker(client: AsyncClient) -> None:
    with trio.fail_after(20):
        parent = await client.spawn(["sleep", "60"])
        child = await client.spawn(sh("echo for my parent; exit 3"), parent=parent.id)
        await client.wait(child.id)
        (wake,) = [wake async for wake in client.events(worker=parent.id)]
        assert (wake.id, wake.run, wake.parent) == (child.id, parent.run, parent.id)
        assert (wake.state, wake.exit_code, wake.preview) == ("failed", 3, "for my parent\n")
        assert [wake async for wake in client.events(run=parent.run)] == []  # not the run's
        await client.stop(parent.id)


async def test_the_switchs_wakes_are_one_per_worker_of_its_run(client: AsyncClient) -> None:
    with trio.fail_after(20):
        async with client.stop_switch() as switch:
            finished = await switch.spawn(sh("echo done"))
            failed = await switch.spawn(sh("exit 7"))
            stopped = await switch.spawn(["sleep", "60"])
            delegated = await switch.spawn(["true"], parent=stopped.id)
            await client.wait(delegated.id)
            got: dict[str, Wake] = {}
            async with contextlib.aclosing(switch.wakes()) as wakes:
                async for wake in wakes:
                    assert wake.id not in got
                    got[wake.id] = wake
                    if len(got) == 2:
                        await switch.one(stopped.id)
                    if len(got) == 3:
                        break
            assert {i: (w.state, w.exit_code) for i, w in got.items()} == {
                finished.id: ("finished", 0),
                failed.id: ("failed", 7),
                stopped.id: ("stopped", -15),
            }
            assert {w.run for w in got.values()} == {switch.run}
            assert [wake async for wake in client.events(run=switch.run)] == []
            # The delegated worker woke its parent, not the run.
            assert [w.id async for w in client.events(worker=stopped.id)] == [delegated.id]


# -- subagentctl events ----------------------------------------------------------------


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


def test_ctl_events_prints_each_wake_once_in_the_design_shape(daemon: DaemonProcess) -> None:
    run = daemon.ctl("new-run").stdout.strip()
    spawned = [
        daemon.ctl("spawn", "--run", run, "--", "sh", "-c", script).stdout.split()[0]
        for script in ("echo all good", "echo broken; exit 4")
    ]
    for worker in spawned:
        assert daemon.ctl("wait", worker).returncode == 0
    first = daemon.ctl("--json", "events", "--run", run)
    assert first.returncode == 0, _said(first)
    documents = [json.loads(line) for line in first.stdout.splitlines()]
    assert all(set(document) == WAKE_FIELDS for document in documents)
    assert {document["id"]: document for document in documents} == {
        spawned[0]: {
            "id": spawned[0],
            "run": run,
            "parent": None,
            "state": "finished",
            "exit_code": 0,
            "preview": "all good\n",
            "attempt": 1,
            "reason": "",
        },
        spawned[1]: {
            "id": spawned[1],
            "run": run,
            "parent": None,
            "state": "failed",
            "exit_code": 4,
            "preview": "broken\n",
            "attempt": 1,
            "reason": "",
        },
    }
    second = daemon.ctl("--json", "events", "--run", run)
    assert (second.returncode, second.stdout) == (0, ""), _said(second)


def test_ctl_events_prints_one_line_a_wake_for_a_person(daemon: DaemonProcess) -> None:
    parent = daemon.ctl("spawn", "--", "sleep", "60").stdout.split()[0]
    script = r"printf 'line one\n\033[31mline two\n'; exit 2"
    child = daemon.ctl("spawn", "--parent", parent, "--", "sh", "-c", script).stdout.split()[0]
    assert daemon.ctl("wait", child).returncode == 0
    shown = daemon.ctl("events", "--worker", parent)
    assert shown.returncode == 0, _said(shown)
    # The output is cleaned onto one line (its newlines as \n, the colour taken out): it can
    # neither break the line nor colour the terminal.
    assert shown.stdout == f"{child} failed exit=2 line one\\nline two\n"
    again = daemon.ctl("events", "--worker", parent)
    assert (again.returncode, again.stdout) == (0, ""), _said(again)
    assert again.stderr == f"no wakes pending for worker {parent}\n"
    assert daemon.ctl("stop", parent).returncode == 0


@pytest.mark.parametrize(
    "args",
    [["events", "-f"], ["events", "--run", "r-1", "--worker", "w-1"]],
    ids=["neither", "both"],
)
def test_ctl_events_needs_exactly_one_parent(daemon: DaemonProcess, args: list[str]) -> None:
    proc = daemon.ctl(*args)
    assert proc.returncode == 2, _said(proc)
    assert "--run" in proc.stderr
    assert proc.stdout == ""


def test_ctl_events_of_an_unknown_run_is_not_found(daemon: DaemonProcess) -> None:
    proc = daemon.ctl("events", "--run", "r-nope")
    assert proc.returncode == 1, _said(proc)
    assert proc.stderr.startswith("subagentctl: not_found: ")


def _read_line(stream: IO[bytes] | None, timeout: float = 10.0) -> str:
    """One line of a child's output, or an assertion error after `timeout` seconds."""
    assert stream is not None
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no whole line within {timeout}s: {line!r}"
        byte = os.read(stream.fileno(), 1)  # a byte at a time: nothing read past the line
        assert byte, f"output ended before a whole line: {line!r}"
        line += byte
    return line.decode()


def _stuck(pid: int) -> str:
    """What a process that did not end is doing: its signal masks and where it waits."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [line for line in status if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt"))]
    wchan = Path(f"/proc/{pid}/wchan").read_text()
    return f"{'; '.join(masks)}; wchan {wchan}"


def test_ctl_events_follows_until_ctrl_c_and_acknowledges_what_it_printed(
    daemon: DaemonProcess,
) -> None:
    run = daemon.ctl("new-run").stdout.strip()
    first = daemon.ctl("spawn", "--run", run, "--", "echo", "first").stdout.split()[0]
    assert daemon.ctl("wait", first).returncode == 0
    with subprocess.Popen(
        [str(BIN / "subagentctl"), "--json", "events", "--run", run, "-f"],
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # As from a terminal: a suite run in the background (`&`) has SIGINT ignored, and
        # a process that starts with it ignored gets no KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as follower:
        try:
            # From the first page: once printed, the subscription is in place.
            assert json.loads(_read_line(follower.stdout))["id"] == first
            printed = [first]
            for text in ("second", "third"):
                spawned = daemon.ctl("spawn", "--run", run, "--", "echo", text)
                worker = spawned.stdout.split()[0]
                document = json.loads(_read_line(follower.stdout))
                assert (document["id"], document["preview"]) == (worker, f"{text}\n")
                printed.append(worker)
            follower.send_signal(signal.SIGINT)
            try:
                assert follower.wait(timeout=10) == 130
            except subprocess.TimeoutExpired:
                raise AssertionError(f"Ctrl-C did not end it: {_stuck(follower.pid)}") from None
            assert follower.stdout is not None
            assert follower.stdout.read() == b""
        finally:
            if follower.poll() is None:
                follower.kill()
    # Each wake was acknowledged before the next was read; only the last may have met
    # the Ctrl-C between its printing and its acknowledgement.
    left = daemon.ctl("--json", "events", "--run", run).stdout.splitlines()
    assert [json.loads(line)["id"] for line in left] in ([], printed[-1:])
