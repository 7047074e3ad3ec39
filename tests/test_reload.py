"""Reload in place: every worker, line, pid and wake survives the exec; a failed
reload leaves the old image serving; a crash leaves nothing running unowned."""

from __future__ import annotations

import functools
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Refused

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, sh, wait_output
from .helpers import reload_on_own_connection as reload

COUNT_LINES = "i=0; while [ $i -lt {n} ]; do i=$((i+1)); echo line $i; sleep 0.02; done"


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_reload_keeps_every_worker_pid_and_line(daemon: DaemonProcess) -> None:
    gate = daemon.root / "gate"  # the workers write until the reload is done: none ends before
    writer = (
        f"i=0; while [ ! -e {gate} ] || [ $i -lt 5 ]; do i=$((i+1)); echo line $i; sleep 0.02; done"
    )
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            workers = [await client.spawn(sh(writer)) for _ in range(20)]
            for w in workers:
                await wait_output(client, w.id, b"line 5\n")
        assert daemon.proc is not None
        reply = await reload(daemon)
        gate.touch()
        assert isinstance(reply, p.ReloadReply), reply
        assert (reply.image_generation, reply.carried_live, reply.stopped_by_reload) == (2, 20, [])
        async with AsyncClient(daemon.socket) as client:
            info = await client.info()
            assert (info.pid, info.image_generation, info.reloads) == (daemon.proc.pid, 2, 1)
            for w in workers:
                view = await client.wait(w.id)
                assert (view.state, view.pid) == ("finished", w.pid)
                lines = (await client.collect(w.id)).result.splitlines()
                # Every line, in order, none lost or doubled across the exec.
                assert lines == [f"line {i}" for i in range(1, len(lines) + 1)], lines
                assert len(lines) >= 5


async def test_three_reloads_in_a_row(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo up; while :; do sleep 0.1; done"))
            await wait_output(client, worker.id, b"up")
        for generation in (2, 3, 4):
            reply = await reload(daemon)
            assert isinstance(reply, p.ReloadReply), reply
            assert reply.image_generation == generation
        async with AsyncClient(daemon.socket) as client:
            view = await client.status(worker.id)
            assert (view.state, view.pid) == ("running", worker.pid)
            await client.stop(worker.id)


async def test_sighup_reloads_and_speaks_sd_notify(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    with trio.fail_after(30):
        daemon.proc.send_signal(signal.SIGHUP)
        seen = await trio.to_thread.run_sync(daemon.wait_notify, "READY=1")
        reloading = [line for line in seen if line.startswith(("RELOADING=", "MONOTONIC_USEC="))]
        assert reloading[0] == "RELOADING=1"
        assert int(reloading[1].split("=")[1]) > 0
        async with AsyncClient(daemon.socket) as client:
            assert (await client.info()).image_generation == 2
        assert await trio.to_thread.run_sync(daemon.terminate) == 0
        assert "STOPPING=1" in await trio.to_thread.run_sync(daemon.wait_notify, "STOPPING=1")


async def test_a_broken_agents_toml_refuses_the_reload_and_loses_nothing(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(sh("echo up; while :; do sleep 0.1; done"))
        await wait_output(client, worker.id, b"up")
        daemon.config.write_text('[agents.reviewer]\ncommand = ["x"]\ntimeout = "soon"\n')
        reply = await reload(daemon)
        assert isinstance(reply, p.Error)
        assert reply.code == "refused"
        assert "agents.reviewer.timeout" in reply.message
        info = await client.info()  # the same connection: the old image never went away
        assert (info.image_generation, info.workers) == (1, {"running": 1})
        assert (await client.spawn(["true"])).state == "running"  # the fence is lifted
        await client.stop(worker.id)


async def test_a_failed_exec_leaves_the_old_image_serving(daemon_dirs: DaemonProcess) -> None:
    daemon = daemon_dirs
    daemon.start(env={"SUBAGENTD_FAULT": "reload:unexecutable"})  # execv fails, once
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo up; while :; do sleep 0.1; done"))
            await wait_output(client, worker.id, b"up")
        reply = await reload(daemon)
        assert isinstance(reply, p.Error)
        assert "old image serves on" in reply.message
        async with AsyncClient(daemon.socket) as fresh:
            assert (await fresh.info()).image_generation == 1
            await fresh.stop(worker.id)
            view = await fresh.status(worker.id)
            assert view.state == "stopped"


async def test_workers_ending_around_a_reload_wake_once_each(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            workers = [
                await client.spawn(sh(f"sleep 0.{i}; echo {i}"), run=run) for i in range(1, 10)
            ]
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply)
        async with AsyncClient(daemon.socket) as client:
            for w in workers:
                await client.wait(w.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=run))
            page = await conn.receive()
            assert isinstance(page, p.Wakes)
            assert sorted(w.id for w in page.wakes) == sorted(w.id for w in workers)


async def test_a_worker_that_cannot_be_carried_is_stopped_by_reload(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT_NO_CARRY": "fragile"})
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            fragile = await client.spawn(["sleep", "60"], name="fragile")
            sturdy = await client.spawn(["sleep", "60"], name="sturdy")
        reply = await reload(daemon_dirs)
        assert isinstance(reply, p.ReloadReply)
        assert (reply.carried_live, reply.stopped_by_reload) == (1, [fragile.id])
        async with AsyncClient(daemon_dirs.socket) as client:
            assert (await client.status(fragile.id)).state == "stopped_by_reload"
            assert (await client.status(sturdy.id)).state == "running"
            await client.stop(sturdy.id)


#: A worker named `fragile` cannot be carried, and the exec fails (once): a reload that
#: fails after it stopped what it could not carry.
FAILING_AFTER_A_STOP = {
    "SUBAGENTD_FAULT_NO_CARRY": "fragile",
    "SUBAGENTD_FAULT": "reload:unexecutable",
}


async def test_a_reload_failing_after_it_stopped_a_worker_says_which(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start(env=FAILING_AFTER_A_STOP)
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            fragile = await client.spawn(["sleep", "60"], name="fragile")
            sturdy = await client.spawn(["sleep", "60"], name="sturdy")
            with pytest.raises(Refused) as refused:
                await client.reload()
            assert refused.value.stopped_by_reload == [fragile.id]
            assert "exec failed" in refused.value.message
            assert f"before failing it stopped {fragile.id}" in refused.value.message
            assert (await client.info()).image_generation == 1  # the old image serves on
            assert (await client.status(fragile.id)).state == "stopped_by_reload"
            assert (await client.status(sturdy.id)).state == "running"
            await client.stop(sturdy.id)


async def test_subagentctl_reload_shows_the_workers_a_failed_reload_stopped(
    daemon_dirs: DaemonProcess,
) -> None:
    for as_json in (False, True):
        daemon_dirs.start(env=FAILING_AFTER_A_STOP)
        with trio.fail_after(30):
            async with AsyncClient(daemon_dirs.socket) as client:
                fragile = await client.spawn(["sleep", "60"], name="fragile")
            args = ("--json", "reload") if as_json else ("reload",)
            proc = await trio.to_thread.run_sync(functools.partial(daemon_dirs.ctl, *args))
            assert proc.returncode == 1, proc
            if as_json:
                error = msgspec.json.decode(proc.stdout)["error"]
                assert (error["code"], error["stopped_by_reload"]) == ("refused", [fragile.id])
            else:
                assert f"before failing it stopped {fragile.id}" in proc.stderr
        await trio.to_thread.run_sync(daemon_dirs.terminate)


async def test_connects_during_reloads_are_never_refused(daemon: DaemonProcess) -> None:
    refused: list[OSError] = []
    connected = 0
    done = threading.Event()

    def connect_loop() -> None:
        """Connect, say hello, read the answer, hang up; again and again until told."""
        nonlocal connected
        hello = p.encode(p.Hello(id=1))
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(daemon.socket))  # blocking: waits in the backlog if need be
                    s.settimeout(30)
                    s.sendall(hello)
                    s.recv(4096)  # a welcome, or the reloading notice
                    connected += 1
                except OSError as exc:
                    refused.append(exc)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(trio.to_thread.run_sync, connect_loop))
            try:
                for _ in range(2):
                    reply = await reload(daemon)
                    assert isinstance(reply, p.ReloadReply), reply
            finally:
                done.set()
    assert refused == []
    assert connected > 0


async def test_kill_9_then_restart_interrupts_keeps_results_and_leaves_no_orphan(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            done = await client.spawn(sh("echo kept"))
            await client.wait(done.id)
            running = await client.spawn(sh("sleep 60 & echo child $!; wait"))
            seen = await wait_output(client, running.id, b"\n")
            child = int(seen.split()[1])
        daemon.kill()
        assert alive(child)  # orphaned by the crash
        await trio.to_thread.run_sync(daemon.start)
        assert running.pid is not None
        assert not alive(child)
        assert not alive(running.pid)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(running.id)).state == "interrupted"
            assert (await client.collect(done.id)).result == "kept\n"
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Subscribe(id=2, run=running.run))
            page = await conn.receive()
            assert isinstance(page, p.Wakes)
            assert [(w.id, w.state) for w in page.wakes] == [(running.id, "interrupted")]
