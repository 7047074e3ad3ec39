"""Workers end to end: spawn, output, input, results, stop, over the real socket.

Stop's grace and the timeout are waited out in-process on the mock clock
(tests/inprocess.py); the rest talks to a subagentd process.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol.errors import Busy, NotFound, Refused

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, sh, wait_output
from .inprocess import at, held, in_process


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_spawn_runs_the_command_and_collect_returns_its_stdout(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("echo hello; echo oops >&2; exit 0"), name="greeter")
        assert worker.state == "running"
        assert worker.name == "greeter"
        assert worker.id.startswith("w-")
        assert worker.run.startswith("r-")
        result = await client.collect(worker.id, wait=True)
        assert (result.state, result.exit_code, result.result) == ("finished", 0, "hello\n")
        ended = await client.status(worker.id)
        assert ended.ended_at is not None
        assert ended.ended_at >= ended.started_at


async def test_a_written_result_file_wins_over_stdout(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh('echo noise; printf "the answer" > "$SUBAGENTD_RESULT"'))
        result = await client.collect(worker.id, wait=True)
        assert result.result == "the answer"


async def test_input_arrives_on_stdin_then_end_of_file(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(["wc", "-c"], input="x" * 200_000)
        result = await client.collect(worker.id, wait=True)
        assert result.result.strip() == "200000"
        no_input = await client.spawn(["cat"])  # /dev/null: ends at once
        assert (await client.collect(no_input.id, wait=True)).state == "finished"


async def test_worker_knows_itself_and_never_sees_the_service_managers_variables(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(["env"], env={"MY_SETTING": "on"}, cwd="/tmp")
        env = dict(
            line.split("=", 1)
            for line in (await client.collect(worker.id, wait=True)).result.splitlines()
            if "=" in line
        )
        assert env["MY_SETTING"] == "on"
        assert env["SUBAGENTD_WORKER_ID"] == worker.id
        assert env["SUBAGENTD_RUN_ID"] == worker.run
        assert env["SUBAGENTD_SOCKET"] == str(daemon.socket)
        assert env["SUBAGENTD_ARCHIVE"] == worker.archive
        assert env["SUBAGENTD_RESULT"] == str(Path(worker.archive) / "result")
        assert len(env["SUBAGENTD_TOKEN"]) >= 32
        assert env["PWD"] == "/tmp"
        # The fixture gives the daemon NOTIFY_SOCKET: it must stop at the daemon.
        assert not [
            k for k in env if k in ("NOTIFY_SOCKET",) or k.startswith(("LISTEN_", "WATCHDOG_"))
        ]


async def test_watch_pages_from_a_cursor(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("for i in $(seq 1 300); do echo line $i; done"))
        await client.wait(worker.id)
        page = await client.watch_page(worker.id, since=0, limit=2)
        assert [e.seq for e in page.entries] == [1, 2]
        assert page.entries[0].kind == "state"
        assert page.next == 2
        assert not page.complete
        text = b""
        cursor, complete = 0, False
        while not complete:
            page = await client.watch_page(worker.id, since=cursor, limit=3)
            text += b"".join(e.data for e in page.entries if e.kind == "stdout")
            cursor, complete = page.next, page.complete
        assert text.decode().split("\n")[:-1] == [f"line {i}" for i in range(1, 301)]
        beyond = await client.watch_page(worker.id, since=10_000)
        assert beyond.entries == []
        assert beyond.next == 10_000


async def test_follow_streams_output_until_the_worker_ends(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(sh("echo first; read _; echo second"), input="go\n")
        kinds, text = [], b""
        async for entry in client.watch(worker.id, follow=True):
            kinds.append(entry.kind)
            if entry.kind == "stdout":
                text += entry.data
        assert text == b"first\nsecond\n"
        assert kinds[0] == "state"
        assert kinds[-1] == "state"
        last = (await client.watch_page(worker.id, since=0, limit=1000)).entries[-1]
        assert last.data.startswith(b"finished")


async def test_a_nonzero_exit_is_failed_and_a_signal_is_negative(client: AsyncClient) -> None:
    with trio.fail_after(20):
        failed = await client.spawn(sh("exit 3"))
        assert (await client.wait(failed.id)).state == "failed"
        assert (await client.status(failed.id)).exit_code == 3
        killed = await client.spawn(sh("kill -KILL $$"))
        view = await client.wait(killed.id)
        assert (view.state, view.exit_code) == ("failed", -9)


#: On the mock clock these pass at once; long enough that no real wait could outlast them.
GRACE = 30.0
TIMEOUT = 600.0
#: A TERM-ignoring worker that says at once (its traps run as `wait` is cut short) that it
#: got TERM, and that it is alive when sent USR1.
STUBBORN = (
    "trap 'echo got TERM' TERM; trap 'echo alive' USR1; echo ready; "
    "while :; do sleep 100000 & wait $!; done"
)


async def test_stop_is_term_then_kill_after_the_grace_period(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):  # real waits (starting, a polite exit): no grace may end
            polite = await client.spawn(["sleep", "100000"])
            stubborn = await client.spawn(sh(STUBBORN), grace=GRACE)
            await wait_output(client, stubborn.id, b"ready")
            assert await client.stop(polite.id)
            view = await client.status(polite.id)
            assert (view.state, view.exit_code) == ("stopped", -signal.SIGTERM)
        async with d.client() as stopper, trio.open_nursery() as nursery:
            with held(autojump_clock):
                asked = trio.current_time()
                nursery.start_soon(stopper.stop, stubborn.id)
                await wait_output(client, stubborn.id, b"got TERM")  # TERM first
                await d.settle()
            async with at(autojump_clock, asked + GRACE - 0.01):  # not a moment early
                await d.settle()  # a KILL due by now is sent
                assert stubborn.pid is not None
                os.kill(stubborn.pid, signal.SIGUSR1)
                await wait_output(client, stubborn.id, b"alive")
            async with at(autojump_clock, asked + GRACE):  # the grace runs out: KILL
                await client.wait(stubborn.id)
        view = await client.status(stubborn.id)
        assert (view.state, view.exit_code) == ("stopped", -signal.SIGKILL)
        assert d.ended(stubborn.id) - asked == pytest.approx(GRACE, abs=1e-3)
        assert view.pid is not None
        assert not alive(view.pid)
        assert not await client.stop("w-never-seen")


async def test_timeout_ends_a_worker_timed_out(autojump_clock: MockClock, short_tmp: Path) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):  # its real start must not run its clock
            worker = await client.spawn(["sleep", "100000"], timeout=TIMEOUT)
        started = d.wall.trio_time(d.record(worker.id).started_at)
        async with at(autojump_clock, started + TIMEOUT - 0.01):  # not a moment early
            assert d.record(worker.id).stop_reason is None  # asked at the deadline
        async with at(autojump_clock, started + TIMEOUT):  # TERM, and a prompt exit
            assert (await client.wait(worker.id)).state == "timed_out"
        assert d.ended(worker.id) - started == pytest.approx(TIMEOUT, abs=1e-3)


async def test_collecting_a_running_worker_without_wait_is_busy(client: AsyncClient) -> None:
    with trio.fail_after(20):
        worker = await client.spawn(["sleep", "60"])
        with pytest.raises(Busy, match="collect it with wait"):
            await client.collect(worker.id)
        with pytest.raises(NotFound):
            await client.collect("w-nope")
        await client.stop(worker.id)


async def test_ls_and_info_count_workers_by_state(client: AsyncClient) -> None:
    with trio.fail_after(20):
        running = await client.spawn(["sleep", "60"])
        done = await client.spawn(["true"])
        await client.wait(done.id)
        assert [w.id for w in await client.ls()] == [running.id]
        assert {w.id for w in await client.ls(all=True)} == {running.id, done.id}
        assert [w.id for w in await client.ls(all=True, run=done.run)] == [done.id]
        info = await client.info()
        assert info.workers == {"running": 1, "finished": 1}
        assert info.holds_park
        assert info.pid != os.getpid()
        assert info.image_generation == 1
        await client.stop(running.id)


async def test_sigterm_stops_every_worker_and_exits_zero(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh("trap 'echo bye; exit 0' TERM; echo up; while :; do sleep 0.1; done")
            )
            await wait_output(client, worker.id, b"up")
        assert worker.pid is not None
        code = await trio.to_thread.run_sync(daemon.terminate)
        assert code == 0, daemon.log()
        assert not alive(worker.pid)
        assert not daemon.socket.exists()
        await trio.to_thread.run_sync(daemon.start)  # the ending outlives the daemon
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"


async def test_restart_after_kill_takes_over_the_stale_lock_and_socket(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        daemon.kill()
        assert daemon.socket.exists()  # left behind by the dead daemon
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.info()).pid == daemon.proc.pid  # type: ignore[union-attr]


async def test_a_spawn_the_os_rejects_ends_failed_and_leaves_nothing_starting(
    client: AsyncClient, daemon: DaemonProcess, tmp_path: Path
) -> None:
    # Executable, but no program: exec fails (ENOEXEC) after every check at the door passed.
    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x7fELF, or so it says")
    program.chmod(0o755)
    with trio.fail_after(30):
        worker = await client.spawn([str(program)])
        assert worker.state == "failed"
        page = await client.watch_page(worker.id)
        assert any(b"Exec format error" in e.data for e in page.entries if e.kind == "note")
        assert "starting" not in (await client.info()).workers
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Reload(id=2))
        assert isinstance(await conn.receive(), p.ReloadReply)  # nothing stuck blocks it


async def test_a_worker_starts_in_its_cwd_and_group_with_only_its_three_fds(
    client: AsyncClient, tmp_path: Path
) -> None:
    """The daemon spawns through glibc's posix_spawn where it can (see processes/_spawn):
    the worker gets what Popen gave it, and nothing of the daemon's own."""
    script = (
        'pwd; [ "$(cut -d" " -f5 /proc/$$/stat)" = $$ ] && echo own-group; cd /proc/$$/fd && echo *'
    )
    with trio.fail_after(30):
        worker = await client.spawn(["sh", "-c", script], cwd=str(tmp_path))
        result = await client.collect(worker.id, wait=True)
        # Its signals as the exec left them: read by the worker itself (a shell blocks
        # all of them around each fork, so it cannot be asked).
        signals = await client.spawn(["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"])
        masks = await client.collect(signals.id, wait=True)
    assert result.state == "finished", result
    cwd, group, fds = result.result.splitlines()
    assert cwd == str(tmp_path)
    assert group == "own-group"
    assert fds.split() == ["0", "1", "2", "3"]  # 3: the directory the shell globs
    blocked, ignored = masks.result.splitlines()
    assert int(blocked.split()[1], 16) == 0
    assert not int(ignored.split()[1], 16) & (1 << (signal.SIGPIPE - 1))  # as Popen left it


async def test_while_stopping_the_daemon_starts_nothing_new(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    assert daemon.proc is not None
    gate = tmp_path / "gate"
    # Slow to stop until the test opens the gate: no grace is waited out on a real clock.
    slow_to_stop = f"trap 'while [ ! -e {gate} ]; do sleep 0.02; done; exit 0' TERM; echo up; "
    slow_to_stop += "while :; do sleep 60 & wait $!; done"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            slow = await client.spawn(sh(slow_to_stop), grace=60)
            await wait_output(client, slow.id, b"up")
            daemon.proc.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(daemon.wait_notify, "STOPPING=1")
            with pytest.raises(Refused, match="shutting down"):
                await client.spawn(["sleep", "60"])
        gate.touch()
        try:
            assert await trio.to_thread.run_sync(daemon.proc.wait, 20) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the daemon did not stop; its log:\n{daemon.log()}") from None
        assert slow.pid is not None
        assert not alive(slow.pid)


async def test_the_result_is_the_end_of_stdout_however_much_stderr_came_after(
    daemon: DaemonProcess,
) -> None:
    # The journal's newest entries are stderr only: the stdout before them is
    # still the result, from memory, and from the archive after a restart.
    script = "echo 'RESULT: all good'; head -c 614400 /dev/zero >&2"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(script))
            assert (await client.wait(worker.id)).state == "finished"
            assert (await client.status(worker.id)).state == "finished"
    daemon.terminate()
    daemon.start()
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            result = await client.collect(worker.id)
            assert result.result == "RESULT: all good\n"


async def test_a_resumed_worker_collects_its_last_attempts_output(client: AsyncClient) -> None:
    script = 'if [ -n "$SUBAGENTD_RESUME" ]; then echo second; else echo first; exit 3; fi'
    with trio.fail_after(30):
        worker = await client.spawn(sh(script))
        assert (await client.wait(worker.id)).state == "failed"
        await client.resume(worker.id)
        result = await client.collect(worker.id, wait=True)
        assert result.result.splitlines()[-1] == "second"


async def test_a_stop_asked_as_an_exited_workers_supervision_closes_is_taken(
    autojump_clock: MockClock, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop asked (a `stop_run` racing the ending, as CI once saw) just as an exited
    worker's supervision takes its last pump back is taken, never "Nursery is closed".

    Each pump is made to linger, shielded, after its end of file until a time the test
    sets; the test wakes at that same time, so it runs in the scheduling batch in which
    the pumps end, after them half the time (trio reverses half its batches): in the
    gap before the supervision's task resumes. Twelve workers: missed 1 time in 4,096."""
    from subagentd.daemon.processes import _process
    from subagentd.daemon.processes._process import pump as real_pump

    lingering: list[trio.CancelScope] = []

    async def lingering_pump(fd: int, deliver: Callable[[bytes], Awaitable[None]]) -> None:
        try:
            await real_pump(fd, deliver)
        finally:
            with trio.CancelScope(shield=True) as scope:
                lingering.append(scope)
                await trio.sleep_forever()

    monkeypatch.setattr(_process, "pump", lingering_pump)  # each pipe's source
    async with in_process(short_tmp) as d, d.client() as client:
        for _ in range(12):
            with held(autojump_clock):  # the real exit, and its tree ended, come first
                worker = await client.spawn(["true"])
                live = d.daemon.supervisor.get(worker.id)
                assert live is not None
                await live.terminated.wait()
            await trio.sleep(10)  # past the pipes' drain (1 s): only the pumps are left
            released = trio.current_time() + 1
            for scope in lingering:
                scope.deadline = released
            lingering.clear()
            await trio.sleep_until(released)
            d.daemon.stops.stop(worker.id)  # what a stop request does, in this very batch
            ended = await client.wait(worker.id)
            assert ended.exit_code == 0, ended
