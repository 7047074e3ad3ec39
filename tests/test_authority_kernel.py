"""Authority by the kernel: where workers have cgroups, a process inside a worker's acts as
that worker whatever its environment says, so a host that drops SUBAGENTD_TOKEN (the MCP
SDK passes its servers six variables) cannot make an agent the user. Without cgroups,
`info` says plainly that scoping is by token and advisory.

Real daemon, real workers: each worker runs subagentctl (or an MCP host, or a client
kept across a reload) itself, and prints what it was answered; the test reads that from
its journal and checks what is still running.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Client
from subagentd.daemon.core._authority import caller_at_hello
from subagentd.daemon.core._session import Close, Session
from subagentd.daemon.processes._cgroup import Cgroups, PeerUnplaced, peer_cgroup
from subagentd.protocol.errors import Forbidden

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, paged_stdout, sh, wait_output
from .inprocess import in_process
from .test_limits import _leave_free, _limit_descriptors

CTL = BIN / "subagentctl"
PYTHON = sys.executable
#: What `info` says in scan mode, in a person's words (client/_cli.py, AUTHORITY_MEANS).
ADVISORY = "token (advisory: no cgroups, so a connection is whom its token says"


@pytest.fixture
def kernel(daemon_dirs: DaemonProcess) -> DaemonProcess:
    """A daemon whose workers have cgroups: authority by the kernel."""
    daemon_dirs.start()
    with Client(daemon_dirs.socket, timeout=30) as client:
        info = client.info()
    if not info.tree_tracking.startswith("cgroup "):
        pytest.skip(f"this machine gives the daemon no cgroup: {info.tree_tracking}")
    assert info.authority == "kernel"
    return daemon_dirs


@pytest.fixture
async def user(kernel: DaemonProcess) -> AsyncIterator[AsyncClient]:
    """The user, outside every worker's cgroup."""
    async with AsyncClient(kernel.socket) as client:
        yield client


async def output_of(client: AsyncClient, worker_id: str) -> str:
    """What a worker printed (stdout and, redirected there, stderr), once it has ended."""
    await client.wait(worker_id)
    return (await paged_stdout(client, worker_id)).decode()


def tokenless(*commands: str) -> list[str]:
    """A worker's script: with SUBAGENTD_TOKEN unset, run each subagentctl command and
    print its output and `exit=<status>`."""
    lines = ["unset SUBAGENTD_TOKEN"]
    lines += [f"{CTL} {command} 2>&1; echo exit=$?" for command in commands]
    return sh("\n".join(lines))


async def test_a_worker_that_drops_its_token_stops_fences_and_cancels_nothing_beyond_itself(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    with trio.fail_after(60):
        epoch = await user.set_fence()
        sibling = await user.spawn(["sleep", "60"])
        elsewhere = await user.spawn(["sleep", "60"])  # a worker of another run
        me = await user.spawn(
            tokenless(
                f"stop {sibling.id}",
                f"stop {elsewhere.id}",
                "fence --clear",
                f"fence --cancel {epoch}",
                "cancel all",
                f"cancel run:{sibling.run}",
                "--json info",
            ),
            run=sibling.run,
        )
        printed = await output_of(user, me.id)
        ended = await user.status(me.id)
        sibling_now = await user.status(sibling.id)
        elsewhere_now = await user.status(elsewhere.id)

    *refusals, info, info_exit = printed.splitlines()
    assert len(refusals) == 12, printed
    for refusal, exit_status in zip(refusals[::2], refusals[1::2], strict=True):
        assert refusal.startswith("subagentctl: forbidden: "), printed
        assert me.id in refusal, printed  # it is told whom it acts as
        assert exit_status == "exit=1"
    assert info_exit == "exit=0"
    shown = json.loads(info)
    assert shown["authority"] == "kernel"
    assert shown["caller"] == me.id
    # Nothing was stopped: not the sibling, not the other run, not the worker itself.
    assert ended.state == "finished", ended
    assert sibling_now.state == "running"
    assert elsewhere_now.state == "running"

    # The user, outside every worker's cgroup, may still do all of it.
    assert kernel.ctl("fence", "--clear").returncode == 0
    stopped = kernel.ctl("stop", sibling.id)
    assert stopped.returncode == 0, stopped.stderr
    cancelled = kernel.ctl("--json", "cancel", "all")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["cancelled"] == [elsewhere.id]


async def test_a_double_forked_setsid_grandchild_is_still_its_worker(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    sibling = await user.spawn(["sleep", "60"])
    escape = kernel.root / "escape.py"
    escape.write_text(
        "import os, sys\n"
        "leader = os.getsid(0)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.environ.pop('SUBAGENTD_TOKEN', None)\n"
        "        print(f'detached pid={os.getpid()} sid={os.getsid(0)} leader_sid={leader}',"
        " flush=True)\n"
        "        os.execv('/bin/sh', ['sh', '-c', sys.argv[1]])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "os.execv('/bin/sleep', ['sleep', '60'])  # its tree lives on with it\n"
    )
    grandchild_does = f"{CTL} stop {sibling.id} 2>&1; echo exit=$?"
    with trio.fail_after(60):
        me = await user.spawn([PYTHON, str(escape), grandchild_does], run=sibling.run)
        printed = (await wait_output(user, me.id, b"exit=")).decode()
        sibling_now = await user.status(sibling.id)

    detached = dict(word.split("=") for word in printed.split("\n", 1)[0].split()[1:])
    # A session of its own, and not its leader (the classic daemon's double fork).
    assert detached["leader_sid"] != detached["sid"] != detached["pid"]
    assert "subagentctl: forbidden: " in printed, printed
    assert f"worker {me.id} may act only on itself" in printed, printed
    assert printed.rstrip().endswith("exit=1"), printed
    assert sibling_now.state == "running"


async def test_a_worker_presenting_another_workers_token_is_refused(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    with trio.fail_after(60):
        other = await user.spawn(sh('echo "token=$SUBAGENTD_TOKEN"; exec sleep 60'))
        token = (await wait_output(user, other.id, b"\n")).decode().split("token=")[1].split()[0]
        me = await user.spawn(
            sh(
                f"SUBAGENTD_TOKEN={token} {CTL} stop {other.id} 2>&1; echo exit=$?\n"
                f"{CTL} --json info 2>&1"  # with its own token: fine
            )
        )
        printed = await output_of(user, me.id)
        other_now = await user.status(other.id)

        # From outside every worker's cgroup, a worker's token is that worker, as before.
        conn = RawConnection(await trio.open_unix_socket(str(kernel.socket)))
        try:
            await conn.send(p.Hello(id=1, token=token))
            welcome = await conn.receive()
        finally:
            await conn.stream.aclose()

    refusal, own = printed.split("exit=1\n")
    assert refusal.startswith("subagentctl: forbidden: "), printed
    assert f"inside worker {me.id}'s cgroup" in refusal
    assert f"may not present worker {other.id}'s token" in refusal
    assert "unset SUBAGENTD_TOKEN" in refusal  # what to do about it
    assert json.loads(own)["caller"] == me.id
    assert other_now.state == "running"
    assert isinstance(welcome, p.Welcome)
    assert welcome.worker == other.id


#: An MCP host inside a worker, configured as the README shows: the server gets only the
#: SDK's default environment (HOME, LOGNAME, PATH, SHELL, TERM, USER) and SUBAGENTD_SOCKET.
MCP_HOST = """\
import json, os, sys
import anyio
from mcp import ClientSession, StdioServerParameters, stdio_client

async def main() -> None:
    server, calls = sys.argv[1], json.loads(sys.argv[2])
    params = StdioServerParameters(
        command=server, env={"SUBAGENTD_SOCKET": os.environ["SUBAGENTD_SOCKET"]}
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = (await session.list_tools()).tools
        print(json.dumps({"offered": sorted(tool.name for tool in listed)}))
        for tool, arguments in calls:
            result = await session.call_tool(tool, arguments)
            text = " ".join(c.text for c in result.content if c.type == "text")
            print(json.dumps({"tool": tool, "is_error": result.is_error, "text": text}))

anyio.run(main)
"""


async def test_an_mcp_server_under_the_readmes_config_inside_a_worker_cannot_stop_a_sibling(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    host = kernel.root / "mcp_host.py"
    host.write_text(MCP_HOST)
    with trio.fail_after(90):
        sibling = await user.spawn(["sleep", "60"])
        calls = [
            ["subagent_stop", {"worker": sibling.id}],
            ["subagent_cancel", {"scope": "all"}],
            ["subagent_stop_run", {"run": sibling.run}],
            ["subagent_list", {}],
        ]
        me = await user.spawn(
            [PYTHON, str(host), str(BIN / "subagentd-mcp"), json.dumps(calls)], run=sibling.run
        )
        await user.wait(me.id)
        printed = (await paged_stdout(user, me.id)).decode()
        ended = await user.status(me.id)
        sibling_now = await user.status(sibling.id)

    offered, *results = [json.loads(line) for line in printed.splitlines()]
    # The daemon told it whose it is (the host passed no token): a worker's tools only.
    assert "subagent_stop" in offered["offered"]
    assert "subagent_stop_run" not in offered["offered"], offered
    assert [r["tool"] for r in results] == [tool for tool, _ in calls], printed
    stop, cancel, stop_run, listed = results
    for result in (stop, cancel):
        assert result["is_error"], result
        assert result["text"].startswith("forbidden: "), result
    assert stop_run["is_error"], stop_run
    assert stop_run["text"] == "not_found: no tool 'subagent_stop_run' here", stop_run
    assert not listed["is_error"]
    assert sibling.id not in listed["text"]  # it sees only itself
    assert ended.state == "finished", ended
    assert sibling_now.state == "running"


async def test_a_process_lingering_in_a_stopping_workers_cgroup_still_acts_as_that_worker(
    kernel: DaemonProcess, user: AsyncClient, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    with trio.fail_after(60):
        sibling = await user.spawn(["sleep", "60"])
        me = await user.spawn(
            sh(
                "trap '' TERM; echo ready\n"
                f"while [ ! -e {go} ]; do sleep 0.02; done\n"
                "unset SUBAGENTD_TOKEN\n"
                f"{CTL} stop {sibling.id} 2>&1; echo exit=$?\n"
                f"{CTL} --json info"
            ),
            run=sibling.run,
            grace=30,
        )
        await wait_output(user, me.id, b"ready")
        await user.stop(me.id, wait=False)
        stopping = await user.status(me.id)
        go.touch()
        printed = await output_of(user, me.id)
        sibling_now = await user.status(sibling.id)

    assert stopping.state == "running"
    assert stopping.stopping
    assert f"subagentctl: forbidden: worker {me.id} may act only on itself" in printed, printed
    assert json.loads(printed.rsplit("exit=1\n", 1)[1])["caller"] == me.id
    assert sibling_now.state == "running"


RELOADED = """\
import os, sys
os.environ.pop("SUBAGENTD_TOKEN")
from subagentd.client import Client
from subagentd.protocol.errors import RemoteError

with Client(timeout=30) as client:
    info = client.info()
    print(f"before generation={info.image_generation} caller={info.caller}", flush=True)
    sys.stdin.readline()  # the test reloads meanwhile; this connection is told `reloading`
    info = client.info()
    print(f"after generation={info.image_generation} caller={info.caller}", flush=True)
    try:
        client.stop(sys.argv[1])
    except RemoteError as exc:
        print(f"stop {exc.code}", flush=True)
    else:
        print("stop done", flush=True)
"""


async def test_a_reload_keeps_a_caller_the_kernel_decided(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    script = kernel.root / "reloaded.py"
    script.write_text(RELOADED)
    with trio.fail_after(60):
        sibling = await user.spawn(["sleep", "60"])
        me = await user.spawn([PYTHON, str(script), sibling.id], stdin_open=True)
        await wait_output(user, me.id, b"before")
        reply = await user.reload()
        assert reply.image_generation == 2
        await user.send(me.id, b"go\n")
        printed = await output_of(user, me.id)
        sibling_now = await user.status(sibling.id)

    assert printed.splitlines() == [
        f"before generation=1 caller={me.id}",
        f"after generation=2 caller={me.id}",
        "stop forbidden",
    ]
    assert sibling_now.state == "running"


async def test_a_connection_handed_over_keeps_whom_its_hello_made_it(short_tmp: Path) -> None:
    """What a reload keeps (the connection that asked) is handed over with whom it acts
    as, not made the user by the handing: the old image's pause, then the serving of it
    again (a reload that failed gives it back so, as the new image takes it after the
    exec). Only the user may ask for a reload, so the server is asked here directly."""
    with trio.fail_after(60):
        answer, worker = await _handed_over_and_asked(short_tmp)
    assert isinstance(answer, p.Error), answer
    assert answer.code == "forbidden"
    assert f"acts as worker {worker.id}" in answer.message


async def _handed_over_and_asked(short_tmp: Path) -> tuple[p.Reply | None, p.WorkerView]:
    async with in_process(short_tmp) as d, d.client() as client:
        worker = await client.spawn(sh('echo "$SUBAGENTD_TOKEN"; exec sleep 60'))
        token = (await wait_output(client, worker.id, b"\n")).decode().strip()
        conn = RawConnection(await trio.open_unix_socket(str(d.socket)))
        try:
            await conn.send(p.Hello(id=1, token=token))
            welcome = await conn.receive()
            assert isinstance(welcome, p.Welcome)
            assert welcome.worker == worker.id
            [held] = [c for c in d.server._open if c.session.caller == worker.id]
            kept = await d.server.pause([(held, 1)])
            assert [handover.caller for handover in kept.values()] == [worker.id]
            d.server.resume(list(kept.values()))
            await conn.send(p.NewRun(id=2))
            answer = await conn.receive()
        finally:
            await conn.stream.aclose()
        await client.stop(worker.id)
    return answer, worker


async def test_without_cgroups_info_says_scoping_is_by_token_and_advisory(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start("--cgroups", "off")
    with trio.fail_after(60):
        async with AsyncClient(daemon_dirs.socket) as user:
            info = await user.info()
            sibling = await user.spawn(["sleep", "60"])
            me = await user.spawn(
                sh(
                    f"{CTL} stop {sibling.id} 2>&1; echo exit=$?\n"  # its token: scoped
                    f"{CTL} --json info\n"
                    f"unset SUBAGENTD_TOKEN; {CTL} --json info"  # without: the user (advisory)
                ),
                run=sibling.run,
            )
            printed = await output_of(user, me.id)
            sibling_now = await user.status(sibling.id)

    assert info.authority == "token"
    assert info.caller is None
    text = daemon_dirs.ctl("info").stdout
    assert f"authority: {ADVISORY}" in text
    assert "a worker's process that omits its token acts for the user" in text
    assert "caller: the user" in text
    assert json.loads(daemon_dirs.ctl("--json", "info").stdout)["authority"] == "token"

    refusal, exit_status, with_token, without = printed.splitlines()
    assert refusal.startswith(f"subagentctl: forbidden: worker {me.id} may act only"), printed
    assert exit_status == "exit=1"
    documents = [json.loads(with_token), json.loads(without)]
    assert [d["caller"] for d in documents] == [me.id, None]
    assert all(d["authority"] == "token" for d in documents)
    assert sibling_now.state == "running"


async def test_a_connection_no_descriptor_is_left_to_place_is_refused_not_made_the_user(
    kernel: DaemonProcess,
) -> None:
    assert kernel.proc is not None
    pid = kernel.proc.pid
    held: list[socket.socket] = []
    welcomed: list[RawConnection] = []
    with trio.fail_after(30):
        try:
            limit = _limit_descriptors(pid, spare=12)
            # Placing a peer takes two descriptors for a moment (its pidfd, the read of
            # /proc/PID/cgroup) besides the connection's own: leave the daemon two.
            await trio.to_thread.run_sync(_leave_free, pid, limit, 2, held, kernel.socket)
            # (A descriptor the daemon held for a moment as they were counted may leave it
            # one more: a connection welcomed is held too, and the next one tried.)
            refusal: p.DaemonMessage | None = None
            for _ in range(4):
                conn = await RawConnection.open(kernel.socket, hello=False)
                welcomed.append(conn)
                await conn.send(p.Hello(id=1))
                refusal = await conn.receive()
                if not isinstance(refusal, p.Welcome):
                    break
            assert isinstance(refusal, p.Error), f"welcomed with no descriptor to spare: {refusal}"
            assert await conn.receive() is None  # and closed
            held.pop().close()  # one more free: it is placed, and acts for the user
            conn = await RawConnection.open(kernel.socket, hello=False)
            try:
                await conn.send(p.Hello(id=1))
                welcome = await conn.receive()
            finally:
                await conn.stream.aclose()
        finally:
            for sock in held:
                sock.close()
            for raw in welcomed:
                await raw.stream.aclose()

    assert isinstance(refusal, p.Error), refusal
    assert refusal.code == "forbidden"
    assert "cannot tell whether this connection comes from inside a worker" in refusal.message
    assert "Too many open files" in refusal.message
    assert isinstance(welcome, p.Welcome)
    assert welcome.worker is None


# -- the pieces, called as they are: placing a process, and the hello's decision -------

WORKERS = Cgroups(
    Path("/sys/fs/cgroup/user.slice/subagentd.service/subagentd-0123456789ab"),
    home=Path("/sys/fs/cgroup/user.slice/subagentd.service"),
    listed_as="/user.slice/subagentd.service/subagentd-0123456789ab",
)
#: A host with the v1 hierarchies mounted and the v2 one beside them ("unified"): the v1
#: lines say nothing of workers, whatever their paths.
HYBRID = """\
9:name=systemd:/user.slice/subagentd.service/subagentd-0123456789ab/w-decoy
4:memory:/process_api/96d3014c531e5ec7cc6a69126282a700
1:cpu:/
0::{}
"""


@pytest.mark.parametrize(
    ("path", "worker"),
    [
        ("/user.slice/subagentd.service/subagentd-0123456789ab/w-1234567890", "w-1234567890"),
        # What the worker made below its own cgroup is still its.
        ("/user.slice/subagentd.service/subagentd-0123456789ab/w-1234567890/mine", "w-1234567890"),
        # A cgroup removed under it: still the worker's, never the user's.
        (
            "/user.slice/subagentd.service/subagentd-0123456789ab/w-1234567890 (deleted)",
            "w-1234567890",
        ),
        ("/user.slice/subagentd.service", None),  # the daemon's own: outside every worker's
        ("/user.slice/subagentd.service/subagentd-0123456789ab", None),  # in no worker's
        ("/user.slice/subagentd.service/subagentd-ba9876543210/w-1234567890", None),  # another
        ("/", None),
        ("/../../user.slice/subagentd.service/subagentd-0123456789ab/w-x", None),  # another ns
        # Never listed so; were it, the connection would act as no one, never the user.
        ("/user.slice/subagentd.service/subagentd-0123456789ab/../w-1234567890", ".."),
    ],
)
@pytest.mark.parametrize("layout", ["v2", "hybrid"])
def test_a_process_is_placed_by_its_cgroup_v2_line_alone(
    path: str, worker: str | None, layout: str
) -> None:
    listing = f"0::{path}\n" if layout == "v2" else HYBRID.format(path)
    assert WORKERS.worker_of(listing) == worker


@pytest.mark.parametrize(
    "listing",
    ["", "\n", "4:memory:/user.slice/subagentd.service/subagentd-0123456789ab/w-1\n", "0:x:/\n"],
)
def test_a_listing_without_a_cgroup_v2_line_places_no_one(listing: str) -> None:
    with pytest.raises(PeerUnplaced, match="names no cgroup v2"):
        WORKERS.worker_of(listing)


def test_the_workers_cgroup_of_a_daemon_at_the_hierarchys_root_is_found_as_listed() -> None:
    # This machine's test daemon: v1 hierarchies, its v2 cgroup the root of "unified".
    at_root = Cgroups(
        Path("/sys/fs/cgroup/unified/subagentd-0123456789ab"),
        home=Path("/sys/fs/cgroup/unified"),
        listed_as="/subagentd-0123456789ab",
    )
    assert at_root.worker_of(HYBRID.format("/subagentd-0123456789ab/w-1")) == "w-1"
    assert at_root.worker_of(HYBRID.format("/")) is None


async def test_a_peer_that_exited_is_never_placed_by_a_pid_that_may_be_another_s() -> None:
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(["sleep", "60"])
        pidfd = os.pidfd_open(process.pid)
        try:
            assert "0::" in peer_cgroup(process.pid, pidfd)  # alive: read
            process.kill()
            await trio.lowlevel.wait_readable(pidfd)
            # A zombie still reads; but it has exited, and its pid is no proof of it.
            with pytest.raises(PeerUnplaced, match="exited as its cgroup was read"):
                peer_cgroup(process.pid, pidfd)
            await process.wait()
            with pytest.raises(PeerUnplaced, match="has exited"):
                peer_cgroup(process.pid, None)
        finally:
            os.close(pidfd)


@pytest.mark.parametrize("pid", [0, -1])
def test_a_peer_with_no_pid_the_daemon_can_see_is_not_placed(pid: int) -> None:
    with pytest.raises(PeerUnplaced, match="no pid in the daemon's pid namespace"):
        peer_cgroup(pid, None)


TOKENS = {"t-own": "w-own", "t-other": "w-other"}


@pytest.mark.parametrize(
    ("token", "within", "caller"),
    [
        (None, None, None),  # outside every worker, no token: the user
        ("t-other", None, "w-other"),  # outside, a worker's token: that worker, as ever
        (None, "w-own", "w-own"),  # inside, its token dropped: still the worker
        ("t-own", "w-own", "w-own"),  # inside, its own token: fine
        (None, "w-released", "w-released"),  # inside a cgroup of a worker no longer known
    ],
)
def test_whom_a_connection_acts_as(token: str | None, within: str | None, caller: str) -> None:
    assert caller_at_hello(token, within, TOKENS.get) == caller


@pytest.mark.parametrize(
    ("token", "within", "why"),
    [
        ("t-other", "w-own", "inside worker w-own's cgroup.*may not present worker w-other's"),
        ("t-nobody", "w-own", "token is not known"),
        ("t-nobody", None, "token is not known"),
        ("", None, "token is not known"),
    ],
)
def test_a_token_a_connection_may_not_give_is_refused(
    token: str, within: str | None, why: str
) -> None:
    with pytest.raises(Forbidden, match=why):
        caller_at_hello(token, within, TOKENS.get)


def hello_in(within: str | None, token: str | None) -> tuple[Session, p.Reply | Close | None]:
    """A session placed `within` a worker's cgroup (None: outside every worker's), fed a
    hello with `token`; the session and what it answers."""
    session = Session(TOKENS.get, pid=4242, daemon_version="9.9", frame_limit=1 << 20)
    session.within = within
    session.receive(p.encode(p.Hello(id=1, token=token)))
    event = session.next_event()
    assert event is None or isinstance(event, p.Reply | Close)
    return session, event


def test_a_session_placed_in_a_workers_cgroup_welcomes_it_as_that_worker() -> None:
    session, welcome = hello_in("w-own", None)
    assert isinstance(welcome, p.Welcome)
    assert welcome.worker == session.caller == "w-own"


def test_a_session_placed_in_a_workers_cgroup_closes_on_another_workers_token() -> None:
    session, closed = hello_in("w-own", "t-other")
    assert isinstance(closed, Close)
    assert closed.error.code == "forbidden"
    assert "may not present worker w-other's token" in closed.error.message
    assert not session.welcomed
    assert session.caller is None


async def test_a_worker_whose_cgroup_cannot_be_made_is_not_started_outside_it(
    kernel: DaemonProcess, user: AsyncClient
) -> None:
    # Started outside its cgroup (once, the fallback to scanning), a worker was outside
    # every worker's: its tokenless connections acted for the user. Now it is not started.
    with trio.fail_after(60):
        sibling = await user.spawn(["sleep", "60"])
        base = Path((await user.info()).tree_tracking.removeprefix("cgroup "))
        limit = base / "cgroup.max.descendants"
        limit.write_text("1")  # the sibling's: no room for another
        try:
            me = await user.spawn(tokenless(f"stop {sibling.id}"), run=sibling.run)
        finally:
            limit.write_text("max")
        ended = await user.wait(me.id)
        sibling_now = await user.status(sibling.id)
        log = kernel.log()
        again = await user.spawn(["true"])  # room again: spawns as before
        assert (await user.wait(again.id)).state == "finished"
    assert me.pid is None, me  # nothing ran
    assert ended.state == "failed", ended
    assert f"cannot use {base / me.id}" in log
    assert "its connections would act for the user; nothing was started" in log
    assert sibling_now.state == "running"
