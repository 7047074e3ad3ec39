"""Review of the seams closed in issue 24's second round: each test an attack on one."""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import trio

from subagentd.client import AsyncClient, Client, _core
from subagentd.protocol.errors import SubagentdError

from .conftest import DaemonProcess
from .test_wakes_reload_storm import ended_run, nothing_left, reload_from_elsewhere

#: Far below the client's reconnect window (30 s), far above a break's own time.
LEAVE_WITHIN = 5.0
#: Calls a client makes after a restart for its detached ack to be answered among them.
CALLS_FOR_THE_ACK = 50


async def test_a_blocking_consumer_leaving_with_the_daemon_gone_leaves_at_once(
    daemon: DaemonProcess,
) -> None:
    """The blocking client's twin of the trio consumer's seam: a `break` out of its wake
    stream with the daemon killed acknowledges the wake in hand, and must not wait out the
    reconnect window for a daemon that refuses every connect."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> float:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    daemon.kill()
                    left = time.monotonic()
                    break
                return time.monotonic() - left

        assert await trio.to_thread.run_sync(consume) < LEAVE_WITHIN


async def test_a_blocking_consumer_leaving_across_a_reload_has_its_wake_acknowledged(
    daemon: DaemonProcess,
) -> None:
    """A reload is no daemon gone: the blocking consumer's leaving acknowledgement, made
    as its connection goes with the reload, is taken by the new image."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> float:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    trio.from_thread.run(reload_from_elsewhere, daemon)
                    left = time.monotonic()
                    break
                return time.monotonic() - left

        assert await trio.to_thread.run_sync(consume) < LEAVE_WITHIN
        assert await nothing_left(daemon, run) == []


async def test_a_blocking_consumers_leaving_ack_goes_out_at_its_next_call_after_a_restart(
    daemon: DaemonProcess,
) -> None:
    """Left to the connection with the daemon gone, the acknowledgement goes out with the
    client's next call, once a daemon serves again: the wake it had is not handed again."""
    with trio.fail_after(90):
        run, _ids = await ended_run(daemon, 1)

        def consume() -> None:
            with Client(daemon.socket) as client:
                for _wake in client.events(run=run, follow=True):
                    daemon.kill()
                    break
                daemon.start()
                # Its next calls, on a new connection: the ack goes out among them (after
                # the recall that finds its wake again), answered before the client closes.
                for _ in range(CALLS_FOR_THE_ACK):
                    client.info()
                    if not client._conn._detached:
                        break
                assert not client._conn._detached

        await trio.to_thread.run_sync(consume)
        assert await nothing_left(daemon, run) == []


async def test_an_ack_of_wakes_let_go_into_ranges_on_this_connection_is_taken(
    daemon: DaemonProcess,
) -> None:
    """A consumer with ack=False that acknowledges late, once more wakes came than the
    ledger keeps each by seq (here 4, as 10,000 would be): the older are known only by
    their parent's range, and their acknowledgement must still go out, on the very
    connection they came on, so that no subscriber gets them again."""
    with trio.fail_after(60):
        run, ids = await ended_run(daemon, 10)
        client = AsyncClient(daemon.socket)
        client._conn = _core.Connection(reconnect=True, acks_kept=4)
        async with client:
            got = [wake async for wake in client.events(run=run, ack=False)]
            assert {wake.id for wake in got} == ids
            assert client._conn._acks._let_go_seqs  # the attack's premise: some let go
            await client.ack([wake.seq for wake in got])
        assert await nothing_left(daemon, run) == []


async def test_an_ack_of_wakes_let_go_into_ranges_before_a_reload_is_taken_after_it(
    daemon: DaemonProcess,
) -> None:
    """As above, the wakes let go on a connection a reload ended, some of them acknowledged
    meanwhile by another client: each is acknowledged once, none handed again."""
    with trio.fail_after(60):
        run, _ids = await ended_run(daemon, 10)
        client = AsyncClient(daemon.socket)
        client._conn = _core.Connection(reconnect=True, acks_kept=4)
        async with client:
            got = [wake async for wake in client.events(run=run, ack=False)]
            assert client._conn._acks._let_go_seqs
            async with AsyncClient(daemon.socket) as other:
                theirs = [wake async for wake in other.events(run=run, ack=False)]
                await other.ack([theirs[0].seq, theirs[-1].seq])
            await reload_from_elsewhere(daemon)  # the client's connection goes with it
            await client.ack([wake.seq for wake in got])
        assert await nothing_left(daemon, run) == []


async def test_a_trio_consumers_detached_ack_goes_out_once_a_restarted_daemon_serves(
    daemon: DaemonProcess,
) -> None:
    """Cancelled with the daemon killed, the consumer left its ack to the connection; the
    daemon starts again (seqs there are never those of other wakes) and the client's next
    call carries the conversation on: the ack goes out, once, and the wake is not handed
    to the next subscriber."""
    with trio.fail_after(90):
        run, _ids = await ended_run(daemon, 1)
        async with AsyncClient(daemon.socket) as client:
            with trio.CancelScope() as scope:
                async with contextlib.aclosing(client.events(run=run, follow=True)) as wakes:
                    async for _wake in wakes:
                        daemon.kill()
                        scope.cancel()
                        await trio.sleep_forever()
            await trio.to_thread.run_sync(daemon.start)
            for _ in range(CALLS_FOR_THE_ACK):
                await client.info()
                if not client._conn._detached:
                    break
            assert not client._conn._detached
        assert await nothing_left(daemon, run) == []


async def test_an_unsure_wal_tail_never_gives_a_resumed_attempt_its_earlier_attempts_ending(
    daemon_dirs: DaemonProcess,
) -> None:
    """A worker failed, was resumed, and the daemon died before the new attempt's start
    was journaled; the WAL then ends inside a frame (torn: `WalTail.unsure`), so recovery
    trusts the journals' endings. The journal's last ending is the earlier attempt's: the
    new attempt is `interrupted`, not given that `failed`."""
    daemon_dirs.start()
    with trio.fail_after(90):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = (await client.spawn(["sh", "-c", "exit 3"], name="twice")).id
            assert (await client.wait(worker)).state == "failed"
        assert daemon_dirs.terminate() == 0
        daemon_dirs.start(env={"SUBAGENTD_FAULT": "die-before-start-written:twice"})
        assert daemon_dirs.proc is not None
        blocking = Client(daemon_dirs.socket)
        blocking._conn = _core.Connection(reconnect=False)  # the daemon dies next
        with blocking:
            assert blocking.resume(worker).attempt == 2
        assert await trio.to_thread.run_sync(daemon_dirs.proc.wait, 30) == -9
        wal = daemon_dirs.state_dir / "state.db-wal"
        fd = os.open(wal, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"\0" * 10)  # a frame's first bytes, as a kill -9 amid its write
        os.close(fd)
        await trio.to_thread.run_sync(daemon_dirs.start)
        async with AsyncClient(daemon_dirs.socket) as client:
            view = await client.status(worker)
            assert (view.state, view.attempt) == ("interrupted", 2)


async def test_a_store_restored_from_an_older_copy_gives_no_seq_again(
    daemon_dirs: DaemonProcess,
) -> None:
    """state.db put back from a copy taken before some wakes were given (a person's
    restore from backup, the seq mark left as the daemon wrote it): the store's floor is
    behind, the mark is not, and no later wake takes a seq given before."""
    daemon_dirs.start()
    with trio.fail_after(90):
        await ended_run(daemon_dirs, 2)
        assert daemon_dirs.terminate() == 0
        db = daemon_dirs.state_dir / "state.db"
        backup = daemon_dirs.root / "state.db.backup"
        shutil.copyfile(db, backup)
        await trio.to_thread.run_sync(daemon_dirs.start)
        run, _ids = await ended_run(daemon_dirs, 2)
        given = {wake.seq for wake in await nothing_left(daemon_dirs, run)}
        assert daemon_dirs.terminate() == 0
        shutil.copyfile(backup, db)
        await trio.to_thread.run_sync(daemon_dirs.start)
        run, _ids = await ended_run(daemon_dirs, 2)
        again = {wake.seq for wake in await nothing_left(daemon_dirs, run)}
        assert len(again) == 2
        assert min(again) > max(given), (given, again)


async def test_an_ack_of_a_seq_in_a_range_never_delivered_here_acknowledges_nothing(
    daemon: DaemonProcess,
) -> None:
    """Runs R and Q end wakes in turn, so Q's seqs fall inside the range this client keeps
    for R (it follows R alone). Its ack of a Q wake it never had, which the daemon would
    refuse, is done without effect: Q's wake stays pending for Q's subscriber."""
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as spawner:
            runs = [await spawner.new_run(), await spawner.new_run()]
            for _ in range(6):
                for run in runs:
                    await spawner.wait((await spawner.spawn(["true"], run=run)).id)
        r, q = runs
        client = AsyncClient(daemon.socket)
        client._conn = _core.Connection(reconnect=True, acks_kept=4)
        async with client:
            got = [wake async for wake in client.events(run=r, ack=False)]
            ((low, high),) = client._conn._acks._let_go_seqs.values()
            async with AsyncClient(daemon.socket) as other:
                theirs = [wake async for wake in other.events(run=q, ack=False)]
            inside = [wake.seq for wake in theirs if low < wake.seq < high]
            assert inside  # the attack's premise
            with contextlib.suppress(SubagentdError):
                await client.ack(inside)
            await client.ack([wake.seq for wake in got])
        assert await nothing_left(daemon, r) == []
        assert [wake.seq for wake in await nothing_left(daemon, q)] == [w.seq for w in theirs]


async def test_a_seq_mark_that_cannot_be_written_costs_no_wake_and_is_said_until_it_is(
    daemon: DaemonProcess,
) -> None:
    """A directory planted at the mark's name while the daemon runs (a write that fails
    as a full disk's would, at the moment a wake must be posted): the wake is posted and
    delivered all the same, `info` says the mark cannot be written, and once it can, the
    next wake writes it and the problem goes."""
    mark = daemon.state_dir / "state.db.seq-mark"
    with trio.fail_after(60):
        mark.unlink(missing_ok=True)
        mark.mkdir()
        run, ids = await ended_run(daemon, 1)
        assert {wake.id for wake in await nothing_left(daemon, run)} == ids
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
            assert any("seq mark" in problem for problem in problems), problems
            mark.rmdir()
            run, ids = await ended_run(daemon, 1)
            assert {wake.id for wake in await nothing_left(daemon, run)} == ids
            problems = (await client.info()).problems
            assert not any("seq mark" in problem for problem in problems), problems
        assert mark.is_file()
