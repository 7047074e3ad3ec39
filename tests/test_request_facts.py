"""What each request declares about itself on its class, once, is what both sides act on:
which reply answers it, whether a worker may send it, whether it may be sent twice, whether
it streams. These pin the declarations to the protocol document and to the wire."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from subagentd.client import _core
from subagentd.protocol import (
    ClientMessage,
    Collect,
    Done,
    Page,
    Reply,
    Request,
    Status,
    Subscribe,
    Watch,
    Welcome,
    WorkerReply,
    client_decoder,
    encode,
    op,
)
from subagentd.protocol.errors import ProtocolError

from .test_framing import EXAMPLES

README = Path(__file__).parent.parent / "protocol" / "README.md"
REQUESTS = [m for m in EXAMPLES if isinstance(m, Request)]
REPLIES = {type(m): m for m in EXAMPLES if isinstance(m, Reply)}


def _op(cls: type[Request[Reply]]) -> str:
    return str(cls.__struct_config__.tag)


def test_the_declared_facts_are_not_fields_and_never_go_on_the_wire() -> None:
    body = msgspec.msgpack.decode(encode(Status(id=2, worker="w-1"))[4:])
    assert body == {"op": "status", "worker": "w-1", "id": 2}
    # A peer that sent one anyway changes nothing: unknown keys are ignored.
    sent = msgspec.msgpack.encode({"op": "spawn", "id": 3, "for_workers": False, "reply": "x"})
    assert type(client_decoder.decode(sent)).for_workers is True


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_the_client_takes_exactly_the_declared_reply_as_an_answer(
    request_: Request[Reply],
) -> None:
    declared = type(request_).reply
    assert _core.answer(request_, REPLIES[declared]) is REPLIES[declared]
    wrong = (
        Done(id=request_.id)
        if declared is not Done
        else Welcome(id=1, version=1, daemon_version="", pid=1)
    )
    with pytest.raises(ProtocolError, match=f"expected {declared.__name__}"):
        _core.answer(request_, wrong)


def test_a_reply_names_its_own_kind_the_way_the_wire_does() -> None:
    assert Status.reply is WorkerReply
    assert Watch.reply is Page
    assert op(Status(id=1, worker="w")) == "status"
    assert op(Done(id=1)) == "done"


def _authority_rows() -> dict[str, str]:
    """The Authority table of protocol/README.md: each op named in a row, to that row's rule."""
    section = README.read_text().split("## Authority", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_what_a_worker_may_send_is_what_the_protocol_document_says() -> None:
    rows = _authority_rows()
    requests = [cls for cls in typing.get_args(ClientMessage) if _op(cls) != "hello"]
    assert {_op(cls) for cls in requests} == set(rows)
    kept_from_workers = {_op(cls) for cls in requests if not cls.for_workers}
    assert kept_from_workers == {
        name for name, rule in rows.items() if rule.startswith("`forbidden`")
    }


def test_nothing_that_changes_state_is_sent_twice_after_a_lost_connection() -> None:
    resent = {type(r).__name__ for r in REQUESTS if r.resendable()}
    assert resent == {
        "ListWorkers",
        "Status",
        "Watch",
        "Collect",  # the example waits; one that does not wait is not sent again
        "Wait",
        "Info",
        "WaitRunStopped",
        "Subscribe",
        "LatestResumable",
        "Grep",
        "WaitFor",
        # Lost with its connection it was never read (a requester's connection is carried
        # across the exec); sent again, it reloads the image on disk, as was asked.
        "Reload",
    }
    assert not Collect(id=1, worker="w").resendable()


def test_only_a_followed_watch_and_a_subscription_stream() -> None:
    assert {type(r).__name__ for r in REQUESTS if r.streams()} == {"Watch", "Subscribe"}
    assert not Watch(id=1, worker="w", follow=False).streams()
    assert Subscribe(id=1, run="r", follow=False).streams()
