"""Edges of reload and of runs, driven the way a user drives them: an unexpected
failure early in a reload, reloads pipelined on one connection and asked too
soon, and a run nested in a lone spawn's implicit run.
"""

from __future__ import annotations

import json

import trio

from subagentd import protocol as p

from .conftest import DaemonProcess
from .helpers import RawConnection


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


async def reload_on_own_connection(daemon: DaemonProcess) -> p.Reply:
    """Ask for a reload on a connection of its own; the answer comes from the new image."""
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Reload(id=2))
        reply = await conn.receive()
        assert reply is not None
        return reply


async def test_a_reload_asked_at_once_after_another_is_busy_until_retry_after(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        first = await reload_on_own_connection(daemon)
        assert isinstance(first, p.ReloadReply), first
        second = await reload_on_own_connection(daemon)
        assert isinstance(second, p.Error), second
        assert second.code == "busy"
        assert second.retry_after is not None
        assert 0 < second.retry_after <= 1.0
        await trio.sleep(second.retry_after)  # what the refusal says to do
        third = await reload_on_own_connection(daemon)
        assert isinstance(third, p.ReloadReply), third
        assert third.image_generation == 3
