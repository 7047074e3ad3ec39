"""The protocol's version and limits, shared by the daemon and every client."""

from __future__ import annotations

#: This package's version: the one place it is written (pyproject.toml reads it from
#: here), so no image pays for importlib.metadata at start, nor a client at each connect.
__version__ = "0.1.0"

#: Bumped when a message changes incompatibly; fields added with defaults do not bump it.
PROTOCOL_VERSION = 1

#: A frame body larger than this closes the connection with `too_large`.
DEFAULT_FRAME_LIMIT = 16 * 1024 * 1024


def package_version() -> str:
    """This installation's version."""
    return __version__
