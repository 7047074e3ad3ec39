"""A restart serves while it recovers: after kill -9, the new daemon answers `info` at once
(saying how far its recovery has come) and every request that needs the workers it is taking
back `recovering` with a bounded `retry_after`; the clients send those again by themselves,
so a user sees no error, and once recovery is over everything is as it was.

Recovery is held where it ends what was running by the daemon's test-only hold
(SUBAGENTD_FAULT=recovery:held: it waits until a writer of the FIFO `recovery` in the state
dir has opened and closed it), so the test sees it under way for as long as it needs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Client, Recovering, RunStopped, _core
from subagentd.daemon.core._recovering import (
    RETRY_AFTER_MAX,
    RETRY_AFTER_MIN,
    RecoveryProgress,
)
from subagentd.daemon.core._session import Session

from .conftest import DaemonProcess
from .helpers import RawConnection, sh, wait_output

HOLD = {"SUBAGENTD_FAULT": "recovery:held"}


@contextmanager
def hold_fifo(daemon: DaemonProcess) -> Iterator[os.PathLike[str]]:
    fifo = daemon.state_dir / "recovery"
    os.mkfifo(fifo)
    try:
        yield fifo
    finally:
        fifo.unlink(missing_ok=True)


async def held_open(fifo: os.PathLike[str]) -> int:
    """The FIFO's write end, opened once recovery holds its read end: it is under way."""
    return await trio.to_thread.run_sync(os.open, fifo, os.O_WRONLY, abandon_on_cancel=True)


async def ask(conn: RawConnection, request: p.Request[p.Reply]) -> p.DaemonMessage | None:
    await conn.send(request)
    return await conn.receive()


def assert_recovering(reply: p.DaemonMessage | None, rid: int, op: str) -> None:
    assert isinstance(reply, p.Error), reply
    assert (reply.id, reply.code) == (rid, "recovering"), reply
    assert reply.retry_after is not None, reply
    assert RETRY_AFTER_MIN <= reply.retry_after <= RETRY_AFTER_MAX, reply
    assert op in reply.message, reply
    assert "send it again after retry_after" in reply.message, reply


async def recovery_of(conn: RawConnection, rid: int) -> p.Recovery | None:
    reply = await ask(conn, p.Info(id=rid))
    assert isinstance(reply, p.InfoReply), reply
    return reply.info.recovering


async def test_a_restart_answers_info_while_it_recovers_the_rest_recovering_and_clients_retry(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start()
    with trio.fail_after(120):
        async with AsyncClient(daemon_dirs.socket) as client:
            run = await client.new_run()
            for _ in range(3):
                await client.wait((await client.spawn(["true"], run=run)).id)
            marked = await client.spawn(sh('echo "$SUBAGENTD_TOKEN"; exec sleep 600'), run=run)
            token = (await wait_output(client, marked.id, b"\n")).decode().strip()
            await client.spawn(["sleep", "600"], run=run)
            to_stop = await client.new_run()
            await client.spawn(["sleep", "600"], run=to_stop)
            every = await client.ls(all=True)
            before = {w.id: w.state for w in every}
            in_run = {w.id for w in every if w.run == run}
        daemon_dirs.kill()
        with hold_fifo(daemon_dirs) as fifo:
            daemon_dirs.start(env=HOLD, ready="STATUS=recovering")
            holding = await held_open(fifo)
            try:
                conn = await RawConnection.open(daemon_dirs.socket)  # welcomed: the user's
                recovery = await recovery_of(conn, 2)
                assert recovery is not None
                assert (recovery.phase, recovery.done, recovery.total) == (
                    "ending what was running",
                    0,
                    3,
                ), recovery
                shown = await trio.to_thread.run_sync(daemon_dirs.ctl, "info")
                assert shown.returncode == 0, shown.stderr
                assert "recovering: ending what was running: 0 of 3" in shown.stdout, shown.stdout
                assert_recovering(await ask(conn, p.ListWorkers(id=3)), 3, "list_workers")
                assert_recovering(await ask(conn, p.Spawn(id=4, argv=["true"])), 4, "spawn")
                assert_recovering(await ask(conn, p.Stop(id=5, worker=marked.id)), 5, "stop")
                assert_recovering(await ask(conn, p.Wait(id=6, worker=marked.id)), 6, "wait")
                assert_recovering(await ask(conn, p.Reload(id=7)), 7, "reload")
                # A worker's token is not known yet: recovering, not forbidden, and the
                # connection stays open for the hello to be said again.
                by_token = await RawConnection.open(daemon_dirs.socket, hello=False)
                for rid in (1, 2):
                    reply = await ask(by_token, p.Hello(id=rid, token=token))
                    assert_recovering(reply, rid, "token")
                # A stream waits (it waits anyway) and goes on once recovery is over.
                await conn.send(p.Subscribe(id=8, run=run))
                answered = (await recovery_of(conn, 9) or recovery).answered
                assert answered == 7, answered

                seen: dict[str, Any] = {}

                def blocking() -> None:
                    with Client(daemon_dirs.socket, timeout=30) as daemon:
                        seen["blocking"] = {w.id: w.state for w in daemon.ls(all=True)}
                        seen["stop_run"] = daemon.stop_run(to_stop)

                async def trio_client() -> None:
                    async with AsyncClient(daemon_dirs.socket) as daemon:
                        seen["trio"] = {w.id: w.state for w in await daemon.ls(all=True)}
                        seen["wait"] = (await daemon.wait(marked.id)).state

                def cli() -> None:
                    seen["cli"] = daemon_dirs.ctl("ls", "--all", "--json", timeout=60)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.to_thread.run_sync, blocking)
                    nursery.start_soon(trio_client)
                    nursery.start_soon(trio.to_thread.run_sync, cli)
                    # Released once each client has been answered `recovering` at least once.
                    # Polled: only info tells of the refusals (each client's first ask).
                    while (now := await recovery_of(conn, 10)) is not None and (  # noqa: ASYNC110
                        now.answered < answered + 3
                    ):
                        await trio.sleep(0.05)
                    assert now is not None, "recovery ended before the clients were refused"
                    assert not seen, seen
                    os.close(holding)
                    holding = -1
            finally:
                if holding >= 0:
                    os.close(holding)
        daemon_dirs.wait_notify("READY=1")
        after = {i: ("interrupted" if s == "running" else s) for i, s in before.items()}
        assert seen["blocking"] == after, seen["blocking"]
        assert seen["trio"] == after, seen["trio"]
        assert seen["wait"] == "interrupted", seen["wait"]
        assert seen["stop_run"] == [], seen["stop_run"]  # its worker was interrupted already
        ctl = seen["cli"]
        assert ctl.returncode == 0, ctl.stderr
        for worker_id in before:
            assert worker_id in ctl.stdout, ctl.stdout
        wakes = await conn.receive()
        assert isinstance(wakes, p.Wakes), wakes
        assert wakes.id == 8, wakes
        assert {w.id for w in wakes.wakes} == in_run, wakes  # 3 finished, 2 interrupted
        assert await recovery_of(conn, 11) is None
        welcome = await ask(by_token, p.Hello(id=3, token=token))
        assert isinstance(welcome, p.Welcome), welcome
        assert welcome.worker == marked.id, welcome
        await conn.stream.aclose()
        await by_token.stream.aclose()
        async with AsyncClient(daemon_dirs.socket) as client:
            with pytest.raises(RunStopped):  # the stop asked during recovery was not lost
                await client.spawn(["true"], run=to_stop)
            assert {w.id: w.state for w in await client.ls(all=True)} == after


async def test_a_recovery_that_never_ends_is_a_clear_error_at_the_clients_timeout(
    daemon_dirs: DaemonProcess,
) -> None:
    """Hostile: recovery stuck (held for good, as on an archive it cannot get past). A
    client gets `Recovering` saying so at its own timeout, not a hang; SIGTERM still stops
    the daemon, and the next start takes every worker back."""
    daemon_dirs.start()
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            live = await client.spawn(["sleep", "600"])
        daemon_dirs.kill()
        with hold_fifo(daemon_dirs) as fifo:
            daemon_dirs.start(env=HOLD, ready="STATUS=recovering")
            holding = await held_open(fifo)
            try:

                def give_up() -> tuple[Recovering, float]:
                    began = time.monotonic()
                    with (
                        Client(daemon_dirs.socket, timeout=1.0) as daemon,
                        pytest.raises(Recovering) as refused,
                    ):
                        daemon.status(live.id)
                    return refused.value, time.monotonic() - began

                refusal, waited = await trio.to_thread.run_sync(give_up)
                assert 1.0 - RETRY_AFTER_MAX <= waited < 5, waited  # stops short of passing it
                assert "recovering its workers after a restart" in str(refusal), refusal
                assert "ending what was running: 0 of 1" in str(refusal), refusal
                with trio.move_on_after(1) as trio_gave_up:  # the trio client's own bound
                    async with AsyncClient(daemon_dirs.socket) as daemon:
                        await daemon.status(live.id)
                assert trio_gave_up.cancelled_caught
                code = await trio.to_thread.run_sync(daemon_dirs.terminate, 20)
                assert code == 0, daemon_dirs.log()
            finally:
                os.close(holding)
        daemon_dirs.start()
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(live.id)).state == "interrupted"


def test_retry_after_is_bounded_and_follows_the_rate_of_recovery() -> None:
    progress = RecoveryProgress(now=100.0)
    assert progress.retry_after(100.0) == 0.2  # no rate yet
    progress.begin("ending what was running", 1000, now=100.0)
    progress.took(10)
    assert progress.retry_after(101.0) == RETRY_AFTER_MAX  # 990 left at 10/s: capped
    progress.took(989)
    assert progress.retry_after(101.0) == RETRY_AFTER_MIN  # one left: floored
    progress.took(50)  # more than there were: done stays total
    assert progress.view(101.0).done == 1000
    assert progress.retry_after(100.0) == 0.2  # a clock that did not move: no rate


@pytest.mark.parametrize(
    ("retry_after", "pause"),
    [
        (None, _core.RECOVERY_PAUSE),
        (math.nan, _core.RECOVERY_PAUSE),
        (math.inf, _core.RECOVERY_PAUSE),
        (-math.inf, _core.RECOVERY_PAUSE),
        (-1.0, _core.RECOVERY_PAUSE_MIN),
        (0.0, _core.RECOVERY_PAUSE_MIN),
        (1e300, _core.RECOVERY_PAUSE_MAX),
        (0.3, 0.3),
    ],
)
def test_a_clients_pause_on_recovering_is_bounded_whatever_the_daemon_says(
    retry_after: float | None, pause: float
) -> None:
    reply = p.Error(id=2, code="recovering", message="", retry_after=retry_after)
    assert _core.retry_delay(p.Stop(id=2, worker="w-1"), reply) == pause
    # Within the client's own timeout (a recovery that never ends is an error then).
    assert _core.give_up_at(reply, 10.0, 1.5) == 11.5
    assert _core.give_up_at(reply, 10.0, None) == 10.0 + _core.RECONNECT_WINDOW
    assert _core.give_up_at(reply, 10.0, 1e9) == 10.0 + _core.RECONNECT_WINDOW


def test_a_tokens_hello_while_recovering_is_answered_and_may_be_said_again() -> None:
    """The session's side, by calling it: `recovering`, not `forbidden`, and no close; the
    same connection's next hello is welcomed once the token is known."""
    progress: RecoveryProgress | None = RecoveryProgress(now=0.0)

    def worker_for_token(token: str) -> str | None:
        if progress is not None:
            raise progress.refusal(None, 1.0)
        return {"tok": "w-1"}.get(token)

    session = Session(worker_for_token, pid=1, daemon_version="0", frame_limit=1 << 20)
    session.receive(p.encode(p.Hello(id=1, token="tok")))
    refused = session.next_event()
    assert isinstance(refused, p.Error), refused
    assert (refused.id, refused.code, refused.retry_after) == (1, "recovering", 0.2), refused
    assert not session.welcomed
    progress = None
    session.receive(p.encode(p.Hello(id=2, token="tok")))
    welcome = session.next_event()
    assert isinstance(welcome, p.Welcome), welcome
    assert welcome.worker == "w-1"
