"""The protocol's version and limits, shared by the daemon and every client."""

from __future__ import annotations

import functools
from importlib import metadata

#: Bumped when a message changes incompatibly; fields added with defaults do not bump it.
PROTOCOL_VERSION = 1

#: A frame body larger than this closes the connection with `too_large`.
DEFAULT_FRAME_LIMIT = 16 * 1024 * 1024


@functools.cache
def package_version() -> str:
    """This installation's version (read once: importlib.metadata parses files each call)."""
    try:
        return metadata.version("subagentd")
    except metadata.PackageNotFoundError:  # running from a tree that was never installed
        return "0+unknown"
