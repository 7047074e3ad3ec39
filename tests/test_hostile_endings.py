"""Endings, recovery and resume meet files a worker planted and errors nobody expects:
nothing keeps the daemon from starting, no wake is lost, nothing is left `starting`,
and no worker escapes recovery by a damaged record.

Workers run as the same user and are told their archive directory, so each test
has a real worker do the planting, the way a hostile or broken one would.
"""

from __future__ import annotations

import os
import resource
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.daemon.store._store import STORE_NAME
from subagentd.protocol.errors import Internal

from .conftest import DaemonProcess
from .helpers import alive, sh, wait_output
from .helpers import pending_wakes as _wakes

PY = sys.executable


async def _until(condition: Callable[[], object], what: str) -> None:
    """Poll for a condition no event announces (a file a worker writes, a log line)."""
    while not condition():  # noqa: ASYNC110  nothing to wait on but the condition: `what`
        await trio.sleep(0.02)


async def test_a_planted_directory_does_not_keep_the_daemon_from_starting_after_a_crash(
    daemon: DaemonProcess,
) -> None:
    """A worker that made `stdout.tail` a directory (a rename onto it fails EISDIR)
    does not turn a daemon crash into a daemon that never starts again: the directory
    is moved aside, the tail written, and every interrupted worker gets its wake."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            planter = await client.spawn(
                sh('mkdir "$SUBAGENTD_ARCHIVE/stdout.tail"; echo planted; sleep 600'), run=run
            )
            other = await client.spawn(sh("echo other; sleep 600"), run=run)
            await wait_output(client, planter.id, b"planted\n")
            await wait_output(client, other.id, b"other\n")
        daemon.kill()  # a crash (OOM, a bug): both are found interrupted at the next start
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            for worker in (planter, other):
                assert (await client.status(worker.id)).state == "interrupted"
            assert (await client.collect(planter.id)).result == "planted\n"
        woken = sorted((w.id, w.state) for w in await _wakes(daemon, run))
        assert woken == sorted([(planter.id, "interrupted"), (other.id, "interrupted")])


_LEASER = """
import fcntl, os, signal, sys, time
path, marker = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGIO, signal.SIG_IGN)  # keep the lease when the daemon's open breaks it
fd = os.open(path, os.O_RDWR)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
open(marker, "w").close()
time.sleep(600)
"""


async def test_a_lease_on_a_result_file_loses_the_workers_wake(daemon: DaemonProcess) -> None:
    """Another worker (same user) holds a file lease on B's result, so the daemon's
    O_NONBLOCK open of it fails EWOULDBLOCK: B still ends `finished` with its wake,
    whose preview and collect say the result could not be read and give stdout's end."""
    gate, where, leased = daemon.root / "gate", daemon.root / "where", daemon.root / "leased"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            b = await client.spawn(
                sh(
                    f'echo my result > "$SUBAGENTD_RESULT"; echo "$SUBAGENTD_RESULT" > {where}; '
                    f"while [ ! -e {gate} ]; do sleep 0.02; done; echo my stdout"
                ),
                run=run,
            )
            await _until(lambda: where.exists() and where.read_text().strip(), "result path")
            result_path = where.read_text().strip()
            leaser = await client.spawn([PY, "-c", _LEASER, result_path, str(leased)])
            await _until(leased.exists, "lease taken")
            gate.touch()
            ended = await client.wait(b.id)
            collected = await client.collect(b.id)
            await client.stop(leaser.id)
            (wake,) = await _wakes(daemon, run)
    unreadable = "[result file could not be read ("
    assert (wake.id, wake.state, ended.state, ended.exit_code) == (b.id, "finished", "finished", 0)
    assert wake.preview.startswith(unreadable), wake.preview
    assert wake.preview.endswith("my stdout\n"), wake.preview
    assert collected.result.startswith(unreadable), collected.result
    assert collected.result.endswith("my stdout\n"), collected.result


async def test_descriptor_exhaustion_as_a_worker_ends_loses_its_wake(
    daemon: DaemonProcess,
) -> None:
    """EMFILE while a worker ends (issue 11: exhaustion is a state, not a loss): its
    result file cannot be opened, yet the worker's wake is posted, its preview saying why
    and giving the end of stdout."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    gate = daemon.root / "gate"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(
                sh(
                    f'echo my result > "$SUBAGENTD_RESULT"; '
                    f"while [ ! -e {gate} ]; do sleep 0.02; done; echo done"
                ),
                run=run,
            )
            soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))
            try:
                gate.touch()
                ended = await client.wait(worker.id)  # on a connection opened before
            finally:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        (wake,) = await _wakes(daemon, run)
    # Its state may be `failed`: with no descriptor, its tree could not be seen to end.
    assert (wake.id, wake.state) == (worker.id, ended.state), daemon.log()[-4000:]
    assert wake.preview.startswith("[result file could not be read ("), wake.preview
    assert wake.preview.endswith("done\n"), wake.preview


async def test_a_resume_that_meets_a_planted_stdout_tail_directory_leaves_nothing_starting(
    daemon: DaemonProcess,
) -> None:
    """A directory the worker made at stdout.tail (whose unlink fails EISDIR) is moved
    aside before the record is reopened: the resume starts the next attempt, which ends
    like any other, and nothing is left `starting`."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh('mkdir "$SUBAGENTD_ARCHIVE/stdout.tail"; exit 3'))
            assert (await client.wait(worker.id)).state == "failed"
            resumed = await client.resume(worker.id)
            ended = await client.wait(worker.id)
            assert (resumed.attempt, ended.attempt, ended.state) == (2, 2, "failed")
            await client.stop(worker.id)


async def test_a_resume_that_fails_after_reopening_ends_the_attempt_and_says_why(
    daemon_dirs: DaemonProcess,
) -> None:
    """Whatever fails once the record is reopened (here an injected fault: a stand-in
    for any unexpected exception) ends that attempt as a spawn failure does: the
    worker is `failed` at attempt 2, not `starting` for good, its journal says why,
    and a wait or a stop of it answers at once."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "resume:flaky"})
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(sh("exit 3"), name="flaky")
            assert (await client.wait(worker.id)).state == "failed"
            with pytest.raises(Internal):
                await client.resume(worker.id)
            ended = await client.wait(worker.id)
            assert (ended.state, ended.attempt) == ("failed", 2)
            await client.stop(worker.id)
            page = await client.watch_page(worker.id, since=0, limit=100)
            assert any(b"attempt 2 failed to start" in e.data for e in page.entries)
            assert page.entries[-1].data == b"failed exit_code=None", page.entries[-1]


def _edit_record(daemon: DaemonProcess, worker_id: str, **fields: object) -> None:
    """Change a worker's record in the store while the daemon is down, as damage (or a
    program of the user's) may: a row that still decodes, saying something else."""
    db = sqlite3.connect(daemon.state_dir / STORE_NAME)
    try:
        (blob,) = db.execute("SELECT record FROM workers WHERE id = ?", (worker_id,)).fetchone()
        record = msgspec.msgpack.decode(blob) | fields
        db.execute(
            "UPDATE workers SET record = ? WHERE id = ?",
            (msgspec.msgpack.encode(record), worker_id),
        )
        db.commit()
    finally:
        db.close()


def _damage_record(daemon: DaemonProcess, worker_id: str) -> None:
    """Make a worker's row in the store undecodable while the daemon is down."""
    db = sqlite3.connect(daemon.state_dir / STORE_NAME)
    try:
        db.execute("UPDATE workers SET record = x'c1c1c1' WHERE id = ?", (worker_id,))
        db.commit()
    finally:
        db.close()


async def test_a_worker_whose_record_does_not_decode_is_still_ended_by_recovery(
    daemon_dirs: DaemonProcess,
) -> None:
    """A row that does not decode costs only itself: with trees found by /proc scans (no
    cgroups) there is no pid to go by, so its record is rebuilt from its snapshot, it is
    `interrupted`, and its processes are found by the worker id they inherited (a
    setsid'd stray too); it is reported, and its sibling recovered as ever."""
    daemon = daemon_dirs
    daemon.extra_args = ["--cgroups", "off"]
    daemon.start()
    stray_pid = daemon.root / "stray"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh(
                    f'setsid sh -c "echo \\$\\$ > {stray_pid}; exec sleep 600" & '
                    f"until [ -s {stray_pid} ]; do sleep 0.01; done; echo planted; sleep 600"
                )
            )
            sibling = await client.spawn(["sleep", "600"], run=worker.run)
            await wait_output(client, worker.id, b"planted\n")
        assert worker.pid is not None
        stray = int(stray_pid.read_text())
        daemon.kill()
        _damage_record(daemon, worker.id)
        await trio.to_thread.run_sync(daemon.start)
        try:
            assert not alive(worker.pid), "the worker runs on, unsupervised, after recovery"
            assert not alive(stray), "its stray runs on, unsupervised, after recovery"
            async with AsyncClient(daemon.socket) as client:
                ended = await client.status(worker.id)
                assert (ended.state, ended.run) == ("interrupted", worker.run)
                assert (await client.status(sibling.id)).state == "interrupted"
                assert any(worker.id in problem for problem in (await client.info()).problems)
                journal = await client.watch_page(worker.id, since=0, limit=100)
                assert any(b"rebuilt" in e.data for e in journal.entries)
        finally:
            for pid in (worker.pid, stray):
                if alive(pid):
                    os.killpg(pid, 9)


_TAMPER_SPARES = """
spares="$(dirname "$SUBAGENTD_ARCHIVE")"
while :; do
  n=0
  for d in "$spares"/.spare-*; do
    [ -d "$d" ] || continue
    printf x > "$d/snapshot.json"; mkfifo "$d/result" 2>/dev/null; n=$((n + 1))
  done
  [ "$n" -ge 8 ] && break
  sleep 0.01
done
echo tampered; sleep 600
"""


async def test_a_tampered_spare_archive_is_replaced_by_a_fresh_one(daemon: DaemonProcess) -> None:
    """Spare archives (.spare-*, made ahead for spawns) are in every worker's reach:
    one that wrote into all of them made the next spawn refused ("free some space").
    A tampered spare is deleted instead, and the spawn makes a fresh archive."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            tamperer = await client.spawn(sh(_TAMPER_SPARES))
            await wait_output(client, tamperer.id, b"tampered\n")
            worker = await client.spawn(sh("echo fine"))
            ended = await client.wait(worker.id)
            assert (ended.state, (await client.collect(worker.id)).result) == ("finished", "fine\n")
            await client.stop(tamperer.id)


async def test_a_parent_loop_planted_before_a_crash_is_cut_when_records_are_restored(
    daemon: DaemonProcess,
) -> None:
    """After a crash the registry is rebuilt from the store: two records that (damaged)
    name each other as parent must not send a stop's walk of the subtree round forever."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            a = await client.spawn(sh("echo up; sleep 600"), run=run)
            b = await client.spawn(sh("echo up; sleep 600"), run=run)
            for worker in (a, b):
                await wait_output(client, worker.id, b"up\n")
        daemon.kill()
        _edit_record(daemon, a.id, parent=b.id)
        _edit_record(daemon, b.id, parent=a.id)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
            assert any("loops back" in problem for problem in problems), problems
            assert {w.id for w in await client.ls(all=True, run=run)} == {a.id, b.id}
            assert await client.stop(a.id)  # found, ended (interrupted): its walk ends
            assert await client.stop_run(run) == []


def _stranger() -> subprocess.Popen[bytes]:
    """A process of the user's that no worker started (an editor, a shell)."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def _start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat, which any process of the user's may read."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


async def test_recovery_does_not_signal_a_process_a_planted_record_names(
    daemon_dirs: DaemonProcess,
) -> None:
    """After a crash, recovery ends an interrupted worker's leftover tree from the pid
    and start time its record names; both are in /proc/PID/stat for any process of the
    user's, so a record that names another process's (damaged, or written by an older
    image's worker into its record.json) must not have recovery TERM that process, its
    group and its descendants. The pid is believed only for a process carrying the
    worker's id in its environment; else the worker's processes are found by that id
    alone (the real one still ends)."""
    daemon = daemon_dirs
    daemon.start("--cgroups", "off")  # with cgroups, the worker's cgroup is used instead
    victim = _stranger()
    worker_pid: int | None = None
    try:
        with trio.fail_after(60):
            async with AsyncClient(daemon.socket) as client:
                worker = await client.spawn(["sleep", "60"], grace=1)
                worker_pid = (await client.status(worker.id)).pid
            assert worker_pid is not None
            daemon.kill()  # a crash: no checkpoint, the next start recovers from the store
            _edit_record(daemon, worker.id, pid=victim.pid, pid_start=_start_time(victim.pid))
            await trio.to_thread.run_sync(daemon.start, "--cgroups", "off")
            assert victim.poll() is None, f"recovery signalled pid {victim.pid}"
            assert not alive(worker_pid), "the worker itself was not ended by recovery"
            async with AsyncClient(daemon.socket) as client:
                problems = (await client.info()).problems
            assert any(str(victim.pid) in problem for problem in problems), problems
    finally:
        victim.kill()
        victim.wait()
        if worker_pid is not None and alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


async def test_a_record_naming_another_worker_is_rebuilt_from_its_snapshot_by_recovery(
    daemon: DaemonProcess,
) -> None:
    """A record whose `id` names another worker was taken for that worker's: after a
    crash, recovery held two records under one id, and `status` of the one rewritten
    answered as the other. Who a record is comes from its row's key: that one is
    unreadable, rebuilt from its snapshot (interrupted like any other), and reported."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            liar = await client.spawn(["sleep", "60"], run=run, grace=1)
            other = await client.spawn(["sleep", "60"], run=run, grace=1)
        daemon.kill()  # a crash: the next start recovers from the store
        _edit_record(daemon, liar.id, id=other.id)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            views = [await client.status(w) for w in (liar.id, other.id)]
            states = {view.id: view.state for view in views}
            problems = (await client.info()).problems
    assert states == {liar.id: "interrupted", other.id: "interrupted"}, states
    assert any(liar.id in problem and other.id in problem for problem in problems), problems
