"""Both clients schedule alike (issue 27, item 5): the blocking `Client` takes every
scheduling field the trio `AsyncClient` does, under the same names and defaults, and a
planner on it gets a capped run, an order, start-after, ready and retries end to end;
its hostile values are refused `invalid` naming the field, the daemon serving on.
"""

from __future__ import annotations

import inspect
import math

import pytest

from subagentd.client import AsyncClient, Client
from subagentd.protocol.errors import Invalid

from .conftest import DaemonProcess
from .helpers import sh

#: Fails on its first attempt, then finishes (SUBAGENTD_RESUME is the attempt).
FLAKY = '[ "${SUBAGENTD_RESUME:-1}" -ge 2 ]'
SCHEDULING = (
    "priority",
    "retries",
    "backoff",
    "backoff_max",
    "retry_on",
    "ready",
    "after",
    "after_ok",
    "after_ready",
)


@pytest.mark.parametrize(
    ("method", "names"),
    [("spawn", SCHEDULING), ("new_run", ("max_running",)), ("wait", ("ready",))],
)
def test_both_clients_take_the_same_scheduling_fields(method: str, names: tuple[str, ...]) -> None:
    blocking = inspect.signature(getattr(Client, method)).parameters
    trio_side = inspect.signature(getattr(AsyncClient, method)).parameters
    for name in names:
        assert name in blocking, (method, name)
        assert (blocking[name].kind, blocking[name].default) == (
            trio_side[name].kind,
            trio_side[name].default,
        ), (method, name)


def test_the_blocking_client_schedules_a_planners_workers(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, timeout=30) as client:
        run = client.new_run(max_running=1)
        server = client.spawn(sh("echo listening; exec sleep 30"), run=run, ready="^listening")
        low = client.spawn(["true"], run=run)
        high = client.spawn(["true"], run=run, priority=5)
        assert (low.queued, high.queued) == (True, True)
        # The higher priority goes ahead of the one queued before it.
        assert [client.status(w.id).queue_position for w in (high, low)] == [1, 2]
        assert client.wait(server.id, ready=True).ready
        client.stop(server.id)
        assert [client.wait(w.id).state for w in (high, low)] == ["finished", "finished"]
        assert client.status(high.id).started_at <= client.status(low.id).started_at
        flaky = client.spawn(sh(FLAKY), retries=2, backoff=0, backoff_max=1, retry_on=["timeout"])
        ended = client.wait(flaky.id)
        assert (ended.state, ended.attempt, ended.retries) == ("finished", 2, 2)
        failing = client.spawn(sh("exit 3"))
        after = client.spawn(["true"], after=[failing.id])
        skipped = client.spawn(["true"], after_ok=[failing.id])
        unready = client.spawn(["true"], after_ready=[failing.id])
        assert all(v.queued for v in (after, skipped, unready))
        assert client.wait(after.id).state == "finished"
        for worker in (skipped, unready):
            assert (client.wait(worker.id).state, client.status(worker.id).reason) == (
                "stopped",
                "skipped",
            )


@pytest.mark.parametrize(
    ("method", "fields", "named"),
    [
        ("new_run", {"max_running": 0}, "max_running"),
        ("new_run", {"max_running": -1}, "max_running"),
        ("new_run", {"max_running": 100_001}, "max_running"),
        ("new_run", {"max_running": math.nan}, "max_running"),
        ("new_run", {"max_running": "four"}, "max_running"),
        ("spawn", {"priority": 2**63}, "priority"),
        ("spawn", {"priority": "high"}, "priority"),
        ("spawn", {"retries": -1}, "retries"),
        ("spawn", {"retries": 101}, "retries"),
        ("spawn", {"backoff": math.nan}, "backoff"),
        ("spawn", {"backoff": math.inf}, "backoff"),
        ("spawn", {"backoff_max": -1.0}, "backoff_max"),
        ("spawn", {"retry_on": ["crash"]}, "retry_on"),
        ("spawn", {"ready": ""}, "ready"),
        ("spawn", {"ready": "("}, "ready"),
        ("spawn", {"after": ["w"] * 65}, "after"),
        ("spawn", {"after_ok": ["w"] * 65}, "after_ok"),
        ("spawn", {"after_ready": ["x" * 257]}, "after_ready"),
    ],
)
def test_the_blocking_client_refuses_a_hostile_scheduling_field_naming_it(
    daemon: DaemonProcess, method: str, fields: dict[str, object], named: str
) -> None:
    with Client(daemon.socket, timeout=10) as client:
        call = getattr(client, method)
        with pytest.raises(Invalid, match=named):
            call(["true"], **fields) if method == "spawn" else call(**fields)
        assert client.new_run()  # the daemon serves on
