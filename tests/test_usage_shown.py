"""What issue 26 shows a user, where they look: a worker's usage in `ls --json` (items 3),
and a limit reached as an ending of its own (item 4): `top`, the text of `events` (a
wake's state and reason) and `status` say `failed (memory_limit)`. Real daemon, real
kernel limit (cgroup v1 here)."""

from __future__ import annotations

import json

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .test_resource_limits import _allocate, needs_v1
from .test_top import once, row


@needs_v1
async def test_a_memory_limit_ending_is_shown_by_top_events_and_status(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(
                _allocate(256), run=run, limits=p.Limits(memory=p.memory_bytes("64M"))
            )
            assert (await client.wait(worker.id)).reason == "memory_limit"
        top = await trio.to_thread.run_sync(lambda: once(daemon, "--all"))
        assert top.returncode == 0, top.stderr
        assert "failed (memory_limit)" in row(top.stdout, worker.id), top.stdout
        events = await trio.to_thread.run_sync(lambda: daemon.ctl("events", "--run", run))
        assert events.returncode == 0, events.stderr
        assert "failed (memory_limit)" in events.stdout, events.stdout
        status = await trio.to_thread.run_sync(lambda: daemon.ctl("status", worker.id))
        assert "memory_limit" in status.stdout, status.stdout


async def test_ls_json_carries_each_live_workers_usage(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            live = await client.spawn(sh("sleep 300 & echo ready; wait"))
            ended = await client.spawn(["true"])
            await client.wait(ended.id)
            await wait_output(client, live.id, b"ready")
        listed = await trio.to_thread.run_sync(lambda: daemon.ctl("--json", "ls", "--all"))
        assert listed.returncode == 0, listed.stderr
        by_id = {w["id"]: w for w in map(json.loads, listed.stdout.splitlines())}
        usage = by_id[live.id]["usage"]
        assert usage["processes"] == 2, usage
        assert usage["memory"] > 0, usage
        assert usage["cpu_seconds"] >= 0, usage
        assert by_id[ended.id]["usage"] is None  # ended: nothing to read
