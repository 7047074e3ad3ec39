"""Who may ask what: the daemon's one permission decision, asked directly, request by caller.

The family below is what a daemon may know of workers: handles in the registry, a
tombstone, records only in the archive (released), a chain that breaks, a loop in
damaged records. The same decisions are driven end to end through the socket at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.core._authority import Authority
from subagentd.protocol.errors import Forbidden, NotFound

from .conftest import DaemonProcess
from .helpers import RawConnection, sh, wait_output

BOSS = "w-boss"
#: worker -> its parent, as the registry, its tombstones and the archive know them.
REGISTRY = {
    BOSS: None,
    "w-kid": BOSS,
    "w-grand": "w-mid",  # held, below a middle worker only the archive still knows
    "w-other": None,
    "w-nephew": "w-other",
    "w-orphan": "w-lost",  # its parent is known nowhere any more
    "w-a": "w-b",  # damaged records that point at each other
    "w-b": "w-a",
}
TOMBSTONES = {"w-tomb": "w-kid"}
ARCHIVE = {"w-mid": BOSS, "w-gone": BOSS, "w-gone-other": "w-other"}

MINE = [BOSS, "w-kid", "w-grand", "w-mid", "w-gone", "w-tomb"]
NOT_MINE = ["w-other", "w-nephew", "w-gone-other", "w-orphan", "w-a"]
NEVER_SEEN = "w-nobody"


def parent_of(worker_id: str) -> str | None:
    for known in (REGISTRY, TOMBSTONES, ARCHIVE):
        if worker_id in known:
            return known[worker_id]
    raise NotFound(f"no worker {worker_id!r}")


authority = Authority(parent_of)

ON_A_WORKER: list[type[p.Request[p.Reply]]] = [
    p.Status,
    p.Watch,
    p.Collect,
    p.Wait,
    p.Resume,
    p.Grep,
    p.WaitFor,
    p.Send,
]
ON_A_WORKER_OR_STOP: list[type[p.Request[p.Reply]]] = [*ON_A_WORKER, p.Stop]


def _about(kind: type[p.Request[p.Reply]], worker: str) -> p.ClientMessage:
    needs: dict[type[p.Request[p.Reply]], dict[str, object]] = {
        p.Grep: {"pattern": "x"},
        p.WaitFor: {"pattern": "x", "timeout": 1.0},
    }
    request = kind(id=1, worker=worker, **needs.get(kind, {}))  # type: ignore[call-arg]
    assert isinstance(
        request,
        p.Status | p.Watch | p.Collect | p.Wait | p.Resume | p.Stop | p.Grep | p.WaitFor | p.Send,
    )
    return request


KEPT_FROM_WORKERS: list[p.ClientMessage] = [
    p.NewRun(id=1),
    p.StopRun(id=1, run="r-1"),
    p.WaitRunStopped(id=1, run="r-1"),
    p.BeginTurn(id=1),
    p.SetFence(id=1),
    p.CancelFence(id=1, epoch=1),
    p.ClearFence(id=1),
    p.Reload(id=1),
    p.ResumeRun(id=1, run="r-1"),
    p.ReopenRun(id=1, run="r-1"),
    p.LatestResumable(id=1, cwd="/src"),
]
ANY_WORKER_MAY: list[p.ClientMessage] = [
    p.Hello(id=1),  # refused, but as `invalid`: a second hello, not a question of authority
    p.Spawn(id=1),  # its parent is the caller
    p.ListWorkers(id=1, all=True),
    p.Ack(id=1, wakes=[1]),
    p.Info(id=1),
    p.Abort(id=1, request=2),
    p.Subscribe(id=1),  # no parent, or two: `invalid`, whoever asks
    p.Subscribe(id=1, run="r-1", worker="w-kid"),
]


def _forbidden(request: p.ClientMessage, caller: str = BOSS) -> str:
    with pytest.raises(Forbidden) as refused:
        authority.check(caller, request)
    message = refused.value.message
    assert caller in message, message
    return message


@pytest.mark.parametrize(
    "request_",
    [
        *KEPT_FROM_WORKERS,
        *ANY_WORKER_MAY,
        *(_about(kind, w) for kind in ON_A_WORKER_OR_STOP for w in [*NOT_MINE, NEVER_SEEN]),
        p.Spawn(id=1, parent="w-other"),
        p.Subscribe(id=1, run="r-1"),
        p.Cancel(id=1, scope="all"),
        p.Cancel(id=1, scope="worker:w-other"),
    ],
    ids=repr,
)
def test_the_user_may_ask_anything(request_: p.ClientMessage) -> None:
    authority.check(None, request_)  # what does not exist is the dispatch's to say


@pytest.mark.parametrize("request_", KEPT_FROM_WORKERS, ids=p.op)
def test_runs_turns_fences_and_reloads_are_kept_from_workers_by_their_wire_name(
    request_: p.ClientMessage,
) -> None:
    message = _forbidden(request_)
    assert message.startswith(f"{p.op(request_)} is not for a worker's connection")
    assert type(request_).__name__ not in message.split(":")[0]


@pytest.mark.parametrize("request_", ANY_WORKER_MAY, ids=repr)
def test_a_worker_may_send_these_as_they_are(request_: p.ClientMessage) -> None:
    authority.check(BOSS, request_)


@pytest.mark.parametrize("kind", ON_A_WORKER_OR_STOP, ids=lambda k: k.__name__)
@pytest.mark.parametrize("worker", MINE)
def test_a_worker_reaches_its_whole_subtree_released_and_archived_ones_too(
    kind: type[p.Request[p.Reply]], worker: str
) -> None:
    authority.check(BOSS, _about(kind, worker))


@pytest.mark.parametrize("kind", ON_A_WORKER_OR_STOP, ids=lambda k: k.__name__)
@pytest.mark.parametrize("worker", NOT_MINE)
def test_a_worker_reaches_nothing_outside_its_subtree(
    kind: type[p.Request[p.Reply]], worker: str
) -> None:
    message = _forbidden(_about(kind, worker))
    assert worker in message


@pytest.mark.parametrize("kind", ON_A_WORKER, ids=lambda k: k.__name__)
def test_a_worker_never_seen_is_not_found(kind: type[p.Request[p.Reply]]) -> None:
    with pytest.raises(NotFound):
        authority.check(BOSS, _about(kind, NEVER_SEEN))


def test_stopping_a_worker_never_seen_is_allowed_and_answers_found_false_later() -> None:
    authority.check(BOSS, p.Stop(id=1, worker=NEVER_SEEN))


def test_a_released_worker_still_acts_on_what_it_delegated() -> None:
    authority.check("w-mid", p.Status(id=1, worker="w-grand"))
    _forbidden(p.Status(id=1, worker="w-kid"), caller="w-mid")


def test_spawn_under_a_parent_in_the_subtree_only() -> None:
    authority.check(BOSS, p.Spawn(id=1, parent="w-kid"))
    assert "w-nephew" in _forbidden(p.Spawn(id=1, parent="w-nephew"))
    with pytest.raises(NotFound):
        authority.check(BOSS, p.Spawn(id=1, parent=NEVER_SEEN))


def test_subscribe_to_a_worker_in_the_subtree_only_never_to_a_run() -> None:
    authority.check(BOSS, p.Subscribe(id=1, worker="w-tomb"))
    _forbidden(p.Subscribe(id=1, worker="w-other"))
    assert "not to a run's" in _forbidden(p.Subscribe(id=1, run="r-1"))


@pytest.mark.parametrize("scope", ["all", "run:r-1", "turn:1", "fence:1", "workers:w-kid"])
def test_a_worker_cancels_no_scope_but_one_worker(scope: str) -> None:
    assert repr(scope) in _forbidden(p.Cancel(id=1, scope=scope))


def test_a_worker_cancels_a_worker_in_its_subtree_only() -> None:
    authority.check(BOSS, p.Cancel(id=1, scope="worker:w-grand"))
    _forbidden(p.Cancel(id=1, scope="worker:w-nephew"))


def test_a_listing_shows_a_worker_its_subtree_and_the_user_everything() -> None:
    everyone = [*REGISTRY, *TOMBSTONES, *ARCHIVE]
    assert [w for w in everyone if authority.sees(BOSS, w)] == [
        BOSS,
        "w-kid",
        "w-grand",
        "w-tomb",
        "w-mid",
        "w-gone",
    ]
    assert all(authority.sees(None, w) for w in everyone)
    assert not authority.sees(BOSS, NEVER_SEEN)


# -- end to end: a worker's own connection, on the real socket -------------------


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_a_workers_connection_is_refused_by_wire_names_and_reaches_its_released_child(
    daemon: DaemonProcess, client: AsyncClient
) -> None:
    with trio.fail_after(30):
        boss = await client.spawn(sh('echo "token=$SUBAGENTD_TOKEN"; exec sleep 60'))
        sibling = await client.spawn(["sleep", "60"])
        child = await client.spawn(["true"], parent=boss.id)
        await client.collect(child.id, wait=True)  # released: only its archive knows it now
        assert child.id not in [w.id for w in await client.ls(all=True)]
        printed = await wait_output(client, boss.id, b"\n")
        token = printed.decode().split("token=", 1)[1].split()[0]

        conn = RawConnection(await trio.open_unix_socket(str(daemon.socket)))
        try:
            await conn.send(p.Hello(id=1, token=token))
            assert isinstance(await conn.receive(), p.Welcome)
            answers = []
            for request in [
                p.NewRun(id=2),
                p.Subscribe(id=3, run=boss.run),
                p.Status(id=4, worker=sibling.id),
                p.Status(id=5, worker=child.id),
            ]:
                await conn.send(request)
                answers.append(await conn.receive())
        finally:
            await conn.stream.aclose()

    new_run, subscribe, sibling_status, child_status = answers
    assert isinstance(new_run, p.Error)
    assert new_run.code == "forbidden"
    assert new_run.message.startswith("new_run is not for a worker's connection")
    assert boss.id in new_run.message
    assert isinstance(subscribe, p.Error)
    assert subscribe.code == "forbidden"
    assert isinstance(sibling_status, p.Error)
    assert sibling_status.code == "forbidden"
    assert sibling.id in sibling_status.message
    assert isinstance(child_status, p.WorkerReply)
    assert child_status.worker.state == "finished"
