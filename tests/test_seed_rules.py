"""The seed rules as a user meets them: stopping a run is one-way (a resume carries its
workers on, never the run: `reopen_run` is the one way back), a resume that could not
start is refused before anything runs, and a resume takes only its timeout again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Client, NotFound, RunStopped
from subagentd.protocol.errors import Refused

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, pending_wakes, sh, wait_output

# Says which attempt it is, then waits to be stopped.
ATTEMPT = 'echo "attempt ${SUBAGENTD_RESUME:-1}"; while :; do sleep 0.1; done'


async def ask(daemon: DaemonProcess, request: p.Request[p.Reply]) -> p.Reply:
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        request.id = 2
        await conn.send(request)
        reply = await conn.receive()
        assert reply is not None
        return reply


async def ask_raw(daemon: DaemonProcess, message: dict[str, object]) -> p.Reply:
    """A message as any peer may send it, keys and values as given."""
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.stream.send_all(p.frame(msgspec.msgpack.encode(message)))
        reply = await conn.receive()
        assert reply is not None
        return reply


async def refused_spawns_into(client: AsyncClient, run: str) -> None:
    """Every way of starting something new in `run` by its id is refused `run_stopped`."""
    with pytest.raises(RunStopped):
        await client.spawn(["true"], run=run)
    with pytest.raises(RunStopped):
        await client.new_run(outer=run)


# -- stopping is one-way -------------------------------------------------------------


async def test_a_resume_leaves_a_stopped_run_refusing_the_old_switchs_spawns(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with (
            AsyncClient(daemon.socket) as client,
            client.stop_switch(stop_on_exit=False) as switch,
        ):
            worker = await switch.spawn(sh(ATTEMPT))
            await wait_output(client, worker.id, b"attempt 1")
            await switch.all()
            for resume_it in (
                lambda: client.resume(worker.id),
                lambda: client.resume_run(switch.run),
            ):
                await resume_it()
                await wait_output(client, worker.id, b"attempt 2")
                assert (await client.status(worker.id)).state == "running"
                with pytest.raises(RunStopped):
                    await switch.spawn(["true"])
                await refused_spawns_into(client, switch.run)
                await switch.wait_stopped()  # still stopped: answered at once
                await client.stop_run(switch.run)
                assert (await client.status(worker.id)).state == "stopped"


async def test_a_resumed_worker_still_delegates_in_its_stopped_run(daemon: DaemonProcess) -> None:
    """A resume is the wish to carry that worker on: its own delegations with it, here by
    `subagentctl` run inside it as an agent would. A sibling that was not resumed cannot."""
    delegating = (
        'if [ "${SUBAGENTD_RESUME:-1}" = 2 ]; then subagentctl spawn --name kid -- sleep 60; fi; '
        "echo attempt ${SUBAGENTD_RESUME:-1}; while :; do sleep 0.1; done"
    )
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            boss = await client.spawn(sh(delegating), run=run)
            sibling = await client.spawn(["sleep", "60"], run=run)
            await wait_output(client, boss.id, b"attempt 1")
            await client.stop_run(run)
            await client.resume(boss.id)
            await wait_output(client, boss.id, b"attempt 2")
            kids = [w for w in await client.ls(run=run) if w.parent == boss.id]
            assert [(k.name, k.state) for k in kids] == [("kid", "running")]
            with pytest.raises(RunStopped):  # ended, not resumed: its run is stopped
                await client.spawn(["true"], parent=sibling.id)
            await refused_spawns_into(client, run)
            stopped = await client.stop_run(run)  # a later stop takes the resumed subtree
            assert stopped == sorted([boss.id, kids[0].id])


async def test_reopen_run_starts_a_stopped_run_again_nested_ones_with_it(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            outer = await client.new_run()
            inner = await client.new_run(outer=outer)
            await client.stop_run(outer)
            with pytest.raises(RunStopped, match=f"nested in run {outer}"):
                await client.reopen_run(inner)
            with pytest.raises(NotFound):
                await client.reopen_run("r-nope")
            await client.reopen_run(outer)
            await client.reopen_run(outer)  # not stopped: done, nothing to do
            for run in (outer, inner):
                worker = await client.spawn(["true"], run=run)
                assert (await client.wait(worker.id)).state == "finished"
            async with trio.open_nursery() as nursery:
                stopped_again = trio.Event()

                async def wait_for_the_next_stop() -> None:
                    await client.wait_run_stopped(inner)
                    stopped_again.set()

                nursery.start_soon(wait_for_the_next_stop)
                await client.info()  # a round trip: the wait is in, and has not returned
                assert not stopped_again.is_set()
                await client.stop_run(outer)
            assert stopped_again.is_set()


def _reopen_blocking(daemon: DaemonProcess, run: str) -> None:
    with Client(daemon.socket, timeout=30) as blocking:
        blocking.reopen_run(run)


async def test_a_runs_stop_outlives_a_resume_and_a_crash_and_its_reopening_does_too(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            kept, reopened = await client.new_run(), await client.new_run()
            worker = await client.spawn(sh(ATTEMPT), run=kept)
            await wait_output(client, worker.id, b"attempt 1")
            await client.stop_run(kept)
            await client.stop_run(reopened)
            await client.resume(worker.id)
        await trio.to_thread.run_sync(_reopen_blocking, daemon, reopened)  # the twin, likewise
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            await refused_spawns_into(client, kept)
            worker = await client.spawn(["true"], run=reopened)
            assert (await client.wait(worker.id)).state == "finished"


async def test_a_run_let_go_with_its_last_worker_comes_back_stopped_on_a_resume(
    daemon: DaemonProcess,
) -> None:
    """A spawn's own run goes with its last worker's handle: a resume of that worker brings
    it back into memory as stopped as its stop left it."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(ATTEMPT))
            await wait_output(client, worker.id, b"attempt 1")
            await client.stop_run(worker.run)
            await client.collect(worker.id)  # released, and its run with it
            with pytest.raises(NotFound):
                await client.spawn(["true"], run=worker.run)
            await client.resume(worker.id)
            await wait_output(client, worker.id, b"attempt 2")
            with pytest.raises(RunStopped):
                await client.spawn(["true"], run=worker.run)
            await client.stop(worker.id)


async def test_a_run_stopped_after_its_last_worker_failed_stays_stopped_across_a_resume(
    daemon: DaemonProcess,
) -> None:
    """Its stop ended no worker (the one it had had failed): what keeps the run stopped once
    it was let go is its own saved row, read again by the resume, after a crash too."""
    failing = 'echo "attempt ${SUBAGENTD_RESUME:-1}"; [ -n "$SUBAGENTD_RESUME" ] || exit 3; ' + (
        "while :; do sleep 0.1; done"
    )
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(failing))
            assert (await client.wait(worker.id)).state == "failed"
            assert await client.stop_run(worker.run) == []  # it had failed already
            await client.collect(worker.id)  # released, and its run with it
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            with pytest.raises(NotFound):  # let go: no run held under that id
                await client.spawn(["true"], run=worker.run)
            await client.resume(worker.id)
            await wait_output(client, worker.id, b"attempt 2")
            try:
                await refused_spawns_into(client, worker.run)
            finally:
                await client.stop(worker.id)


def _release_hold(hold: Path) -> None:
    """Let a held resume go on: open the FIFO it reads (which waits until it does), close."""
    os.close(os.open(hold, os.O_WRONLY))


@pytest.mark.parametrize(
    ("stop", "collected"),
    [("run", False), ("run", True), ("worker", False)],
    ids=["stop_run", "stop_run-of-a-released-worker", "stop-of-the-worker"],
)
async def test_a_stop_landing_while_a_resume_is_under_way_refuses_it_and_nothing_runs(
    daemon_dirs: DaemonProcess, stop: str, collected: bool
) -> None:
    """The resume is held where it awaits (its journal verified in a thread) while the stop
    lands: the stop, the later ask, wins. It answers that it stopped nothing (nothing ran),
    the resume is refused saying why, and the worker is as it was, resumable again."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "hold-resume:held"})
    hold = daemon_dirs.state_dir / "hold-resume"
    os.mkfifo(hold)
    failing = 'echo "attempt ${SUBAGENTD_RESUME:-1}"; [ -n "$SUBAGENTD_RESUME" ] || exit 3; ' + (
        "while :; do sleep 0.1; done"
    )
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(sh(failing), name="held")
            assert (await client.wait(worker.id)).state == "failed"
            if collected:
                await client.collect(worker.id)
            refusals: list[Refused] = []

            async def resume() -> None:
                with pytest.raises(Refused) as refused:
                    await client.resume(worker.id)
                refusals.append(refused.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(resume)
                # Opened once the resume holds the read end: it is under way, not yet run.
                holding = await trio.to_thread.run_sync(
                    os.open, hold, os.O_WRONLY, abandon_on_cancel=True
                )
                try:
                    asked: p.Request[p.Reply] = (
                        p.StopRun(id=0, run=worker.run, wait=False)
                        if stop == "run"
                        else p.Stop(id=0, worker=worker.id, wait=False)
                    )
                    stopping = await ask(daemon_dirs, asked)
                    assert stopping == p.Stopped(id=2, found=True, stopped=[]), stopping
                finally:
                    os.close(holding)
            [refusal] = refusals
            if stop == "run":
                assert isinstance(refusal, RunStopped), refusal
                assert f"run {worker.run} was stopped while worker {worker.id}" in str(refusal)
            else:
                assert not isinstance(refusal, RunStopped), refusal
                assert f"worker {worker.id} was stopped (user) while" in str(refusal)
            assert "nothing ran; resume it again" in str(refusal)
            view = await client.status(worker.id)
            assert (view.state, view.attempt, view.stopping) == ("failed", 1, False), view
            if not collected:  # else its run was let go again, as it was before the resume
                assert [w.attempt for w in await pending_wakes(daemon_dirs, worker.run)] == [1]
            async with trio.open_nursery() as nursery:  # a resume after the stop runs
                nursery.start_soon(trio.to_thread.run_sync, _release_hold, hold)
                await client.resume(worker.id)
            await wait_output(client, worker.id, b"attempt 2")
            try:
                if stop == "run":
                    await refused_spawns_into(client, worker.run)
            finally:
                await client.stop(worker.id)


# -- refused before anything ran, with why ---------------------------------------------


async def _nothing_ran(daemon: DaemonProcess, client: AsyncClient, worker: p.WorkerView) -> None:
    """The worker is as its stop left it: no attempt counted, no wake, nothing held."""
    view = await client.status(worker.id)
    assert (view.state, view.attempt) == ("stopped", 1)
    assert [w.attempt for w in await pending_wakes(daemon, worker.run)] == [1]
    assert not (await client.info()).holds_park


async def test_a_resume_whose_directory_is_gone_is_refused_and_nothing_runs(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    here = tmp_path / "work"
    here.mkdir()
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(ATTEMPT), cwd=here)
            await wait_output(client, worker.id, b"attempt 1")
            await client.stop(worker.id)
            here.rmdir()
            for _ in range(3):  # each retry is refused alike, and burns nothing
                with pytest.raises(Refused, match=f"working directory '{here}' does not exist"):
                    await client.resume(worker.id)
                await _nothing_ran(daemon, client, worker)
            with pytest.raises(Refused, match="does not exist"):
                await client.resume_run(worker.run)
            await _nothing_ran(daemon, client, worker)
            latest = await client.latest_resumable(here)
            assert (latest.run, latest.resumable) == (worker.run, False)
            assert "does not exist" in latest.reason
            here.mkdir()  # put back, it resumes
            await client.resume(worker.id)
            await wait_output(client, worker.id, b"attempt 2")
            await client.stop(worker.id)


async def test_a_resume_whose_program_is_gone_is_refused_and_nothing_runs(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    program = tmp_path / "agent.sh"
    program.write_text(f"#!/bin/sh\n{ATTEMPT}\n")
    program.chmod(0o755)
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn([str(program)], cwd=tmp_path)
            await wait_output(client, worker.id, b"attempt 1")
            await client.stop(worker.id)
            program.unlink()
            with pytest.raises(Refused, match=f"cannot execute '{program}'"):
                await client.resume(worker.id)
            await _nothing_ran(daemon, client, worker)


# -- only the timeout may be given again -------------------------------------------------

GIVEN_AGAIN: dict[str, object] = {
    "env": {"A": "1"},
    "cwd": "/tmp",
    "grace": 1.0,
    "agent": "other",
    "name": "renamed",
    "run": "r-other",
    "parent": "w-other",
    "stdin_open": True,
    "input": b"new",
    "argv": ["other"],
    "model": "large",
}


async def test_a_resume_refuses_every_field_but_its_timeout_by_name(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"])
            await client.stop(worker.id)
            for field, value in GIVEN_AGAIN.items():
                reply = await ask_raw(daemon, {"op": "resume", "id": 2, "worker": worker.id,
                                               field: value})  # fmt: skip
                assert isinstance(reply, p.Error), (field, reply)
                assert reply.code == "frozen", (field, reply)
                assert f": {field} cannot be given again (only timeout can)" in reply.message
            both = p.Resume(id=0, worker=worker.id, env={"A": "1"}, grace=2.0)
            reply = await ask(daemon, both)
            assert isinstance(reply, p.Error)
            assert ": env, grace cannot be given again" in reply.message
            await _nothing_ran(daemon, client, worker)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("env", 5),
        ("grace", float("nan")),
        ("grace", float("inf")),
        ("grace", -1.0),
        ("grace", "5"),
        ("cwd", "x" * 5000),
        ("stdin_open", "yes"),
        ("name", "n" * 2000),
    ],
)
async def test_a_hostile_value_of_a_field_a_resume_refuses_is_invalid_naming_it(
    daemon: DaemonProcess, field: str, value: object
) -> None:
    with trio.fail_after(30):
        reply = await ask_raw(daemon, {"op": "resume", "id": 2, "worker": "w-1", field: value})
        assert isinstance(reply, p.Error), reply
        assert (reply.code, reply.id) == ("invalid", 2)
        assert f"$.{field}" in reply.message, reply.message


async def test_a_key_no_request_has_is_still_ignored(daemon: DaemonProcess) -> None:
    """Schema evolution: a newer peer may add fields an older daemon does not know; those
    are ignored (a resume's refusals are of the fields a spawn takes, named)."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(ATTEMPT))
            await client.stop(worker.id)
        reply = await ask_raw(daemon, {"op": "resume", "id": 2, "worker": worker.id, "colour": 1})
        assert isinstance(reply, p.WorkerReply), reply
        async with AsyncClient(daemon.socket) as client:
            await wait_output(client, worker.id, b"attempt 2")
            await client.stop(worker.id)


# -- workers find the daemon's own subagentctl ---------------------------------------------


async def test_a_worker_finds_the_daemons_subagentctl_though_the_path_it_got_lacks_it(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    """As under `make run`: the daemon's PATH (so its workers') lacks the venv's bin."""
    daemon_dirs.start(env={"PATH": "/usr/bin:/bin"})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "subagentctl").write_text("#!/bin/sh\necho its own subagentctl\n")
    (mine / "subagentctl").chmod(0o755)
    asks = 'echo "PATH=$PATH"; subagentctl --json info; echo "rc=$?"'
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            inherited = await client.spawn(sh(asks))
            given = await client.spawn(sh(asks), env={"PATH": "/bin"})
            own = await client.spawn(sh(asks), env={"PATH": f"{mine}:/usr/bin:/bin"})
            outputs = []
            for worker in (inherited, given, own):
                assert (await client.wait(worker.id)).state == "finished"
                outputs.append((await client.collect(worker.id)).result)
    first_path = {"inherited": "/usr/bin:/bin", "given": "/bin", "own": f"{mine}:/usr/bin:/bin"}
    for (name, before), out in zip(first_path.items(), outputs, strict=True):
        assert f"PATH={before}{os.pathsep}{BIN}\n" in out, (name, out)  # last, after its own
        assert out.endswith("rc=0\n"), (name, out)
    inherited_out, given_out, own_out = outputs
    for out in (inherited_out, given_out):
        info = json.loads(out.split("\n", 1)[1].rsplit("rc=", 1)[0])
        assert info["protocol"] == p.PROTOCOL_VERSION
    assert "its own subagentctl\n" in own_out  # its PATH wins: the daemon's comes last


@pytest.mark.parametrize(
    ("run", "code"),
    [("", "not_found"), ("r" * 257, "invalid"), (5, "invalid"), (None, "invalid")],
)
async def test_a_hostile_run_to_reopen_is_refused_and_the_daemon_serves_on(
    daemon: DaemonProcess, run: object, code: str
) -> None:
    with trio.fail_after(30):
        reply = await ask_raw(daemon, {"op": "reopen_run", "id": 2, "run": run})
        assert isinstance(reply, p.Error), reply
        assert (reply.id, reply.code) == (2, code), reply
        if code == "invalid":
            assert "$.run" in reply.message
        assert isinstance(await ask(daemon, p.Info(id=0)), p.InfoReply)


def test_subagentctl_reopen_starts_a_stopped_run_again(daemon: DaemonProcess) -> None:
    run = daemon.ctl("--json", "new-run")
    assert run.returncode == 0, run.stderr
    run_id = json.loads(run.stdout)["run"]
    assert daemon.ctl("stop", "--run", run_id).returncode == 0
    refused = daemon.ctl("spawn", "--run", run_id, "--", "true")
    assert refused.returncode == 1
    assert "run_stopped" in refused.stderr
    reopened = daemon.ctl("reopen", run_id)
    assert reopened.returncode == 0, reopened.stderr
    assert reopened.stdout == f"run {run_id} reopened: it accepts spawns again\n"
    assert json.loads(daemon.ctl("reopen", run_id, "--json").stdout) == {
        "run": run_id,
        "reopened": True,
    }
    assert daemon.ctl("spawn", "--run", run_id, "--", "true").returncode == 0
    unknown = daemon.ctl("reopen", "r-nope")
    assert unknown.returncode == 1
    assert "not_found" in unknown.stderr
