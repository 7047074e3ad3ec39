"""subagentd-mcp's spawn as an agent reaches for it (env, grace, key, and a ready pattern
waited for in the same call), its restart, and the progress a host that asks for it sees
while a tool waits.
"""

from __future__ import annotations

from typing import Any

import trio

from .conftest import DaemonProcess
from .helpers import alive, sh
from .test_mcp import call, checked_call, mcp_server, refused, text_of


async def test_spawn_waits_for_its_ready_line_in_the_same_call(daemon: DaemonProcess) -> None:
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            server = await call(
                session,
                "subagent_spawn",
                argv=sh("echo starting; echo listening on 8080; sleep 60"),
                ready=r"listening on \d+",
            )
            assert server["state"] == "running"
            assert server["ready"] == {
                "outcome": "matched",
                "line": "listening on 8080",
                "tail": "",
            }
            crashed = await checked_call(
                session,
                "subagent_spawn",
                {"argv": sh("echo config missing >&2; exit 7"), "ready": "listening"},
            )
            structured = crashed.structured_content
            assert structured is not None
            assert structured["ready"]["outcome"] == "ended"
            assert (structured["state"], structured["exit_code"]) == ("failed", 7)
            assert structured["ready"]["tail"] == "config missing\n"
            assert "ended before a line matched" in text_of(crashed)
            assert "config missing" in text_of(crashed)
            slow = await call(
                session,
                "subagent_spawn",
                argv=sh("echo warming up; sleep 60"),
                ready="never",
                ready_timeout=0.3,
            )
            assert slow["ready"]["outcome"] == "timed_out"
            assert slow["state"] == "running"
            assert slow["ready"]["tail"] == "warming up\n"


async def test_spawn_takes_env_grace_and_key(daemon: DaemonProcess) -> None:
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            spawned = {
                "argv": sh("trap '' TERM; echo $MODE; sleep 60"),
                "env": {"MODE": "stubborn"},
                "grace": 0.2,
                "key": "agent-call-0001",
                "ready": "stubborn",
            }
            first = await call(session, "subagent_spawn", **spawned)
            # Sent again with the same key (its answer lost, say): the same worker.
            again = await call(session, "subagent_spawn", **spawned)
            assert again["id"] == first["id"]
            listed = await call(session, "subagent_list", all=True)
            assert [w["id"] for w in listed["workers"]] == [first["id"]]
            # It ignores TERM: the stop ends it by KILL after its 0.2 s grace, not the
            # daemon's default 5 s.
            with trio.fail_after(3.5):
                await call(session, "subagent_stop", worker=first["id"])
            status = await call(session, "subagent_status", worker=first["id"])
            assert status["state"] == "stopped"
            for env in ({"": "x"}, {"A": "x" * (128 * 1024 + 1)}):
                error = await refused(session, "subagent_spawn", argv=["true"], env=env)
                assert error["code"] == "invalid"
                assert error["message"].startswith("env")
            for grace in (-1, 86_400 * 2, "5"):
                error = await refused(session, "subagent_spawn", argv=["true"], grace=grace)
                assert error["message"].startswith("grace: ")
            for key in ("", "k" * 129, "with space", "tab\there"):
                error = await refused(session, "subagent_spawn", argv=["true"], key=key)
                assert error["message"].startswith("key: ")


async def test_restart_stops_and_starts_a_new_attempt_of_the_same_worker(
    daemon: DaemonProcess,
) -> None:
    with trio.fail_after(40):
        async with mcp_server(daemon) as session:
            parent = await call(
                session, "subagent_spawn", argv=sh("echo serving; sleep 60"), ready="serving"
            )
            restarted = await call(session, "subagent_restart", worker=parent["id"])
            assert restarted["stopped"] == [parent["id"]]
            fresh = restarted["worker"]
            assert (fresh["id"], fresh["attempt"], fresh["state"]) == (parent["id"], 2, "running")
            assert fresh["pid"] != parent["pid"]
            assert not alive(parent["pid"])
            assert alive(fresh["pid"])
            waited = await call(
                session, "subagent_wait", worker=parent["id"], pattern="serving", timeout=20
            )
            assert waited["outcome"] == "matched"
            done = await call(session, "subagent_spawn", argv=["true"])
            await call(session, "subagent_wait", worker=done["id"], timeout=20)
            finished = await refused(session, "subagent_restart", worker=done["id"])
            assert finished["code"] == "refused"
            assert "nothing to resume" in finished["message"]


async def test_a_host_that_asks_sees_progress_while_a_tool_waits(daemon: DaemonProcess) -> None:
    seen: list[tuple[float, float | None]] = []

    async def progressed(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total))

    with trio.fail_after(40):
        async with mcp_server(daemon, {"SUBAGENTD_MCP_PROGRESS_INTERVAL": "0.2"}) as session:
            worker = await call(session, "subagent_spawn", argv=["sleep", "60"])
            result = await session.call_tool(
                "subagent_wait",
                {"worker": worker["id"], "timeout": 1.5},
                progress_callback=progressed,
            )
            assert not result.is_error, text_of(result)
            structured: dict[str, Any] = dict(result.structured_content or {})
            assert structured["outcome"] == "timed_out"
            assert len(seen) >= 3, seen
            assert all(total == 1.5 for _, total in seen)
            assert [p for p, _ in seen] == sorted(p for p, _ in seen)
            # A call that does not wait, or a host that does not ask, gets none.
            count = len(seen)
            await session.call_tool("subagent_list", {}, progress_callback=progressed)
            await session.call_tool("subagent_wait", {"worker": worker["id"], "timeout": 0.6})
            assert len(seen) == count
            # A refusal while progress is asked for is the same tool error.
            gone = await session.call_tool(
                "subagent_wait", {"worker": "w-nope", "timeout": 1}, progress_callback=progressed
            )
            assert gone.is_error
            assert text_of(gone) == "not_found: no worker 'w-nope'"
