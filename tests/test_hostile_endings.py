"""Endings, recovery and resume meet files a worker planted and errors nobody expects:
nothing keeps the daemon from starting, no wake is lost, nothing is left `starting`,
and no worker escapes recovery by damaging its record.

Workers run as the same user and are told their archive directory, so each test
has a real worker do the planting, the way a hostile or broken one would.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol.errors import Internal

from .conftest import DaemonProcess
from .helpers import RawConnection, alive, sh, wait_output
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
    """EMFILE while a worker ends (issue 11: exhaustion is a state, not a loss): the
    result cannot be opened, yet the worker's wake is posted, its preview saying why
    and giving the end of stdout."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    gate = daemon.root / "gate"
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            worker = await client.spawn(
                sh(f"while [ ! -e {gate} ]; do sleep 0.02; done; echo done"), run=run
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


#: What a worker puts in place of its record.json once the daemon has written it.
_RECORD_REPLACEMENTS = {
    "fifo": 'mkfifo "$SUBAGENTD_ARCHIVE/record.json"',
    "directory": 'mkdir "$SUBAGENTD_ARCHIVE/record.json"',
    "symlink": 'ln -s /nonexistent "$SUBAGENTD_ARCHIVE/record.json"',
    # A regular file that JSON nests past any decoder's depth (RecursionError, not DecodeError).
    "nested": 'head -c 100000 /dev/zero | tr "\\0" "[" > "$SUBAGENTD_ARCHIVE/record.json"',
}


@pytest.mark.parametrize("replacement", sorted(_RECORD_REPLACEMENTS))
async def test_a_worker_that_replaces_its_record_is_still_ended_by_recovery(
    daemon_dirs: DaemonProcess, replacement: str
) -> None:
    """Recovery found interrupted workers only through record.json, which is in the
    worker's reach: one replaced by a FIFO, directory or symlink was skipped, and the
    worker's tree ran on unsupervised after a daemon crash. With trees found by /proc
    scans (no cgroups) there is no pid to go by either: its record is rebuilt from
    its snapshot, it is `interrupted`, and its processes are found by the worker id
    they inherited (a setsid'd stray too)."""
    daemon = daemon_dirs
    daemon.extra_args = ["--cgroups", "off"]
    daemon.start()
    stray_pid = daemon.root / "stray"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh(
                    'until grep -q running "$SUBAGENTD_ARCHIVE/record.json"; do sleep 0.01; done; '
                    f'setsid sh -c "echo \\$\\$ > {stray_pid}; exec sleep 600" & '
                    'rm "$SUBAGENTD_ARCHIVE/record.json"; '
                    f"{_RECORD_REPLACEMENTS[replacement]}; "
                    f"until [ -s {stray_pid} ]; do sleep 0.01; done; echo planted; sleep 600"
                )
            )
            await wait_output(client, worker.id, b"planted\n")
        assert worker.pid is not None
        stray = int(stray_pid.read_text())
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        try:
            assert not alive(worker.pid), "the worker runs on, unsupervised, after recovery"
            assert not alive(stray), "its stray runs on, unsupervised, after recovery"
            async with AsyncClient(daemon.socket) as client:
                ended = await client.status(worker.id)
                assert (ended.state, ended.run) == ("interrupted", worker.run)
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


def _reparent(daemon: DaemonProcess, worker_id: str, parent: str) -> None:
    """Rewrite a worker's record.json as the worker itself may: a regular file of its archive."""
    path = daemon.state_dir / "archives" / worker_id / "record.json"
    record = json.loads(path.read_bytes())
    record["parent"] = parent
    path.write_text(json.dumps(record))


async def test_a_parent_loop_planted_in_an_archived_record_does_not_hang_the_daemon(
    daemon: DaemonProcess,
) -> None:
    """A released worker's record whose parent is itself sent the authority walk round
    forever on the event loop: one `status` from a worker's connection hung the daemon."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            a = await client.spawn(["true"], name="a")
            await client.collect(a.id, wait=True)  # released: a lookup reads its archive
            b = await client.spawn(sh("echo $SUBAGENTD_TOKEN; sleep 600"), name="b")
            token = (await wait_output(client, b.id, b"\n")).decode().strip()
            _reparent(daemon, a.id, a.id)
            conn = await RawConnection.open(daemon.socket, hello=False)
            async with conn.stream:
                await conn.send(p.Hello(id=1, token=token))
                assert isinstance(await conn.receive(), p.Welcome)
                await conn.send(p.Status(id=2, worker=a.id))
                reply = await conn.receive()
                assert isinstance(reply, p.Error), reply
                assert reply.code == "forbidden", reply
            assert (await client.info()).workers == {"running": 1}
            await client.stop(b.id)


async def test_a_parent_loop_planted_before_a_crash_is_cut_when_records_are_restored(
    daemon: DaemonProcess,
) -> None:
    """After a crash the registry is rebuilt from records in workers' reach: two that
    name each other as parent must not send a stop's walk of the subtree round forever."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            a = await client.spawn(sh("echo up; sleep 600"), run=run)
            b = await client.spawn(sh("echo up; sleep 600"), run=run)
            for worker in (a, b):
                await wait_output(client, worker.id, b"up\n")
        daemon.kill()
        _reparent(daemon, a.id, b.id)
        _reparent(daemon, b.id, a.id)
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            problems = (await client.info()).problems
            assert any("loops back" in problem for problem in problems), problems
            assert {w.id for w in await client.ls(all=True, run=run)} == {a.id, b.id}
            assert await client.stop(a.id)  # found, ended (interrupted): its walk ends
            assert await client.stop_run(run) == []


def _point_record_elsewhere(daemon: DaemonProcess, worker_id: str) -> Path:
    """Rewrite a worker's record.json (a regular file of its own archive, which README lets
    a worker rewrite) so that its `archive` names a directory outside the state dir, holding
    a copy of what the real archive holds and files of the user's; that directory."""
    real = daemon.state_dir / "archives" / worker_id
    elsewhere = daemon.root / "elsewhere"
    elsewhere.mkdir()
    for name in ("snapshot.json", "journal"):
        (elsewhere / name).write_bytes((real / name).read_bytes())
    (elsewhere / "result").write_text("read from outside the state dir")
    (elsewhere / "stdout.tail").write_text("a file of the user's, outside the state dir")
    record = json.loads((real / "record.json").read_bytes())
    record["archive"] = str(elsewhere)
    for archive in (real, elsewhere):
        (archive / "record.json").write_text(json.dumps(record))
    return elsewhere


async def test_a_record_naming_another_archive_does_not_make_collect_read_there(
    daemon: DaemonProcess,
) -> None:
    """collect (and watch, the wake's preview, the stdout fallback) took the archive from
    the `archive` field of the record it read: a record rewritten by its worker sent
    collect to read a `result` anywhere. The archive is the one the state dir holds for
    that id; the record's claim is corrected, reported in `info`, and shown nowhere."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh("echo real output; exit 3"))
            await client.wait(worker.id)
            first = await client.collect(worker.id)  # the handle goes: lookups read the archive
            assert first.state == "failed"
            _point_record_elsewhere(daemon, worker.id)
            again = await client.collect(worker.id)
            shown = await client.status(worker.id)
            problems = (await client.info()).problems
    assert "outside the state dir" not in again.result, again.result
    assert again.result == "real output\n"
    assert shown.archive == str(daemon.state_dir / "archives" / worker.id)
    assert any(worker.id in problem and "elsewhere" in problem for problem in problems), problems


async def test_a_record_naming_another_archive_does_not_make_resume_write_there(
    daemon: DaemonProcess,
) -> None:
    """resume took the archive from the record it read: it deleted `stdout.tail` there,
    appended to the `journal` there, wrote `record.json` there and gave the worker
    SUBAGENTD_ARCHIVE=there. It resumes the worker in its own archive instead."""
    real = daemon.state_dir / "archives"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh('[ -n "$SUBAGENTD_RESUME" ] && echo "$SUBAGENTD_ARCHIVE" && exit 0; exit 3')
            )
            await client.wait(worker.id)
            await client.collect(worker.id)
            elsewhere = _point_record_elsewhere(daemon, worker.id)
            journal_before = (elsewhere / "journal").read_bytes()
            record_before = (elsewhere / "record.json").read_bytes()
            resumed = await client.resume(worker.id)
            ended = await client.wait(resumed.id)
            told = await client.collect(worker.id)
    assert (elsewhere / "stdout.tail").exists(), "the daemon deleted a file outside its state dir"
    assert (elsewhere / "journal").read_bytes() == journal_before, "it appended to a journal there"
    assert (elsewhere / "record.json").read_bytes() == record_before, "it wrote a record there"
    assert ended.state == "finished"
    assert told.result == f"{real / worker.id}\n", "the worker was told another archive"


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
    """After a crash, recovery ended an interrupted worker's leftover tree from the pid
    and start time its record.json names; that file is in its worker's reach, and both
    are in /proc/PID/stat for any process of the user's: a worker that wrote another
    process's there had recovery TERM that process, its group and its descendants.
    The pid is believed only for a process carrying the worker's id in its environment;
    else the worker's processes are found by that id alone (the real one still ends)."""
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
            daemon.kill()  # a crash: no checkpoint, the next start recovers from archives
            record_path = daemon.state_dir / "archives" / worker.id / "record.json"
            record = json.loads(record_path.read_bytes())
            record["pid"], record["pid_start"] = victim.pid, _start_time(victim.pid)
            record_path.write_text(json.dumps(record))
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
    answered as the other. Who a record is comes from its directory: that one is
    unreadable, rebuilt from its snapshot (interrupted like any other), and reported."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            liar = await client.spawn(["sleep", "60"], run=run, grace=1)
            other = await client.spawn(["sleep", "60"], run=run, grace=1)
        daemon.kill()  # a crash: the next start recovers from the archives
        record_path = daemon.state_dir / "archives" / liar.id / "record.json"
        record = json.loads(record_path.read_bytes())
        record["id"] = other.id
        record_path.write_text(json.dumps(record))
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            views = [await client.status(w) for w in (liar.id, other.id)]
            states = {view.id: view.state for view in views}
            problems = (await client.info()).problems
    assert states == {liar.id: "interrupted", other.id: "interrupted"}, states
    assert any(liar.id in problem and other.id in problem for problem in problems), problems
