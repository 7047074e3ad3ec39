"""What reading 1,000 workers' usage costs the daemon (issue 26, item 3): at most a few %
of one core while `top` is open, nothing while nobody asks. Measured as the daemon's own
CPU time (utime + stime of /proc/PID/stat, every thread), never wall time, so a busy
machine slows the test but does not fail it; the bounds are generous (bench/usage.py has
the figures: about 6 % of a core at one refresh a second here)."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from subagentd.client import AsyncClient

from .conftest import DaemonProcess
from .test_stop_many import _spawn_sleepers

WORKERS = 1000
#: `top` refreshes once a second (its default `--interval`): one listing with usage a
#: second costs the daemon this share of a core at most (a few %, with room for a loaded
#: machine's slower CPU and the 10 ms clock ticks the kernel counts it in).
TOP_SHARE = 0.15
#: Listings measured, back to back: the CPU of each is the window's over their count.
POLLS = 10
#: Nobody asking for this long (a measure of what the daemon spends meanwhile, not a wait
#: for a condition) costs it at most this share of a core.
IDLE_SECONDS = 2.0
IDLE_SHARE = 0.025
TICKS = 100  # os.sysconf("SC_CLK_TCK") on Linux


def _cpu(pid: int) -> float:
    """The daemon's CPU seconds so far, all its threads (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def test_top_s_usage_of_1000_workers_costs_a_few_percent_and_idle_nothing(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start()
    assert daemon_dirs.proc is not None
    pid = daemon_dirs.proc.pid
    with trio.fail_after(600):
        run, pids = await _spawn_sleepers(daemon_dirs, WORKERS)
        async with AsyncClient(daemon_dirs.socket) as client:
            # One listing first: what a first read sets up (the recent-CPU windows) is
            # not what each refresh costs.
            assert len(await client.ls(usage=True)) == WORKERS
            before = _cpu(pid)
            for _ in range(POLLS):
                listed = await client.ls(usage=True)
                assert len(listed) == WORKERS
                assert all(view.usage is not None for view in listed)
                assert all(view.usage.processes == 1 for view in listed if view.usage)
            per_poll = (_cpu(pid) - before) / POLLS
            assert per_poll < TOP_SHARE, f"{per_poll * 1000:.0f} ms of CPU a refresh"
            # Nobody asking: nothing is read.
            before = _cpu(pid)
            began = time.monotonic()
            await trio.sleep(IDLE_SECONDS)
            idle = (_cpu(pid) - before) / (time.monotonic() - began)
            print(f"daemon CPU: {per_poll * 1000:.0f} ms a refresh, {idle * 100:.1f} % idle")
            assert idle < IDLE_SHARE, f"{idle * 100:.1f} % of a core while nobody asks"
            await client.stop_run(run)
        assert len(pids) == WORKERS
