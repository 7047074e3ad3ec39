"""Where the daemon and its clients meet: the default paths and their overrides.

Both sides resolve paths here so that the CLI, the clients and the daemon find
the same socket. Reads the environment; creates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

APP = "subagentd"

# platformdirs (with tempfile) is imported only when a default is wanted: a reload's new
# image, whose paths are its checkpoint's, and a client given $SUBAGENTD_SOCKET, need none.


def default_socket_path(environ: Mapping[str, str] = os.environ) -> Path:
    if path := environ.get("SUBAGENTD_SOCKET"):
        return Path(path)
    import platformdirs

    return Path(platformdirs.user_runtime_dir(APP)) / "subagentd.sock"


def default_state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    if path := environ.get("SUBAGENTD_STATE_DIR"):
        return Path(path)
    import platformdirs

    return Path(platformdirs.user_state_dir(APP))


def default_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    if path := environ.get("SUBAGENTD_CONFIG"):
        return Path(path)
    import platformdirs

    return Path(platformdirs.user_config_dir(APP)) / "agents.toml"


def one_line_warnings(program: str) -> Callable[..., str]:
    """A `warnings.formatwarning` that says a warning (platformdirs' fallback to a runtime
    dir in the temporary directory, say) in one line a person reads, naming `program`,
    not as Python's file, line number and source line."""

    def line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        source: str | None = None,
    ) -> str:
        return f"{program}: warning: {message}\n"

    return line
