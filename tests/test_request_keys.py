"""Idempotency keys (issue 13, item 5): a spawn or resume sent again with its key answers
the worker the first one made, so the clients send them again across a reload and a
caller sees no error; a key is its caller's, bounded, remembered for a while (the mock
clock), kept in the store with its worker (a reload, kill -9), and a hostile one is
refused `invalid`, naming the field."""

from __future__ import annotations

import collections
import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from subagentd import protocol as p
from subagentd.client import Client
from subagentd.daemon.core._registry import WorkerRecord
from subagentd.daemon.core._request_keys import USER, KeyRecord, RequestKeys, asked_key
from subagentd.daemon.store._store import MIGRATIONS, SCHEMA_VERSION, STORE_NAME, Change, Store
from subagentd.protocol.errors import Busy, Invalid

from .conftest import BIN, DaemonProcess
from .helpers import RawConnection, sh
from .inprocess import held, in_process

#: A minute: on the mock clock it passes at once, and a test can look just before it.
KEY_TTL = 60.0


def _names(workers: list[p.WorkerView]) -> collections.Counter[str]:
    return collections.Counter(w.name for w in workers)


# -- (a) across real reloads, an answer lost on purpose -------------------------------

#: The spawns whose answer the daemon loses in a reload of its own (`lose-answer:N`).
LOST = ("lost-1", "lost-2", "lost-3")
SPAWNS = 24


def test_a_blocking_client_spawning_across_reloads_sees_no_error_and_makes_each_worker_once(
    daemon_dirs: DaemonProcess,
) -> None:
    daemon_dirs.start(env={"SUBAGENTD_FAULT": ",".join(f"lose-answer:{n}" for n in LOST)})
    names = [f"w-{i}" for i in range(SPAWNS)]
    for i, lost in enumerate(LOST):  # spread among the others
        names[4 + 7 * i] = lost
    done = threading.Event()
    reloads: list[int] = []

    def reload_meanwhile() -> None:
        """More reloads from elsewhere while the loop spawns, as a user's would come."""
        with Client(daemon_dirs.socket, timeout=30) as other:
            while not done.is_set() and len(reloads) < 3:
                try:
                    reloads.append(other.reload().image_generation)
                except Busy as exc:  # the last one a moment ago
                    time.sleep(exc.retry_after or 0.2)
                time.sleep(0.1)

    reloader = threading.Thread(target=reload_meanwhile)
    reloader.start()
    try:
        with Client(daemon_dirs.socket, timeout=30) as client:
            made = [client.spawn(["true"], name=name) for name in names]
            workers = client.ls(all=True)
            generation = client.info().image_generation
    finally:
        done.set()
        reloader.join(timeout=60)
    # Each spawn made exactly one worker, and answered with it.
    assert _names(workers) == collections.Counter(names)
    by_name = {w.name: w.id for w in workers}
    assert [w.id for w in made] == [by_name[name] for name in names]
    # Each lost answer was lost in a reload of its own, on top of the others'.
    assert generation >= 1 + len(LOST)
    log = daemon_dirs.log()
    assert log.count('"request.repeated"') >= len(LOST), log[-4000:]


# -- (b) a repeated key answers the same worker -----------------------------------------


async def test_a_spawn_sent_again_with_its_key_answers_the_worker_it_made(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):
            first = await client.spawn(["sleep", "100000"], name="once", key="spawn-1")
            again = await client.spawn(["sleep", "100000"], name="once", key="spawn-1")
            assert again.id == first.id
            assert (again.run, again.pid, again.state) == (first.run, first.pid, "running")
            assert _names(await client.ls(all=True)) == {"once": 1}
            # Without a key of its own, each spawn gets a new one: a second worker.
            other = await client.spawn(["sleep", "100000"], name="once")
            assert other.id != first.id

            await client.stop(first.id)
            resumed = await client.resume(first.id, key="resume-1")
            repeated = await client.resume(first.id, key="resume-1")
            assert (resumed.attempt, repeated.attempt) == (2, 2)
            assert (repeated.id, repeated.pid, repeated.state) == (
                resumed.id,
                resumed.pid,
                "running",
            )


async def test_a_keyed_spawn_raw_on_the_wire_is_answered_the_same_twice(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d:
        with held(autojump_clock):
            conn = await RawConnection.open(d.socket)
            spawn = p.Spawn(id=2, argv=["sleep", "100000"], cwd="/", key="raw-1")
            await conn.send(spawn)
            first = await conn.receive()
            await conn.send(spawn)  # the same request, sent again
            second = await conn.receive()
            await conn.stream.aclose()
    assert isinstance(first, p.WorkerReply)
    assert isinstance(second, p.WorkerReply)
    assert second.worker.id == first.worker.id


# -- (c) the same key with another request is refused -------------------------------------


async def test_a_key_sent_with_a_different_request_is_refused_not_answered(
    autojump_clock: MockClock, short_tmp: Path
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        with held(autojump_clock):
            first = await client.spawn(["sleep", "100000"], key="mine")
            for changed in (
                client.spawn(["sleep", "99999"], key="mine"),
                client.spawn(["sleep", "100000"], name="another", key="mine"),
                client.resume(first.id, key="mine"),
            ):
                with pytest.raises(Invalid, match="used for a different request") as refused:
                    await changed
                assert first.id in refused.value.message
            assert len(await client.ls(all=True)) == 1


def test_a_workers_keys_are_its_own_not_the_users(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The same key and the same request from a worker's token make the worker's own child:
    it cannot read the answer to a key the user sent (nor the user a worker's)."""
    here = tmp_path / "here"
    here.mkdir()
    users = json.loads(
        daemon.ctl("--json", "spawn", "--key", "shared", "--cwd", str(here), "--", "true").stdout
    )
    ctl = f"{BIN / 'subagentctl'} --json spawn --key shared -- true"
    parent = json.loads(
        daemon.ctl("--json", "spawn", "--cwd", str(here), "--", *sh(f"{ctl}; echo; {ctl}")).stdout
    )
    with Client(daemon.socket, timeout=30) as client:
        client.wait(parent["id"])
        printed = client.collect(parent["id"]).result.splitlines()
        children = [json.loads(line) for line in printed if line]
        again = client.spawn(["true"], cwd=here, key="shared")
    assert [c["parent"] for c in children] == [parent["id"], parent["id"]]
    assert children[0]["id"] == children[1]["id"] != users["id"]
    assert again.id == users["id"]


def test_subagentctl_spawn_and_resume_with_a_key_answer_the_first_worker(
    daemon: DaemonProcess,
) -> None:
    first = json.loads(daemon.ctl("--json", "spawn", "--key", "job-7", "--", "sleep", "60").stdout)
    again = daemon.ctl("--json", "spawn", "--key", "job-7", "--", "sleep", "60")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["id"] == first["id"]
    other = daemon.ctl("spawn", "--key", "job-7", "--", "sleep", "61")
    assert other.returncode == 1
    assert "invalid" in other.stderr
    assert "used for a different request" in other.stderr
    for hostile in ("", "a b", "k" * 129):
        refused = daemon.ctl("spawn", "--key", hostile, "--", "true")
        assert (refused.returncode, refused.stdout) == (1, ""), hostile
        assert "invalid" in refused.stderr
        assert "$.key" in refused.stderr
    assert daemon.ctl("stop", first["id"]).returncode == 0
    resumed = [daemon.ctl("--json", "resume", first["id"], "--key", "r-7") for _ in range(2)]
    assert [r.returncode for r in resumed] == [0, 0], resumed[1].stderr
    assert [json.loads(r.stdout)["attempt"] for r in resumed] == [2, 2]
    daemon.ctl("stop", first["id"])
    # A whole run's resume takes no key (resume_run has none): refused, not ignored.
    for whole in (["--run", first["run"]], ["--latest"]):
        ignored = daemon.ctl("resume", *whole, "--key", "r-8")
        assert ignored.returncode == 2, ignored
        assert "--key: only with a worker ID" in ignored.stderr


# -- (d) a key is remembered for its ttl, on trio's clock --------------------------------


async def test_a_key_is_forgotten_after_its_ttl(autojump_clock: MockClock, short_tmp: Path) -> None:
    async with in_process(short_tmp, request_key_ttl=KEY_TTL) as d, d.client() as client:
        with held(autojump_clock):
            first = await client.spawn(["sleep", "100000"], key="k")
        spawned = trio.current_time()
        await trio.sleep_until(spawned + KEY_TTL - 1)
        with held(autojump_clock):
            assert (await client.spawn(["sleep", "100000"], key="k")).id == first.id
        await trio.sleep_until(spawned + KEY_TTL + 1)
        with held(autojump_clock):
            later = await client.spawn(["sleep", "100000"], key="k")
        assert later.id != first.id  # forgotten: a new request, a new worker
        assert len(await client.ls()) == 2


# -- (e) a key outlives a reload and a crash ----------------------------------------------


def test_a_key_survives_kill_9_and_a_restart(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, timeout=30) as client:
        first = client.spawn(["sleep", "60"], name="kept", key="before-the-crash")
    daemon.kill()
    daemon.start()
    with Client(daemon.socket, timeout=30) as client:
        again = client.spawn(["sleep", "60"], name="kept", key="before-the-crash")
        assert again.id == first.id
        assert again.state == "interrupted"  # the same worker, as recovery left it
        assert _names(client.ls(all=True)) == {"kept": 1}


async def test_a_key_survives_a_reload_in_place(autojump_clock: MockClock, short_tmp: Path) -> None:
    async with in_process(short_tmp) as d:
        async with d.client() as client:
            with held(autojump_clock):
                first = await client.spawn(["sleep", "100000"], key="across")
        d = await d.reload_in_place()
        async with d.client() as client:
            with held(autojump_clock):
                again = await client.spawn(["sleep", "100000"], key="across")
        assert (again.id, again.pid) == (first.id, first.pid)


# -- (f) hostile keys ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["", "k" * (p.MAX_KEY_LENGTH + 1), "k" * 1_000_000, "with space", "tab\t", "nul\x00", "é"],
)
async def test_a_hostile_key_is_refused_invalid_naming_the_field(
    autojump_clock: MockClock, short_tmp: Path, key: str
) -> None:
    async with in_process(short_tmp) as d, d.client() as client:
        for request in (
            p.Spawn(id=0, argv=["true"], key=key),
            p.Resume(id=0, worker="w-none", key=key),
        ):
            with pytest.raises(Invalid, match=r"\$\.key"):
                await client.request(request)
        with held(autojump_clock):
            assert (await client.spawn(["true"], key="k" * p.MAX_KEY_LENGTH)).id
            assert len(await client.ls(all=True)) == 1  # and serves on


# -- in the store: v2 migrated forward, a key only with its worker ----------------------


def test_a_v2_store_is_migrated_to_v3_and_keeps_its_workers(tmp_path: Path) -> None:
    path = tmp_path / STORE_NAME
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE schema_version "
        "(version INTEGER PRIMARY KEY, migrated_at REAL NOT NULL, by TEXT NOT NULL)"
    )
    for version in (1, 2):  # as the image of schema version 2 made it
        MIGRATIONS[version](db)
        db.execute("INSERT INTO schema_version VALUES (?, 0.0, 'subagentd pid 1')", (version,))
    db.commit()
    db.close()
    store = Store.open(path)
    try:
        assert store.version == SCHEMA_VERSION == 3
        assert store.request_keys() == []
        key = KeyRecord(USER, "k", "w-1", b"digest", 5.0)
        store.commit(Change(workers=[_record("w-1")], keys=[key]), "a test")
        assert store.request_keys() == [key]
        store.commit(Change(dropped_keys=[(USER, "k")]), "a test")
        assert store.request_keys() == []
    finally:
        store.close()


def test_a_key_is_written_in_its_workers_transaction_or_not_at_all(tmp_path: Path) -> None:
    store = Store.open(tmp_path / STORE_NAME)

    def crash() -> None:
        raise RuntimeError("killed inside the transaction")

    try:
        key = KeyRecord("w-parent", "k", "w-1", b"digest", 5.0)
        with pytest.raises(RuntimeError):
            store.commit(
                Change(workers=[_record("w-1")], keys=[key]), "a spawn", before_commit=crash
            )
        assert (store.worker("w-1"), store.request_keys()) == (None, [])
        store.commit(Change(workers=[_record("w-1")], keys=[key]), "a spawn")
        assert (store.worker("w-1"), store.request_keys()) == (_record("w-1"), [key])
    finally:
        store.close()


def _record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(
        id=worker_id, run="r-1", parent=None, name="", state="running", argv=["true"],
        cwd="/", agent=None, grace=1.0, timeout=None, token=f"t-{worker_id}",
        archive=f"/a/{worker_id}", started_at=1.0,
    )  # fmt: skip


# -- the keys' bounds, by calling the pure core -------------------------------------------


def test_a_caller_past_its_count_forgets_its_own_oldest_keys_not_anothers() -> None:
    keys = RequestKeys(ttl=KEY_TTL, per_caller=2)
    made = [KeyRecord("w-flood", f"k{i}", f"w-{i}", b"d", float(i)) for i in range(3)]
    users = KeyRecord(USER, "k0", "w-user", b"d", 0.0)
    assert keys.remember(users, now=0.0) == []
    assert keys.remember(made[0], now=0.0) == []
    assert keys.remember(made[1], now=1.0) == []
    assert keys.remember(made[2], now=2.0) == [("w-flood", "k0")]
    assert keys.find("w-flood", "k0", now=2.0) is None
    assert keys.find(USER, "k0", now=2.0) == users  # the same key, another caller's
    assert keys.find("w-flood", "k2", now=2.0) == made[2]
    # Past the ttl, each is forgotten, and said to be, for the store to drop.
    later = KeyRecord(USER, "k9", "w-9", b"d", KEY_TTL + 1.5)
    assert sorted(keys.remember(later, now=KEY_TTL + 1.5)) == [
        (USER, "k0"),
        ("w-flood", "k1"),
    ]
    assert len(keys) == 2


def test_keys_read_back_from_the_store_are_held_to_the_ttl_and_count() -> None:
    keys = RequestKeys(ttl=KEY_TTL, per_caller=1)
    kept = [
        KeyRecord(USER, "old", "w-1", b"d", 0.0),
        KeyRecord(USER, "older-than-the-newest", "w-2", b"d", KEY_TTL),
        KeyRecord(USER, "newest", "w-3", b"d", KEY_TTL + 1),
    ]
    dropped = keys.load(kept, now=KEY_TTL + 2)
    assert sorted(dropped) == [(USER, "old"), (USER, "older-than-the-newest")]
    assert keys.find(USER, "newest", now=KEY_TTL + 2) == kept[2]


class _SpawnOfALaterVersion(p.Spawn, tag="spawn"):
    """A spawn as a later version declares it: one more field, with a default."""

    later: int = 0


@pytest.mark.parametrize("caller", [None, "w-parent"])
def test_a_field_a_later_version_adds_changes_no_keys_digest(caller: str | None) -> None:
    # Across an upgrade reload, a keyed spawn sent again is decoded with the new image's
    # fields: left at their defaults, they must not make it "a different request".
    asked = {"id": 1, "argv": ["true"], "key": "k", "env": {"A": "1"}, "input": b"in"}
    now = asked_key(p.Spawn(**asked), caller)  # type: ignore[arg-type]
    later = asked_key(_SpawnOfALaterVersion(**asked), caller)  # type: ignore[arg-type]
    assert now is not None
    assert later is not None
    assert later.digest == now.digest
    # ...while a field given other than its default is still part of what was asked.
    given = asked_key(_SpawnOfALaterVersion(**asked, later=1), caller)  # type: ignore[arg-type]
    assert given is not None
    assert given.digest != now.digest
    assert asked_key(p.Spawn(**asked | {"env": {"A": "2"}}), caller) != now  # type: ignore[arg-type]
