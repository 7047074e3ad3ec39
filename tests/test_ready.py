"""Ready: a worker spawned with a `ready` pattern is marked ready once a line of its
output matches; `wait` with `ready` answers then (or at its end); kept across reloads."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Invalid

from .conftest import DaemonProcess
from .helpers import sh


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_a_server_is_ready_once_it_prints_listening_and_not_before(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    go = daemon.root / "go"
    with trio.fail_after(60):
        server = await client.spawn(
            sh(
                f"echo starting; while [ ! -e {go} ]; do sleep 0.01; done; echo listening on 80; "
                "exec sleep 30"
            ),
            ready="^listening",
        )
        assert not server.ready
        async with trio.open_nursery() as nursery:
            readied: list[bool] = []

            async def wait_ready() -> None:
                readied.append((await client.wait(server.id, ready=True)).ready)

            nursery.start_soon(wait_ready)
            assert (await client.wait_for(server.id, "^starting$", timeout=30)).outcome == "matched"
            assert not readied
            assert not (await client.status(server.id)).ready  # "starting" did not match
            go.touch()
        assert readied == [True]
        view = await client.status(server.id)
        assert (view.state, view.ready) == ("running", True)
        assert view.ready_at is not None
        notes = [e.data async for e in client.watch(server.id) if e.kind == "note"]
        assert b"ready: listening on 80" in notes
        assert "running (ready)" in daemon.ctl("ls").stdout
        await client.reload()
        again = await client.status(server.id)
        assert (again.ready, again.ready_at) == (True, view.ready_at)
        assert (await client.wait(server.id, ready=True)).ready  # at once: ready already
        await client.stop(server.id)


async def test_a_wait_for_ready_answers_at_the_end_of_one_that_never_matched(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        worker = await client.spawn(sh("echo nope; exit 3"), ready="^listening")
        ended = await client.wait(worker.id, ready=True)
        assert not ended.ready
        assert (await client.wait(worker.id)).state == "failed"


async def test_ready_is_refused_for_a_bad_pattern_or_a_worker_spawned_without_one(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        for pattern in ("", "(", "a" * 1025, "(?P<x>a)\\1"):
            with pytest.raises(Invalid, match="ready"):
                await client.spawn(["true"], ready=pattern)
        plain = await client.spawn(["sleep", "30"])
        with pytest.raises(Invalid, match="without a ready pattern"):
            await client.wait(plain.id, ready=True)
        await client.stop(plain.id)


def test_subagentctl_spawn_ready_and_wait_ready(daemon: DaemonProcess) -> None:
    done = daemon.ctl("spawn", "--ready", "^up$", "--", "sh", "-c", "echo up; exec sleep 30")
    assert done.returncode == 0, done.stderr
    worker = done.stdout.split()[0]
    waited = daemon.ctl("wait", "--ready", worker)
    assert waited.returncode == 0, waited.stderr
    assert "ready: yes" in waited.stdout
    assert json.loads(daemon.ctl("--json", "status", worker).stdout)["ready"] is True
    assert "--ready" in daemon.ctl("wait", "--help").stdout
    daemon.ctl("stop", worker)


async def test_the_mcp_tools_mark_and_wait_for_ready(daemon: DaemonProcess) -> None:
    from .test_mcp import call, mcp_server

    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            spawned = await call(
                session, "subagent_spawn", argv=sh("echo up; exec sleep 30"), ready="^up$"
            )
            waited = await call(session, "subagent_wait", worker=spawned["id"], ready=True)
            assert waited["outcome"] == "matched"
            assert waited["worker"]["ready_at"] is not None
            await call(session, "subagent_stop", worker=spawned["id"])


async def test_a_worker_not_yet_ready_at_a_reload_is_marked_ready_after_it(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    go = daemon.root / "go"
    with trio.fail_after(60):
        worker = await client.spawn(
            sh(f"while [ ! -e {go} ]; do sleep 0.01; done; echo up; exec sleep 30"), ready="^up$"
        )
        await client.reload()
        go.touch()
        assert (await client.wait(worker.id, ready=True)).ready
        await client.stop(worker.id)
