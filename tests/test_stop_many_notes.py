"""A stop of many (UNSEEN_STOP_FROM workers or more at once) as a watcher and the log see
it, now that each worker's `stopping` note waits for its ending (one opening of its
parked journal, not two) and its ending logs no line of its own: each journal still says
`stopping` once and before its ending, a tree that outlives the stop says it while it
runs on, a reload in the middle carries the note said, and the log has one line for them
all where it had one a worker. A stop of a few is as it was."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd.client import AsyncClient
from subagentd.daemon.processes import _reaper
from subagentd.daemon.workers._supervisor import STOPPING_NOTE_LATE, UNSEEN_STOP_FROM

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .inprocess import held, in_process

#: One past the supervisor's threshold: the fewest a stop of many takes.
MANY = UNSEEN_STOP_FROM + 1
#: A worker that takes its TERM and runs on until a file appears (its tree outlives the stop).
LINGERING = 'trap "echo TERM" TERM; echo up; while [ ! -e "$1" ]; do sleep 0.05; done'


def _logged(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in daemon.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


async def _states(client: AsyncClient, worker_id: str) -> list[bytes]:
    """The `state` entries of a worker's journal, each its first word."""
    entries = (await client.watch_page(worker_id)).entries
    return [e.data.split()[0] for e in entries if e.kind == "state"]


async def test_a_stop_of_many_says_stopping_once_before_each_ending_and_logs_one_line(
    daemon: DaemonProcess,
) -> None:
    """Every journal of a stop_run of MANY reads running, stopping, stopped (the note
    written with the ending); the log has `stop.many_ended` counting their states and no
    `worker.ended` of theirs, where a stop of three still logs each."""
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            ids = [(await client.spawn(["sleep", "3600"], run=run)).id for _ in range(MANY)]
            few_run = await client.new_run()
            few = [(await client.spawn(["sleep", "3600"], run=few_run)).id for _ in range(3)]
            assert sorted(await client.stop_run(run)) == sorted(ids)
            assert sorted(await client.stop_run(few_run)) == sorted(few)
            for worker_id in ids + few:
                entries = (await client.watch_page(worker_id)).entries
                said = [e for e in entries if e.kind == "state"]
                assert [e.data for e in said[1:]] == [b"stopping reason=run", said[2].data]
                assert said[2].data.startswith(b"stopped ")
                assert [e.seq for e in said] == sorted(e.seq for e in said)
            await client.info()  # a round trip after the last ending: its lines are out
    (ended,) = _logged(daemon, "stop.many_ended")
    assert (ended["workers"], ended["states"]) == (MANY, {"stopped": MANY})
    each = {line["worker"] for line in _logged(daemon, "worker.ended")}
    assert each.isdisjoint(ids)
    assert set(few) <= each


async def test_a_tree_that_outlives_a_stop_of_many_says_stopping_while_it_runs_on(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """One worker of a stop of many takes its TERM and runs on (a grace of 600 s): the
    others end, and within STOPPING_NOTE_LATE (and a margin) its journal says
    `stopping reason=run` while it still runs; released, it ends `stopped`, the note once."""
    release = tmp_path / "release"
    with trio.fail_after(STOPPING_NOTE_LATE + 90):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            lingering = await client.spawn([*sh(LINGERING), "sh", str(release)], run=run, grace=600)
            await wait_output(client, lingering.id, b"up\n")
            for _ in range(MANY - 1):
                await client.spawn(["sleep", "3600"], run=run)
            stopped = await client.stop_run(run, wait=False)
            assert len(stopped) == MANY
            await wait_output(client, lingering.id, b"TERM\n")
            async with contextlib.aclosing(client.watch(lingering.id, follow=True)) as entries:
                async for entry in entries:  # the note comes while it runs on
                    if entry.kind == "state" and entry.data.startswith(b"stopping"):
                        break
            view = await client.status(lingering.id)
            assert (view.state, view.stopping) == ("running", True)
            release.touch()
            assert (await client.wait(lingering.id)).state == "stopped"
            assert await _states(client, lingering.id) == [b"running", b"stopping", b"stopped"]


async def test_a_reload_during_a_stop_of_many_carries_each_note_said_once(
    autojump_clock: MockClock, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload before the note of a stop of many's lingering worker was due: the image
    that was asked writes it before its exec (the next takes a stop asked for said), so
    its journal says it once, before the ending the next image writes. The reload comes
    while the others are still ending: their supervisions woken as the old image ends
    reap none of them (`Supervisor.handed_over`), so each is carried with its pipes."""
    # The clock is held throughout (no grace, no late note may come), and the reaper
    # paces its asking by a sleep when one took a millisecond or more (a loaded
    # machine): held, that sleep would never end and no exit would be told again.
    monkeypatch.setattr(_reaper, "PROBE_GAP", math.inf)
    release = short_tmp / "release"
    async with in_process(short_tmp) as d:
        with held(autojump_clock):  # real processes; no grace or late note may come meanwhile
            async with d.client() as client:
                run = await client.new_run()
                lingering = await client.spawn(
                    [*sh(LINGERING), "sh", str(release)], run=run, grace=600
                )
                await wait_output(client, lingering.id, b"up\n")
                for _ in range(MANY - 1):
                    await client.spawn(["sleep", "3600"], run=run)
                assert len(await client.stop_run(run, wait=False)) == MANY
                await wait_output(client, lingering.id, b"TERM\n")
                assert await _states(client, lingering.id) == [b"running"]  # left to later
            await d.reload_in_place()
            async with d.client() as client:
                assert await _states(client, lingering.id) == [b"running", b"stopping"]
                assert (await client.status(lingering.id)).stopping
                release.touch()
                assert (await client.wait(lingering.id)).state == "stopped"
                assert await _states(client, lingering.id) == [
                    b"running",
                    b"stopping",
                    b"stopped",
                ]
