"""Limits on what a worker and its subtree, or a run, may take: enforced by the kernel for
real (the v1 memory, cpu and pids hierarchies of this machine), the `memory_limit` ending
with its one wake, and every door a limit comes in by refusing what cannot be taken."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient, Client
from subagentd.protocol.errors import Refused

from .conftest import BIN, DaemonProcess
from .helpers import sh, wait_output

MIB = 1024 * 1024
#: Allocates (and touches) 8 MiB a step, up to `argv[1]` MiB, then says so and sleeps.
ALLOCATE = (
    "import sys, time\n"
    "chunks = []\n"
    "for _ in range(int(sys.argv[1]) // 8):\n"
    "    chunks.append(bytearray(8 * 1024 * 1024))\n"
    "print('allocated', flush=True)\n"
    "time.sleep(60)\n"
)
SPIN = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


def _allocate(mib: int) -> list[str]:
    return [sys.executable, "-c", ALLOCATE, str(mib)]


def _v1_writable() -> str | None:
    """Why the v1 hierarchies cannot be written here (None: they can)."""
    for name in ("memory", "cpu", "pids"):
        root = Path("/sys/fs/cgroup") / name
        if not (root / "tasks").exists():
            return f"no cgroup v1 {name} hierarchy at {root}"
        if not os.access(root / "tasks", os.W_OK):
            return f"the cgroup v1 {name} hierarchy at {root} is not writable"
    return None


needs_v1 = pytest.mark.skipif(_v1_writable() is not None, reason=str(_v1_writable()))


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


def _node(info: p.DaemonInfo, kind: str, relative: str) -> Path:
    """A worker's limit node of `kind`, from where `info` says the nodes are."""
    how = info.controls[kind].how
    base = how.split(" of nodes under ", 1)[1].split(" ", 1)[0]
    return Path(base) / relative


async def _wake_of(client: AsyncClient, run: str, worker: str) -> list[p.Wake]:
    """Every wake of `run` pending now for `worker` (all posted: it has ended)."""
    async with contextlib.aclosing(client.events(run=run, ack=False)) as wakes:
        return [wake async for wake in wakes if wake.id == worker]


async def _journal_notes(client: AsyncClient, worker: str) -> list[str]:
    page = await client.watch_page(worker, 0, 10_000)
    return [e.data.decode() for e in page.entries if e.kind == "note"]


@needs_v1
async def test_info_says_what_is_enforced_and_how(client: AsyncClient) -> None:
    with trio.fail_after(10):
        info = await client.info()
    assert set(info.controls) == {"memory", "cpus", "pids", "freeze"}
    assert info.controls["freeze"] == p.Control(enforced=True, how="cgroup v2 cgroup.freeze")
    for kind in p.LIMIT_KINDS:
        control = info.controls[kind]
        assert control.enforced, (kind, control)
        assert "cgroup v1" in control.how, control
        assert "subagentd-" in control.how, control


@needs_v1
async def test_allocating_past_its_memory_limit_ends_failed_memory_limit(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        run = await client.new_run()
        worker = await client.spawn(
            _allocate(256), run=run, limits=p.Limits(memory=p.memory_bytes("64M"))
        )
        assert worker.limits == p.Limits(memory=64 * MIB)
        ended = await client.wait(worker.id)
        assert ended.state == "failed"
        assert ended.reason == "memory_limit"
        assert (await client.status(worker.id)).reason == "memory_limit"
        wakes = await _wake_of(client, run, worker.id)
        assert [(w.state, w.reason) for w in wakes] == [("failed", "memory_limit")]
        notes = await _journal_notes(client, worker.id)
        (note,) = [n for n in notes if n.startswith("memory_limit:")]
        peak = int(note.split("peak: ")[1].split(" ")[0])
        assert 60 * MIB <= peak <= 64 * MIB, note
    listed = daemon.ctl("ls", "--all")
    assert "failed (memory_limit)" in listed.stdout, listed.stdout + listed.stderr


@needs_v1
async def test_a_worker_under_its_limits_finishes_and_leaves_no_node(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        worker = await client.spawn(
            sh("echo hello"), limits=p.Limits(memory=64 * MIB, cpus=1.0, pids=50)
        )
        ended = await client.wait(worker.id)
        assert (ended.state, ended.reason) == ("finished", "")
        assert await _journal_notes(client, worker.id) == []
    bases = [_node(info, kind, "") for kind in ("memory", "cpus", "pids")]
    assert all(base.is_dir() for base in bases)
    # Its nodes go once it has ended; the daemon's own once it stops with nothing live.
    assert daemon.terminate() == 0
    assert [base for base in bases if base.exists()] == []


#: Forks 100 children that sleep, counting the forks refused, then says how many.
FORK_LOOP = (
    "import os, time\n"
    "refused = 0\n"
    "for _ in range(100):\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(30)\n"
    "            os._exit(0)\n"
    "    except BlockingIOError:\n"
    "        refused += 1\n"
    "print('refused', refused, flush=True)\n"
    "time.sleep(30)\n"
)


@needs_v1
async def test_a_process_limit_stops_a_fork_loop_and_is_journaled(
    client: AsyncClient,
) -> None:
    with trio.fail_after(60):
        info = await client.info()
        worker = await client.spawn(
            [sys.executable, "-c", FORK_LOOP], limits=p.Limits(pids=20), grace=0
        )
        said = await wait_output(client, worker.id, b"\n")
        node = _node(info, "pids", f"{worker.run}/{worker.id}")
        assert int((node / "pids.current").read_text()) <= 20
        # 19 children beside it (Python's own threads none): 81 refused.
        assert said == b"refused 81\n", said
        assert int((node / "pids.events").read_text().split()[1]) == 81
        await client.stop(worker.id)
        notes = await _journal_notes(client, worker.id)
        assert "pids_limit: 81 forks refused at a process limit (pids.events max 81)" in notes


def _usage_usec(daemon: DaemonProcess, info: p.DaemonInfo, worker: str) -> int:
    """CPU time of a worker's v2 cgroup (cpu.stat is there even without the controller)."""
    base = info.tree_tracking.removeprefix("cgroup ")
    text = (Path(base) / worker / "cpu.stat").read_text()
    return int(text.split("usage_usec ")[1].split()[0])


@needs_v1
async def test_a_cpu_limit_holds_a_spinning_worker_to_its_share(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(30):
        info = await client.info()
        if not info.tree_tracking.startswith("cgroup "):
            pytest.skip(f"no v2 cgroup to read the worker's CPU time from: {info.tree_tracking}")
        worker = await client.spawn(
            [sys.executable, "-c", SPIN], limits=p.Limits(cpus=0.2), grace=0
        )
        await trio.sleep(0.3)  # its start's own cost out of the measure
        before, at = _usage_usec(daemon, info, worker.id), trio.current_time()
        await trio.sleep(1.0)
        used = (_usage_usec(daemon, info, worker.id) - before) / 1e6
        share = used / (trio.current_time() - at)
        await client.stop(worker.id)
    assert 0.1 <= share <= 0.3, share


@needs_v1
async def test_a_subtree_limit_holds_across_a_delegated_child(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    with trio.fail_after(60):
        info = await client.info()
        run = await client.new_run()
        parent = await client.spawn(sh("sleep 60"), run=run, limits=p.Limits(memory=96 * MIB))
        # The child has no limit of its own: its parent's covers it.
        child = await client.spawn(_allocate(256), run=run, parent=parent.id)
        assert child.limits is None
        ended = await client.wait(child.id)
        assert (ended.state, ended.reason) == ("failed", "memory_limit")
        parent_node = _node(info, "memory", f"{run}/{parent.id}")
        assert int((parent_node / "memory.limit_in_bytes").read_text()) == 96 * MIB
        assert int((parent_node / "memory.max_usage_in_bytes").read_text()) >= 80 * MIB
        assert (await client.status(parent.id)).state == "running"
        wakes = await _wake_of(client, run, child.id)
        assert wakes == []  # the child's wake is its parent's, not the run's
        await client.stop(parent.id)


@needs_v1
async def test_a_run_limit_covers_the_run_s_workers_together(
    client: AsyncClient,
) -> None:
    with trio.fail_after(60):
        info = await client.info()
        run = await client.new_run(limits=p.Limits(memory=128 * MIB))
        first = await client.spawn(_allocate(80), run=run)
        await wait_output(client, first.id, b"allocated")
        second = await client.spawn(_allocate(80), run=run)
        # Together past the run's limit: the kernel kills in the run, the larger first
        # (either may be it, as their sizes are the same), and the other lives on.
        ended: list[p.WorkerView] = []
        async with trio.open_nursery() as nursery:

            async def wait(worker: str) -> None:
                ended.append(await client.wait(worker))
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait, first.id)
            nursery.start_soon(wait, second.id)
        assert [(e.state, e.reason) for e in ended] == [("failed", "memory_limit")]
        node = _node(info, "memory", run)
        assert int((node / "memory.limit_in_bytes").read_text()) == 128 * MIB
        (other,) = {first.id, second.id} - {ended[0].id}
        assert (await client.status(other)).state == "running"
        await client.stop(other)


@needs_v1
async def test_a_resume_runs_under_the_snapshot_s_limits(client: AsyncClient) -> None:
    with trio.fail_after(60):
        info = await client.info()
        # Its first attempt fails; its second allocates past the snapshot's limit.
        allocate = shlex.join(_allocate(256))
        script = f'[ "$SUBAGENTD_RESUME" ] || exit 3; exec {allocate}'
        worker = await client.spawn(sh(script), limits=p.Limits(memory=48 * MIB, pids=30))
        assert (await client.wait(worker.id)).state == "failed"
        again = await client.resume(worker.id)
        assert again.limits == p.Limits(memory=48 * MIB, pids=30)
        node = _node(info, "pids", f"{worker.run}/{worker.id}")
        assert int((node / "pids.max").read_text()) == 30
        ended = await client.wait(worker.id)
        assert (ended.attempt, ended.state, ended.reason) == (2, "failed", "memory_limit")


@needs_v1
async def test_a_reload_keeps_limits_in_force(client: AsyncClient, daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        info = await client.info()
        # Allocates once told to, by a line on its stdin, after the reload.
        script = f"read go; exec {shlex.join(_allocate(256))}"
        worker = await client.spawn(sh(script), limits=p.Limits(memory=64 * MIB), stdin_open=True)
        await client.reload()
        assert (await client.status(worker.id)).limits == p.Limits(memory=64 * MIB)
        node = _node(info, "memory", f"{worker.run}/{worker.id}")
        assert int((node / "memory.limit_in_bytes").read_text()) == 64 * MIB
        await client.send(worker.id, b"go\n")
        ended = await client.wait(worker.id)
        assert (ended.state, ended.reason) == ("failed", "memory_limit")


@needs_v1
async def test_a_delegate_is_placed_only_in_the_hierarchies_its_way_limits(
    client: AsyncClient,
) -> None:
    """A chain whose root has no limit, its child a memory limit, the grandchild none: the
    grandchild goes in the memory hierarchy below its parent, and in no other (its
    ancestors' records are known: none of them limits CPU or processes)."""
    with trio.fail_after(60):
        info = await client.info()
        root = await client.spawn(["sleep", "60"])
        parent = await client.spawn(
            ["sleep", "60"], parent=root.id, limits=p.Limits(memory=96 * MIB)
        )
        child = await client.spawn(["sleep", "60"], parent=parent.id)
        relative = f"{root.run}/{root.id}/{parent.id}/{child.id}"
        assert _node(info, "memory", relative).is_dir()
        for kind in ("cpus", "pids"):
            assert not _node(info, kind, relative).exists(), kind
            assert not _node(info, kind, f"{root.run}/{root.id}").exists(), kind
        await client.stop(root.id)


async def test_a_limit_is_refused_where_cgroups_are_off(daemon_dirs: DaemonProcess) -> None:
    daemon_dirs.start("--cgroups", "off")
    with trio.fail_after(20):
        async with AsyncClient(daemon_dirs.socket) as client:
            info = await client.info()
            assert all(not info.controls[kind].enforced for kind in p.LIMIT_KINDS)
            # A pause is still had, by signals over the scanned tree.
            assert info.controls["freeze"] == p.Control(
                enforced=True, how="SIGSTOP/SIGCONT over the process tree (scan)"
            )
            assert "--cgroups off" in info.controls["memory"].how
            with pytest.raises(Refused, match=r"memory limit, which this daemon cannot enforce"):
                await client.spawn(sh("true"), limits=p.Limits(memory=64 * MIB))
            with pytest.raises(Refused, match=r"pids limit"):
                await client.new_run(limits=p.Limits(pids=10))
            # Nothing was made of the refused spawn; one without a limit runs.
            worker = await client.spawn(sh("true"))
            assert (await client.wait(worker.id)).state == "finished"
            assert len(await client.ls(all=True)) == 1


HOSTILE = {
    "memory": [0, -1, 1024, 2**50 + 1, 2**63 - 1, 1.5, "2G", "lots", True],
    "cpus": [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 0.001, 1025.0, "1.5", 1e308],
    "pids": [0, -5, 4_194_305, 2**63 - 1, 2.5, "many"],
}


@pytest.mark.parametrize(
    ("field", "value"), [(f, v) for f, values in HOSTILE.items() for v in values]
)
def test_hostile_limits_fail_decoding_naming_the_field(field: str, value: object) -> None:
    body = msgspec.msgpack.encode(
        {"op": "spawn", "id": 1, "argv": ["true"], "limits": {field: value}}
    )
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.limits\.{field}"):
        p.client_decoder.decode(body)
    run = msgspec.msgpack.encode({"op": "new_run", "id": 1, "limits": {field: value}})
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.limits\.{field}"):
        p.client_decoder.decode(run)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64M", 64 * MIB),
        ("2G", 2 << 30),
        ("1.5G", 3 << 29),
        ("512MiB", 512 * MIB),
        ("512mb", 512 * MIB),
        ("1048576", MIB),
        (MIB, MIB),
        ("1P", 2**50),
    ],
)
def test_memory_forms_people_write(text: object, expected: int) -> None:
    assert p.memory_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "lots", "64X", "-64M", "0", "1K", "nan", "inf", "2P", "1e9", "64 M B", True]
)
def test_memory_forms_refused(text: object) -> None:
    with pytest.raises(p.LimitError, match=r"^memory: "):
        p.memory_bytes(text)


@pytest.mark.parametrize("text", ["", "two", "nan", "inf", "-1", "0", "0.001", "1025", True])
def test_cpu_forms_refused(text: object) -> None:
    with pytest.raises(p.LimitError, match=r"^cpus: "):
        p.cores(text)


@pytest.mark.parametrize("text", ["", "many", "0", "-3", "2.5", "4194305", "1e3", True, 2.0])
def test_pids_forms_refused(text: object) -> None:
    with pytest.raises(p.LimitError, match=r"^pids: "):
        p.process_count(text)


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--memory", "lots", "memory"),
        ("--memory", "0", "memory"),
        ("--memory", "2P", "memory"),
        ("--cpus", "nan", "cpus"),
        ("--cpus", "inf", "cpus"),
        ("--cpus", "-1", "cpus"),
        ("--cpus", "0", "cpus"),
        ("--pids", "0", "pids"),
        ("--pids", "9999999999", "pids"),
        ("--pids", "many", "pids"),
        ("--memory", "", "memory"),
    ],
)
def test_the_cli_refuses_hostile_limits(
    daemon: DaemonProcess, flag: str, value: str, field: str
) -> None:
    for command in (["spawn", flag, value, "--", "true"], ["new-run", flag, value]):
        done = daemon.ctl(*command)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert f"{field}: " in done.stderr, done.stderr
    with Client(daemon.socket) as sync:
        assert sync.ls(all=True) == []


def test_the_cli_spawns_and_shows_limits(daemon: DaemonProcess) -> None:
    if _v1_writable() is not None:
        pytest.skip(str(_v1_writable()))
    done = daemon.ctl("spawn", "--memory", "1.5G", "--cpus", "1.5", "--pids", "100", "--", "true")
    assert done.returncode == 0, done.stderr
    worker = done.stdout.split()[0]
    with Client(daemon.socket) as sync:
        view = sync.status(worker)
    assert view.limits == p.Limits(memory=3 << 29, cpus=1.5, pids=100)
    shown = daemon.ctl("status", worker)
    assert "memory 1536M, cpus 1.5, pids 100" in shown.stdout, shown.stdout
    run = daemon.ctl("new-run", "--memory", "2G")
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('memory = "lots"', "agents.a.memory"),
        ("memory = 0", "agents.a.memory"),
        ("memory = 1.5", "agents.a.memory"),
        ("cpus = nan", "agents.a.cpus"),
        ("cpus = inf", "agents.a.cpus"),
        ("cpus = -1", "agents.a.cpus"),
        ("cpus = true", "agents.a.cpus"),
        ("pids = 0", "agents.a.pids"),
        ('pids = "many"', "agents.a.pids"),
        ("pids = 99999999999", "agents.a.pids"),
    ],
)
def test_agents_toml_refuses_hostile_limits_naming_file_and_key(
    daemon_dirs: DaemonProcess, line: str, key: str
) -> None:
    daemon_dirs.config.write_text(f'[agents.a]\ncommand = ["true"]\n{line}\n')
    done = subprocess.run(
        [str(BIN / "subagentd"), "--config", str(daemon_dirs.config), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
        env=daemon_dirs.env,
    )
    assert done.returncode != 0
    assert f"{daemon_dirs.config}: {key}" in done.stderr, done.stderr


@needs_v1
async def test_an_agent_s_limits_apply_and_a_spawn_s_lay_over_them(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.config.write_text(
        '[agents.a]\ncommand = ["sh", "-c", "exit 0"]\nmemory = "2G"\ncpus = 1.5\npids = 100\n'
    )
    daemon_dirs.start()
    with trio.fail_after(20):
        async with AsyncClient(daemon_dirs.socket) as client:
            plain = await client.spawn([], agent="a")
            assert plain.limits == p.Limits(memory=2 << 30, cpus=1.5, pids=100)
            over = await client.spawn([], agent="a", limits=p.Limits(pids=10))
            assert over.limits == p.Limits(memory=2 << 30, cpus=1.5, pids=10)


async def test_the_mcp_spawn_tool_takes_limits_and_refuses_hostile_ones(
    daemon: DaemonProcess,
) -> None:
    from .test_mcp import call, mcp_server, refused

    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            hostile: dict[str, list[object]] = {
                "memory": [0, -1, "lots", "", "2P", 1.5, True, 2**63],
                "cpus": [0, -1, "nan", "inf", 1025, "two", True],
                "pids": [0, -1, "many", 2.5, 4_194_305, True],
            }
            for field, values in hostile.items():
                for value in values:
                    error = await refused(
                        session, "subagent_spawn", argv=["true"], **{field: value}
                    )
                    assert error["code"] == "invalid", (field, value, error)
                    assert error["message"].startswith(f"{field}: "), (field, value, error)
            if _v1_writable() is not None:
                return
            worker = await call(
                session, "subagent_spawn", argv=["true"], memory="64M", cpus=0.5, pids="20"
            )
            assert worker["limits"] == {"memory": 64 * MIB, "cpus": 0.5, "pids": 20}
            assert worker["reason"] == ""
    with Client(daemon.socket) as sync:
        assert len(sync.ls(all=True)) == 1  # no refused one was made


@needs_v1
def test_a_clean_start_sweeps_the_limit_nodes_a_dead_daemon_left(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start()
    with Client(daemon_dirs.socket) as sync:
        info = sync.info()
        bases = [_node(info, kind, "") for kind in ("memory", "pids")]
        worker = sync.spawn(sh("sleep 60"), limits=p.Limits(memory=64 * MIB, pids=10))
        leaf = f"{worker.run}/{worker.id}"
        assert all((base / leaf).is_dir() for base in bases)
        # No CPU limit on its way: it is placed in no cpu node.
        assert not _node(info, "cpus", leaf).exists()
    daemon_dirs.kill()  # no shutdown: its nodes (and its worker) are left behind
    assert all((base / leaf).is_dir() for base in bases)
    daemon_dirs.start()
    with Client(daemon_dirs.socket) as sync:
        assert sync.status(worker.id).state == "interrupted"
        sync.info()  # served: the sweep at its start is done
    assert [base / leaf for base in bases if (base / leaf).exists()] == []
    assert [base / worker.run for base in bases if (base / worker.run).exists()] == []


@needs_v1
async def test_a_limited_worker_s_memory_is_read_from_its_v1_memory_node(
    client: AsyncClient,
) -> None:
    """Where the worker has a v1 memory node (a memory limit on its way), its usage's memory
    and peak are that node's counters: 100 MiB touched shows as 100 MiB more, within 10%."""
    from .test_usage import OBEDIENT, told, usage_of

    with trio.fail_after(60):
        info = await client.info()
        worker = await client.spawn(
            [sys.executable, "-c", OBEDIENT], stdin_open=True, limits=p.Limits(memory=512 * MIB)
        )
        await wait_output(client, worker.id, b"ready")
        before = await usage_of(client, worker.id)
        assert before.source == "cgroup", before
        await told(client, worker, "alloc", b"allocated")
        allocated = await usage_of(client, worker.id)
        grown = allocated.memory - before.memory
        assert abs(grown - 100 * MIB) < 10 * MIB, (before, allocated)
        node = _node(info, "memory", f"{worker.run}/{worker.id}")
        peak = int((node / "memory.max_usage_in_bytes").read_text())
        assert allocated.memory_peak is not None
        assert allocated.memory <= allocated.memory_peak <= peak
        assert allocated.memory_peak >= before.memory + 100 * MIB - 2 * MIB
        await told(client, worker, "free", b"freed")
        freed = await usage_of(client, worker.id)
        assert freed.memory < allocated.memory - 50 * MIB, freed
        assert freed.memory_peak is not None
        assert freed.memory_peak >= allocated.memory  # the node's peak stands
        await client.stop(worker.id)


@needs_v1
def test_a_clean_start_removes_the_empty_bases_a_killed_daemon_left(
    daemon_dirs: DaemonProcess,
) -> None:
    """A daemon killed with nothing live leaves its bases (and the spare nodes it made
    ahead) behind: the next start removes them, and makes them again at a limited spawn."""
    daemon_dirs.start()
    with Client(daemon_dirs.socket) as sync:
        info = sync.info()
        bases = [_node(info, kind, "") for kind in ("memory", "cpus", "pids")]
        worker = sync.spawn(sh("true"), limits=p.Limits(memory=64 * MIB, cpus=1.0, pids=10))
        assert sync.wait(worker.id).state == "finished"
        assert all(base.is_dir() for base in bases)
    daemon_dirs.kill()
    assert all(base.is_dir() for base in bases)  # left: no shutdown removed them
    daemon_dirs.start()
    with Client(daemon_dirs.socket) as sync:
        sync.info()  # served: the sweep at its start is done
        assert [base for base in bases if base.exists()] == []
        again = sync.spawn(sh("sleep 60"), limits=p.Limits(pids=10))
        assert (bases[2] / again.run / again.id).is_dir()
        sync.stop(again.id)


@needs_v1
async def test_a_run_limit_covers_the_runs_nested_in_it(client: AsyncClient) -> None:
    """A run nested in a limited one (`new_run(outer=R)`) is part of it, as R's stop stops
    it: its workers' nodes are below R's, and R's limit holds them (with R's own)."""
    with trio.fail_after(60):
        info = await client.info()
        outer = await client.new_run(limits=p.Limits(memory=96 * MIB, pids=40))
        inner = await client.new_run(outer)
        deeper = await client.new_run(inner)
        beside = await client.spawn(sh("sleep 60"), run=outer)
        worker = await client.spawn(_allocate(256), run=deeper)
        ended = await client.wait(worker.id)
        assert (ended.state, ended.reason) == ("failed", "memory_limit")
        node = _node(info, "memory", outer)
        assert int((node / "memory.limit_in_bytes").read_text()) == 96 * MIB
        assert int((node / "memory.max_usage_in_bytes").read_text()) >= 80 * MIB
        pids = _node(info, "pids", outer)
        assert int((pids / "pids.max").read_text()) == 40
        assert (pids / beside.id).is_dir()  # the outer run's own worker, beside the nested
        # A worker of the nested run forks under the outer run's process limit, which the
        # outer run's own worker shares.
        forked = await client.spawn([sys.executable, "-c", FORK_LOOP], run=inner, grace=0)
        said = await wait_output(client, forked.id, b"\n")
        assert _node(info, "pids", f"{outer}/{inner}/{forked.id}").is_dir()
        assert int((pids / "pids.current").read_text()) <= 40
        assert int(said.split()[1]) >= 60, said  # 100 forks, at most 38 beside the rest
        await client.stop_run(outer)


#: Says "ready", waits for a writer of the FIFO `argv[1]`, then allocates (and touches)
#: 1 MiB after 1 MiB until the kernel kills it.
HOG = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "open(sys.argv[1], 'rb').read()\n"
    "held = []\n"
    "while True:\n"
    "    held.append(bytearray(1 << 20))\n"
)


@needs_v1
async def test_an_oom_while_a_delegate_is_born_into_a_full_subtree_spares_the_daemon(
    daemon_dirs: DaemonProcess, tmp_path: Path
) -> None:
    """The daemon's forking thread stands in a delegate's node, below a parent at its
    memory limit, when the parent's subtree runs out (held there: SUBAGENTD_FAULT
    hold-in-nodes). The kernel's OOM killer weighs only thread group leaders, and that
    thread is never the daemon's: the parent's hog is killed, never the daemon (~36 MB
    resident, more than the hog's 24 MB, so the one killed were it a candidate)."""
    daemon_dirs.start(env={"SUBAGENTD_FAULT": "hold-in-nodes:delegate"})
    hold = daemon_dirs.state_dir / "hold-in-nodes"
    os.mkfifo(hold)
    go = tmp_path / "go"
    os.mkfifo(go)
    with trio.fail_after(60):
        async with (
            AsyncClient(daemon_dirs.socket) as client,
            AsyncClient(daemon_dirs.socket) as spawning,
        ):
            info = await client.info()
            parent = await client.spawn(
                [sys.executable, "-c", HOG, str(go)], limits=p.Limits(memory=24 * MIB)
            )
            await wait_output(client, parent.id, b"ready")
            node = _node(info, "memory", f"{parent.run}/{parent.id}")
            delegated: list[p.WorkerView] = []
            async with trio.open_nursery() as nursery:

                async def delegate() -> None:
                    delegated.append(
                        await spawning.spawn(sh("sleep 60"), parent=parent.id, name="delegate")
                    )

                nursery.start_soon(delegate)
                # The forking thread stands in the delegate's node (held there): the
                # kernel's files say so, and nothing else could (the daemon is held).
                await _kernel_says(lambda: _thread_in_a_node_below(node))
                # Now the hog fills its parent's subtree: the kernel kills in it.
                await trio.to_thread.run_sync(_open_for_writing, go)
                await _kernel_says(lambda: _oom_kills(node) > 0)
                assert daemon_dirs.proc is not None
                assert daemon_dirs.proc.poll() is None, "the daemon was killed"
                await trio.to_thread.run_sync(_open_for_writing, hold)  # the fork goes on
            (child,) = delegated
            ended = await client.wait(parent.id)
            assert (ended.state, ended.reason) == ("failed", "memory_limit")
            # The delegate runs, or failed: born while the hog's memory was not yet given
            # back, its exec may find no room (an exec's failure, not a kill: no reason),
            # or be the victim itself. Either way a worker's ending, not the daemon's.
            now = await client.status(child.id)
            assert now.state in ("running", "failed"), now
            if now.state == "running":
                await client.stop(child.id)
    assert daemon_dirs.terminate() == 0


async def _kernel_says(condition: Callable[[], bool]) -> None:
    """Until `condition` holds: a kernel file no event tells of, looked at every 10 ms."""
    while True:
        if condition():
            return
        await trio.sleep(0.01)


def _thread_in_a_node_below(node: Path) -> bool:
    return any(
        (child / "tasks").read_text().strip()
        for child in node.iterdir()
        if child.is_dir() and not child.name.startswith(".")
    )


def _open_for_writing(fifo: Path) -> None:
    with open(fifo, "wb"):
        pass


def _oom_kills(node: Path) -> int:
    text = (node / "memory.oom_control").read_text()
    return int(text.split("oom_kill ")[1].split()[0])


@needs_v1
async def test_a_limited_delegate_s_memory_is_its_own_not_its_parent_s_too(
    client: AsyncClient,
) -> None:
    """A worker's usage reads its v1 memory node's own figures (memory.stat), not its
    subtree's: a limited delegate's 100 MiB are the delegate's, and `info`'s totals count
    them once."""
    from .test_usage import OBEDIENT, told, usage_of

    with trio.fail_after(60):
        parent = await client.spawn(sh("sleep 60"), limits=p.Limits(memory=512 * MIB))
        child = await client.spawn(
            [sys.executable, "-c", OBEDIENT],
            parent=parent.id,
            stdin_open=True,
            limits=p.Limits(memory=256 * MIB),
        )
        await wait_output(client, child.id, b"ready")
        before = await usage_of(client, child.id)
        await told(client, child, "alloc", b"allocated")
        allocated = await usage_of(client, child.id)
        assert abs(allocated.memory - before.memory - 100 * MIB) < 10 * MIB, allocated
        held = await usage_of(client, parent.id)
        assert held.source == "cgroup", held
        assert held.memory < 20 * MIB, held  # its node's own: not the delegate's below it
        await client.stop(parent.id)
