"""subagentd-mcp schedules as a planner asks it to (issue 27): subagent_new_run makes a run
capped at N workers running at once, subagent_spawn into it queues what is over the cap
(answered at once, with its place), and every hostile cap is refused `invalid` naming the
field, before the daemon is asked, with the server serving on.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from subagentd.client import AsyncClient
from subagentd.client._mcp_args import Invalid, NewRunArguments, checked
from subagentd.protocol import MAX_RUNNING

from .conftest import DaemonProcess
from .helpers import sh
from .test_mcp import call, checked_call, mcp_server, refused, text_of


async def test_new_run_caps_the_workers_spawned_into_it_and_queues_the_rest(
    daemon: DaemonProcess,
) -> None:
    go = daemon.root / "go"
    gated = sh(f"while [ ! -e {go} ]; do sleep 0.05; done")
    with trio.fail_after(60):
        async with mcp_server(daemon) as session:
            made = await checked_call(session, "subagent_new_run", {"max_running": 2})
            assert made.structured_content is not None
            run = made.structured_content["run"]
            assert made.structured_content["max_running"] == 2
            assert text_of(made) == f"new run {run} (at most 2 running at once)"
            spawned = [await call(session, "subagent_spawn", argv=gated, run=run) for _ in range(5)]
            # Answered at once: two running, three queued in order, unstarted.
            assert [w["queued"] for w in spawned] == [False, False, True, True, True]
            assert [w["queue_position"] for w in spawned] == [None, None, 1, 2, 3]
            assert all(w["pid"] is None for w in spawned[2:])
            listed = await call(session, "subagent_list", run=run)
            assert [w["queue_position"] for w in listed["workers"]] == [None, None, 1, 2, 3]
            shown = await checked_call(session, "subagent_list", {"run": run})
            assert "queued #1" in text_of(shown)
            go.touch()
            for worker in spawned:
                ended = await call(session, "subagent_wait", worker=worker["id"], timeout=20)
                assert ended["outcome"] == "ended"
    async with AsyncClient(daemon.socket) as client:
        views = await client.ls(all=True, run=run)
    assert sorted(v.id for v in views) == sorted(w["id"] for w in spawned)
    assert all(v.state == "finished" and v.attempt == 1 for v in views)
    # First in, first out: the queued started in their order, after the first two.
    order = sorted(views, key=lambda v: v.started_at)
    assert [v.id for v in order][2:] == [w["id"] for w in spawned[2:]]


async def test_new_run_without_a_cap_queues_nothing(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            made = await call(session, "subagent_new_run")
            assert made["max_running"] is None
            spawned = [
                await call(session, "subagent_spawn", argv=["sleep", "30"], run=made["run"])
                for _ in range(3)
            ]
            assert not any(w["queued"] for w in spawned)
            await call(session, "subagent_stop_run", run=made["run"])


async def test_new_run_nests_under_an_outer_run_with_its_limits(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            outer = await call(session, "subagent_new_run", memory="1G")
            inner = await call(session, "subagent_new_run", outer=outer["run"], max_running=1)
            first = await call(session, "subagent_spawn", argv=["sleep", "30"], run=inner["run"])
            second = await call(session, "subagent_spawn", argv=["true"], run=inner["run"])
            assert (first["queued"], second["queued"]) == (False, True)
            # Stopping the outer run reaches the inner one's queue: ended never started.
            stopped = await call(session, "subagent_stop_run", run=outer["run"])
            assert set(stopped["stopped"]) >= {first["id"], second["id"]}
            status = await call(session, "subagent_status", worker=second["id"])
            assert (status["state"], status["reason"], status["pid"]) == (
                "stopped",
                "never_started",
                None,
            )


#: Hostile arguments of subagent_new_run, each with the field its refusal must name.
HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"max_running": -1}, "max_running"),
    ({"max_running": 0}, "max_running"),
    ({"max_running": MAX_RUNNING + 1}, "max_running"),
    ({"max_running": 2**70}, "max_running"),
    ({"max_running": 1.5}, "max_running"),
    ({"max_running": "four"}, "max_running"),
    ({"max_running": "4"}, "max_running"),
    ({"max_running": True}, "max_running"),
    ({"max_running": [4]}, "max_running"),
    ({"outer": ""}, "outer"),
    ({"outer": "r" * 1000}, "outer"),
    ({"memory": "lots"}, "memory"),
    ({"cpus": -1}, "cpus"),
    ({"pids": 0}, "pids"),
    ({"max_runing": 4}, "max_runing"),
]


async def test_a_hostile_new_run_is_invalid_naming_the_field(daemon: DaemonProcess) -> None:
    with trio.fail_after(30):
        async with mcp_server(daemon) as session:
            for arguments, field in HOSTILE:
                error = await refused(session, "subagent_new_run", **arguments)
                assert error["code"] == "invalid", (arguments, error)
                assert error["message"].startswith(f"{field}: "), (arguments, error)
                assert "errors.pydantic.dev" not in error["message"]
                # As the server gets them too (Python's JSON parser takes NaN, which the
                # SDK's client sends as null: no cap, as absent is).
                with pytest.raises(Invalid) as refused_as:
                    checked(NewRunArguments, arguments)
                assert refused_as.value.field == field
            for value in (float("nan"), float("inf"), -float("inf")):
                with pytest.raises(Invalid) as refused_as:
                    checked(NewRunArguments, {"max_running": value})
                assert refused_as.value.field == "max_running"
            # The server and the daemon serve on.
            fine = await call(session, "subagent_new_run", max_running=MAX_RUNNING)
            assert fine["max_running"] == MAX_RUNNING
