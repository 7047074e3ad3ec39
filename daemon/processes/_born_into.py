"""A worker born straight into its cgroup v2 leaf, by the `_clone3` extension
(clone3 with CLONE_INTO_CGROUP, built from `_clone3.c` at install).

Used for the workers with cgroup v2 limits (`_v2_nodes`): v2 moves whole processes, so
the daemon cannot step one thread into a limited node to fork there as it does in v1
(`_forker`); standing there itself, all its threads would count against `pids.max` and
its leader would be a candidate of the node's OOM killer. Why an extension: Python has
no clone3, glibc's `posix_spawnattr_setcgroup_np` is 2.41 (this host's is 2.36), and a
raw clone through ctypes would run the interpreter in the child (its locks, the GIL).
Where the extension is not built, `available` is False and `WHY_NOT` says so: a limit
that needs a v2 controller is refused naming it (`Controllers.find`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ._spawn import executable

try:
    from . import _clone3  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install): the fallback, said in `info`
    _clone3 = None

#: Whether workers can be born into a cgroup v2 leaf here.
available = _clone3 is not None
#: Why not, for `info` and a refusal.
WHY_NOT = (
    "the clone3 helper (subagentd.daemon.processes._clone3, built from _clone3.c at "
    "install) is not built here, so no worker can be born into a limited cgroup v2 node"
)


def spawn_into(
    leaf: Path,
    argv: list[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
) -> int:
    """Start `argv` born in the cgroup v2 `leaf`, as `_spawn.spawn` starts it elsewhere
    (its own process group, its stdin, stdout and stderr the fds given, each 3 or more,
    no other fd); its pid. OSError as Popen's: a chdir or exec error is raised here, and
    a leaf that cannot take it (EBUSY: one passing controllers on; ENOENT: gone)."""
    if _clone3 is None:
        raise OSError(0, WHY_NOT)
    path = executable(argv[0], cwd, env)
    fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pid, pidfd = _clone3.spawn_into(
            fd,
            os.fsencode(path),
            [os.fsencode(arg) for arg in argv],
            [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()],
            os.fsencode(cwd),
            stdin,
            stdout,
            stderr,
        )
    except OSError as exc:
        if exc.filename in ("exec", "chdir"):  # the step: the file it could not take
            named = argv[0] if exc.filename == "exec" else cwd
            raise OSError(exc.errno, exc.strerror, named) from None
        raise
    finally:
        os.close(fd)
    # A live worker holds no pidfd (its pid is ours, unreaped: `_process`).
    os.close(pidfd)
    return int(pid)
