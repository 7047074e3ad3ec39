"""Both clients across a reload, and subagentctl's reload and resume: a caller following a
journal or a wake stream, or waiting on a worker, sees no error and no gap."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from pathlib import Path

import trio
import trio.testing

from subagentd.client import AsyncClient, Client, Wake

from .conftest import BIN, DaemonProcess
from .helpers import sh

LINES = 150
# Numbered lines, slowly enough that a reload lands in the middle of them.
COUNT = f"i=0; while [ $i -lt {LINES} ]; do i=$((i+1)); echo line $i; sleep 0.01; done"
EVERY_LINE = b"".join(b"line %d\n" % i for i in range(1, LINES + 1))


async def reload_from_elsewhere(daemon: DaemonProcess) -> None:
    """Reload on a connection of its own: every other connection is told `reloading`."""
    async with AsyncClient(daemon.socket) as other:
        reply = await other.reload()
    assert reply.image_generation >= 2


async def test_a_followed_watch_sees_every_line_once_across_a_reload(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(COUNT))
            seen = b""
            reloaded = False
            async with contextlib.aclosing(client.watch(worker.id, follow=True)) as entries:
                async for entry in entries:
                    if entry.kind == "stdout":
                        seen += entry.data
                    if not reloaded and b"line 20\n" in seen:
                        await reload_from_elsewhere(daemon)
                        reloaded = True
            assert reloaded
            assert seen == EVERY_LINE
            assert (await client.info()).image_generation == 2  # the same client, reconnected


def test_a_blocking_followed_watch_sees_every_line_once_across_a_reload(
    daemon: DaemonProcess,
) -> None:
    halfway = threading.Event()
    reloaded: list[int] = []

    def reload_when_halfway() -> None:
        if halfway.wait(timeout=30):
            with Client(daemon.socket, timeout=30) as other:
                reloaded.append(other.reload().image_generation)

    reloader = threading.Thread(target=reload_when_halfway)
    reloader.start()
    try:
        with Client(daemon.socket, timeout=30) as client:
            worker = client.spawn(sh(COUNT))
            seen = b""
            for entry in client.watch(worker.id, follow=True):
                if entry.kind == "stdout":
                    seen += entry.data
                if b"line 20\n" in seen:
                    halfway.set()
            assert seen == EVERY_LINE
            assert client.status(worker.id).state == "finished"
    finally:
        halfway.set()
        reloader.join(timeout=30)
    assert reloaded == [2]


async def test_a_followed_wake_stream_gets_every_wake_once_across_a_reload(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client, AsyncClient(daemon.socket) as spawner:
            run = await client.new_run()
            before = [await spawner.spawn(["true"], run=run) for _ in range(3)]
            # Ending around the reload: before it, during it, after it.
            around = [await spawner.spawn(sh(f"sleep 0.{i}"), run=run) for i in range(1, 8)]
            wakes: list[Wake] = []
            async with contextlib.aclosing(client.events(run=run, follow=True)) as stream:
                async for wake in stream:
                    wakes.append(wake)
                    if len(wakes) == 3:
                        await reload_from_elsewhere(daemon)
                        after = [await spawner.spawn(["true"], run=run) for _ in range(3)]
                    if len(wakes) == 13:
                        break
            expected = {w.id for w in before + around + after}
            assert sorted(w.id for w in wakes) == sorted(expected)
        # Every wake handed over was acknowledged: nothing is left for the next subscriber.
        async with AsyncClient(daemon.socket) as client:
            assert [w async for w in client.events(run=run)] == []


async def test_a_wait_in_flight_across_a_reload_returns_the_worker(
    daemon: DaemonProcess,
) -> None:
    gate = daemon.root / "gate"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client, trio.open_nursery() as nursery:
            worker = await client.spawn(sh(f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 3"))
            ended = []

            async def wait() -> None:
                ended.append(await client.wait(worker.id))

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()  # the wait is out, its answer awaited
            await reload_from_elsewhere(daemon)
            gate.touch()
        [view] = ended
        assert (view.id, view.state, view.exit_code) == (worker.id, "failed", 3)


def test_subagentctl_reload_prints_what_it_carried(daemon: DaemonProcess) -> None:
    spawned = daemon.ctl("--json", "spawn", "--", "sleep", "60")
    assert spawned.returncode == 0, spawned.stderr
    reloaded = daemon.ctl("--json", "reload")
    assert reloaded.returncode == 0, reloaded.stderr
    assert json.loads(reloaded.stdout) == {
        "image_generation": 2,
        "carried_live": 1,
        "stopped_by_reload": [],
    }
    assert json.loads(daemon.ctl("--json", "info").stdout)["image_generation"] == 2
    again = daemon.ctl("reload")
    while again.returncode == 1 and "busy" in again.stderr:  # a second within the last
        again = daemon.ctl("reload")
    assert again.returncode == 0, again.stderr
    assert again.stdout == "image generation 3: carried 1 live, stopped by reload: none\n"


# A worker that says which attempt it is, then waits to be stopped.
ATTEMPT = 'echo "attempt ${SUBAGENTD_RESUME:-1}"; while :; do sleep 0.1; done'


def follow_until(daemon: DaemonProcess, worker_id: str, marker: bytes) -> bytes:
    seen = b""
    with Client(daemon.socket, timeout=30) as client:
        for entry in client.watch(worker_id, follow=True):
            if entry.kind == "stdout":
                seen += entry.data
                if marker in seen:
                    return seen
    raise AssertionError(f"{worker_id} ended before printing {marker!r}: {seen!r}")


def test_subagentctl_resume_runs_the_next_attempt_and_refuses_a_new_input(
    daemon: DaemonProcess,
) -> None:
    worker = json.loads(daemon.ctl("--json", "spawn", "--", *sh(ATTEMPT)).stdout)
    follow_until(daemon, worker["id"], b"attempt 1\n")
    assert daemon.ctl("stop", worker["id"]).returncode == 0
    resumed = daemon.ctl("--json", "resume", worker["id"], "--timeout", "60")
    assert resumed.returncode == 0, resumed.stderr
    view = json.loads(resumed.stdout)
    assert (view["id"], view["attempt"], view["state"]) == (worker["id"], 2, "running")
    assert follow_until(daemon, worker["id"], b"attempt 2\n") == b"attempt 1\nattempt 2\n"

    running = daemon.ctl("resume", worker["id"])  # still running: nothing to carry on
    assert running.returncode == 1
    assert "refused" in running.stderr
    assert daemon.ctl("stop", worker["id"]).returncode == 0
    for given in (["--input", "another task"], ["--model", "large"], ["--", "true"]):
        frozen = daemon.ctl("--json", "resume", worker["id"], *given)
        assert frozen.returncode == 1, given
        assert json.loads(frozen.stdout)["error"]["code"] == "frozen", given
    assert json.loads(daemon.ctl("--json", "status", worker["id"]).stdout)["attempt"] == 2


def ctl_in(daemon: DaemonProcess, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """subagentctl run from `cwd`, as a person standing there would."""
    return subprocess.run(
        [str(BIN / "subagentctl"), *args],
        env=daemon.env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_subagentctl_resume_latest_picks_the_newest_resumable_run_here(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    nothing = ctl_in(daemon, here, "resume", "--latest")
    assert (nothing.returncode, nothing.stdout) == (1, "")
    assert f"no run with a snapshot to resume from was started in {here}" in nothing.stderr

    older = json.loads(ctl_in(daemon, here, "--json", "spawn", "--", "sleep", "60").stdout)
    ctl_in(daemon, here, "stop", older["id"])
    newer = json.loads(ctl_in(daemon, here, "--json", "spawn", "--", "true").stdout)
    ctl_in(daemon, here, "wait", newer["id"])  # ends well: not resumable
    other = json.loads(ctl_in(daemon, elsewhere, "--json", "spawn", "--", "sleep", "60").stdout)
    ctl_in(daemon, elsewhere, "stop", other["id"])

    resumed = ctl_in(daemon, here, "resume", "--latest")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == f"{older['id']} (run {older['run']})\n"
    assert json.loads(daemon.ctl("--json", "status", older["id"]).stdout)["attempt"] == 2
    assert json.loads(daemon.ctl("--json", "status", other["id"]).stdout)["state"] == "stopped"

    # The older run is live again; the newest ended well: nothing here would resume.
    none_left = ctl_in(daemon, here, "resume", "--latest")
    assert (none_left.returncode, none_left.stdout) == (1, "")
    assert newer["run"] in none_left.stderr
    assert "ended well" in none_left.stderr
    daemon.ctl("stop", older["id"])
