"""Descriptors per live worker in the daemon: its two pipes (no pidfd), and no journal
while it is idle; an idle journal, closed, still takes every byte its worker writes
later, in this image and across a reload."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.client._units import render
from subagentd.daemon.store._journal import OPEN_JOURNALS
from subagentd.protocol.errors import Refused

from .conftest import DaemonProcess
from .helpers import paged_stdout, reload_on_own_connection, wait_output

#: Live `sleep` workers in these tests: more than the journals held open at once.
MANY = OPEN_JOURNALS + 44
#: What a live worker may hold in the daemon: its stdout and stderr pipes. No pidfd: its
#: exit is told by SIGCHLD, and it is reaped by its pid (daemon/processes/_reaper.py).
PER_WORKER = 2
#: The daemon's own besides (store, logs, sockets, connections, open journals), and room.
DAEMON_OWN = OPEN_JOURNALS + 120


def _descriptors(pid: int) -> list[str]:
    """What each descriptor of `pid` names (a path, pipe:[...], anon_inode:[pidfd]...)."""
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return names


async def _spawn_sleepers(client: AsyncClient, count: int) -> list[str]:
    run = await client.new_run()
    return [(await client.spawn(["sleep", "600"], run=run)).id for _ in range(count)]


async def test_a_live_worker_holds_at_most_two_descriptors_in_the_daemon(
    daemon: DaemonProcess,
) -> None:
    """With MANY live workers the daemon holds <= MANY * 2 + its own: a journal is held
    open only while it is among those used last, and no pidfd is (before: 3 a worker)."""
    assert daemon.proc is not None
    with trio.fail_after(240):
        async with AsyncClient(daemon.socket) as client:
            await _spawn_sleepers(client, MANY)
            assert (await client.info()).workers == {"running": MANY}
            held = _descriptors(daemon.proc.pid)
            journals = [name for name in held if name.endswith("/journal")]
            assert len(journals) <= OPEN_JOURNALS, len(journals)
            assert len(held) <= MANY * PER_WORKER + DAEMON_OWN, (len(held), MANY)
            pidfds = [name for name in held if name == "anon_inode:[pidfd]"]
            assert len(pidfds) < MANY // 10, len(pidfds)


async def test_an_idle_journal_closed_takes_every_byte_later_and_across_a_reload(
    daemon: DaemonProcess,
) -> None:
    """A worker that writes, goes quiet while MANY others start (its journal is closed
    for theirs), then writes again, before and after a reload: every byte is in its
    journal, in order, and read back whole."""
    assert daemon.proc is not None
    script = 'while read line; do echo "got $line"; done'
    with trio.fail_after(300):
        async with AsyncClient(daemon.socket) as client:
            talker = await client.spawn(["sh", "-c", script], stdin_open=True)
            await client.send(talker.id, "one\n")
            await wait_output(client, talker.id, b"got one\n")
            await _spawn_sleepers(client, MANY)
            journal = str(Path(talker.archive) / "journal")
            assert journal not in _descriptors(daemon.proc.pid)  # closed while it was idle
            await client.send(talker.id, "two\n")
            await wait_output(client, talker.id, b"got two\n")
        await reload_on_own_connection(daemon)
        async with AsyncClient(daemon.socket) as client:
            await _spawn_sleepers(client, MANY)  # its journal closed in the new image too
            await client.send(talker.id, "three\n", eof=True)
            await client.wait(talker.id)
            assert await paged_stdout(client, talker.id) == b"got one\ngot two\ngot three\n"
            assert (await client.status(talker.id)).state == "finished"


def test_the_user_unit_holds_10000_live_workers_descriptors(tmp_path: Path) -> None:
    """The unit `install-units` writes sets LimitNOFILE= to more than 10,000 live
    workers need at 3 each (today: none, so systemd's default soft 1024 / hard 524288)."""
    service = render(tmp_path)["subagentd.service"]
    limits = [line for line in service.splitlines() if line.startswith("LimitNOFILE=")]
    assert limits == ["LimitNOFILE=524288"]
    assert 10_000 * PER_WORKER + DAEMON_OWN < 524288


async def test_the_daemon_raises_its_soft_descriptor_limit_to_its_hard_one(
    daemon_dirs: DaemonProcess,
) -> None:
    """Started from a shell's soft 1024, the daemon runs with its soft limit at its hard
    one (and the hard one raised where it may: with CAP_SYS_RESOURCE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        daemon_dirs.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert daemon_dirs.proc is not None
    its_soft, its_hard = resource.prlimit(daemon_dirs.proc.pid, resource.RLIMIT_NOFILE)
    assert its_soft == its_hard >= hard


async def test_a_journal_replaced_while_closed_is_refused_and_its_worker_ends_failed(
    daemon: DaemonProcess,
) -> None:
    """A worker that renames a file of its own over its idle (closed) journal: the daemon
    never writes into that file nor reads it as the journal; the worker ends `failed`,
    and the others run on."""
    assert daemon.proc is not None
    with trio.fail_after(300):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            talker = await client.spawn(
                ["sh", "-c", 'read line; echo "got $line"'], stdin_open=True, run=run
            )
            await _spawn_sleepers(client, MANY)
            journal = Path(talker.archive) / "journal"
            assert str(journal) not in _descriptors(daemon.proc.pid)
            planted = journal.with_name("planted")
            planted.write_bytes(b"a worker's own bytes")
            planted.rename(journal)
            await client.send(talker.id, "one\n", eof=True)
            ended = await client.wait(talker.id)
            assert ended.state == "failed"
            # Its ending recorded, and its run woken once (review4: the ending's own
            # `state` entry, refused too, lost both).
            assert [wake.id async for wake in client.events(run=run)] == [talker.id]
            assert journal.read_bytes() == b"a worker's own bytes"
            assert (await client.info()).workers.get("running") == MANY


async def test_a_journal_replaced_while_closed_then_a_reload_is_never_read_as_the_journal(
    daemon: DaemonProcess,
) -> None:
    """As above, but a reload comes before the worker writes again: a journal of another
    worker (whole entries, right checksums: anything a worker can write) renamed over
    the idle one's is not read by the next image as its journal either: it is refused,
    as it would have been without the reload."""
    assert daemon.proc is not None
    with trio.fail_after(300):
        async with AsyncClient(daemon.socket) as client:
            forger = await client.spawn(["echo", "forged"])
            await client.wait(forger.id)
            talker = await client.spawn(
                ["sh", "-c", 'read line; echo "got $line"'], stdin_open=True
            )
            await _spawn_sleepers(client, MANY)
            journal = Path(talker.archive) / "journal"
            assert str(journal) not in _descriptors(daemon.proc.pid)
            planted = journal.with_name("planted")
            planted.write_bytes((Path(forger.archive) / "journal").read_bytes())
            planted.rename(journal)
        await reload_on_own_connection(daemon)
        async with AsyncClient(daemon.socket) as client:
            await client.send(talker.id, "one\n", eof=True)
            # Refused as it is without a reload (the test above): its journal was parked
            # across the exec as the file it was, so the planted one is never taken.
            assert (await client.wait(talker.id)).state == "failed"
            with pytest.raises(Refused, match="another file was put at its name"):
                await paged_stdout(client, talker.id)


async def test_a_journal_replaced_while_closed_then_a_quiet_ending_wakes_its_parent_once(
    daemon: DaemonProcess,
) -> None:
    """A worker that writes nothing more after its idle journal is renamed over: its ending
    (the daemon's own `state` entry refused) still ends it, wakes its run once, and
    leaves the planted file untouched; the daemon serves on."""
    assert daemon.proc is not None
    with trio.fail_after(300):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            talker = await client.spawn(["sh", "-c", "read line"], stdin_open=True, run=run)
            await _spawn_sleepers(client, MANY)
            journal = Path(talker.archive) / "journal"
            assert str(journal) not in _descriptors(daemon.proc.pid)
            planted = journal.with_name("planted")
            planted.write_bytes(b"a worker's own bytes")
            planted.rename(journal)
            await client.send(talker.id, "one\n", eof=True)
            ended = await client.wait(talker.id)
            assert ended.state in ("finished", "failed")
            wakes = [wake async for wake in client.events(run=run)]
            assert [wake.id for wake in wakes] == [talker.id]
            assert journal.read_bytes() == b"a worker's own bytes"
            assert (await client.info()).workers.get("running") == MANY
