"""Small things the end-to-end tests share: shell commands and process checks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from subagentd import protocol as p
from subagentd.client import AsyncClient
from subagentd.protocol import DaemonMessage, Stop, Stopped


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie has already ended)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return raw[raw.rindex(b")") + 2 : raw.rindex(b")") + 3] not in (b"Z", b"X")


def descriptors(pid: int) -> dict[int, tuple[str, bool]]:
    """Each open descriptor of `pid`: what it is, and whether an exec would carry it."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            fdinfo = Path(f"/proc/{pid}/fdinfo/{name}").read_text()
        except FileNotFoundError:
            continue  # closed while we looked
        flags = next(int(line.split()[1], 8) for line in fdinfo.splitlines() if "flags:" in line)
        found[int(name)] = (target, not flags & os.O_CLOEXEC)
    return found


def command_line(pid: int) -> list[str]:
    """The arguments `pid` runs with (after an exec, the new image's)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def pids_in(path: Path) -> list[int]:
    """The pids a worker wrote into `path`, one per line."""
    return [int(line) for line in path.read_text().split()]


async def follow_stdout(
    client: AsyncClient, worker_id: str, done: Callable[[bytes], bool]
) -> bytes:
    """Follow the worker's journal until `done(stdout so far)`; the stdout so far."""
    seen = b""
    async with contextlib.aclosing(client.watch(worker_id, follow=True)) as entries:
        async for entry in entries:
            if entry.kind == "stdout":
                seen += entry.data
                if done(seen):
                    return seen
    raise AssertionError(f"worker {worker_id} ended before its output was complete: {seen!r}")


async def wait_output(client: AsyncClient, worker_id: str, marker: bytes) -> bytes:
    """Follow the worker's journal until its stdout holds `marker`; the stdout so far."""
    return await follow_stdout(client, worker_id, lambda seen: marker in seen)


async def until_note(client: AsyncClient, worker_id: str, text: str) -> None:
    """Follow the worker's journal until a note holding `text` (its retry's, say)."""
    async with contextlib.aclosing(client.watch(worker_id, follow=True)) as entries:
        async for entry in entries:
            if entry.kind == "note" and text in entry.data.decode():
                return
    raise AssertionError(f"no note {text!r} in {worker_id}'s journal")


async def paged_stdout(client: AsyncClient, worker_id: str, limit: int = 10_000) -> bytes:
    """A finished worker's whole stdout, read back page by page from cursor 0."""
    text, cursor = b"", 0
    while True:
        page = await client.watch_page(worker_id, since=cursor, limit=limit)
        text += b"".join(e.data for e in page.entries if e.kind == "stdout")
        cursor = page.next
        if page.complete:
            return text


async def stop_ids(client: AsyncClient, worker_id: str) -> list[str]:
    """Stop a worker and answer the ids the daemon says it stopped."""
    reply = await client.request(Stop(id=0, worker=worker_id))
    assert isinstance(reply, Stopped)
    return reply.stopped


class RawConnection:
    """The wire, with nothing of the client library in between."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = p.FrameDecoder()

    @classmethod
    async def open(cls, socket: os.PathLike[str], hello: bool = True) -> RawConnection:
        conn = cls(await trio.open_unix_socket(os.fspath(socket)))
        if hello:
            try:
                await conn.send(p.Hello(id=1))
                assert isinstance(await conn.receive(), p.Welcome)
            except BaseException:
                await trio.aclose_forcefully(conn.stream)
                raise
        return conn

    async def send(self, message: p.Request[p.Reply]) -> None:
        await self.stream.send_all(p.encode(message))

    async def receive(self) -> DaemonMessage | None:
        """The next message, or None once the daemon closed the connection."""
        while (body := self.decoder.next_frame()) is None:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.decoder.feed(data)
        return p.daemon_decoder.decode(body)


#: The `connect` fixture (conftest): opens raw connections, closed after the test.
Connect = Callable[..., Awaitable[RawConnection]]


class _Served(Protocol):
    """A daemon under test (conftest's DaemonProcess): where it serves."""

    @property
    def socket(self) -> Path: ...


async def reload_on_own_connection(daemon: _Served) -> p.Reply:
    """Ask for a reload on a connection of its own; the answer comes from the new image."""
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Reload(id=2))
        reply = await conn.receive()
        assert reply is not None
        return reply


async def pending_wakes(daemon: _Served, run: str) -> list[p.Wake]:
    """The wakes not yet acknowledged for `run` (a subscription's first page)."""
    conn = await RawConnection.open(daemon.socket)
    async with conn.stream:
        await conn.send(p.Subscribe(id=2, run=run))
        reply = await conn.receive()
        assert isinstance(reply, p.Wakes)
        return reply.wakes


def write_old_record(archive: Path, view: Mapping[str, object], **fields: object) -> None:
    """Write `archive`/record.json as an image before the store did, from a worker's
    status (`subagentctl --json status`), with `fields` over it."""
    record = {
        key: view.get(key)
        for key in (
            "id", "run", "parent", "name", "state", "cwd", "agent", "archive",
            "pid", "exit_code", "started_at", "ended_at",
        )
    } | {
        "argv": view.get("argv") or ["true"], "attempt": view.get("attempt", 1),
        "turn": view.get("turn", 0), "grace": 5.0, "timeout": None, "token": "an old token",
    }  # fmt: skip
    (archive / "record.json").write_bytes(msgspec.json.encode(record | fields))
