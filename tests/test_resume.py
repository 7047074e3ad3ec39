"""Resume: an ended worker or run carries on from its archive, by its old id,
running what its snapshot froze, never today's files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, NotFound, RunStopped, _core

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, sh, wait_output


async def ask(daemon: DaemonProcess, request: p.Request[p.Reply]) -> p.Reply:
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        request.id = 2
        await conn.send(request)
        reply = await conn.receive()
        assert reply is not None
        return reply


async def resume(daemon: DaemonProcess, worker: str, **given: object) -> p.Reply:
    return await ask(daemon, p.Resume(id=0, worker=worker, **given))  # type: ignore[arg-type]


# A worker that says which attempt it is and what it was given, then waits to be stopped.
ATTEMPT = 'echo "attempt ${SUBAGENTD_RESUME:-1} input $(cat)"; while :; do sleep 0.1; done'


async def test_resume_after_stop_carries_on_with_the_same_id_and_journal(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(ATTEMPT), input="the task")
            await wait_output(client, worker.id, b"attempt 1 input the task\n")
            await client.stop(worker.id)
        reply = await resume(daemon, worker.id)
        assert isinstance(reply, p.WorkerReply), reply
        assert (reply.worker.id, reply.worker.attempt, reply.worker.state) == (
            worker.id,
            2,
            "running",
        )
        async with AsyncClient(daemon.socket) as client:
            out = await wait_output(client, worker.id, b"attempt 2 input the task\n")
            assert out.startswith(b"attempt 1 input the task\n")  # one journal, both attempts
            page = await client.watch_page(worker.id, limit=1000)
            assert b"attempt 2: resumed" in [e.data for e in page.entries if e.kind == "note"]
            await client.stop(worker.id)
            assert (await client.status(worker.id)).state == "stopped"


async def test_the_frozen_snapshot_wins_over_an_edited_agents_toml(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.config.write_text(
        '[agents.echoer]\ncommand = ["sh", "-c", "echo model={model}; sleep 60"]\nmodel = "small"\n'
    )
    daemon_dirs.start()
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn([], agent="echoer", input="x")
            await wait_output(client, worker.id, b"model=small")
            await client.stop(worker.id)
        daemon_dirs.config.write_text(
            '[agents.echoer]\ncommand = ["sh", "-c", "echo model={model}; sleep 60"]\n'
            'model = "large"\n'
        )
        assert isinstance(await resume(daemon_dirs, worker.id), p.WorkerReply)
        async with AsyncClient(daemon_dirs.socket) as client:
            out = await wait_output(client, worker.id, b"model=small\nmodel=")
            assert out.count(b"model=small") == 2
            assert b"large" not in out
            await client.stop(worker.id)


async def test_a_resume_gives_only_the_timeout_anew(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"])
            await client.stop(worker.id)
        for given in ({"input": b"new"}, {"argv": ["other"]}, {"model": "large"}):
            reply = await resume(daemon, worker.id, **given)
            assert isinstance(reply, p.Error)
            assert reply.code == "frozen"
        reply = await resume(daemon, worker.id, timeout=0.2)
        assert isinstance(reply, p.WorkerReply)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.wait(worker.id)).state == "timed_out"


async def test_resume_is_refused_with_the_reason(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            done = await client.spawn(["true"])
            await client.wait(done.id)
            running = await client.spawn(["sleep", "60"])
            gone = await client.spawn(["sleep", "60"])
            await client.stop(gone.id)
        (Path(gone.archive) / "snapshot.json").unlink()
        for worker, why in ((done.id, "ended well"), (running.id, "is running"),
                            (gone.id, "snapshot"), ("w-nope", "no worker")):  # fmt: skip
            reply = await resume(daemon, worker)
            assert isinstance(reply, p.Error), reply
            assert why in reply.message
        async with AsyncClient(daemon.socket) as client:
            await client.stop(running.id)


async def test_resume_after_kill_9_of_the_daemon(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(ATTEMPT), input="survive")
            await wait_output(client, worker.id, b"attempt 1")
        daemon.kill()
        await trio.to_thread.run_sync(daemon.start)
        reply = await resume(daemon, worker.id)
        assert isinstance(reply, p.WorkerReply), reply
        async with AsyncClient(daemon.socket) as client:
            await wait_output(client, worker.id, b"attempt 2 input survive")
            await client.stop(worker.id)


async def test_resume_after_a_reload_that_had_to_stop_it(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT_NO_CARRY": "fragile"})
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn(sh(ATTEMPT), name="fragile", input="x")
            await wait_output(client, worker.id, b"attempt 1")
        reply = await ask(daemon_dirs, p.Reload(id=0))
        assert isinstance(reply, p.ReloadReply)
        assert reply.stopped_by_reload == [worker.id]
        reply = await resume(daemon_dirs, worker.id)
        assert isinstance(reply, p.WorkerReply), reply
        async with AsyncClient(daemon_dirs.socket) as client:
            await wait_output(client, worker.id, b"attempt 2")
            await client.stop(worker.id)


async def test_resume_run_restarts_the_highest_unfinished_workers(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            finished = await client.spawn(["true"], run=run)
            await client.wait(finished.id)
            top = await client.spawn(["sleep", "60"], run=run)
            child = await client.spawn(["sleep", "60"], parent=top.id)
            await client.stop_run(run)
        reply = await ask(daemon, p.ResumeRun(id=0, run=run))
        assert isinstance(reply, p.WorkerList), reply
        assert [w.id for w in reply.workers] == [top.id]  # its child is top's to restart
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(finished.id)).attempt == 1
            assert (await client.status(child.id)).state == "stopped"
            with pytest.raises(RunStopped):  # a resume carries workers on, not the run
                await client.spawn(["true"], run=run)
            await client.reopen_run(run)
            await client.spawn(["true"], run=run)  # started again, explicitly
            await client.stop_run(run)
        async with AsyncClient(daemon.socket) as client:
            good = await client.new_run()
            await client.wait((await client.spawn(["true"], run=good)).id)
        reply = await ask(daemon, p.ResumeRun(id=0, run=good))
        assert isinstance(reply, p.Error)
        assert "ended well" in reply.message


async def test_latest_picks_the_newest_resumable_run_of_the_directory(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    with trio.fail_after(30):
        reply = await ask(daemon, p.LatestResumable(id=0, cwd=str(here)))
        assert isinstance(reply, p.Error)
        assert reply.code == "not_found"
        async with AsyncClient(daemon.socket) as client:
            older = await client.spawn(["sleep", "60"], cwd=here)
            await client.stop(older.id)
            newer = await client.spawn(["true"], cwd=here)  # ends well: not resumable
            await client.wait(newer.id)
            other = await client.spawn(["sleep", "60"], cwd=elsewhere)
            await client.stop(other.id)
        reply = await ask(daemon, p.LatestResumable(id=0, cwd=str(here)))
        assert isinstance(reply, p.Latest)
        assert (reply.run, reply.resumable) == (older.run, True)
        assert isinstance(await ask(daemon, p.ResumeRun(id=0, run=older.run)), p.WorkerList)
        reply = await ask(daemon, p.LatestResumable(id=0, cwd=str(here)))  # older is live now
        assert isinstance(reply, p.Latest)
        assert (reply.run, reply.resumable) == (newer.run, False)
        assert "ended well" in reply.reason
        async with AsyncClient(daemon.socket) as client:
            await client.stop(older.id)


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, timeout=30)


async def test_resume_checks_the_git_branch_and_never_switches_it(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "feature")
    _git(
        repo,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"], cwd=repo)
            await client.stop(worker.id)
        _git(repo, "checkout", "-q", "-b", "other")
        reply = await resume(daemon, worker.id)
        assert isinstance(reply, p.Error)
        assert "'feature'" in reply.message
        assert "'other'" in reply.message
        assert (repo / ".git" / "HEAD").read_text().strip() == "ref: refs/heads/other"
        _git(repo, "branch", "-q", "-D", "feature")
        reply = await resume(daemon, worker.id)
        assert isinstance(reply, p.Error)
        assert "no longer exists" in reply.message
        _git(repo, "checkout", "-q", "-b", "feature")
        reply = await resume(daemon, worker.id)
        assert isinstance(reply, p.WorkerReply), reply
        async with AsyncClient(daemon.socket) as client:
            await client.stop(worker.id)


def test_a_second_daemon_on_the_same_state_dir_is_refused(daemon: DaemonProcess) -> None:
    other = subprocess.run(
        [str(BIN / "subagentd"), "--socket", str(daemon.root / "other.sock"),
         "--state-dir", str(daemon.state_dir)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert other.returncode == 1
    assert daemon.proc is not None
    assert f"pid {daemon.proc.pid}" in other.stderr


async def test_a_worker_resumed_between_two_pages_of_a_listing_is_listed_once(
    daemon: DaemonProcess,
) -> None:
    """A listing pages in the order workers were first spawned, which a resume does not
    change: a worker resumed after its page was read does not come again on a later one."""
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            run = await client.new_run()
            first = await client.spawn(
                sh('[ -n "$SUBAGENTD_RESUME" ] && exec sleep 30; exit 3'), run=run
            )
            assert (await client.wait(first.id)).state == "failed"
            later = [(await client.spawn(["sleep", "30"], run=run)).id for _ in range(2)]
            cursor = _core.ListingCursor(all=True, run=run)
            pages = 0
            while not cursor.done:
                page = msgspec.structs.replace(cursor.request(), limit=1)
                cursor.take(await client.request(page))
                pages += 1
                if pages == 1:
                    assert [w.id for w in cursor.workers] == [first.id]
                    await client.resume(first.id)  # it starts again, after the others
            await client.stop_run(run, wait=False)
    assert [w.id for w in cursor.workers] == [first.id, *later]


# -- issue 13, item 7: latest_resumable by the directory, however named; runs with a snapshot


async def test_latest_resumable_finds_a_directory_however_it_is_named_and_says_from_what(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Spawned by a symlink's name, asked by the real one with a trailing slash, `.` and
    `..`, or by the symlink: one directory, one answer. It says which workers a resume
    would carry on (`from`) and holds nothing else (no request id), in the client and in
    `subagentctl --json resume --latest --dry-run` alike."""
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(here)
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"], cwd=link)
            assert worker.cwd == str(here)  # kept by its real path
            await client.stop(worker.id)
            expected = {"run": worker.run, "resumable": True, "reason": "", "from": [worker.id]}
            for name in (f"{here}/", f"{here}/./sub/..", str(link), f"{link}/"):
                latest = await client.latest_resumable(name)
                assert msgspec.to_builtins(latest) == expected, name
        proc = await trio.to_thread.run_sync(
            lambda: daemon.ctl("--json", "resume", "--latest", "--dry-run", cwd=link)
        )
        assert proc.returncode == 0, proc.stderr
        assert msgspec.json.decode(proc.stdout) == expected
        proc = await trio.to_thread.run_sync(
            lambda: daemon.ctl("resume", "--latest", "--dry-run", cwd=here / "sub" / "..")
        )
        assert proc.returncode == 0, proc.stderr
        assert f"run: {worker.run}\nresumable: True\nreason: -\nfrom: {worker.id}\n" == proc.stdout
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"  # a dry run resumes nothing


async def test_latest_resumable_takes_no_worker_without_a_snapshot_for_a_run(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A run whose workers left no snapshot (removed, or the empty one of a spawn refused
    before writing it) is no run to resume from: the newest run that has one is answered,
    and a directory with none is `not_found`."""
    here, bare = tmp_path / "here", tmp_path / "bare"
    here.mkdir()
    bare.mkdir()
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            done = await client.spawn(["true"], cwd=here)
            await client.wait(done.id)
            gone = await client.spawn(["sleep", "60"], cwd=here)
            await client.stop(gone.id)
            empty = await client.spawn(["sleep", "60"], cwd=bare)
            await client.stop(empty.id)
        (Path(gone.archive) / "snapshot.json").unlink()
        (Path(empty.archive) / "snapshot.json").write_bytes(b"")
        async with AsyncClient(daemon.socket) as client:
            latest = await client.latest_resumable(here)
            assert (latest.run, latest.resumable, latest.from_) == (done.run, False, [])
            assert "ended well" in latest.reason
            with pytest.raises(NotFound, match="no run with a snapshot"):
                await client.latest_resumable(bare)
        proc = await trio.to_thread.run_sync(lambda: daemon.ctl("resume", "--latest", cwd=bare))
        assert proc.returncode == 1
        assert f"no run with a snapshot to resume from was started in {bare}" in proc.stderr


# -- issue 13, item 8: a resume says what changed on disk since its spawn

AGENT = """[agents.echoer]
command = ["sh", "-c", "echo model={model} $GREETING; sleep 60"]
model = "%s"
timeout = %d
env = {GREETING = "%s"}
"""


async def test_a_resume_names_the_agent_fields_edited_since_its_spawn_and_runs_the_frozen_one(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.config.write_text(AGENT % ("small", 600, "hi"))
    daemon_dirs.start()
    with trio.fail_after(30):
        async with AsyncClient(daemon_dirs.socket) as client:
            worker = await client.spawn([], agent="echoer")
            await wait_output(client, worker.id, b"model=small hi\n")
            await client.stop(worker.id)
            same = await client.resume(worker.id)  # nothing changed: nothing said
            assert (same.attempt, same.changed) == (2, "")
            # Its line first: a stop at once could end it before its echo.
            await wait_output(client, worker.id, b"model=small hi\n" * 2)
            await client.stop(worker.id)
            daemon_dirs.config.write_text(AGENT % ("large", 900, "hello"))
            resumed = await client.resume(worker.id)
            assert (
                resumed.changed
                == "agent 'echoer' in agents.toml now differs in model, env, timeout"
            )
            out = await wait_output(client, worker.id, b"model=small hi\n" * 3)
            assert (b"large" in out, b"hello" in out) == (False, False)  # the frozen one ran
            notes = [e.data.decode() for e in (await client.watch_page(worker.id)).entries
                     if e.kind == "note"]  # fmt: skip
            assert notes[-2:] == [
                "attempt 2: resumed",
                f"attempt 3: resumed; changed since its spawn: {resumed.changed}",
            ]
            await client.stop(worker.id)
        daemon_dirs.config.write_text(
            (AGENT % ("small", 600, "hi")).replace("sleep 60", "sleep 61")
        )
        proc = await trio.to_thread.run_sync(lambda: daemon_dirs.ctl("resume", worker.id))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (
            f"{worker.id} (run {worker.run})\n"
            "  changed since its spawn: agent 'echoer' in agents.toml now differs in command\n"
        )
        daemon_dirs.config.write_text("[agents.other]\ncommand = ['true']\n")
        async with AsyncClient(daemon_dirs.socket) as client:
            await client.stop(worker.id)
            gone = await client.resume(worker.id)
            assert gone.changed == "agent 'echoer' is no longer in agents.toml"
            await client.stop(worker.id)


def _commit(repo: Path) -> str:
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
         "-m", "x")  # fmt: skip
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    )
    return head.stdout.strip()


async def test_a_resume_says_head_moved_since_its_spawn_and_the_journal_note_too(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    first = _commit(repo)
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(["sleep", "60"], cwd=repo)
            await client.stop(worker.id)
            assert (await client.resume(worker.id)).changed == ""  # HEAD where it was
            await client.stop(worker.id)
            second = _commit(repo)
            _git(repo, "pack-refs", "--all")  # the branch now only in packed-refs
            resumed = await client.resume(worker.id)
            assert resumed.changed == f"HEAD moved: {first} -> {second}"
            page = await client.watch_page(worker.id)
            assert page.entries[-2].data.decode() == (  # the last is its `running` state
                f"attempt 3: resumed; changed since its spawn: HEAD moved: {first} -> {second}"
            )
            await client.stop(worker.id)
        proc = await trio.to_thread.run_sync(lambda: daemon.ctl("--json", "resume", worker.id))
        assert proc.returncode == 0, proc.stderr
        document = msgspec.json.decode(proc.stdout)
        assert (document["id"], document["attempt"]) == (worker.id, 4)
        assert document["changed"] == f"HEAD moved: {first} -> {second}"
        async with AsyncClient(daemon.socket) as client:
            await client.stop(worker.id)
