"""posix_spawn through glibc: a worker's fork and exec without a thread and without Popen.

glibc's posix_spawn clones with CLONE_VM|CLONE_VFORK: the child shares the daemon's
memory only until its exec, runs nothing but the file actions asked for, and reports a
failed chdir or exec back as the call's own error. So it is safe in a threaded
process, costs no copy of the daemon's page tables, and is cheap enough to run on
the event loop (a thread hop and Popen's Python cost more than the spawn itself).
Python's own os.posix_spawn has no chdir and no closefrom; ctypes reaches glibc's
(2.34 or later). Where they are missing `available` is False and the caller uses Popen.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping

_POSIX_SPAWN_SETPGROUP = 0x02
_POSIX_SPAWN_SETSIGDEF = 0x04
_POSIX_SPAWN_SETSIGMASK = 0x08
#: Popen's restore_signals: what Python ignores, and a worker expects at its default.
_DEFAULT_SIGNALS = [
    sig for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if (sig := getattr(signal, name, None))
]

# Opaque glibc types, given more room than any glibc needs (80, 336 and 128 bytes on
# x86-64): they are only ever handled through glibc's own functions.
_FileActions = ctypes.c_byte * 512
_Attributes = ctypes.c_byte * 1024
_SigSet = ctypes.c_byte * 256


def _libc() -> ctypes.CDLL | None:
    try:
        # glibc's soname first: find_library runs ldconfig (2.5 ms of a reload's start).
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        from ctypes.util import find_library  # only where glibc's soname is not found

        try:
            libc = ctypes.CDLL(find_library("c"), use_errno=True)
        except OSError:
            return None
    needed = (
        "posix_spawn",
        "posix_spawnp",
        "posix_spawn_file_actions_init",
        "posix_spawn_file_actions_destroy",
        "posix_spawn_file_actions_adddup2",
        "posix_spawn_file_actions_addchdir_np",
        "posix_spawn_file_actions_addclosefrom_np",
        "posix_spawnattr_init",
        "posix_spawnattr_destroy",
        "posix_spawnattr_setflags",
        "posix_spawnattr_setpgroup",
        "posix_spawnattr_setsigdefault",
        "posix_spawnattr_setsigmask",
        "sigemptyset",
        "sigaddset",
    )
    if not all(hasattr(libc, name) for name in needed):
        return None
    libc.posix_spawnattr_setflags.argtypes = [ctypes.c_void_p, ctypes.c_short]
    return libc


_LIBC = _libc()
#: Whether `spawn` can be used here (glibc with addchdir_np and addclosefrom_np).
available = _LIBC is not None


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(result, f"{what}: {os.strerror(result)}")


def executable(argv0: str, cwd: str, env: Mapping[str, str]) -> str:
    """The file `argv0` names, searched as Popen does: a name with a slash as it is (from
    `cwd`), else along the worker's own PATH. FileNotFoundError if none is executable."""
    if "/" in argv0:
        return argv0
    for directory in os.get_exec_path(dict(env)):
        candidate = os.path.join(cwd, directory, argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, os.strerror(2), argv0)


def spawn(
    argv: list[str], *, cwd: str, env: Mapping[str, str], stdin: int, stdout: int, stderr: int
) -> int:
    """Start `argv` in `cwd` with `env`, in a process group of its own, its stdin, stdout
    and stderr the fds given (each 3 or more) and no other fd; its pid. Raises OSError
    (and ValueError for a NUL) as Popen would: exec and chdir errors are reported here."""
    assert _LIBC is not None, "posix_spawn is not available: see `available`"
    libc = _LIBC
    if any("\0" in arg for arg in argv) or any("\0" in k + v for k, v in env.items()):
        raise ValueError("embedded null byte")
    if "/" not in argv[0] and "PATH" in env and env["PATH"] == os.environ.get("PATH"):
        # The worker's PATH is the daemon's own, which posix_spawnp searches: in the child,
        # after its chdir, as Popen's child does; one stat of each directory saved here.
        path, start = argv[0], libc.posix_spawnp
    else:
        path, start = executable(argv[0], cwd, env), libc.posix_spawn
    args = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
    environ = (ctypes.c_char_p * (len(env) + 1))(
        *[os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()], None
    )
    actions, attributes, defaults, mask = _FileActions(), _Attributes(), _SigSet(), _SigSet()
    _check(libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        _check(libc.posix_spawnattr_init(attributes), "posix_spawnattr_init")
        try:
            for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
                _check(libc.posix_spawn_file_actions_adddup2(actions, fd, target), "adddup2")
            _check(libc.posix_spawn_file_actions_addclosefrom_np(actions, 3), "addclosefrom")
            _check(libc.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)), "addchdir")
            libc.sigemptyset(defaults)
            for sig in _DEFAULT_SIGNALS:
                libc.sigaddset(defaults, int(sig))
            libc.sigemptyset(mask)
            _check(libc.posix_spawnattr_setsigdefault(attributes, defaults), "setsigdefault")
            _check(libc.posix_spawnattr_setsigmask(attributes, mask), "setsigmask")
            _check(libc.posix_spawnattr_setpgroup(attributes, 0), "setpgroup")
            flags = _POSIX_SPAWN_SETPGROUP | _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK
            _check(libc.posix_spawnattr_setflags(attributes, flags), "setflags")
            pid = ctypes.c_int(0)
            result = start(ctypes.byref(pid), os.fsencode(path), actions, attributes, args, environ)
        finally:
            libc.posix_spawnattr_destroy(attributes)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)
    if result != 0:
        raise OSError(result, os.strerror(result), argv[0])
    return pid.value
