"""subagentctl top against a real daemon: in a real terminal (a detached tmux pane of a
fixed size, read with `capture-pane` and driven with `send-keys`), and `--once` as a
script runs it.

What a pane shows is announced by nothing: the tests poll it (`_shown`), every wait
bounded by `trio.fail_after`. What the daemon did (a worker stopped) is asked of it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from subagentd.client import AsyncClient, WorkerView
from subagentd.client._top import (
    TAIL_ENTRIES,
    Act,
    Budget,
    JournalTail,
    Screen,
    Spent,
    keys,
    last_line,
    press,
    printable,
    tree,
    widths,
)

from .conftest import BIN, DaemonProcess
from .helpers import sh, wait_output

CTL = str(BIN / "subagentctl")
TMUX = shutil.which("tmux")
needs_tmux = pytest.mark.skipif(TMUX is None, reason="tmux is not installed: no terminal to run in")

#: How long a pane may take to show what is awaited.
SHOWN_WITHIN = 15
SLEEPER = "echo started; exec sleep 300"
STUBBORN = "trap '' TERM; echo ready; while :; do sleep 0.1; done"
# Colours, a screen clear, a window title (OSC), a bell, a backspace, a bidi override, no newline.
HOSTILE = r"printf 'ok \033[31mRED\033[2J\033]0;pwned\007 bell\007 bs\b rtl\342\200\256 end'"
HOSTILE_SHOWN = "ok RED bell? bs? rtl? end"


@dataclass
class Pane:
    """subagentctl top in a tmux pane of its own server (`-S`), of a fixed size."""

    server: Path

    async def tmux(self, *args: str) -> str:
        assert TMUX is not None
        done = await trio.run_process(
            [TMUX, "-S", str(self.server), *args], capture_stdout=True, capture_stderr=True
        )
        return done.stdout.decode()

    async def text(self) -> str:
        return await self.tmux("capture-pane", "-p", "-t", "top")

    async def keys(self, *keys: str) -> None:
        await self.tmux("send-keys", "-t", "top", *keys)

    async def shown(self, condition: Callable[[str], bool], what: str) -> str:
        """The pane's text once `condition` holds of it (polled: nothing announces it)."""
        text = await self.text()
        with trio.move_on_after(SHOWN_WITHIN):
            while not condition(text):  # polled: nothing announces what a pane shows (`what`)
                await trio.sleep(0.05)
                text = await self.text()
            return text
        raise AssertionError(f"not shown within {SHOWN_WITHIN}s: {what}; the pane:\n{text}")


_PANES = itertools.count()


@asynccontextmanager
async def top_pane(
    daemon: DaemonProcess, *args: str, width: int = 140, height: int = 30
) -> AsyncIterator[Pane]:
    """`subagentctl top ARGS` running in a detached pane; its exit status is printed
    there as EXIT=N once it ends."""
    command = shlex.join([CTL, "top", "--interval", "0.2", *args])
    async with shell_pane(daemon, f"{command}; echo EXIT=$?", width, height) as pane:
        yield pane


@asynccontextmanager
async def shell_pane(
    daemon: DaemonProcess, script: str, width: int = 140, height: int = 30
) -> AsyncIterator[Pane]:
    """`script` run by the shell in a detached pane, which stays once it ends."""
    # A server of its own each: one just killed may still hold its socket's name.
    pane = Pane(daemon.root / f"tmux-{next(_PANES)}.sock")
    env = daemon.env | {"TERM": "xterm-256color"}
    env.pop("TMUX", None)
    assert TMUX is not None
    await trio.run_process(
        [
            TMUX,
            "-S",
            str(pane.server),
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            str(width),
            "-y",
            str(height),
            f"{script}; sleep 600",
        ],
        env=env,
    )
    try:
        yield pane
    finally:
        with trio.CancelScope(shield=True):
            await pane.tmux("kill-server")


def row(text: str, worker_id: str) -> str:
    """The table's row of `worker_id` (not a message naming it: a row names its run)."""
    return next(line for line in text.splitlines() if worker_id in line and " r-" in line)


def once(daemon: DaemonProcess, *args: str, columns: int = 160) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CTL, "top", "--once", *args],
        env=daemon.env | {"COLUMNS": str(columns)},
        capture_output=True,
        text=True,
        timeout=30,
    )


# -- in a terminal ------------------------------------------------------------------------


@needs_tmux
async def test_top_shows_the_tree_and_stops_the_selected_worker_with_its_subtree_only(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            parent = await client.spawn(sh(SLEEPER), name="parent")
            child = await client.spawn(
                sh("echo child says hi; exec sleep 300"),
                name="child",
                run=parent.run,
                parent=parent.id,
            )
            grandchild = await client.spawn(
                sh(SLEEPER), name="grandchild", run=parent.run, parent=child.id
            )
            other = await client.spawn(sh(SLEEPER), name="other")
            await wait_output(client, child.id, b"hi\n")
            async with top_pane(daemon) as pane:
                text = await pane.shown(
                    lambda t: "child says hi" in t and other.id in t, "every worker, a line"
                )
                assert all(row(text, w.id).split()[0] == "running" for w in (parent, child, other))
                # The tree: each child two columns in from its parent, oldest root first.
                at = {w.id: row(text, w.id).index(w.id) for w in (parent, child, grandchild)}
                assert at[child.id] == at[parent.id] + 2 == at[grandchild.id] - 2, text
                lines = text.splitlines()
                order = [
                    next(i for i, s in enumerate(lines) if w.id in s)
                    for w in (parent, child, grandchild, other)
                ]
                assert order == sorted(order), text

                await pane.keys("Down", "s")
                await pane.shown(lambda t: f"stop {child.id} and its subtree?" in t, "the ask")
                await pane.keys("y")
                ended = await client.wait(child.id)
                assert ended.state == "stopped"
                assert (await client.wait(grandchild.id)).state == "stopped"
                text = await pane.shown(
                    lambda t: (
                        row(t, child.id).split()[0] == "stopped"
                        and row(t, grandchild.id).split()[0] == "stopped"
                    ),
                    "the subtree stopped",
                )
                # A stopped worker stays on screen, its last line with it.
                assert "child says hi" in row(text, child.id)
                assert (await client.status(parent.id)).state == "running"
                assert (await client.status(other.id)).state == "running"
                assert row(text, parent.id).split()[0] == "running"

                await pane.keys("q")
                await pane.shown(lambda t: "EXIT=0" in t, "top quit")


@needs_tmux
async def test_top_asks_before_a_stop_follows_a_journal_and_stops_a_run(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            counter = await client.spawn(
                sh("i=0; while :; do i=$((i+1)); echo line $i; sleep 0.05; done"), name="counter"
            )
            mate = await client.spawn(sh(SLEEPER), name="mate", run=counter.run)
            bystander = await client.spawn(sh(SLEEPER), name="bystander")
            async with top_pane(daemon) as pane:
                await pane.shown(lambda t: bystander.id in t and "line " in t, "workers")
                # Any key but y leaves it running.
                await pane.keys("s")
                await pane.shown(lambda t: "and its subtree?" in t, "the ask")
                await pane.keys("n")
                await pane.shown(lambda t: "not stopped" in t, "no stop")
                assert (await client.status(counter.id)).state == "running"

                await pane.keys("f")
                text = await pane.shown(
                    lambda t: (
                        f"following {counter.id}" in t
                        and len(re.findall(r"^line \d+$", t, re.M)) >= 5
                    ),
                    "the journal followed",
                )
                numbers = [int(n) for n in re.findall(r"^line (\d+)$", text, re.M)]
                assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), text
                await pane.shown(
                    lambda t: (
                        max(map(int, re.findall(r"^line (\d+)$", t, re.M)), default=0) > numbers[-1]
                    ),
                    "the journal growing on screen",
                )
                await pane.keys("Escape")
                await pane.shown(lambda t: "LAST OUTPUT" in t, "the table again")

                await pane.keys("r")
                await pane.shown(lambda t: f"stop run {counter.run}" in t, "the ask")
                await pane.keys("y")
                assert (await client.wait(counter.id)).state == "stopped"
                assert (await client.wait(mate.id)).state == "stopped"
                await pane.shown(
                    lambda t: row(t, mate.id).split()[0] == "stopped", "the run stopped"
                )
                assert (await client.status(bystander.id)).state == "running"


@needs_tmux
async def test_top_survives_a_reload_and_says_when_the_daemon_goes_away(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(90):
        async with AsyncClient(daemon.socket) as client:
            first = await client.spawn(sh(SLEEPER), name="first")
            async with top_pane(daemon) as pane:
                await pane.shown(lambda t: first.id in t, "the worker")
                await client.reload()
                second = await client.spawn(sh(SLEEPER), name="second")
                text = await pane.shown(lambda t: second.id in t, "a worker after the reload")
                assert "EXIT=" not in text
                assert row(text, first.id).split()[0] == "running"

                await trio.to_thread.run_sync(daemon.terminate)
                text = await pane.shown(lambda t: "EXIT=" in t, "top ended")
                assert "EXIT=3" in text, text
                assert "the daemon went away" in text, text


@needs_tmux
async def test_top_output_cannot_drive_the_terminal_and_a_narrow_one_still_draws(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            hostile = await client.spawn(
                sh(HOSTILE + "; exec sleep 300"), name="\033[2J\033]0;pwned\007ev\u202eil\r\007"
            )
            await wait_output(client, hostile.id, b"end")
            async with top_pane(daemon) as pane:
                text = await pane.shown(lambda t: HOSTILE_SHOWN in t, "the hostile line, cleaned")
                assert "pwned" not in await pane.tmux("display-message", "-p", "#{pane_title}")
                assert "subagentd top" in text.splitlines()[0], text  # not cleared away
                assert "?[2J" not in text
                assert "ev?il??" in row(text, hostile.id)
                # No colour reached the pane either: its cells carry no attribute.
                styled = await pane.tmux("capture-pane", "-p", "-e", "-t", "top")
                hostile_row = next(line for line in styled.splitlines() if "ev?il" in line)
                assert not re.search(r"\x1b\[(?:[0-9;]*;)?31[;m]", hostile_row), hostile_row
            async with top_pane(daemon, width=24, height=6) as narrow:
                text = await narrow.shown(lambda t: "running" in t, "a row in 24 columns")
                assert all(len(line) <= 24 for line in text.splitlines()), text
                await narrow.tmux("resize-window", "-t", "top", "-x", "12", "-y", "3")
                await narrow.shown(lambda t: "subagentd" in t or "subag" in t, "drawn again")
                await narrow.keys("q")
                await narrow.shown(lambda t: "EXIT=0" in t, "quit in 12 columns")


@needs_tmux
async def test_top_at_60_columns_keeps_ids_and_pids_whole_and_still_across_frames(
    daemon: DaemonProcess,
) -> None:
    """RUN and the last output give way first; the columns stay where they are from one
    frame to the next while the last output changes length."""
    flip = "while :; do echo x; sleep 0.3; echo a much longer line of output; sleep 0.3; done"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            parent = await client.spawn(sh(flip), name="parent")
            child = await client.spawn(sh(SLEEPER), name="child", run=parent.run, parent=parent.id)
            views = [parent, child]
            async with top_pane(daemon, width=60, height=12) as pane:

                def rows(text: str) -> list[str]:
                    return [next(line for line in text.splitlines() if v.id in line) for v in views]

                def places(text: str) -> list[tuple[int, int]]:
                    return [(line.index(v.id), line.index(str(v.pid))) for line, v in
                            zip(rows(text), views, strict=True)]  # fmt: skip

                def showing(end: str) -> Callable[[str], bool]:
                    return lambda t: all(v.id in t for v in views) and rows(t)[0].endswith(end)

                short = await pane.shown(showing(" x"), "the short line")
                long = await pane.shown(showing("…"), "the long line, cut")
                for text in (short, long):
                    assert all(len(line) <= 60 for line in text.splitlines()), text
                    assert all(
                        f" {v.pid} " in line for line, v in zip(rows(text), views, strict=True)
                    )
                    assert "RUN" not in text, text
                    assert parent.run not in text, text
                assert places(short) == places(long), (short, long)
                assert places(short)[1][0] == places(short)[0][0] + 2  # the tree kept


@needs_tmux
async def test_the_cli_prints_no_byte_that_drives_the_terminal(daemon: DaemonProcess) -> None:
    """ls, status, watch, events, grep and collect in a real terminal, of a worker named and
    writing to clear it, retitle it and colour it: the pane keeps its title, what was on
    it before, and no colour."""
    name = "\033[2J\033]0;pwned\007ev\u202eil\r\007"
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            hostile = await client.spawn(sh(HOSTILE), name=name)
            await client.wait(hostile.id)
            commands = [
                ["ls", "--all"], ["status", hostile.id], ["watch", hostile.id],
                ["events", "--run", hostile.run], ["grep", hostile.id, "RED"],
                ["collect", hostile.id],
            ]  # fmt: skip
            script = "echo BEFORE && " + " && ".join(shlex.join([CTL, *c]) for c in commands)
            async with shell_pane(daemon, f"{script}; done=$?; echo; echo EXIT=$done") as pane:
                text = await pane.shown(lambda t: "EXIT=" in t, "every command done")
                assert "BEFORE" in text, text  # not cleared
                assert "EXIT=0" in text, text
                assert text.count(HOSTILE_SHOWN) == 4, text  # watch, events, grep, collect
                assert "ev?il??" in text, text
                title = await pane.tmux("display-message", "-p", "#{pane_title}")
                assert "pwned" not in title, title
                styled = await pane.tmux("capture-pane", "-p", "-e", "-t", "top")
                assert not re.search(r"\x1b\[(?:[0-9;]*;)?31[;m]", styled), styled


# -- one frame, for scripts -----------------------------------------------------------------


async def test_top_once_prints_one_frame_with_stopping_shown_and_a_run_filter(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            # Its stop stays in flight for its grace (the daemon KILLs it after).
            stubborn = await client.spawn(sh(STUBBORN), name="stubborn", grace=8)
            await wait_output(client, stubborn.id, b"ready")
            child = await client.spawn(
                sh("trap '' TERM; printf 'half a line'; while :; do sleep 0.1; done"),
                run=stubborn.run,
                parent=stubborn.id,
                name="child",
                grace=8,
            )
            await wait_output(client, child.id, b"half a line")
            elsewhere = await client.spawn(sh(SLEEPER), name="elsewhere")
            await client.stop(stubborn.id, wait=False)
            done = await trio.to_thread.run_sync(lambda: once(daemon))
            assert done.returncode == 0, done.stderr
            assert "\x1b" not in done.stdout
            lines = done.stdout.splitlines()
            assert lines[0].startswith("subagentd top: all runs")
            assert row(done.stdout, stubborn.id).split()[0] == "stopping"
            assert row(done.stdout, child.id).split()[0] == "stopping"
            assert "ready" in row(done.stdout, stubborn.id)
            assert "half a line" in row(done.stdout, child.id)
            assert row(done.stdout, child.id).index(child.id) == (
                row(done.stdout, stubborn.id).index(stubborn.id) + 2
            )
            assert elsewhere.id in done.stdout

            one_run = await trio.to_thread.run_sync(lambda: once(daemon, "--run", stubborn.run))
            assert one_run.returncode == 0, one_run.stderr
            assert stubborn.id in one_run.stdout
            assert elsewhere.id not in one_run.stdout
            await client.stop(elsewhere.id)


async def test_top_once_on_an_empty_daemon_and_on_none(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        done = await trio.to_thread.run_sync(lambda: once(daemon))
        assert done.returncode == 0, done.stderr
        assert "no workers" in done.stdout
        await trio.to_thread.run_sync(daemon.terminate)
        gone = await trio.to_thread.run_sync(lambda: once(daemon))
        assert gone.returncode == 3, gone
        assert gone.stderr.startswith("subagentctl: no daemon at "), gone.stderr


async def test_top_once_cleans_what_workers_write_and_fits_a_narrow_terminal(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            hostile = await client.spawn(sh(HOSTILE + "; exec sleep 300"), name="\033]0;x\007n")
            huge = await client.spawn(
                [sys.executable, "-c", "import sys, time; sys.stdout.write('y' * 3_000_000); "
                 "sys.stdout.flush(); time.sleep(300)"],
                name="huge",
            )  # fmt: skip
            await wait_output(client, hostile.id, b"end")
            await wait_output(client, huge.id, b"y" * 1000)
            done = await trio.to_thread.run_sync(lambda: once(daemon, columns=400))
            assert done.returncode == 0, done.stderr
            assert HOSTILE_SHOWN in row(done.stdout, hostile.id)
            unprintable = [c for c in done.stdout if c != "\n" and not c.isprintable()]
            assert unprintable == [], unprintable
            assert "yyyy" in row(done.stdout, huge.id)
            assert max(len(line) for line in done.stdout.splitlines()) <= 400

            narrow = await trio.to_thread.run_sync(lambda: once(daemon, columns=20))
            assert narrow.returncode == 0, narrow.stderr
            assert all(len(line) <= 20 for line in narrow.stdout.splitlines()), narrow.stdout


async def test_top_once_json_prints_one_frame_with_every_worker_and_its_raw_last_line(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            parent = await client.spawn(sh(HOSTILE + "; exec sleep 300"), name="parent")
            child = await client.spawn(sh(SLEEPER), name="child", run=parent.run, parent=parent.id)
            await wait_output(client, parent.id, b"end")
            await wait_output(client, child.id, b"started")
            done = await trio.to_thread.run_sync(lambda: once(daemon, "--json"))
            assert done.returncode == 0, done.stderr
            (line,) = done.stdout.splitlines()  # one document, one line
            frame = json.loads(line)
            assert (frame["run"], frame["running"]) == (None, 2)
            workers = frame["workers"]
            assert [(w["id"], w["depth"]) for w in workers] == [(parent.id, 0), (child.id, 1)]
            assert workers[0]["last_output"].startswith("ok \x1b[31mRED")  # as written
            assert workers[0]["argv"] == sh(HOSTILE + "; exec sleep 300")
            assert workers[1]["last_output"] == "started"
            assert workers[1]["pid"] == child.pid
            live = await trio.to_thread.run_sync(lambda: daemon.ctl("top", "--json"))
            assert live.returncode == 2, live
            assert "--json: only with --once" in live.stderr


async def test_top_once_piped_is_as_wide_as_what_it_shows(daemon: DaemonProcess) -> None:
    """Not padded to 80 columns, and the last output not cut to a few characters."""
    long = "a line of output longer than eighty columns, " * 3
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            talker = await client.spawn(sh(f"echo '{long}'; exec sleep 300"), name="t")
            await wait_output(client, talker.id, b"columns")
            env = {k: v for k, v in daemon.env.items() if k not in ("COLUMNS", "LINES")}
            done = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [CTL, "top", "--once"], env=env, capture_output=True, text=True, timeout=30
                )
            )
            assert done.returncode == 0, done.stderr
            assert long.strip() in row(done.stdout, talker.id), done.stdout
            assert all(line == line.rstrip() for line in done.stdout.splitlines()), done.stdout
            header = next(line for line in done.stdout.splitlines() if "LAST OUTPUT" in line)
            assert header.endswith("LAST OUTPUT"), header


async def test_top_shows_the_last_output_of_an_ended_worker_with_a_long_journal(
    daemon: DaemonProcess,
) -> None:
    """Five entries or more: the last page alone held none of its output."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            ended = await client.spawn(
                sh("echo one; sleep 0.2; echo two; sleep 0.2; echo three"), name="ended"
            )
            await client.wait(ended.id)
            page = await client.watch_page(ended.id, 0, 100)
            kinds = [entry.kind for entry in page.entries]
            assert kinds == ["state", "stdout", "stdout", "stdout", "state"], kinds
            entries = await JournalTail(ended.id).advance(client, Budget(), 4)
            assert last_line(entries) == "three"
            done = await trio.to_thread.run_sync(lambda: once(daemon, "--all"))
            assert done.returncode == 0, done.stderr
            assert row(done.stdout, ended.id).endswith("three"), done.stdout


async def test_top_looks_back_past_a_journals_last_entries_that_are_not_output(
    daemon: DaemonProcess,
) -> None:
    """A worker's journal may end in entries of other kinds (here what `send` wrote): the
    last line of output shown is the one before them."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            reader = await client.spawn(
                sh("echo last words; cat >/dev/null"), name="reader", stdin_open=True
            )
            await wait_output(client, reader.id, b"last words")
            for text in ("one\n", "two\n", "three\n", "four\n", "five\n", "six\n"):
                await client.send(reader.id, text)
            await client.send(reader.id, "", eof=True)
            await client.wait(reader.id)
            page = await client.watch_page(reader.id, 0, 100)
            kinds = [entry.kind for entry in page.entries]
            assert "stdout" not in kinds[-TAIL_ENTRIES - 4 :], kinds  # past the merged pages
            done = await trio.to_thread.run_sync(lambda: once(daemon, "--all"))
            assert done.returncode == 0, done.stderr
            assert row(done.stdout, reader.id).endswith("last words"), done.stdout


async def test_the_last_line_of_a_long_journal_costs_a_few_pages(daemon: DaemonProcess) -> None:
    """Galloping to the end, then halving: pages in the log of the journal's length, not
    in its length; and once at the end, a page a frame."""
    with trio.fail_after(60):
        async with AsyncClient(daemon.socket) as client:
            chatty = await client.spawn(
                [sys.executable, "-u", "-c",
                 "import time\nfor i in range(3000):\n print('n', i)\n time.sleep(0.0005)\n"
                 "time.sleep(300)"],
            )  # fmt: skip
            await wait_output(client, chatty.id, b"n 2999\n")
            page = await client.watch_page(chatty.id, 0, 100_000)
            last = page.entries[-1].seq
            assert last > 200, "too few entries to tell a gallop from a walk"
            tail = JournalTail(chatty.id)
            budget = Budget(pages=1000)
            entries = await tail.advance(client, budget, 4)
            used = 1000 - budget.pages
            assert entries[-1].seq == last
            assert tail.cursor == last
            # The output's last line, though a pipe read may have cut it in two entries.
            assert last_line(entries) == "n 2999"
            assert used <= 2 * math.ceil(math.log2(last)) + 4, (used, last)
            again = Budget(pages=1000)
            assert await tail.advance(client, again, 4) == []
            assert 1000 - again.pages == 1
            spent = Budget(pages=3)
            with pytest.raises(Spent):
                await JournalTail(chatty.id).advance(client, spent, 4)


# -- without the extra, without a terminal ---------------------------------------------------


def test_top_without_rich_says_how_to_install_it(daemon: DaemonProcess) -> None:
    hide_rich = (
        "import sys; sys.modules['rich'] = None; "
        "from subagentd.client._cli import main; sys.exit(main(['top', '--once']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_rich],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done
    assert "pip install 'subagentd[top]'" in done.stderr


def test_top_without_a_terminal_points_to_once(daemon: DaemonProcess) -> None:
    done = daemon.ctl("top")
    assert done.returncode == 2, done
    assert "--once" in done.stderr


# -- the pure parts, by calling them ---------------------------------------------------------


def _view(worker_id: str, parent: str | None = None, at: float = 0.0) -> WorkerView:
    return WorkerView(id=worker_id, run="r-1", parent=parent, state="running", started_at=at)


def test_the_tree_puts_children_under_their_parent_and_orphans_at_the_root() -> None:
    views = [
        _view("w-c", parent="w-a", at=3),
        _view("w-a", at=1),
        _view("w-o", parent="w-gone", at=2),
        _view("w-b", parent="w-a", at=2),
        _view("w-d", parent="w-b", at=4),
    ]
    assert [(row.view.id, row.depth) for row in tree(views)] == [
        ("w-a", 0),
        ("w-b", 1),
        ("w-d", 2),
        ("w-c", 1),
        ("w-o", 0),
    ]


def test_printable_leaves_no_escape_or_control_and_keys_parse_sequences() -> None:
    hostile = "a\x1b[31mb\x1b]8;;http://x\x1b\\c\x1b]0;t\x07d\x1bMe\x00\x7f\u202e\u200bf\tg\r"
    assert printable(hostile) == "abcde????f g?"
    assert len(printable("x" * 10_000)) == 400
    assert list(keys("j\x1b[A\x1b[Bq\x1b[1;5Cs\x1b")) == ["j", "up", "down", "q", "s", "escape"]


def test_a_stop_is_asked_and_confirmed_by_y_only() -> None:
    screen = Screen()
    screen.saw([_view("w-a", at=1), _view("w-b", parent="w-a", at=2)], [])
    assert screen.selected == "w-a"
    assert press(screen, "down", 10) is None
    assert press(screen, "s", 10) is None
    assert screen.asking == "stop"
    assert press(screen, "n", 10) is None
    assert screen.asking is None
    press(screen, "s", 10)
    assert press(screen, "y", 10) == Act("stop", "w-b")
    press(screen, "r", 10)
    assert press(screen, "y", 10) == Act("stop_run", "r-1")
    press(screen, "f", 10)
    assert screen.follow is not None
    assert screen.follow.worker_id == "w-b"
    press(screen, "escape", 10)
    assert screen.follow is None
    press(screen, "q", 10)
    assert screen.quit


@pytest.mark.parametrize("interval", ["nan", "inf", "0", "-1", "soon"])
def test_an_unusable_interval_is_refused_naming_it(daemon: DaemonProcess, interval: str) -> None:
    ran = subprocess.run(
        [CTL, "top", "--once", "--interval", interval],
        env=daemon.env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ran.returncode == 2, ran
    assert "--interval" in ran.stderr


def test_columns_give_way_in_order_and_never_cut_an_id_or_a_pid() -> None:
    def cells(last: str) -> list[tuple[str, ...]]:
        return [
            ("running", "r-63062eb0d9", "w-3fdd3ae2ce", "parent", "30s", "14647", "0.5", "3.5M",
             last),
            ("stopping", "r-63062eb0d9", "  w-df03feb553", "a name of twenty-five c", "2s", "",
             "", "", ""),
        ]  # fmt: skip

    wide = widths(cells("x"), 140)
    assert list(wide) == [
        "STATE", "RUN", "WORKER", "NAME", "AGE", "PID", "CPU%", "MEM", "LAST OUTPUT",
    ]  # fmt: skip
    assert (wide["WORKER"], wide["PID"], wide["NAME"], wide["CPU%"], wide["MEM"]) == (
        14, 7, 20, 5, 5,
    )  # fmt: skip
    assert sum(wide.values()) + 2 * 8 == 140  # the last output takes the rest
    assert "RUN" not in widths(cells("x"), 100)  # the first to go
    assert widths(cells("x"), 90) == {
        "STATE": 9, "WORKER": 14, "NAME": 20, "AGE": 6, "PID": 7, "CPU%": 5, "MEM": 5,
        "LAST OUTPUT": 10,
    }  # fmt: skip
    # The name shrinks, for the last output to keep 8.
    assert widths(cells("x"), 80) == {
        "STATE": 9, "WORKER": 14, "NAME": 12, "AGE": 6, "PID": 7, "CPU%": 5, "MEM": 5,
        "LAST OUTPUT": 8,
    }  # fmt: skip
    # Then MEM goes, then CPU%, before the last output.
    assert widths(cells("x"), 70) == {
        "STATE": 9, "WORKER": 14, "NAME": 9, "AGE": 6, "PID": 7, "CPU%": 5, "LAST OUTPUT": 8,
    }  # fmt: skip
    at_60 = widths(cells("x"), 60)  # then the last output goes, and the name has its room
    assert at_60 == {"STATE": 9, "WORKER": 14, "NAME": 16, "AGE": 6, "PID": 7}
    at_40 = widths(cells("x"), 40)
    assert at_40 == {"STATE": 9, "WORKER": 14, "PID": 7}
    assert list(widths(cells("x"), 25)) == ["STATE", "WORKER"]
    for width in (140, 90, 60, 40, 25):  # what the last output says moves no column
        short, long = widths(cells("x"), width), widths(cells("y" * 300), width)
        assert {k: v for k, v in short.items() if k != "LAST OUTPUT"} == {
            k: v for k, v in long.items() if k != "LAST OUTPUT"
        }
        assert short == long
    # A name never widened to the width it is cut to (8): it keeps its own.
    assert widths([(*cells("x")[0][:3], "ab", *cells("x")[0][4:])], 60)["NAME"] == 4
    piped = widths(cells("y" * 1000), None)  # as wide as the cells, to a bound
    assert (piped["LAST OUTPUT"], piped["NAME"], piped["RUN"]) == (400, 20, 12)
