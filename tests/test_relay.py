"""The output relay (daemon/processes/_relay.py, _relay_program.py): past the descriptor
threshold (`--relay-above`, 0 here: every worker) a worker's stdout and stderr pipes are
held by a relay process, and the daemon holds no descriptor for it; what is above the
launcher port sees a relayed worker exactly as a piped one. Real daemons, real relays."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.processes._relay_program import NOFILE_ENV, RESERVE
from subagentd.daemon.store._journal import OPEN_JOURNALS
from subagentd.protocol import Error, ReloadReply

from .conftest import BIN, DaemonProcess
from .helpers import (
    alive,
    paged_stdout,
    pending_wakes,
    reload_on_own_connection,
    sh,
    wait_output,
)
from .test_reload_handed import touched as touched

RELAY_ALL = ("--relay-above", "0")


def _relays(daemon_pid: int) -> list[int]:
    """The pids of the daemon's relay processes (its children running _relay_program)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == daemon_pid and any(a.endswith(b"_relay_program.py") for a in argv):
            found.append(int(entry))
    return sorted(found)


def _pipes(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:")
    return count


@pytest.fixture
def relayed(daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A daemon that relays every worker's output."""
    daemon_dirs.start(*RELAY_ALL)
    return daemon_dirs


async def _stderr(client: AsyncClient, worker_id: str) -> bytes:
    page = await client.watch_page(worker_id, since=0, limit=100_000)
    return b"".join(e.data for e in page.entries if e.kind == "stderr")


async def test_a_relayed_workers_output_is_attributed_and_ordered_per_stream(
    relayed: DaemonProcess,
) -> None:
    """Two relayed workers writing stdout and stderr interleaved: each stream's lines in
    order, in its own worker's journal, and each ends as a piped worker does."""
    assert relayed.proc is not None
    script = 'for i in $(seq 1 300); do echo "$W out $i"; echo "$W err $i" >&2; done'
    with trio.fail_after(60):
        async with AsyncClient(relayed.socket) as client:
            a = await client.spawn(["sh", "-c", f"W=a; {script}"])
            b = await client.spawn(["sh", "-c", f"W=b; {script}; exit 3"])
            assert _relays(relayed.proc.pid), "no relay was started"
            assert (await client.wait(a.id)).state == "finished"
            assert (await client.wait(b.id)).state == "failed"
            for worker, w in ((a, "a"), (b, "b")):
                out = await paged_stdout(client, worker.id)
                err = await _stderr(client, worker.id)
                assert out == "".join(f"{w} out {i}\n" for i in range(1, 301)).encode()
                assert err == "".join(f"{w} err {i}\n" for i in range(1, 301)).encode()
            result = await client.collect(b.id)
            assert result.exit_code == 3


async def test_follow_and_wait_for_see_a_relayed_worker_as_a_piped_one(
    relayed: DaemonProcess,
) -> None:
    """`watch --follow` gets a relayed worker's lines as they come, `wait --for` matches
    its line, and the CLI's grep finds it."""
    with trio.fail_after(60):
        async with AsyncClient(relayed.socket) as client:
            worker = await client.spawn(
                sh('echo "listening on 4242"; read x; echo "got $x"'), stdin_open=True
            )
            seen = await wait_output(client, worker.id, b"listening on 4242\n")
            assert seen == b"listening on 4242\n"
            matched = await client.wait_for(worker.id, r"listening on \d+", timeout=20)
            assert matched.outcome == "matched"
            await client.send(worker.id, "hello\n", eof=True)
            assert await wait_output(client, worker.id, b"got hello\n")
            assert (await client.wait(worker.id)).state == "finished"
    said = relayed.ctl("info")
    assert said.returncode == 0, said.stderr
    assert "relays" in said.stdout  # no worker live: its relay holds nothing now
    grep = relayed.ctl("grep", worker.id, "got")
    assert grep.returncode == 0, grep.stderr
    assert "got hello" in grep.stdout


async def test_the_daemons_descriptors_do_not_grow_with_relayed_workers(
    relayed: DaemonProcess,
) -> None:
    """300 live relayed `sleep` workers: the daemon holds no pipe of theirs and nothing
    else a worker but the journals it keeps open (256 at most); the relay, two each."""
    assert relayed.proc is not None
    many = OPEN_JOURNALS + 44
    with trio.fail_after(180):
        async with AsyncClient(relayed.socket) as client:
            run = await client.new_run()
            first = await client.spawn(sh("echo up; exec sleep 600"), run=run)
            await wait_output(client, first.id, b"up\n")
            _, others_before = _held(relayed.proc.pid)
            pipes_before = _pipes(relayed.proc.pid)
            for _ in range(many):
                await client.spawn(["sleep", "600"], run=run)
            assert (await client.info()).workers == {"running": many + 1}
            (relay,) = _relays(relayed.proc.pid)
            said = (await client.info()).relays
            assert said is not None
            assert (said.relay_above, said.pids, said.streams) == (0, [relay], 2 * (many + 1))
            assert said.capacity > 2 * (many + 1)
            journals, others = _held(relayed.proc.pid)
            assert _pipes(relayed.proc.pid) == pipes_before
            assert journals <= OPEN_JOURNALS
            assert others - others_before <= 10, (others, others_before)
            assert _pipes(relay) >= 2 * (many + 1)
            await client.stop_run(run)
            assert (await client.info()).workers.get("running", 0) == 0
    assert _pipes(relay) <= 2


def _held(pid: int) -> tuple[int, int]:
    """(journals, every other descriptor) `pid` holds."""
    journals = others = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith("/journal"):
                journals += 1
            else:
                others += 1
    return journals, others


async def test_a_stop_of_a_relayed_tree_and_a_stop_run_leave_nothing_alive(
    relayed: DaemonProcess,
) -> None:
    """A relayed worker with a child, stopped; then a run of 20 relayed workers, stopped:
    no process of theirs is left, and each parent's wake comes once per worker."""
    with trio.fail_after(90):
        async with AsyncClient(relayed.socket) as client:
            tree = await client.spawn(sh('sleep 600 & echo "child $!"; wait'))
            seen = await wait_output(client, tree.id, b"\n")
            child = int(re.search(rb"child (\d+)", seen).group(1))  # type: ignore[union-attr]
            await client.stop(tree.id)
            assert (await client.wait(tree.id)).state == "stopped"
            assert not alive(child)
            run = await client.new_run()
            ids = [(await client.spawn(sh("echo up; sleep 600"), run=run)).id for _ in range(20)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
            assert sorted(await client.stop_run(run)) == sorted(ids)
            for worker_id in ids:
                assert (await client.status(worker_id)).state == "stopped"
            assert not [pid for pid in pids if pid is not None and alive(pid)]
        woken = [(w.id, w.state) for w in await pending_wakes(relayed, run)]
        assert sorted(woken) == sorted((i, "stopped") for i in ids)  # each exactly once


async def test_a_reload_carrying_relayed_workers_mid_output_loses_and_doubles_nothing(
    relayed: DaemonProcess,
) -> None:
    """Relayed workers writing numbered lines through two reloads: each line once, in
    order, in its journal (the relay kept running; unread messages waited in its socket
    for the new image; what the old one journaled and credited is not sent again)."""
    assert relayed.proc is not None
    lines = 20_000
    script = f"i=0; while [ $i -lt {lines} ]; do i=$((i+1)); echo line $i; done"
    with trio.fail_after(120):
        async with AsyncClient(relayed.socket) as client:
            ids = [(await client.spawn(sh(script + "; sleep 1"))).id for _ in range(4)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"line 10\n")
            (relay,) = _relays(relayed.proc.pid)
        for _ in range(2):
            reply = await reload_on_own_connection(relayed)
            assert isinstance(reply, ReloadReply), reply
        assert _relays(relayed.proc.pid) == [relay]  # the same relay, across both execs
        async with AsyncClient(relayed.socket) as client:
            for worker_id in ids:
                assert (await client.wait(worker_id)).state == "finished"
                out = await paged_stdout(client, worker_id)
                want = "".join(f"line {i}\n" for i in range(1, lines + 1)).encode()
                assert out == want, (len(out), len(want))


async def test_a_flood_from_one_relayed_worker_does_not_hold_back_anothers_line(
    relayed: DaemonProcess,
) -> None:
    """One relayed worker floods stdout; another writes a line when told: it arrives
    promptly, and neither the daemon's nor the relay's memory grows with the flood."""
    assert relayed.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(relayed.socket) as client:
            flood = await client.spawn(["sh", "-c", "exec yes flooding-the-relay"])
            await wait_output(client, flood.id, b"flooding")
            (relay,) = _relays(relayed.proc.pid)
            await trio.sleep(1.0)  # the flood under way: memory as it settles
            daemon_rss, relay_rss = _rss(relayed.proc.pid), _rss(relay)
            quiet = await client.spawn(sh("read x; echo $x"), stdin_open=True)
            for n in range(5):
                start = trio.current_time()
                await client.send(quiet.id, f"ping {n}\n" if n == 4 else "", eof=n == 4)
                if n == 4:
                    await wait_output(client, quiet.id, b"ping 4\n")
                    assert trio.current_time() - start < 2.0
            await trio.sleep(2.0)  # more flood: what memory it costs would show
            assert _rss(relayed.proc.pid) < daemon_rss + 64 * 1024 * 1024
            assert _rss(relay) < relay_rss + 8 * 1024 * 1024
            await client.stop(flood.id)
            await client.wait(flood.id)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_the_relay_killed_ends_its_workers_interrupted_and_a_new_one_serves(
    relayed: DaemonProcess,
) -> None:
    """kill -9 of the relay: each relayed worker's tree is stopped and it ends
    `interrupted` with a note in its journal, `info` reports a problem, the daemon serves
    on, a resume by the old id works, and the next spawn is relayed by a new relay."""
    assert relayed.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(relayed.socket) as client:
            ids = [(await client.spawn(sh("echo up; sleep 600"))).id for _ in range(3)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
            (relay,) = _relays(relayed.proc.pid)
            os.kill(relay, signal.SIGKILL)
            for worker_id in ids:
                assert (await client.wait(worker_id)).state == "interrupted"
                page = await client.watch_page(worker_id, since=0, limit=1000)
                notes = [e.data for e in page.entries if e.kind == "note"]
                assert any(b"output relay" in n for n in notes), notes
            assert not [pid for pid in pids if pid is not None and alive(pid)]
            problems = (await client.info()).problems
            assert any("output relay" in p and "interrupted" in p for p in problems), problems
            resumed = await client.resume(ids[0])
            assert resumed.id == ids[0]
            await wait_output(client, ids[0], b"up\nup\n")
            after = await client.spawn(sh("echo again"))
            assert (await client.wait(after.id)).state == "finished"
            assert await paged_stdout(client, after.id) == b"again\n"
            (new_relay,) = _relays(relayed.proc.pid)
            assert new_relay != relay
            assert relayed.proc.poll() is None


async def test_kill_9_of_the_daemon_with_relayed_workers_the_restart_recovers_them(
    relayed: DaemonProcess,
) -> None:
    """kill -9 of the daemon: its relay sees its socket's end and exits; the restart ends
    the leftover trees and archives the workers `interrupted`, as it does piped ones."""
    assert relayed.proc is not None
    with trio.fail_after(90):
        async with AsyncClient(relayed.socket) as client:
            ids = [(await client.spawn(sh("echo up; sleep 600"))).id for _ in range(3)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"up\n")
            pids = [(await client.status(w)).pid for w in ids]
            (relay,) = _relays(relayed.proc.pid)
        relay_exited = os.pidfd_open(relay)
        relayed.kill()
        await trio.lowlevel.wait_readable(relay_exited)  # its socket's end: it exits
        os.close(relay_exited)
        relayed.start(*RELAY_ALL)
        async with AsyncClient(relayed.socket) as client:
            for worker_id in ids:
                assert (await client.wait(worker_id)).state == "interrupted"
                assert await paged_stdout(client, worker_id) == b"up\n"
        assert not [pid for pid in pids if pid is not None and alive(pid)]


async def test_a_full_relay_means_a_second_one(daemon_dirs: DaemonProcess) -> None:
    """A relay whose own limit holds 4 workers' streams: the fifth worker is relayed by a
    second relay, and every worker's output arrives."""
    limit = RESERVE + 8
    daemon_dirs.start(*RELAY_ALL, env={NOFILE_ENV: str(limit)})
    assert daemon_dirs.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            ids = [(await client.spawn(sh(f"echo n{n}; sleep 600"))).id for n in range(7)]
            for n, worker_id in enumerate(ids):
                await wait_output(client, worker_id, f"n{n}\n".encode())
            assert len(_relays(daemon_dirs.proc.pid)) == 2
            for worker_id in ids:
                await client.stop(worker_id)


def test_relay_above_refuses_what_is_not_a_descriptor_number(daemon_dirs: DaemonProcess) -> None:
    """`--relay-above` takes a whole number from 0: -1, 1.5, nan, inf, 2^70 and '' are
    refused with a clear error, and nothing starts."""
    for bad in ("-1", "1.5", "nan", "inf", str(2**70), ""):
        done = subprocess.run(
            [str(BIN / "subagentd"), "--socket", str(daemon_dirs.socket), f"--relay-above={bad}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, (bad, done)
        assert "--relay-above" in done.stderr, done.stderr
        assert not daemon_dirs.socket.exists()


async def test_a_rebuilt_handoff_asks_the_relay_what_it_holds_and_loses_nothing(
    daemon_dirs: DaemonProcess,
) -> None:
    """A reload whose checkpoint does not decode: the new image finds the relay's socket
    among what it inherited, asks it its inventory, and the relayed workers' output goes
    on into their journals, every line once."""
    daemon_dirs.start(*RELAY_ALL, env={"SUBAGENTD_FAULT": "handoff:garbage"})
    assert daemon_dirs.proc is not None
    lines = 30_000
    script = f"i=0; while [ $i -lt {lines} ]; do i=$((i+1)); echo line $i; done; read x"
    with trio.fail_after(120):
        async with AsyncClient(daemon_dirs.socket) as client:
            ids = [(await client.spawn(sh(script), stdin_open=True)).id for _ in range(2)]
            for worker_id in ids:
                await wait_output(client, worker_id, b"line 10\n")
            (relay,) = _relays(daemon_dirs.proc.pid)
        assert await reload_on_own_connection_lost(daemon_dirs)
        async with AsyncClient(daemon_dirs.socket) as client:
            problems = (await client.info()).problems
            assert any("took over from what the kernel shows" in p for p in problems)
            assert _relays(daemon_dirs.proc.pid) == [relay], daemon_dirs.log()[-6000:]
            want = "".join(f"line {i}\n" for i in range(1, lines + 1)).encode()
            for worker_id in ids:
                assert await wait_output(client, worker_id, f"line {lines}\n".encode()) == want
                await client.stop(worker_id)
                assert (await client.wait(worker_id)).state == "stopped"


async def reload_on_own_connection_lost(daemon: DaemonProcess) -> bool:
    """A reload whose answer is lost with its checkpoint: True once the new image serves."""
    with contextlib.suppress(AssertionError):  # no answer: it ended with the old image
        await reload_on_own_connection(daemon)
    async with AsyncClient(daemon.socket) as client:
        return (await client.info()).image_generation >= 1


async def test_below_the_threshold_nothing_is_relayed_past_it_every_worker_is(
    daemon_dirs: DaemonProcess,
) -> None:
    """With the default threshold (far above a test's descriptors) no relay starts; with
    `--relay-above 80`, the first workers keep their pipes in the daemon and those whose
    pipes come above 80 are relayed, each one's output whole either way."""
    for args, relayed_wanted in (((), False), (("--relay-above", "80"), True)):
        daemon_dirs.start(*args)
        assert daemon_dirs.proc is not None
        baseline = _pipes(daemon_dirs.proc.pid)
        with trio.fail_after(90):
            async with AsyncClient(daemon_dirs.socket) as client:
                ids = [(await client.spawn(sh(f"echo n{n}; sleep 600"))).id for n in range(60)]
                for n, worker_id in enumerate(ids):
                    await wait_output(client, worker_id, f"n{n}\n".encode())
                relays = _relays(daemon_dirs.proc.pid)
                assert bool(relays) == relayed_wanted
                piped = (_pipes(daemon_dirs.proc.pid) - baseline) // 2
                if relayed_wanted:
                    assert 5 < piped < 55, piped
                    assert _pipes(relays[0]) == 2 * (60 - piped), (piped, _pipes(relays[0]))
                else:
                    assert piped >= 59
                for worker_id in ids:
                    await client.stop(worker_id)
        assert daemon_dirs.terminate() == 0


async def test_a_reload_into_an_image_that_cannot_carry_relayed_streams_is_refused(
    daemon_dirs: DaemonProcess, touched: Path
) -> None:
    """An image on disk that reads checkpoints before version 5 would hold none of the
    relayed workers' output: the reload is refused saying so, and they run on, relayed."""
    daemon_dirs.start(*RELAY_ALL, env={"SUBAGENTD_FAULT": "check:reads-before-4"})
    assert daemon_dirs.proc is not None
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(sh("echo one; read x; echo $x"), stdin_open=True)
            await wait_output(client, worker.id, b"one\n")
            os.utime(touched)  # the image on disk changed: its --check says what it reads
            reply = await reload_on_own_connection(daemon_dirs)
            assert isinstance(reply, Error), reply
            assert "relays hold" in reply.message, reply
            await client.send(worker.id, "two\n", eof=True)
            assert (await client.wait(worker.id)).state == "finished"
            assert await paged_stdout(client, worker.id) == b"one\ntwo\n"
