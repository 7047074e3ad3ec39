"""Start after: a spawn naming other workers waits, queued, until they have ended
(`after`), finished (`after_ok`; else it ends skipped, naming which) or are ready
(`after_ready`); only workers the caller can see may be named."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.protocol.errors import Invalid, NotFound

from .conftest import DaemonProcess
from .helpers import pending_wakes, sh


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


def _gated(go: object, then: str) -> list[str]:
    return sh(f"while [ ! -e {go} ]; do sleep 0.01; done; {then}")


async def test_after_starts_once_all_have_ended(client: AsyncClient, daemon: DaemonProcess) -> None:
    go = daemon.root / "go"
    with trio.fail_after(60):
        first = await client.spawn(_gated(go, "exit 0"))
        second = await client.spawn(_gated(go, "exit 3"))
        later = await client.spawn(["sh", "-c", "echo started"], after=[first.id, second.id])
        assert (later.state, later.queued, later.pid) == ("starting", True, None)
        go.touch()
        ended = await client.wait(later.id)
        assert (ended.state, ended.exit_code) == ("finished", 0)
        views = [await client.status(w) for w in (first.id, second.id, later.id)]
        assert views[2].started_at >= max(v.ended_at or 0 for v in views[:2])


async def test_after_ok_with_a_failing_dependency_ends_skipped_naming_it(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        ok = await client.spawn(["true"], run=run)
        bad = await client.spawn(sh("exit 4"), run=run)
        skipped = await client.spawn(["true"], run=run, after_ok=[ok.id, bad.id])
        ended = await client.wait(skipped.id)
        assert (ended.state, ended.reason, ended.pid) == ("stopped", "skipped", None)
        notes = [e.data.decode() async for e in client.watch(skipped.id) if e.kind == "note"]
        assert any(f"worker {bad.id} ended failed (exit_code=4)" in n for n in notes)
        wakes = [w for w in await pending_wakes(daemon, run) if w.id == skipped.id]
        assert len(wakes) == 1


async def test_after_ready_starts_the_client_only_once_the_server_listens(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    go = daemon.root / "go"
    with trio.fail_after(60):
        server = await client.spawn(
            _gated(go, "echo listening; exec sleep 30"), ready="^listening$"
        )
        client_worker = await client.spawn(["true"], after_ready=[server.id])
        assert (await client.wait_for(server.id, "x", timeout=0.3)).outcome == "timed_out"
        assert (await client.status(client_worker.id)).queued  # not before the server listens
        go.touch()
        ended = await client.wait(client_worker.id)
        assert ended.state == "finished"
        ready_at = (await client.status(server.id)).ready_at
        assert ready_at is not None
        assert ended.started_at >= ready_at
        await client.stop(server.id)


async def test_after_ready_of_one_that_ends_unready_is_skipped(client: AsyncClient) -> None:
    with trio.fail_after(30):
        server = await client.spawn(sh("exit 0"), ready="^listening$")
        waiting = await client.spawn(["true"], after_ready=[server.id])
        ended = await client.wait(waiting.id)
        assert (ended.state, ended.reason) == ("stopped", "skipped")


async def test_only_existing_workers_in_reach_may_be_named(client: AsyncClient) -> None:
    with trio.fail_after(30):
        with pytest.raises(NotFound):
            await client.spawn(["true"], after=["w-0000000000"])
        other = await client.spawn(["sleep", "30"])
        # From inside a worker: a sibling out of its reach is refused, as any reference.
        inside = await client.spawn(
            sh(f"subagentctl spawn --after {other.id} -- true; echo rc=$?; exec sleep 30")
        )
        found = await client.wait_for(inside.id, "^rc=", timeout=20)
        assert found.line == "rc=1"
        said = [e.data async for e in client.watch(inside.id) if e.kind == "stderr"]
        assert b"forbidden" in b"".join(said)
        for bad in (["x" * 257], ["w"] * 65):
            with pytest.raises(Invalid, match="after"):
                await client.spawn(["true"], after=bad)
        await client.stop(other.id)
        await client.stop(inside.id)


async def test_a_worker_waiting_for_others_stays_waiting_across_a_reload(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    go = daemon.root / "go"
    with trio.fail_after(60):
        first = await client.spawn(_gated(go, "exit 0"))
        later = await client.spawn(["true"], after_ok=[first.id])
        await client.reload()
        assert (await client.status(later.id)).queued
        go.touch()
        assert (await client.wait(later.id)).state == "finished"


def test_subagentctl_spawn_after(daemon: DaemonProcess) -> None:
    first = daemon.ctl("spawn", "--", "sh", "-c", "exit 2").stdout.split()[0]
    done = daemon.ctl("spawn", "--after-ok", first, "--", "true")
    assert done.returncode == 0, done.stderr
    later = done.stdout.split()[0]
    daemon.ctl("wait", later)
    assert "stopped (skipped)" in daemon.ctl("status", later).stdout
    assert "--after-ready" in daemon.ctl("spawn", "--help").stdout
