"""Files a worker can reach: planted FIFOs, symlinks and huge files freeze nothing,
leak nothing and send no write outside the state dir.

Workers run as the same user and are told their archive directory, so each
test has a real worker do the planting, the way a hostile or broken one would.
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, alive, reload_on_own_connection, sh, wait_output

#: Far below the gigabyte a planted file would cost if read whole.
RSS_BOUND_KB = 300 * 1024


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


def _victim(daemon: DaemonProcess, text: bytes = b"precious, outside the state dir\n") -> Path:
    """A file of the user's outside the state dir, which no daemon write may reach."""
    victim = daemon.root / "victim"
    victim.write_bytes(text)
    victim.chmod(0o640)
    return victim


def _assert_untouched(victim: Path, text: bytes = b"precious, outside the state dir\n") -> None:
    assert victim.read_bytes() == text
    assert stat.S_IMODE(victim.stat().st_mode) == 0o640


# -- reads -------------------------------------------------------------------


async def test_a_record_json_planted_in_the_archive_is_neither_read_nor_written(
    daemon: DaemonProcess,
) -> None:
    """A worker's record is in the store, out of its reach: a FIFO or a symlink it puts
    where older images kept record.json freezes nothing, is not written through, and
    changes nothing a client sees, before a crash or after."""
    victim = _victim(daemon)
    async with AsyncClient(daemon.socket) as client:
        with trio.fail_after(15):
            fifo = await client.spawn(sh('mkfifo "$SUBAGENTD_ARCHIVE/record.json"; echo fifo'))
            link = await client.spawn(sh(f'ln -s {victim} "$SUBAGENTD_ARCHIVE/record.json"'))
            for worker in (fifo, link):
                assert (await client.wait(worker.id)).state == "finished"
            assert (await client.collect(fifo.id)).result == "fifo\n"
    _assert_untouched(victim)
    assert stat.S_ISFIFO((Path(fifo.archive) / "record.json").lstat().st_mode)  # left as put
    daemon.kill()
    with trio.fail_after(30):
        await trio.to_thread.run_sync(daemon.start)
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(fifo.id)).state == "finished"
            assert (await client.collect(link.id)).state == "finished"
    _assert_untouched(victim)


async def test_git_head_fifo_in_cwd_does_not_freeze_a_spawn(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    tree = daemon.root / "tree"
    with trio.fail_after(15):
        planter = await client.spawn(sh(f"mkdir -p {tree}/.git && mkfifo {tree}/.git/HEAD"))
        assert (await client.wait(planter.id)).exit_code == 0
        worker = await client.spawn(["true"], cwd=tree)
        assert (await client.wait(worker.id)).state == "finished"
        assert (await client.info()).pid > 0


async def test_stdout_tail_symlinked_to_a_huge_file_is_not_read(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    big = daemon.root / "big"
    with trio.fail_after(20):
        worker = await client.spawn(
            sh(f'truncate -s 1G {big} && ln -s {big} "$SUBAGENTD_ARCHIVE/stdout.tail"; echo done')
        )
        await client.wait(worker.id)
        result = await client.collect(worker.id)
        assert result.result == "done\n"  # from the journal, not the planted file
        assert (await client.info()).pid > 0
    assert daemon.proc is not None
    assert _peak_rss_kb(daemon.proc.pid) < RSS_BOUND_KB


async def test_result_symlink_does_not_make_collect_print_another_file(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    secret = daemon.root / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    with trio.fail_after(15):
        worker = await client.spawn(sh(f'ln -s {secret} "$SUBAGENTD_RESULT"; echo my output'))
        await client.wait(worker.id)
        result = await client.collect(worker.id)
    assert "PRIVATE KEY" not in result.result
    assert "result file is not a regular file" in result.result
    assert result.result.endswith("my output\n")


# -- writes ------------------------------------------------------------------


async def test_stdout_tail_tmp_symlink_is_not_written_through(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    victim = _victim(daemon)
    with trio.fail_after(20):
        # Over a megabyte of output: images before the store wrote stdout.tail at the end.
        worker = await client.spawn(
            sh(
                f'ln -s {victim} "$SUBAGENTD_ARCHIVE/stdout.tail.tmp"; '
                "head -c 1200000 /dev/zero | tr '\\0' x; echo; echo the end"
            )
        )
        await client.wait(worker.id)
        result = await client.collect(worker.id)
    assert result.result.endswith("the end\n")
    _assert_untouched(victim)


async def test_checkpoint_tmp_symlink_is_not_written_through_by_a_reload(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    victim = _victim(daemon)
    with trio.fail_after(30):
        worker = await client.spawn(
            sh(f'ln -s {victim} "$SUBAGENTD_ARCHIVE/../../checkpoint.tmp"; echo planted; sleep 60')
        )
        await wait_output(client, worker.id, b"planted")
        assert (daemon.state_dir / "checkpoint.tmp").is_symlink()
        async with AsyncClient(daemon.socket) as asker:
            reply = await asker.reload()
        assert reply.carried_live == 1
        async with AsyncClient(daemon.socket) as after:
            assert (await after.status(worker.id)).state == "running"
    _assert_untouched(victim)


# -- the lock ----------------------------------------------------------------


async def _second_daemon(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    """Start another daemon on the same state dir (its own socket), as a person might."""
    command = [
        str(BIN / "subagentd"),
        "--socket", str(daemon.root / "second.sock"),
        "--state-dir", str(daemon.state_dir),
        "--config", str(daemon.config),
    ]  # fmt: skip
    return await trio.to_thread.run_sync(
        functools.partial(
            subprocess.run, command, env=daemon.env, capture_output=True, text=True, timeout=10
        )
    )


async def _refused_while_the_first_serves(
    daemon: DaemonProcess, client: AsyncClient, plant: str
) -> None:
    assert daemon.proc is not None
    with trio.fail_after(30):
        worker = await client.spawn(sh(f"{plant}; echo planted; sleep 60"))
        await wait_output(client, worker.id, b"planted")
        second = await _second_daemon(daemon)
        assert second.returncode == 1
        assert f"in use by pid {daemon.proc.pid}" in second.stderr
        view = await client.status(worker.id)
        assert view.state == "running"
        assert view.pid is not None
        assert alive(view.pid)


async def test_deleting_the_lock_file_does_not_let_a_second_daemon_in(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    await _refused_while_the_first_serves(daemon, client, 'rm "$SUBAGENTD_ARCHIVE/../../lock"')


async def test_a_lock_symlink_does_not_let_a_second_daemon_in_nor_is_written_through(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    victim = _victim(daemon)
    plant = f'ln -sf {victim} "$SUBAGENTD_ARCHIVE/../../lock"'
    await _refused_while_the_first_serves(daemon, client, plant)
    _assert_untouched(victim)


def _lock_file_held(daemon: DaemonProcess) -> bool:
    """Whether a daemon of an earlier image, which flocks the file `lock`, is kept out."""
    fd = os.open(daemon.state_dir / "lock", os.O_RDWR | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


async def test_a_daemon_of_the_previous_image_holding_the_lock_file_keeps_a_new_one_out(
    daemon_dirs: DaemonProcess,
) -> None:
    """The image before the lock moved to the directory flocks the file `lock`: a new
    daemon must see it held and refuse, naming it, rather than start beside it."""
    daemon_dirs.state_dir.mkdir(mode=0o700)
    old = os.open(daemon_dirs.state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the earlier daemon holds
        os.write(old, b'{"pid":%d,"host":"%s"}' % (os.getpid(), socket.gethostname().encode()))
        with trio.fail_after(30):
            second = await _second_daemon(daemon_dirs)
        assert second.returncode == 1, second.stderr
        assert f"in use by pid {os.getpid()}" in second.stderr
    finally:
        os.close(old)


async def test_a_daemon_of_the_previous_image_is_kept_out_while_one_serves_and_reloads(
    daemon: DaemonProcess,
) -> None:
    """The serving daemon holds the file `lock` too, written in place, and a reload's exec
    carries that flock along with the directory's."""
    assert daemon.proc is not None
    with trio.fail_after(60):
        assert _lock_file_held(daemon)
        for _ in range(2):  # the image a reload starts carries it on again
            assert isinstance(await reload_on_own_connection(daemon), p.ReloadReply)
            assert _lock_file_held(daemon)
        holder = msgspec.json.decode((daemon.state_dir / "lock").read_bytes())
        assert holder["pid"] == daemon.proc.pid
        await trio.to_thread.run_sync(daemon.terminate)
        assert not (daemon.state_dir / "lock").exists()


async def test_a_lock_file_hard_linked_elsewhere_is_replaced_not_written_through(
    daemon_dirs: DaemonProcess,
) -> None:
    victim = _victim(daemon_dirs)
    daemon_dirs.state_dir.mkdir(mode=0o700)
    os.link(victim, daemon_dirs.state_dir / "lock")
    with trio.fail_after(30):
        await trio.to_thread.run_sync(daemon_dirs.start)
        assert _lock_file_held(daemon_dirs)
    _assert_untouched(victim)


# -- resume and git files ----------------------------------------------------


@pytest.mark.parametrize(
    "plant",
    [
        'ln -s loop "$GITDIR/loop"; echo loop > "$GITDIR/commondir"',
        'printf "%0300d" 0 > "$GITDIR/commondir"',  # a name too long to look up
        'printf "a\\000b" > "$GITDIR/commondir"',  # a NUL byte in the path
    ],
    ids=["symlink_loop", "name_too_long", "nul_byte"],
)
async def test_a_planted_git_commondir_refuses_resume_and_latest_with_the_reason(
    daemon: DaemonProcess, tmp_path: Path, plant: str
) -> None:
    """The worker's cwd is a linked worktree (a .git file naming its gitdir); the worker
    makes that gitdir's commondir lead nowhere a lookup can go. Resuming it, its run, or
    asking for the latest resumable run there answers why, never `internal`."""
    work, gitdir = tmp_path / "work", tmp_path / "gitdir"
    work.mkdir()
    gitdir.mkdir()
    (work / ".git").write_text(f"gitdir: {gitdir}\n")
    (gitdir / "HEAD").write_text("ref: refs/heads/main\n")
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh(f"GITDIR={gitdir}; {plant}; echo planted; sleep 60"), cwd=work
            )
            await wait_output(client, worker.id, b"planted")
            await client.stop(worker.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            for rid, request in enumerate(
                [p.Resume(id=0, worker=worker.id), p.ResumeRun(id=0, run=worker.run)], start=2
            ):
                request.id = rid
                await conn.send(request)
                reply = await conn.receive()
                assert isinstance(reply, p.Error), reply
                assert (reply.code, "cannot be read" in reply.message) == ("refused", True), reply
            await conn.send(p.LatestResumable(id=9, cwd=str(work)))
            latest = await conn.receive()
        assert isinstance(latest, p.Latest), latest
        assert (latest.run, latest.resumable) == (worker.run, False)
        assert "cannot be read" in latest.reason
        async with AsyncClient(daemon.socket) as client:
            assert (await client.status(worker.id)).state == "stopped"


def _detached_repo(repo: Path) -> str:
    """A git work tree at `repo` with one commit, HEAD detached at it; the commit."""
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"],
                 ["checkout", "-q", "--detach"]):  # fmt: skip
        subprocess.run([*git, *args], check=True, capture_output=True, timeout=30)
    return (repo / ".git" / "HEAD").read_text().strip()


@pytest.mark.parametrize(
    "plant",
    ["rm .git/HEAD && mkfifo .git/HEAD", 'rm .git/HEAD && ln -s "$ELSEWHERE" .git/HEAD'],
    ids=["fifo", "symlink"],
)
async def test_a_fifo_or_symlink_at_git_head_freezes_no_resume_and_is_never_followed(
    daemon: DaemonProcess, tmp_path: Path, plant: str
) -> None:
    """A worker spawned on a detached HEAD (no branch for the resume to check) puts a FIFO,
    or a symlink to a file elsewhere naming another commit, at .git/HEAD. Its resume
    goes ahead, says HEAD cannot be read now, waits on no writer and reads nothing
    through the symlink."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    head = _detached_repo(repo)
    elsewhere.write_text("ab" * 20 + "\n")
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(
                sh(f"{plant}; echo planted; sleep 60"), cwd=repo, env={"ELSEWHERE": str(elsewhere)}
            )
            await wait_output(client, worker.id, b"planted")
            await client.stop(worker.id)
            resumed = await client.resume(worker.id)
            assert resumed.changed == (
                f"HEAD in {repo} cannot be read now (not a regular file); it was {head}"
            )
            assert (await client.status(worker.id)).state == "running"
            await client.stop(worker.id)
            assert (await client.info()).pid > 0


async def test_a_snapshot_nested_too_deep_refuses_resume_and_latest_with_the_reason(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """JSON nested deeper than the decoder recurses raises RecursionError, no DecodeError."""
    plant = 'printf "%05000d" 0 | tr 0 "[" > "$SUBAGENTD_ARCHIVE/snapshot.json"'
    with trio.fail_after(30):
        async with AsyncClient(daemon.socket) as client:
            worker = await client.spawn(sh(f"{plant}; echo planted; sleep 60"), cwd=tmp_path)
            await wait_output(client, worker.id, b"planted")
            await client.stop(worker.id)
        conn = await RawConnection.open(daemon.socket)
        async with conn.stream:
            await conn.send(p.Resume(id=2, worker=worker.id))
            reply = await conn.receive()
            assert isinstance(reply, p.Error), reply
            assert (reply.code, "no longer reads" in reply.message) == ("refused", True), reply
            await conn.send(p.LatestResumable(id=3, cwd=str(tmp_path)))
            latest = await conn.receive()
        assert isinstance(latest, p.Latest), latest
        assert (latest.run, latest.resumable) == (worker.run, False)
