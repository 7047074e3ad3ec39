"""Usage where a person or a model looks (issue 26, item 3): `top`'s CPU% and MEM columns
and its sorting by them (keys c, m, t; `--sort`), `--once --json`, and the MCP tools'
results. Real workers: one spins, one holds 60 MiB, one sleeps."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from subagentd.client import AsyncClient, WorkerView
from subagentd.client._top import Order, Screen, by_usage, press
from subagentd.protocol import Usage

from .conftest import DaemonProcess
from .helpers import sh, wait_output
from .test_mcp import call, mcp_server, text_of
from .test_top import needs_tmux, once, row, top_pane

SPINNER = "print('spinning', flush=True)\nwhile True: pass"
HOLDER = (
    "import time\nheld = bytearray(60 * 1024 * 1024)\n"
    "for i in range(0, len(held), 4096): held[i] = 1\n"
    "print('holding', flush=True)\ntime.sleep(300)"
)


@asynccontextmanager
async def three_workers(daemon: DaemonProcess) -> AsyncIterator[tuple[WorkerView, ...]]:
    """A spinner, a holder of 60 MiB and a sleeper, each started and said so; stopped after."""
    async with AsyncClient(daemon.socket) as client:
        spinner = await client.spawn([sys.executable, "-c", SPINNER], name="spinner")
        holder = await client.spawn([sys.executable, "-c", HOLDER], name="holder")
        sleeper = await client.spawn(sh("echo sleeping; exec sleep 300"), name="sleeper")
        for worker, said in ((spinner, b"spinning"), (holder, b"holding"), (sleeper, b"sleeping")):
            await wait_output(client, worker.id, said)
        await trio.sleep(0.5)  # the spinner's CPU% over a while, not its first instant
        try:
            yield spinner, holder, sleeper
        finally:
            for worker in (spinner, holder, sleeper):
                await client.stop(worker.id, wait=False)


def order_in(text: str, views: tuple[WorkerView, ...]) -> list[str]:
    """The names of `views` in the order their rows come in `text`."""
    at = {view.name: text.index(row(text, view.id)) for view in views}
    return sorted(at, key=at.__getitem__)


async def test_top_once_shows_cpu_and_mem_and_sorts_by_each(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with three_workers(daemon) as views:
            shown = await trio.to_thread.run_sync(lambda: once(daemon))
            assert shown.returncode == 0, shown.stderr
            header = next(line for line in shown.stdout.splitlines() if "LAST OUTPUT" in line)
            assert header.split()[5:8] == ["PID", "CPU%", "MEM"], header
            spinner, holder, _ = views
            cpu = float(row(shown.stdout, spinner.id).split()[6])
            assert cpu > 20, shown.stdout  # a core's worth, on a shared machine at least this
            mem = row(shown.stdout, holder.id).split()[7]
            assert mem.endswith("M"), shown.stdout
            assert 60 <= float(mem[:-1]) < 100, shown.stdout

            by_cpu = await trio.to_thread.run_sync(lambda: once(daemon, "--sort", "cpu"))
            assert "by CPU%" in by_cpu.stdout.splitlines()[0]
            assert order_in(by_cpu.stdout, views)[0] == "spinner", by_cpu.stdout
            by_mem = await trio.to_thread.run_sync(lambda: once(daemon, "--sort", "mem"))
            assert "by MEM" in by_mem.stdout.splitlines()[0]
            assert order_in(by_mem.stdout, views)[0] == "holder", by_mem.stdout

            frame = await trio.to_thread.run_sync(lambda: once(daemon, "--json", "--sort", "mem"))
            workers = json.loads(frame.stdout)["workers"]
            assert workers[0]["id"] == holder.id
            assert all(w["usage"]["processes"] == 1 for w in workers), workers
            assert workers[0]["usage"]["memory"] >= 60 * 1024 * 1024


@needs_tmux
async def test_top_sorts_by_cpu_and_mem_at_a_key_and_back_to_the_tree(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(90):
        async with three_workers(daemon) as views, top_pane(daemon, width=120) as pane:
            await pane.shown(lambda t: all(v.id in t for v in views) and "CPU%" in t, "all")
            await pane.keys("c")
            text = await pane.shown(lambda t: "by CPU%" in t, "sorted by CPU%")
            assert order_in(text, views)[0] == "spinner", text
            await pane.keys("m")
            text = await pane.shown(lambda t: "by MEM" in t, "sorted by MEM")
            assert order_in(text, views)[0] == "holder", text
            await pane.keys("t")
            text = await pane.shown(lambda t: "by " not in t.splitlines()[0], "the tree again")
            assert order_in(text, views) == ["spinner", "holder", "sleeper"], text  # oldest first
            await pane.keys("q")
            await pane.shown(lambda t: "EXIT=0" in t, "quit")


def _view(worker_id: str, started: float, usage: Usage | None) -> WorkerView:
    return WorkerView(id=worker_id, run="r", state="running", started_at=started, usage=usage)


def _usage(percent: float | None, memory: int) -> Usage:
    return Usage(cpu_seconds=1.0, cpu_percent=percent, memory=memory, processes=1, source="cgroup")


def test_sorting_puts_the_biggest_first_and_those_without_usage_last() -> None:
    views = [
        _view("w-old", 1.0, _usage(5.0, 300)),
        _view("w-ended", 0.5, None),
        _view("w-busy", 2.0, _usage(90.0, 100)),
        _view("w-unknown", 3.0, _usage(None, 200)),
    ]

    def ids(order: Order) -> list[str]:
        return [r.view.id for r in by_usage(views, order)]

    assert ids("cpu") == ["w-busy", "w-old", "w-unknown", "w-ended"]
    assert ids("mem") == ["w-old", "w-unknown", "w-busy", "w-ended"]
    screen = Screen(views=views)
    assert screen.rows()[0].view.id == "w-ended"  # the tree: oldest first
    for key, first in (("c", "w-busy"), ("m", "w-old"), ("t", "w-ended")):
        assert press(screen, key, 10) is None
        assert screen.rows()[0].view.id == first, key


async def test_the_mcp_tools_results_carry_usage(daemon: DaemonProcess) -> None:
    with trio.fail_after(60):
        async with three_workers(daemon) as (spinner, holder, _), mcp_server(daemon) as session:
            status = await call(session, "subagent_status", worker=holder.id)
            assert status["usage"]["processes"] == 1
            assert status["usage"]["memory"] >= 60 * 1024 * 1024
            assert status["usage"]["source"] in ("cgroup", "proc")
            result = await session.call_tool("subagent_status", {"worker": holder.id})
            assert "usage: cpu " in text_of(result)
            listed = await call(session, "subagent_list")
            by_id = {w["id"]: w for w in listed["workers"]}
            assert by_id[spinner.id]["usage"]["cpu_percent"] > 20
            assert by_id[holder.id]["usage"]["memory"] >= 60 * 1024 * 1024
            text = text_of(await session.call_tool("subagent_list", {}))
            assert f"{holder.id} " in text
            assert "mem=" in next(line for line in text.splitlines() if holder.id in line)
            ended = await call(session, "subagent_list", all=True)
            assert all(
                (w["usage"] is None) == (w["state"] not in ("running", "starting"))
                for w in ended["workers"]
            ), ended
