"""A reload's check of the image on disk: into the very image running it runs no
`--check` child (the same code would prove nothing new) but still refuses a broken
config; after a file of the image changed on disk, it runs the child."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .helpers import RawConnection, sh, wait_output
from .helpers import reload_on_own_connection as reload


def checks(daemon: DaemonProcess) -> list[str]:
    """How each reload so far checked the image on disk (its `reload.checked` event)."""
    events = []
    for line in daemon.log().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "reload.checked":
            events.append(event.get("check", "(not said)"))
    return events


def module_file(name: str) -> Path:
    """The file `name` is imported from, as installed (in a strict editable install, a
    link to the source)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin)


@pytest.fixture
def touched(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A module file of the package, its mtime put back after the test (its bytecode
    stays valid; its ctime says it was touched, which no call can undo)."""
    path = module_file(request.param)
    before = path.stat()
    try:
        yield path
    finally:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


async def test_a_reload_into_the_same_image_runs_no_check_child(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo up; while :; do sleep 0.1; done"))
            await wait_output(client, worker.id, b"up")
        for generation in (2, 3):
            reply = await reload(daemon)
            assert isinstance(reply, p.ReloadReply), reply
            assert (reply.image_generation, reply.carried_live) == (generation, 1)
        assert checks(daemon) == ["image unchanged: config and state dir checked in place"] * 2
        async with AsyncClient(daemon.socket) as client:
            await client.stop(worker.id)


@pytest.mark.parametrize(
    "touched",
    [
        "subagentd.daemon.lifecycle._reload",  # imported by the image running
        "subagentd.daemon.__main__",  # not imported by it (started as `subagentd`)
    ],
    indirect=True,
)
async def test_a_reload_after_a_file_of_the_image_changed_runs_the_check_child(
    daemon: DaemonProcess, touched: Path
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo up; while :; do sleep 0.1; done"))
            await wait_output(client, worker.id, b"up")
        os.utime(touched)  # as an edit or a reinstall in place leaves it
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply), reply
        assert reply.carried_live == 1
        [how] = checks(daemon)
        assert how.startswith("--check in a child: "), how
        assert str(touched) in how
        async with AsyncClient(daemon.socket) as client:
            await client.stop(worker.id)


async def test_a_broken_config_refuses_a_reload_into_the_same_image(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        daemon.config.write_text('[agents.reviewer]\ncommand = ["x"]\ntimeout = "soon"\n')
        reply = await reload(daemon)
        assert isinstance(reply, p.Error), reply
        assert reply.code == "refused"
        assert reply.message.startswith("the new image refuses this reload: ")
        assert "agents.reviewer.timeout" in reply.message
        daemon.config.write_text('[agents.reviewer]\ncommand = ["x"]\n')  # mended
        reply = await reload(daemon)
        assert isinstance(reply, p.ReloadReply), reply
        assert checks(daemon) == ["image unchanged: config and state dir checked in place"]


@pytest.mark.parametrize("touched", ["subagentd.daemon.lifecycle._reload"], indirect=True)
async def test_a_spawn_while_the_check_child_runs_is_answered_not_told_reloading(
    daemon_dirs: DaemonProcess, touched: Path
) -> None:
    """The check runs before the fence: the old image serves on meanwhile, spawns
    included (they were refused `reloading` for the child's few hundred ms)."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "check:hold"})
    hold = daemon_dirs.state_dir / "hold-check"
    os.mkfifo(hold)
    os.utime(touched)  # the image on disk changed: the reload runs its --check child
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            replies: list[p.Reply] = []

            async def reload_and_keep() -> None:
                replies.append(await reload(daemon_dirs))

            nursery.start_soon(reload_and_keep)
            # Opened once the child holds its read end; it reads until this end closes.
            holding = await trio.to_thread.run_sync(os.open, hold, os.O_WRONLY)
            try:
                conn = await RawConnection.open(daemon_dirs.socket)
                async with conn.stream:
                    await conn.send(p.Spawn(id=2, argv=sh("echo up; sleep 600")))
                    spawned = await conn.receive()
                assert isinstance(spawned, p.WorkerReply), spawned
            finally:
                os.close(holding)
        [reply] = replies
        assert isinstance(reply, p.ReloadReply), reply
        assert reply.carried_live == 1
        [how] = checks(daemon_dirs)
        assert how.startswith("--check in a child: "), how
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.stop(spawned.worker.id)
