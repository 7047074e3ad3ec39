"""Edges of reload and of runs, driven the way a user drives them: an unexpected
failure early in a reload, reloads pipelined on one connection and asked too
soon, requests in flight and frames half read on the connection that asks, a
failing worker's grace, a run nested in a lone spawn's implicit run, and a
resume of a run or a waiting stop_run under way when a reload begins.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon._settings import DEFAULT_RELOAD_INTERVAL as MIN_INTERVAL

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, reload_on_own_connection, sh, wait_output
from .inprocess import held, in_process

# Numbered lines, slowly enough that reloads land in the middle of them.
COUNT_LINES = "i=0; while [ $i -lt {n} ]; do i=$((i+1)); echo line $i; sleep 0.02; done"


def ctl_json(daemon: DaemonProcess, *args: str) -> dict[str, object]:
    """Run `subagentctl --json ARGS` and parse its document, failing loudly on an error."""
    proc = daemon.ctl("--json", *args)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    document = json.loads(proc.stdout)
    assert isinstance(document, dict)
    return document


async def test_a_run_nested_in_a_collected_lone_spawns_run_keeps_taking_spawns(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        lone = await trio.to_thread.run_sync(ctl_json, daemon, "spawn", "--", "true")
        outer = str(lone["run"])
        nested = await trio.to_thread.run_sync(ctl_json, daemon, "new-run", "--outer", outer)
        inner = str(nested["run"])
        # The lone worker ends and is collected: its run had no other worker of its own.
        await trio.to_thread.run_sync(ctl_json, daemon, "collect", "--wait", str(lone["id"]))
        for _ in range(2):
            spawned = await trio.to_thread.run_sync(
                ctl_json, daemon, "spawn", "--run", inner, "--", "true"
            )
            assert spawned["run"] == inner
        # Stopping the outer run still reaches the run nested in it.
        stopped = await trio.to_thread.run_sync(lambda: daemon.ctl("stop", "--run", outer))
        assert stopped.returncode == 0, stopped.stderr
        refused = await trio.to_thread.run_sync(
            lambda: daemon.ctl("spawn", "--run", inner, "--", "true")
        )
        assert refused.returncode != 0
        assert "stopped" in refused.stderr, refused.stderr


async def test_a_reload_asked_at_once_after_another_is_busy_saying_how_long(
    daemon_dirs: DaemonProcess,
) -> None:
    # The new image keeps the interval it was started with (carried in the checkpoint),
    # and counts it from its serving. Waiting it out: on the mock clock, below.
    daemon_dirs.start("--reload-interval", "30")
    with trio.fail_after(60):
        first = await reload_on_own_connection(daemon_dirs)
        assert isinstance(first, p.ReloadReply), first
        second = await reload_on_own_connection(daemon_dirs)
        assert isinstance(second, p.Error), second
        assert second.code == "busy"
        assert second.retry_after is not None
        assert 20 < second.retry_after <= 30, second.retry_after


async def test_a_reload_refused_as_too_soon_says_when_and_is_taken_then(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    # In-process, on the mock clock: every attempt fails early (an injected fault), so
    # nothing execs, and the rate limit counts from each failure as from a reload.
    early = frozenset({("reload", "early")})
    async with in_process(short_tmp, faults=early) as d:
        with held(autojump_clock):  # only the test moves the clock
            first = await reload_on_own_connection(d)
            assert isinstance(first, p.Error), first
            assert first.code == "internal"  # the fault, not the limit
            second = await reload_on_own_connection(d)
            assert isinstance(second, p.Error), second
            assert second.code == "busy"
            assert second.retry_after == pytest.approx(MIN_INTERVAL)
            autojump_clock.jump(MIN_INTERVAL / 2)
            third = await reload_on_own_connection(d)
            assert isinstance(third, p.Error), third
            assert third.code == "busy"
            assert third.retry_after == pytest.approx(MIN_INTERVAL / 2)
            assert third.retry_after is not None
            autojump_clock.jump(third.retry_after + 1e-6)  # as the refusal says
            d.daemon.faults.asked = early  # the fault fires once: armed again
            fourth = await reload_on_own_connection(d)
            assert isinstance(fourth, p.Error), fourth
            assert fourth.code == "internal"  # taken: failed by the fault, not busy


async def test_a_reload_failing_before_its_freeze_undoes_nothing_it_did_not_do(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "reload:early,reload:unexecutable"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            writer = await client.spawn(sh(COUNT_LINES.format(n=400)))
            await wait_output(client, writer.id, b"line 3\n")
        early = await reload_on_own_connection(daemon_dirs)
        assert isinstance(early, p.Error), early
        assert (early.code, "injected fault at reload:early" in early.message) == (
            "internal",
            True,
        )
        # An exec that fails rolls back what it did: its requester is answered, all serve on.
        failed = await reload_on_own_connection(daemon_dirs)  # execv fails, once
        assert isinstance(failed, p.Error), failed
        assert "old image serves on" in failed.message
        reloaded = await reload_on_own_connection(daemon_dirs)
        assert isinstance(reloaded, p.ReloadReply), reloaded
        assert (reloaded.image_generation, reloaded.carried_live) == (2, 1)
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.wait(writer.id)).state == "finished"
            result = await client.collect(writer.id)
            assert result.result == "".join(f"line {i}\n" for i in range(1, 401))


async def test_two_reloads_pipelined_on_one_connection_are_both_answered_and_it_serves_on(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.stream.send_all(p.encode(p.Reload(id=2)) + p.encode(p.Reload(id=3)))
            answers = [await conn.receive(), await conn.receive()]
            assert all(isinstance(a, p.ReloadReply) for a in answers), answers
            assert sorted(a.id for a in answers if a is not None) == [2, 3]
            await conn.send(p.Info(id=4))
            info = await conn.receive()
            assert isinstance(info, p.InfoReply), info
            assert info.info.image_generation == 2


async def _until(condition: Callable[[], object]) -> None:
    """Poll for a condition no event announces (a file a worker writes, a log line)."""
    while not condition():  # noqa: ASYNC110  nothing to wait on but the condition
        await trio.sleep(0.02)


async def test_a_wait_in_flight_on_the_reloading_connection_is_answered(
    daemon: DaemonProcess,
) -> None:
    """A wait, a followed watch and a followed subscription in flight on the connection
    that asks for a reload are each answered: the daemon says `reloading` under their own
    ids and the client sends them again on the same connection, which the reload keeps."""
    gate = daemon.root / "gate"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(
                sh(f"echo before; while [ ! -e {gate} ]; do sleep 0.02; done; echo after"),
                run=run,
            )
            await wait_output(client, worker.id, b"before\n")
            ended: list[p.WorkerView] = []
            watched: list[bytes] = []
            woken: list[str] = []

            async def wait() -> None:
                ended.append(await client.wait(worker.id))

            async def watch() -> None:
                async for entry in client.watch(worker.id, follow=True):
                    if entry.kind == "stdout":
                        watched.append(entry.data)  # noqa: PERF401  seen as they come

            async def subscribe() -> None:
                async with contextlib.aclosing(client.events(run=run, follow=True)) as wakes:
                    async for wake in wakes:
                        woken.append(wake.id)
                        return

            async with trio.open_nursery() as nursery:
                for task in (wait, watch, subscribe):
                    nursery.start_soon(task)
                await _until(lambda: watched)  # all three are in flight by now
                reloaded = await client.reload()
                assert reloaded.image_generation == 2
                gate.touch()
            assert [view.state for view in ended] == ["finished"]
            assert b"".join(watched) == b"before\nafter\n"
            assert woken == [worker.id]

        # On the wire: the wait is answered `reloading` under its id, sent again, answered.
        gate.unlink()
        async with AsyncClient(daemon.socket) as client:
            waiting = await client.spawn(sh(f"while [ ! -e {gate} ]; do sleep 0.02; done"))
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Wait(id=2, worker=waiting.id))
            await conn.send(p.Reload(id=3))
            told = await conn.receive()
            assert isinstance(told, p.Error), told
            assert (told.id, told.code, told.retry_after is not None) == (2, "reloading", True)
            await conn.send(p.Wait(id=2, worker=waiting.id))
            reloaded_reply = await conn.receive()
            assert isinstance(reloaded_reply, p.ReloadReply), reloaded_reply
            gate.touch()
            answer = await conn.receive()
            assert isinstance(answer, p.WorkerReply), answer
            assert (answer.id, answer.worker.state) == (2, "finished")


async def test_a_frame_half_read_when_the_reload_execs_is_not_lost(
    daemon: DaemonProcess,
) -> None:
    """Bytes the old image read from the carried connection but had not yet taken as a
    request are carried across the exec: the new image reads the rest of the frame."""
    with trio.fail_after(30):
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            info = p.encode(p.Info(id=3))
            await conn.stream.send_all(p.encode(p.Reload(id=2)) + info[:3])
            reloaded = await conn.receive()
            assert isinstance(reloaded, p.ReloadReply), reloaded
            await conn.stream.send_all(info[3:])
            answer = await conn.receive()
            assert isinstance(answer, p.InfoReply), answer
            assert answer.info.image_generation == 2


async def test_a_failing_workers_grace_does_not_stall_a_reload_for_everyone(
    daemon_dirs: DaemonProcess,
) -> None:
    """A worker whose supervision failed is ended at once, not given its grace while a
    reload, which waits for that ending, keeps every client waiting."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "pump:faulty"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            faulty = await client.spawn(
                sh("trap '' TERM; echo hello; while :; do sleep 0.05; done"),
                name="faulty",
                grace=60,
            )
        await _until(lambda: "worker.supervision_failed" in daemon_dirs.log())
        served = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reload_on_own_connection, daemon_dirs)
            await _until(lambda: "reload.checked" in daemon_dirs.log())
            with trio.move_on_after(8):
                async with AsyncClient(daemon_dirs.socket) as client:
                    assert (await client.info()).pid > 0
                    assert (await client.wait(faulty.id)).state == "failed"
                served = True
            nursery.cancel_scope.cancel()
        assert served, f"nobody was served for 8 s while {faulty.id} had its grace"
        assert faulty.pid is not None
        assert not alive(faulty.pid)


async def test_a_resume_run_under_way_when_a_reload_begins_resumes_every_head_once(
    daemon: DaemonProcess,
) -> None:
    """A reload asked (by anyone) while a resume of a run is restarting its heads waits for
    all of them: the resume is answered with every head, each resumed once, never half
    done and refused `reloading` for the rest (whose re-send finds the run live)."""
    heads = 60
    script = 'if [ -n "$SUBAGENTD_RESUME" ]; then exec sleep 30; fi; exit 3'
    with trio.fail_after(120):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as other:
            run = await client.new_run()
            workers = [await client.spawn(sh(script), run=run, grace=1) for _ in range(heads)]
            for worker in workers:
                assert (await client.wait(worker.id)).state == "failed"
            outcome: list[object] = []
            async with trio.open_nursery() as nursery:

                async def resume_run() -> None:
                    try:
                        outcome.append(await client.resume_run(run))
                    except Exception as exc:
                        outcome.append(exc)

                nursery.start_soon(resume_run)
                # Once the first head runs again, the resume of the run is under way.
                first = sorted(workers, key=lambda w: (w.started_at, w.id))[0]
                while (await other.status(first.id)).attempt < 2:  # noqa: ASYNC110  a condition
                    await trio.sleep(0.005)
                await other.reload()
            attempts = [(await other.status(w.id)).attempt for w in workers]
            await other.stop_run(run, wait=False)
    assert isinstance(outcome[0], list), f"resume_run raised {outcome[0]!r}"
    assert sorted(view.id for view in outcome[0]) == sorted(w.id for w in workers)
    assert attempts == [2] * heads, attempts


async def test_a_stop_run_cut_short_by_a_reload_on_its_connection_answers_what_it_stopped(
    daemon: DaemonProcess,
) -> None:
    """A stop_run waiting (out its worker's grace) on the connection that asks for a reload
    is answered with what it stopped, not `reloading`: sent again, it would find the run
    stopped already and answer that it stopped nothing."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as watcher:
            run = await client.new_run()
            worker = await client.spawn(
                sh("trap 'echo term' TERM; echo ready; while :; do sleep 0.1; done"),
                run=run,
                grace=8,
            )
            await wait_output(watcher, worker.id, b"ready")
            answered: list[list[str]] = []
            told = trio.Event()
            async with trio.open_nursery() as nursery:

                async def stop_run() -> None:
                    answered.append(await client.stop_run(run))  # waits for the grace
                    told.set()

                nursery.start_soon(stop_run)
                await wait_output(watcher, worker.id, b"term")  # the stop waits out the grace
                await client.reload()  # on the same connection, as an AsyncClient shares one
                with trio.move_on_after(4):  # half the grace
                    await told.wait()
                # Answered at the seal, without waiting out the grace: the worker still runs.
                assert (await watcher.status(worker.id)).state == "running"
                nursery.cancel_scope.cancel()
    assert answered == [[worker.id]], f"stop_run answered {answered}, not [{worker.id!r}]"
