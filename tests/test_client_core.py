"""The clients' shared core: where they find the daemon, what they send, how replies come back."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec
import pytest

from subagentd.client import _core
from subagentd.protocol import (
    HEADER,
    Abort,
    Ack,
    BeginTurn,
    Cancel,
    CancelFence,
    Cancelled,
    ClearFence,
    DaemonInfo,
    Done,
    Entry,
    Error,
    FenceReply,
    FrameDecoder,
    Hello,
    InfoReply,
    Page,
    Reply,
    Request,
    ResultReply,
    Resume,
    ResumeRun,
    RunReply,
    SetFence,
    Spawn,
    Status,
    Stop,
    Stopped,
    StopRun,
    Subscribe,
    TurnReply,
    Wait,
    WaitRunStopped,
    Wake,
    Wakes,
    Watch,
    Welcome,
    WorkerList,
    WorkerReply,
    WorkerResult,
    WorkerView,
    client_decoder,
    encode,
    frame,
)
from subagentd.protocol.errors import (
    Busy,
    ConnectionLost,
    DaemonUnavailable,
    ErrorCode,
    Forbidden,
    Frozen,
    Internal,
    Invalid,
    NotFound,
    ProtocolError,
    Refused,
    Reloading,
    RemoteError,
    RunStopped,
    TooLarge,
    UnsupportedVersion,
)

WORKER = WorkerView(id="w-1", run="r-1", state="running", started_at=1.0)


def entry(seq: int) -> Entry:
    return Entry(seq=seq, kind="stdout", data=b"line %d\n" % seq, at=float(seq))


def page(request_id: int, seqs: list[int], *, next: int, complete: bool = False) -> Page:
    return Page(id=request_id, entries=[entry(seq) for seq in seqs], next=next, complete=complete)


# -- finding the daemon ------------------------------------------------------------


def test_an_explicit_socket_wins_over_the_environment() -> None:
    environ = {"SUBAGENTD_SOCKET": "/from/env.sock"}
    assert _core.socket_path("/given.sock", environ) == Path("/given.sock")


def test_the_environment_wins_over_the_default() -> None:
    environ = {"SUBAGENTD_SOCKET": "/from/env.sock"}
    assert _core.socket_path(None, environ) == Path("/from/env.sock")


def test_the_default_socket_is_in_the_user_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert _core.socket_path(None, {}) == tmp_path / "subagentd" / "subagentd.sock"


def test_a_client_inside_a_worker_presents_its_token() -> None:
    assert _core.token({"SUBAGENTD_TOKEN": "t0k"}) == "t0k"
    assert _core.token({"SUBAGENTD_TOKEN": ""}) is None
    assert _core.token({}) is None


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ECONNREFUSED])
def test_no_daemon_says_where_it_looked_and_how_to_start_one(code: int) -> None:
    error = _core.unavailable(Path("/run/s.sock"), OSError(code, os.strerror(code)))
    assert isinstance(error, DaemonUnavailable)
    assert "/run/s.sock" in str(error)
    assert "systemctl --user start subagentd" in str(error)


def test_another_connect_failure_says_why_without_suggesting_a_start() -> None:
    error = _core.unavailable(
        Path("/run/s.sock"), PermissionError(errno.EACCES, "Permission denied")
    )
    assert "Permission denied" in str(error)
    assert "start one" not in str(error)


# -- replies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (ErrorCode.NOT_FOUND, NotFound),
        (ErrorCode.INVALID, Invalid),
        (ErrorCode.FORBIDDEN, Forbidden),
        (ErrorCode.REFUSED, Refused),
        (ErrorCode.RUN_STOPPED, RunStopped),
        (ErrorCode.FROZEN, Frozen),
        (ErrorCode.BUSY, Busy),
        (ErrorCode.RELOADING, Reloading),
        (ErrorCode.UNSUPPORTED_VERSION, UnsupportedVersion),
        (ErrorCode.TOO_LARGE, TooLarge),
        (ErrorCode.INTERNAL, Internal),
    ],
)
def test_an_error_reply_raises_the_exception_for_its_code(
    code: ErrorCode, kind: type[RemoteError]
) -> None:
    with pytest.raises(kind) as caught:
        _core.expect(Error(id=3, code=code, message="what and why", retry_after=2.0), RunReply)
    assert type(caught.value) is kind
    assert (caught.value.code, caught.value.message) == (code, "what and why")
    assert caught.value.retry_after == 2.0


def test_run_stopped_and_frozen_are_refusals() -> None:
    with pytest.raises(Refused):
        _core.checked(Error(id=1, code="run_stopped", message="run r-1 was stopped"))
    with pytest.raises(Refused):
        _core.checked(Error(id=1, code="frozen", message="a fence stops new launches"))


def test_a_code_from_a_newer_daemon_is_kept_verbatim() -> None:
    with pytest.raises(RemoteError) as caught:
        _core.checked(Error(id=1, code="quota_exceeded", message="too many workers"))
    assert type(caught.value) is RemoteError
    assert caught.value.code == "quota_exceeded"


def test_a_reply_of_the_wrong_kind_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="RunReply"):
        _core.expect(Done(id=4), RunReply)


def test_each_call_returns_the_value_inside_its_reply() -> None:
    result = WorkerResult(id="w-1", state="finished", exit_code=0, result="ok")
    info = DaemonInfo(
        version="0.1.0",
        protocol=1,
        pid=9,
        image_generation=1,
        reloads=0,
        workers={},
        holds_park=False,
    )
    assert _core.status("w-1").answer(WorkerReply(id=2, worker=WORKER)) == WORKER
    assert _core.wait("w-1").answer(WorkerReply(id=2, worker=WORKER)) == WORKER
    assert _core.ls(all=True).answer(WorkerList(id=2, workers=[WORKER])) == [WORKER]
    assert _core.new_run().answer(RunReply(id=2, run="r-9")) == "r-9"
    assert _core.collect("w-1").answer(ResultReply(id=2, result=result)) == result
    assert _core.info().answer(InfoReply(id=2, info=info)) == info
    assert _core.hello(None).answer(Welcome(id=1, version=1, daemon_version="0.1.0", pid=9))


def test_turns_cancels_and_fences_answer_what_their_replies_carry() -> None:
    assert _core.begin_turn().answer(TurnReply(id=2, turn=4)) == 4
    assert _core.cancel("turn:4").answer(Cancelled(id=2, cancelled=["w-1", "w-2"])) == [
        "w-1",
        "w-2",
    ]
    assert _core.set_fence().answer(FenceReply(id=2, epoch=7)) == 7
    assert _core.cancel_fence(7).answer(Cancelled(id=2, cancelled=[])) == []
    assert _core.clear_fence().answer(Done(id=2)) is None
    assert _core.wait_run_stopped("r-1").answer(Done(id=2)) is None


def test_turns_cancels_and_fences_send_what_they_were_given() -> None:
    assert _core.begin_turn().request == BeginTurn(id=0)
    assert _core.cancel("worker:w-1").request == Cancel(id=0, scope="worker:w-1")
    assert _core.set_fence().request == SetFence(id=0)
    assert _core.cancel_fence(3).request == CancelFence(id=0, epoch=3)
    assert _core.clear_fence().request == ClearFence(id=0)
    assert _core.wait_run_stopped("r-1").request == WaitRunStopped(id=0, run="r-1")


def test_a_refused_cancel_raises_what_the_daemon_said() -> None:
    with pytest.raises(Invalid, match="turn:G"):
        _core.cancel("bogus").answer(
            Error(id=2, code="invalid", message="cannot cancel 'bogus': a scope is `turn:G`...")
        )
    with pytest.raises(Forbidden):
        _core.set_fence().answer(Error(id=2, code="forbidden", message="not for a worker"))


def test_stop_answers_false_for_a_worker_never_seen() -> None:
    call = _core.stop("w-404")
    assert call.answer(Stopped(id=2, found=False, stopped=[])) is False
    assert call.answer(Stopped(id=2, found=True, stopped=[])) is True


def test_stop_run_answers_the_stopped_ids_and_refuses_an_unknown_run() -> None:
    call = _core.stop_run("r-1")
    assert call.answer(Stopped(id=2, found=True, stopped=["w-1", "w-2"])) == ["w-1", "w-2"]
    with pytest.raises(NotFound, match="r-1"):
        call.answer(Stopped(id=2, found=False, stopped=[]))


# -- requests ------------------------------------------------------------------------


def test_spawn_starts_the_worker_where_the_caller_stands() -> None:
    request = _core.spawn(["make"]).request
    assert isinstance(request, Spawn)
    assert request.cwd == os.getcwd()
    given = _core.spawn(["make"], cwd=Path("/src"), key="k-1").request
    assert given == Spawn(id=0, argv=["make"], cwd="/src", key="k-1")


def test_spawn_sends_text_input_as_utf8_and_bytes_as_they_are() -> None:
    text = _core.spawn(["cat"], input="héllo").request
    raw = _core.spawn(["cat"], input=b"\xff").request
    assert isinstance(text, Spawn)
    assert isinstance(raw, Spawn)
    assert (text.input, raw.input) == ("héllo".encode(), b"\xff")


def test_hello_carries_the_token() -> None:
    request = _core.hello("t0k").request
    assert isinstance(request, Hello)
    assert request.token == "t0k"


# -- the conversation ----------------------------------------------------------------


def sent(data: bytes | None) -> object:
    """The request inside one frame the connection sent."""
    assert data is not None, "nothing was sent"
    decoder = FrameDecoder()
    decoder.feed(data)
    (body,) = decoder.frames()
    return client_decoder.decode(body)


def test_hello_is_request_1_and_ids_count_up_from_it() -> None:
    conn = _core.Connection()
    ids = [conn.send(request)[0] for request in (Hello(id=0), Status(id=0, worker="w-1"))]
    assert ids == [1, 2]
    request_id, data = conn.send(Status(id=0, worker="w-1"))
    assert sent(data) == Status(id=request_id, worker="w-1")
    assert request_id == 3


def test_replies_reach_their_own_request_whatever_the_order_and_split() -> None:
    conn = _core.Connection()
    first, _ = conn.send(Status(id=0, worker="w-1"))
    second, _ = conn.send(Status(id=0, worker="w-2"))
    wire = encode(RunReply(id=second, run="r-2")) + encode(RunReply(id=first, run="r-1"))
    conn.receive_data(wire[:5])
    assert conn.next_reply(first) is None
    conn.receive_data(wire[5:])
    assert conn.next_reply(first) == RunReply(id=first, run="r-1")
    assert conn.next_reply(second) == RunReply(id=second, run="r-2")
    assert conn.next_reply(second) is None


def test_a_stream_keeps_its_pages_while_another_request_is_answered() -> None:
    conn = _core.Connection()
    stream, _ = conn.send(_core.JournalCursor("w-1", follow=True).request())
    stop, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(
        encode(page(stream, [1], next=1))
        + encode(Stopped(id=stop, found=True, stopped=["w-1"]))
        + encode(page(stream, [2], next=2, complete=True))
    )
    assert conn.next_reply(stop) == Stopped(id=stop, found=True, stopped=["w-1"])
    assert conn.next_reply(stream) == page(stream, [1], next=1)
    assert conn.next_reply(stream) == page(stream, [2], next=2, complete=True)


@pytest.mark.parametrize(
    "reply",
    [
        TurnReply(id=2, turn=1),
        Cancelled(id=2, cancelled=["w-1"]),
        FenceReply(id=2, epoch=1),
        Done(id=2),
    ],
    ids=lambda reply: type(reply).__name__,
)
def test_the_replies_to_turns_cancels_and_fences_reach_their_request(reply: Reply) -> None:
    conn = _core.Connection()
    conn.send(Hello(id=0))
    request_id, _ = conn.send(BeginTurn(id=0))
    assert request_id == 2
    conn.receive_data(encode(reply))
    assert conn.next_reply(request_id) == reply
    assert not conn.closed


def test_events_and_replies_to_finished_requests_are_dropped() -> None:
    conn = _core.Connection()
    done, _ = conn.send(Status(id=0, worker="w-1"))
    conn.finish(done)
    waiting, _ = conn.send(Status(id=0, worker="w-1"))
    wake = msgspec.msgpack.encode({"op": "wake", "id": 0, "worker": "w-1"})
    conn.receive_data(
        encode(RunReply(id=done, run="late"))
        + frame(wake)
        + encode(RunReply(id=waiting, run="r-1"))
    )
    assert conn.next_reply(waiting) == RunReply(id=waiting, run="r-1")
    assert not conn.closed


def test_an_aborted_stream_is_told_once_and_its_stragglers_dropped() -> None:
    conn = _core.Connection()
    stream, _ = conn.send(_core.JournalCursor("w-1", follow=True).request())
    data = conn.abort(stream)
    assert data is not None
    abort = sent(data)
    assert isinstance(abort, Abort)
    assert abort.request == stream
    later, _ = conn.send(Status(id=0, worker="w-1"))
    assert later == abort.id + 1
    conn.receive_data(
        encode(page(stream, [5], next=5))
        + encode(Done(id=abort.id))
        + encode(WorkerReply(id=later, worker=WORKER))
    )
    assert conn.next_reply(later) == WorkerReply(id=later, worker=WORKER)


def test_a_reply_that_does_not_decode_ends_the_connection() -> None:
    conn = _core.Connection()
    request_id, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(frame(msgspec.msgpack.encode({"op": "worker", "id": request_id})))
    assert conn.closed
    with pytest.raises(ProtocolError, match=f"request {request_id}"):
        conn.next_reply(request_id)


def test_an_oversized_frame_from_the_daemon_ends_the_connection() -> None:
    conn = _core.Connection()
    request_id, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(HEADER.pack(2**31))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        conn.next_reply(request_id)


def test_end_of_file_fails_every_open_request_and_every_later_send() -> None:
    conn = _core.Connection()
    first, _ = conn.send(Status(id=0, worker="w-1"))
    second, _ = conn.send(Status(id=0, worker="w-2"))
    conn.receive_data(b"")
    for request_id in (first, second):
        with pytest.raises(ConnectionLost):
            conn.next_reply(request_id)
    with pytest.raises(ConnectionLost):
        conn.send(Status(id=0, worker="w-3"))
    assert conn.abort(first) is None


def test_replies_that_arrived_before_the_end_are_still_delivered() -> None:
    conn = _core.Connection()
    request_id, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(encode(WorkerReply(id=request_id, worker=WORKER)))
    conn.receive_data(b"")
    assert conn.next_reply(request_id) == WorkerReply(id=request_id, worker=WORKER)
    with pytest.raises(ConnectionLost):
        conn.next_reply(request_id)


def test_the_daemons_parting_error_is_what_the_end_raises() -> None:
    conn = _core.Connection()
    request_id, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(encode(Error(id=0, code="too_large", message="frame of 20 MiB")))
    assert conn.next_reply(request_id) is None
    conn.receive_data(b"")
    with pytest.raises(TooLarge, match="20 MiB"):
        conn.next_reply(request_id)


def test_a_transport_failure_is_connection_lost_with_its_cause() -> None:
    conn = _core.Connection()
    request_id, _ = conn.send(Status(id=0, worker="w-1"))
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    conn.connection_lost(reset)
    with pytest.raises(ConnectionLost) as caught:
        conn.next_reply(request_id)
    assert caught.value.__cause__ is reset


# -- reading a journal ---------------------------------------------------------------


def test_a_snapshot_pages_until_a_page_comes_back_empty() -> None:
    cursor = _core.JournalCursor("w-1", since=10)
    assert cursor.request().since == 10
    assert cursor.take(page(1, [11, 12], next=12)) == [entry(11), entry(12)]
    assert not cursor.done
    assert cursor.request().since == 12
    assert cursor.take(page(2, [], next=12)) == []
    assert cursor.done


def test_a_snapshot_stops_at_the_complete_page() -> None:
    cursor = _core.JournalCursor("w-1")
    assert cursor.take(page(1, [1, 2], next=2, complete=True)) == [entry(1), entry(2)]
    assert cursor.done


def test_a_followed_watch_goes_on_through_empty_pages_until_complete() -> None:
    cursor = _core.JournalCursor("w-1", follow=True)
    assert cursor.request().follow
    cursor.take(page(1, [], next=0))
    assert not cursor.done
    cursor.take(page(1, [1], next=1, complete=True))
    assert cursor.done


def test_a_watch_of_an_unknown_worker_raises_not_found() -> None:
    cursor = _core.JournalCursor("w-404")
    with pytest.raises(NotFound):
        cursor.take(Error(id=1, code="not_found", message="no worker 'w-404'"))


# -- wakes ---------------------------------------------------------------------------


def wake(seq: int) -> Wake:
    return Wake(seq=seq, id=f"w-{seq}", run="r-1", state="finished", exit_code=0, preview="ok")


def test_a_subscription_asks_for_one_parent_and_follows_only_if_told() -> None:
    assert _core.WakeSubscription(run="r-1").request() == Subscribe(id=0, run="r-1")
    followed = _core.WakeSubscription(worker="w-1", follow=True).request()
    assert followed == Subscribe(id=0, worker="w-1", follow=True)


def test_an_unfollowed_subscription_ends_with_its_first_page_even_an_empty_one() -> None:
    subscription = _core.WakeSubscription(run="r-1")
    assert subscription.take(Wakes(id=2, wakes=[], complete=True)) == []
    assert subscription.done
    again = _core.WakeSubscription(run="r-1")
    assert again.take(Wakes(id=2, wakes=[wake(1), wake(2)], complete=True)) == [wake(1), wake(2)]
    assert again.done


def test_a_followed_subscription_goes_on_through_empty_pages() -> None:
    subscription = _core.WakeSubscription(run="r-1", follow=True)
    assert subscription.take(Wakes(id=2, wakes=[])) == []
    assert not subscription.done
    assert subscription.take(Wakes(id=2, wakes=[wake(3)])) == [wake(3)]
    assert not subscription.done
    subscription.take(Wakes(id=2, wakes=[], complete=True))
    assert subscription.done


def test_a_refused_subscription_raises_and_is_over() -> None:
    subscription = _core.WakeSubscription(run="r-404", follow=True)
    with pytest.raises(NotFound, match="r-404"):
        subscription.take(Error(id=2, code="not_found", message="no run 'r-404'"))
    assert subscription.done  # nothing left to abort
    with pytest.raises(Invalid):
        _core.WakeSubscription().take(Error(id=2, code="invalid", message="give a run or a worker"))


def test_ack_sends_the_seqs_and_answers_done() -> None:
    call = _core.ack(iter([4, 7]))
    assert call.request == Ack(id=0, wakes=[4, 7])
    assert call.answer(Done(id=3)) is None
    with pytest.raises(Invalid, match="never delivered"):
        call.answer(Error(id=3, code="invalid", message="wakes [9] were never delivered"))


def test_an_ack_is_answered_while_its_subscription_keeps_its_pages() -> None:
    conn = _core.Connection()
    stream, _ = conn.send(_core.WakeSubscription(run="r-1", follow=True).request())
    ack, data = conn.send(_core.ack([1]).request)
    assert sent(data) == Ack(id=ack, wakes=[1])
    conn.receive_data(
        encode(Wakes(id=stream, wakes=[wake(1)]))
        + encode(Wakes(id=stream, wakes=[wake(2)]))
        + encode(Done(id=ack))
    )
    assert conn.next_reply(ack) == Done(id=ack)
    assert conn.next_reply(stream) == Wakes(id=stream, wakes=[wake(1)])
    assert conn.next_reply(stream) == Wakes(id=stream, wakes=[wake(2)])


# -- across a reload -----------------------------------------------------------------

RELOADING = encode(
    Error(id=0, code="reloading", message="the daemon is reloading; reconnect", retry_after=0.2)
)


def reconnect(conn: _core.Connection) -> list[Request[Reply]]:
    """What a shell does once a new connection said welcome: the requests it sends on it."""
    assert conn.reconnecting
    return [client_decoder.decode(data[HEADER.size :]) for data in conn.reconnected()]


def test_told_reloading_the_conversation_goes_on_with_what_only_asks() -> None:
    conn = _core.Connection(reconnect=True)
    waiting, _ = conn.send(Wait(id=0, worker="w-1"))
    answered, _ = conn.send(Status(id=0, worker="w-1"))
    conn.receive_data(encode(WorkerReply(id=answered, worker=WORKER)) + RELOADING)
    assert not conn.closed
    assert reconnect(conn) == [Wait(id=waiting, worker="w-1")]  # the status had its answer
    assert conn.next_reply(answered) == WorkerReply(id=answered, worker=WORKER)
    conn.receive_data(encode(WorkerReply(id=waiting, worker=WORKER)))
    assert conn.next_reply(waiting) == WorkerReply(id=waiting, worker=WORKER)


def test_a_spawn_whose_answer_went_with_the_connection_is_connection_lost() -> None:
    conn = _core.Connection(reconnect=True)
    spawned, _ = conn.send(Spawn(id=0, argv=["true"]))
    conn.receive_data(RELOADING)
    assert reconnect(conn) == []
    with pytest.raises(ConnectionLost, match="whether the request was done is unknown"):
        conn.next_reply(spawned)


def test_a_keyed_spawn_or_resume_whose_answer_went_with_the_connection_is_sent_again() -> None:
    conn = _core.Connection(reconnect=True)
    spawn = _core.spawn(["true"], cwd="/").request
    resume = _core.resume("w-1").request
    spawned, _ = conn.send(spawn)
    resumed, _ = conn.send(resume)
    conn.connection_lost(BrokenPipeError(errno.EPIPE, "Broken pipe"))  # a frame not even sent
    again = reconnect(conn)
    # The same requests, their keys with them: the daemon answers what the first ones made.
    assert again == [
        msgspec.structs.replace(spawn, id=spawned),
        msgspec.structs.replace(resume, id=resumed),
    ]
    assert isinstance(spawn, Spawn)
    assert isinstance(resume, Resume)
    assert len(spawn.key or "") == len(resume.key or "") == 32  # 128 bits, in hex
    assert spawn.key != resume.key
    assert _core.spawn(["true"]).request != _core.spawn(["true"]).request  # a key per call
    conn.receive_data(encode(WorkerReply(id=spawned, worker=WORKER)))
    assert conn.next_reply(spawned) == WorkerReply(id=spawned, worker=WORKER)


def test_a_keyed_spawn_refused_reloading_waits_its_retry_after_not_sent_again_at_once() -> None:
    conn = _core.Connection()
    spawn = _core.spawn(["true"], key="k-1").request
    spawned, _ = conn.send(spawn)
    refusal = Error(id=spawned, code="reloading", message="reloading", retry_after=0.2)
    conn.receive_data(encode(refusal))
    # The launch fence would refuse it again at once: the shell waits, then sends it.
    assert conn.outgoing() == []
    assert conn.next_reply(spawned) == refusal
    assert _core.retry_delay(spawn, refusal) == 0.2


def test_a_request_made_while_reconnecting_goes_out_on_the_new_connection() -> None:
    conn = _core.Connection(reconnect=True)
    conn.receive_data(RELOADING)
    spawned, data = conn.send(Spawn(id=0, argv=["true"]))
    assert data is None
    assert reconnect(conn) == [Spawn(id=spawned, argv=["true"])]


def test_a_followed_watch_carries_on_from_its_cursor_without_pages_twice() -> None:
    conn = _core.Connection(reconnect=True)
    cursor = _core.JournalCursor("w-1", follow=True)
    stream, _ = conn.send(cursor.request(), again=cursor.request)
    conn.receive_data(encode(page(stream, [1, 2], next=2)) + encode(page(stream, [3], next=3)))
    assert cursor.take(conn.next_reply(stream)) == [entry(1), entry(2)]  # type: ignore[arg-type]
    conn.connection_lost(ConnectionResetError(errno.ECONNRESET, "reset"))
    # Page 3 was never taken: it comes again, from the cursor at 2.
    assert reconnect(conn) == [Watch(id=stream, worker="w-1", since=2, follow=True)]
    assert conn.next_reply(stream) is None


def test_an_end_with_nothing_open_and_no_notice_is_just_the_end() -> None:
    conn = _core.Connection(reconnect=True)
    conn.receive_data(b"")
    assert conn.closed
    assert not conn.reconnecting


def test_no_daemon_within_the_window_fails_what_waited() -> None:
    conn = _core.Connection(reconnect=True)
    waiting, _ = conn.send(Wait(id=0, worker="w-1"))
    conn.receive_data(RELOADING)
    conn.reconnect_failed(FileNotFoundError(errno.ENOENT, "No such file or directory"))
    with pytest.raises(ConnectionLost, match="did not serve again"):
        conn.next_reply(waiting)


def requests(data: bytes | list[bytes] | None) -> list[object]:
    """Every request in what the connection sent (frames back to back, or a list of them)."""
    decoder = FrameDecoder()
    decoder.feed(b"".join(data) if isinstance(data, list) else (data or b""))
    return [client_decoder.decode(body) for body in decoder.frames()]


def subscribed_with_a_page(conn: _core.Connection, *seqs: int) -> tuple[int, list[Wake]]:
    """A followed subscription to run r-1 and the wakes of its first page, handed over."""
    subscription = _core.WakeSubscription(run="r-1", follow=True)
    stream, _ = conn.send(subscription.request(), again=subscription.request)
    conn.receive_data(encode(Wakes(id=stream, wakes=[wake(seq) for seq in seqs])))
    reply = conn.next_reply(stream)
    assert reply is not None
    return stream, subscription.take(reply)


def test_an_ack_cut_off_with_its_connection_goes_again_once_its_wake_came_again() -> None:
    conn = _core.Connection(reconnect=True)
    stream, _ = subscribed_with_a_page(conn, 1)
    acked, _ = conn.send(_core.ack([1]).request)
    conn.receive_data(RELOADING)
    assert conn.next_reply(acked) is None  # not done: whether the daemon took it is unknown
    resubscribed, recall = reconnect(conn)
    assert resubscribed == Subscribe(id=stream, run="r-1", follow=True)
    assert isinstance(recall, Subscribe)
    assert (recall.run, recall.follow) == ("r-1", False)  # every pending wake, then complete
    conn.receive_data(encode(Wakes(id=recall.id, wakes=[wake(1)], complete=True)))
    assert requests(conn.outgoing()) == [Ack(id=acked, wakes=[1])]  # delivered here now
    conn.receive_data(encode(Done(id=acked)))
    assert conn.next_reply(acked) == Done(id=acked)


def test_an_ack_cut_off_whose_wake_does_not_come_again_is_done_without_sending() -> None:
    conn = _core.Connection(reconnect=True)
    subscribed_with_a_page(conn, 1, 2)
    acked, _ = conn.send(_core.ack([1]).request)
    conn.receive_data(RELOADING)
    _, recall = reconnect(conn)
    assert isinstance(recall, Subscribe)
    # Wake 1 is not pending any more: the daemon took the ack before it went away.
    conn.receive_data(encode(Wakes(id=recall.id, wakes=[wake(2)], complete=True)))
    assert conn.outgoing() == []
    assert conn.next_reply(acked) == Done(id=acked)
    # Wake 2 came again on the new connection: acknowledged there at once.
    again, data = conn.send(_core.ack([2]).request)
    assert requests(data) == [Ack(id=again, wakes=[2])]


def test_a_wake_of_a_page_from_the_connection_before_is_recalled_before_its_ack() -> None:
    # The storm's case: the caller held wake 2 of an old page while the client reconnected.
    conn = _core.Connection(reconnect=True)
    stream, handed = subscribed_with_a_page(conn, 1, 2)
    assert handed == [wake(1), wake(2)]
    conn.receive_data(RELOADING)
    assert reconnect(conn) == [Subscribe(id=stream, run="r-1", follow=True)]
    acked, data = conn.send(_core.ack([2]).request)
    [recall] = requests(data)  # not the ack: the new connection never delivered wake 2
    assert isinstance(recall, Subscribe)
    assert (recall.run, recall.worker, recall.follow) == ("r-1", None, False)
    conn.receive_data(
        encode(Wakes(id=recall.id, wakes=[wake(2)]))  # more pages to come
        + encode(Wakes(id=recall.id, wakes=[wake(3)], complete=True))
    )
    assert requests(conn.outgoing()) == [Ack(id=acked, wakes=[2])]


def test_a_wake_delivered_again_on_this_connection_is_acknowledged_at_once() -> None:
    conn = _core.Connection(reconnect=True)
    stream, _ = subscribed_with_a_page(conn, 1)
    conn.receive_data(RELOADING)
    reconnect(conn)
    conn.receive_data(encode(Wakes(id=stream, wakes=[wake(1)])))  # the subscription's again
    acked, data = conn.send(_core.ack([1]).request)
    assert requests(data) == [Ack(id=acked, wakes=[1])]


def test_a_delegated_wake_is_recalled_from_its_worker() -> None:
    conn = _core.Connection(reconnect=True)
    subscription = _core.WakeSubscription(worker="w-0", follow=True)
    stream, _ = conn.send(subscription.request(), again=subscription.request)
    child = Wake(seq=4, id="w-4", run="r-1", parent="w-0", state="failed", exit_code=1)
    conn.receive_data(encode(Wakes(id=stream, wakes=[child])) + RELOADING)
    reconnect(conn)
    _, data = conn.send(_core.ack([4]).request)
    [recall] = requests(data)
    assert isinstance(recall, Subscribe)
    assert (recall.run, recall.worker) == (None, "w-0")


def test_a_recall_refused_fails_the_ack_that_waited_on_it() -> None:
    conn = _core.Connection(reconnect=True)
    subscribed_with_a_page(conn, 1)
    conn.receive_data(RELOADING)
    reconnect(conn)
    acked, data = conn.send(_core.ack([1]).request)
    [recall] = requests(data)
    assert isinstance(recall, Subscribe)
    conn.receive_data(encode(Error(id=recall.id, code="forbidden", message="not yours")))
    reply = conn.next_reply(acked)
    assert reply == Error(id=acked, code="forbidden", message="not yours")


def test_a_recall_of_a_parent_gone_finds_nothing_pending() -> None:
    conn = _core.Connection(reconnect=True)
    subscribed_with_a_page(conn, 1)
    conn.receive_data(RELOADING)
    reconnect(conn)
    acked, data = conn.send(_core.ack([1]).request)
    [recall] = requests(data)
    assert isinstance(recall, Subscribe)
    conn.receive_data(encode(Error(id=recall.id, code="not_found", message="no run 'r-1'")))
    assert conn.next_reply(acked) == Done(id=acked)


def test_an_ack_of_a_wake_never_delivered_is_for_the_daemon_to_refuse() -> None:
    conn = _core.Connection(reconnect=True)
    subscribed_with_a_page(conn, 1)
    conn.receive_data(RELOADING)
    acked, data = conn.send(_core.ack([9]).request)  # while reconnecting: held
    assert data is None
    assert Ack(id=acked, wakes=[9]) in reconnect(conn)


def test_an_ack_given_up_on_while_held_is_never_sent() -> None:
    conn = _core.Connection(reconnect=True)
    subscribed_with_a_page(conn, 1)
    conn.receive_data(RELOADING)
    reconnect(conn)
    acked, data = conn.send(_core.ack([1]).request)
    [recall] = requests(data)
    assert isinstance(recall, Subscribe)
    conn.finish(acked)
    conn.receive_data(encode(Wakes(id=recall.id, wakes=[wake(1)], complete=True)))
    assert conn.outgoing() == []


def test_a_hello_cut_off_by_a_reload_is_answered_by_the_next_connections_welcome() -> None:
    conn = _core.Connection(reconnect=True)
    hello, _ = conn.send(_core.hello(None).request)
    conn.receive_data(RELOADING)  # the daemon began reloading before its welcome
    assert conn.reconnecting
    welcome = Welcome(id=_core.HELLO_ID, version=1, daemon_version="0.1.0", pid=7)
    assert conn.reconnected(welcome=welcome) == []  # the handshake said hello again
    assert conn.next_reply(hello) == welcome


def test_a_handshake_answers_the_welcome_and_keeps_what_followed() -> None:
    handshake = _core.Handshake("tok")
    hello = client_decoder.decode(handshake.frame[HEADER.size :])
    assert isinstance(hello, Hello)
    assert (hello.id, hello.token) == (_core.HELLO_ID, "tok")
    welcome = Welcome(id=1, version=1, daemon_version="0.1.0", pid=7)
    after = encode(Wakes(id=5, wakes=[]))
    data = encode(welcome) + after
    assert handshake.receive_data(data[:3]) is None
    assert handshake.receive_data(data[3:]) == welcome
    assert handshake.rest == after
    with pytest.raises(Reloading):
        _core.Handshake(None).receive_data(RELOADING)
    with pytest.raises(ConnectionLost):
        _core.Handshake(None).receive_data(b"")


def test_a_request_answered_reloading_under_its_own_id_is_sent_again() -> None:
    reloading = Error(id=2, code="reloading", message="reloading", retry_after=0.3)
    assert _core.retry_delay(Spawn(id=2), reloading) == 0.3
    assert _core.retry_delay(Resume(id=2, worker="w-1"), reloading) == 0.3
    assert _core.retry_delay(ResumeRun(id=2, run="r-1"), reloading) == 0.3
    # Cut short on the connection that asked for a reload: asking again is safe.
    assert _core.retry_delay(Status(id=2, worker="w-1"), reloading) == 0.3
    # Not a stop: sent again it would say it stopped nothing (its real answer comes instead).
    assert _core.retry_delay(Stop(id=2, worker="w-1"), reloading) is None
    assert _core.retry_delay(StopRun(id=2, run="r-1"), reloading) is None
    assert _core.retry_delay(Cancel(id=2, scope="all"), reloading) is None
    assert _core.retry_delay(Spawn(id=2), Error(id=2, code="busy", message="busy")) is None
    notice = Error(id=0, code="reloading", message="reloading; reconnect")
    assert _core.retry_delay(Spawn(id=2), notice) is None


def test_a_wait_or_stream_answered_reloading_is_sent_again_under_its_id() -> None:
    conn = _core.Connection()
    wait_id, _ = conn.send(Wait(id=0, worker="w-1"))
    since = [0]
    watch_id, _ = conn.send(
        Watch(id=0, worker="w-1", follow=True),
        again=lambda: Watch(id=0, worker="w-1", since=since[0], follow=True),
    )
    conn.receive_data(encode(Page(id=watch_id, entries=[], next=3, complete=False)))
    since[0] = 5  # the caller took pages up to 5; the one still in the inbox comes again
    told = [
        Error(id=rid, code="reloading", message="send it again", retry_after=0.2)
        for rid in (wait_id, watch_id)
    ]
    conn.receive_data(b"".join(encode(e) for e in told))
    assert conn.next_reply(wait_id) is None
    assert conn.next_reply(watch_id) is None
    again = [client_decoder.decode(f[HEADER.size :]) for f in conn.outgoing()]
    assert again == [
        Wait(id=wait_id, worker="w-1"),
        Watch(id=watch_id, worker="w-1", since=5, follow=True),
    ]
    assert conn.outgoing() == []
