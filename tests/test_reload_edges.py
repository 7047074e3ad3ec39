"""Edges of reload and of runs, driven the way a user drives them: an unexpected
failure early in a reload, reloads pipelined on one connection and asked too
soon, and a run nested in a lone spawn's implicit run.
"""

from __future__ import annotations

import json

import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, sh, wait_output

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


async def reload_until_not_busy(daemon: DaemonProcess) -> p.Reply:
    """Reload, waiting out the rate limit as its refusal says."""
    reply = await reload_on_own_connection(daemon)
    while isinstance(reply, p.Error) and reply.code == "busy":
        await trio.sleep(reply.retry_after or 0.1)
        reply = await reload_on_own_connection(daemon)
    return reply


async def test_a_reload_failing_before_its_freeze_undoes_nothing_it_did_not_do(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "reload:early"})
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            writer = await client.spawn(sh(COUNT_LINES.format(n=400)))
            await wait_output(client, writer.id, b"line 3\n")
        early = await reload_until_not_busy(daemon_dirs)
        assert isinstance(early, p.Error), early
        assert (early.code, "injected fault at reload:early" in early.message) == (
            "internal",
            True,
        )
        # An exec that fails rolls back what it did: its requester is answered, all serve on.
        (daemon_dirs.state_dir / "checkpoint").mkdir()  # the checkpoint cannot be renamed there
        failed = await reload_until_not_busy(daemon_dirs)
        assert isinstance(failed, p.Error), failed
        assert "old image serves on" in failed.message
        (daemon_dirs.state_dir / "checkpoint").rmdir()
        reloaded = await reload_until_not_busy(daemon_dirs)
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
