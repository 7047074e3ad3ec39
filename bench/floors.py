"""Floors: what each job costs from Python on this machine with no supervisor at all.

Not a bench of its own: start.py, stop.py, roundtrip.py and reload.py measure
these in the same run, in turns with both daemons, so that a target "within Nx
of the floor" compares figures taken under the same load.

- start: `os.posix_spawn` of `sleep 3600`, then `os.pidfd_open` of it (the
  daemon opens one per worker too). glibc's posix_spawn forks with
  CLONE_VFORK: the call returns once the child's exec has passed its point of
  no return (its old image released; an exec error is the call's return value),
  as the daemon's `Popen` does before its spawn answers (its error pipe closes
  on exec). So "exec'd" is the call's return, the same as the daemon side's;
  then, untimed, each child's /proc/PID/comm is checked to become `sleep` (the
  kernel renames it a few microseconds after that point), and the child is
  killed and reaped.
  `Popen` with stdout and stderr piped is a second reference line.
- stop: a `sleep` already exec'd; `pidfd_send_signal(TERM)`, `poll` on its
  pidfd until readable, `waitpid`: TERM until reaped.
- round trip: `echo_server()`, a bare trio + msgspec server on a Unix socket
  (`python bench/floors.py echo SOCKET`), called by `EchoClient`, a blocking
  socket with the daemon's frame codec.
- reload: a fresh interpreter of the venv's python: `-c pass`, and
  `-c "import trio, msgspec"`, timed until it exits (bytecode written: run
  once first, untimed). What any exec'd new image pays before it can serve.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from subagentd.protocol import FrameDecoder, frame

SLEEP = ["sleep", "3600"]
SLEEP_PATH = next(
    str(Path(d) / "sleep")
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")
    if (Path(d) / "sleep").is_file()
)


def _execs_sleep(pid: int) -> bool:
    """Whether `pid` runs `sleep` (its comm), within 1 s: the kernel names the new image
    a moment after the point of no return of its exec, where the spawn call returns."""
    give_up = time.monotonic() + 1
    while Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
        if time.monotonic() > give_up:
            return False
    return True


def _end(pid: int) -> None:
    """Kill and reap a child of this process."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# -- start -------------------------------------------------------------------


def posix_spawn_once() -> float:
    """ms from `posix_spawn` of `sleep 3600` until it has exec'd and a pidfd holds it."""
    start = time.perf_counter()
    pid = os.posix_spawn(SLEEP_PATH, SLEEP, os.environ)
    pidfd = os.pidfd_open(pid)
    elapsed = (time.perf_counter() - start) * 1000
    assert _execs_sleep(pid), "the child did not exec sleep"
    os.close(pidfd)
    _end(pid)
    return elapsed


def popen_once() -> float:
    """ms of `subprocess.Popen` of `sleep 3600`, stdout and stderr piped (it returns once
    the child has exec'd: exec errors come back through its own pipe)."""
    start = time.perf_counter()
    child = subprocess.Popen(
        SLEEP, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    elapsed = (time.perf_counter() - start) * 1000
    assert _execs_sleep(child.pid), "the child did not exec sleep"
    child.kill()
    child.communicate()
    return elapsed


# -- stop --------------------------------------------------------------------


@contextlib.contextmanager
def sleeping(count: int) -> Iterator[list[int]]:
    """`count` children `sleep 3600` (exec'd once the spawn returned); those not reaped
    on the way out are killed and reaped."""
    pids: list[int] = []
    try:
        pids += (os.posix_spawn(SLEEP_PATH, SLEEP, os.environ) for _ in range(count))
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                _end(pid)


def stop_once(pid: int) -> float:
    """ms from TERM to `pid` (an exec'd `sleep`, our child) until reaped, through a pidfd."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        start = time.perf_counter()
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        poller.poll()
        os.waitpid(pid, 0)
        return (time.perf_counter() - start) * 1000
    finally:
        os.close(pidfd)


# -- round trip ----------------------------------------------------------------


class Ask(msgspec.Struct, tag=True):
    """The echo's request: as small as `info`'s."""

    id: int
    op: str


class Answer(msgspec.Struct):
    id: int
    ok: bool
    op: str


def echo_server(path: str) -> None:
    """Serve the echo on `path` until killed: decode each framed `Ask`, answer an
    `Answer` in the connection's task (as the daemon answers `info`); "ready" on stdout."""
    import trio

    decode = msgspec.msgpack.Decoder(Ask).decode
    encode = msgspec.msgpack.Encoder().encode

    async def connection(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        while data := await stream.receive_some(64 * 1024):
            decoder.feed(data)
            for body in decoder.frames():
                ask = decode(body)
                await stream.send_all(frame(encode(Answer(id=ask.id, ok=True, op=ask.op))))

    async def serve() -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(128)
        print("ready", flush=True)
        await trio.serve_listeners(connection, [trio.SocketListener(sock)])

    trio.run(serve)


@contextlib.contextmanager
def running_echo() -> Iterator[str]:
    """An echo server in its own process (the venv's python); its socket's path."""
    root = Path(tempfile.mkdtemp(prefix="echo-", dir="/tmp"))
    path = str(root / "echo.sock")
    proc = subprocess.Popen(
        [sys.executable, __file__, "echo", path], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the echo server did not start")
        yield path
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.rmdir(root)


class EchoClient:
    """The daemon's bench side, bare: one blocking connection, framed msgpack both ways."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.decoder = FrameDecoder()
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(Answer).decode
        self.next_id = 0

    def call(self) -> Answer:
        self.next_id += 1
        self.sock.sendall(frame(self.encode(Ask(id=self.next_id, op="info"))))
        while (body := self.decoder.next_frame()) is None:
            data = self.sock.recv(64 * 1024)
            if not data:
                raise ConnectionError("the echo server closed the connection")
            self.decoder.feed(data)
        answer = self.decode(body)
        assert answer.id == self.next_id
        return answer

    def close(self) -> None:
        self.sock.close()


# -- reload --------------------------------------------------------------------

INTERPRETER = {"pass": "pass", "imports": "import trio, msgspec"}


def interpreter_once(code: str) -> float:
    """ms from starting the venv's python with `-c code` until it exited (0)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return (time.perf_counter() - start) * 1000


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"] and len(sys.argv) == 3:
        echo_server(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} echo SOCKET (the echo server; see the docstring)")
