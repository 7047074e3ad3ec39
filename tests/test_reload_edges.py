"""Edges of reload and of runs, driven the way a user drives them: an unexpected
failure early in a reload, reloads pipelined on one connection and asked too
soon, and a run nested in a lone spawn's implicit run.
"""

from __future__ import annotations

import json

import trio

from .conftest import DaemonProcess


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
