"""grep filtered by stream and by time, in the daemon: only the lines the filters keep are
matched and counted against `limit`, every line is still numbered and still context, as in
an unfiltered grep; a filter's hostile values are refused `invalid`, naming the field.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.daemon.workers._grep import CHECKPOINT_BYTES, LineScanner, compile_pattern
from subagentd.protocol import Entry, OutputKind

from .conftest import DaemonProcess
from .helpers import Connect, sh
from .test_cli import js, json_error, ok, said, spawn


def _scan(entries: list[Entry], **filters: Any) -> LineScanner:
    scanner = LineScanner(compile_pattern("a"), before=1, after=1, **filters)
    scanner.feed(entries)
    scanner.finish()
    return scanner


def _written(entries: list[Entry]) -> list[tuple[OutputKind, float]]:
    """Each line's stream, and when the entry that ended it was written, in line order."""
    written: list[tuple[OutputKind, float]] = []
    unended: dict[str, float | None] = {"stdout": None, "stderr": None}
    for entry in entries:
        assert entry.kind in ("stdout", "stderr")
        ends = entry.data.count(b"\n")
        written += [(entry.kind, entry.at)] * ends
        last = entry.data.rsplit(b"\n", 1)[-1]
        unended[entry.kind] = entry.at if last else (None if ends else unended[entry.kind])
    for kind in ("stdout", "stderr"):
        at = unended[kind]
        if at is not None:
            written.append((kind, at))
    return written


@given(
    pieces=st.lists(
        st.tuples(st.sampled_from(["stdout", "stderr"]), st.text("ab\n", max_size=12)),
        max_size=30,
    ),
    stream=st.sampled_from([None, "stdout", "stderr"]),
    since=st.one_of(st.none(), st.integers(min_value=0, max_value=30)),
    limit=st.integers(min_value=1, max_value=20),
)
def test_filtered_matches_are_the_unfiltered_ones_the_filters_keep(
    pieces: list[tuple[OutputKind, str]], stream: OutputKind | None, since: int | None, limit: int
) -> None:
    entries = [
        Entry(seq=i + 1, kind=kind, data=text.encode(), at=float(i))
        for i, (kind, text) in enumerate(pieces)
    ]
    everything = _scan(entries, limit=10_000)
    written = _written(entries)
    assert len(written) == everything.line_no

    def kept(line_no: int) -> bool:
        kind, at = written[line_no - 1]
        return (stream is None or kind == stream) and (since is None or at >= since)

    expected = [m for m in everything.matches if kept(m.line_no)]
    filtered = _scan(entries, limit=limit, stream=stream, written_since=since)
    assert filtered.matches == expected[:limit]
    assert filtered.more == (len(expected) > limit)
    assert filtered.line_no == everything.line_no


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as client:
        yield client


async def test_the_limit_counts_only_the_lines_of_the_stream_asked_for(
    client: AsyncClient,
) -> None:
    with trio.fail_after(30):
        script = "i=0; while [ $i -lt 500 ]; do i=$((i+1)); echo hit $i; done; echo hit err >&2"
        worker = await client.spawn(sh(script + "; echo hit last"))
        await client.wait(worker.id)
        errors = await client.grep(worker.id, "hit", limit=1, stream="stderr", before=1)
        out = await client.grep_all(worker.id, "hit", limit=1000, stream="stdout")
        every = await client.grep_all(worker.id, "hit", limit=1000, before=1)
    # (How the two streams interleave in the journal is how the daemon read its pipes.)
    [error] = errors.matches
    assert (error.line, error.kind) == ("hit err", "stderr")
    # Numbered, and given context (either stream), as in the unfiltered grep.
    assert error in every.matches
    assert (errors.truncated, errors.next) == (False, None)
    assert len(out.matches) == 501
    assert {m.kind for m in out.matches} == {"stdout"}
    assert [m.line_no for m in out.matches] == [
        m.line_no for m in every.matches if m.kind == "stdout"
    ]


async def test_a_grep_since_a_time_keeps_later_lines_with_their_whole_context(
    client: AsyncClient, daemon: DaemonProcess
) -> None:
    gate = daemon.root / "gate"
    # Over 3 MiB before the time, so that earlier greps leave checkpoints to start from;
    # the late match's context reaches back before the time and across a checkpoint.
    early = 3 * CHECKPOINT_BYTES // 60 + 1
    script = (
        f"awk 'BEGIN {{ for (i = 1; i <= {early}; i++) printf \"early line %049d\\n\", i }}';"
        f" echo ERROR early; while [ ! -e {gate} ]; do sleep 0.02; done; echo ERROR late;"
        " echo after"
    )
    with trio.fail_after(60):
        worker = await client.spawn(sh(script))
        assert (await client.wait_for(worker.id, "ERROR early", timeout=30)).outcome == "matched"
        between = time.time()
        gate.touch()
        await client.wait(worker.id)
        unfiltered = await client.grep(worker.id, "ERROR", before=100, after=1)
        late = await client.grep(worker.id, "ERROR", before=100, after=1, written_since=between)
        assert [m.line for m in unfiltered.matches] == ["ERROR early", "ERROR late"]
        assert late.matches == unfiltered.matches[1:]
        assert len(late.matches[0].before) == 100
        # Going on past it finds nothing more; a time to come finds nothing at all.
        assert late.next is None
        future = await client.grep(worker.id, "ERROR", written_since=between + 3600)
        assert future.matches == []
        # From the epoch: everything, as unfiltered.
        assert (await client.grep(worker.id, "ERROR", written_since=0)).matches == (
            await client.grep(worker.id, "ERROR")
        ).matches


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("written_since", float("nan"), id="nan"),
        pytest.param("written_since", float("inf"), id="inf"),
        pytest.param("written_since", float("-inf"), id="minus-inf"),
        pytest.param("written_since", -1.0, id="negative"),
        pytest.param("written_since", 1e300, id="huge"),
        pytest.param("written_since", p.MAX_EPOCH + 1, id="after-9999"),
        pytest.param("written_since", "10m", id="a-string"),
        pytest.param("written_since", True, id="a-bool"),
        pytest.param("stream", "stdin", id="stream-stdin"),
        pytest.param("stream", "", id="stream-empty"),
        pytest.param("stream", 1, id="stream-a-number"),
    ],
)
async def test_hostile_filters_are_refused_naming_the_field(
    connect: Connect, field: str, value: object
) -> None:
    with trio.fail_after(20):
        conn = await connect()
        request = {"op": "grep", "id": 7, "worker": "w-x", "pattern": "a", field: value}
        raw = msgspec.msgpack.encode(request)
        await conn.stream.send_all(len(raw).to_bytes(4, "big") + raw)
        reply = await conn.receive()
        assert isinstance(reply, p.Error)
        assert reply.code == "invalid"
        assert field in reply.message
        # The connection serves on; a grep without the filters (an older peer's) decodes.
        await conn.send(p.Grep(id=8, worker="w-nope", pattern="a"))
        after = await conn.receive()
        assert isinstance(after, p.Error)
        assert (after.id, after.code) == (8, "not_found")


def test_subagentctl_grep_takes_since_and_stream(daemon: DaemonProcess) -> None:
    gate = daemon.root / "gate"
    script = (
        "echo hit out 1; echo hit err 1 >&2; "
        f"while [ ! -e {gate} ]; do sleep 0.02; done; echo hit out 2; echo hit err 2 >&2"
    )
    worker = spawn(daemon, "--", "sh", "-c", script)
    ok(daemon.ctl("wait", worker["id"], "--for", "err 1", "--timeout", "20"))
    between = time.time()
    gate.touch()
    ok(daemon.ctl("wait", worker["id"]))
    errors = js(daemon, "grep", worker["id"], "hit", "--stream", "stderr", "--max", "2")
    assert [m["line"] for m in errors["matches"]] == ["hit err 1", "hit err 2"]
    late = js(daemon, "grep", worker["id"], "hit", "--written-since", str(between))
    assert sorted(m["line"] for m in late["matches"]) == ["hit err 2", "hit out 2"]
    recent = ok(daemon.ctl("grep", worker["id"], "out", "--written-since", "10m"))
    assert [line.split(":", 1)[1] for line in recent.stdout.splitlines()] == [
        "hit out 1",
        "hit out 2",
    ]
    future = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(between + 3600))
    none = daemon.ctl("grep", worker["id"], "hit", "--written-since", future)
    assert (none.returncode, none.stdout) == (4, ""), said(none)
    for hostile in ("nan", "inf", "-1", "1e300", "soon", "x" * 100, "99999999999d"):
        refused = daemon.ctl("--json", "grep", worker["id"], "hit", "--written-since", hostile)
        assert json_error(refused, "invalid").startswith("--written-since: "), hostile
    usage = daemon.ctl("grep", worker["id"], "hit", "--stream", "stdin")
    assert usage.returncode == 2, said(usage)
