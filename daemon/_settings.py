"""The daemon's effective settings: resolved once from the command line and the
environment when it starts, then given by each reload to the next image on its
command line (`Settings.command_line`), so that every image of one daemon serves
with the settings it was started with. (Images before checkpoint version 4 carried
them in the checkpoint instead.)"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from subagentd.protocol import MaxRunning

from ._logging import LogFormat
from .core._registry import DEFAULT_FINISHED_TTL, DEFAULT_KEEP_ARCHIVES_DAYS
from .core._request_keys import DEFAULT_REQUEST_KEY_TTL

#: Seconds or days: zero or more, as the command line takes them (nan refused, inf
#: meaning never); the same rule where a checkpoint carries them.
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
#: The largest `relay_above` taken: far past any descriptor limit (fs.nr_open's most is 2^30).
MAX_RELAY_ABOVE = 1 << 31
#: A reload this soon after the last one ended is refused `busy`, with the time left.
DEFAULT_RELOAD_INTERVAL = 1.0


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What `subagentd` was told (or defaulted to) at start.

    A new setting gets a default: a checkpoint written by an image that did not
    know it still decodes, and the new image's default is the only value there is.
    """

    socket: Path
    state_dir: Path
    config: Path
    finished_ttl: NonNegative = DEFAULT_FINISHED_TTL
    idle_exit: NonNegative | None = None
    keep_archives_days: NonNegative = DEFAULT_KEEP_ARCHIVES_DAYS
    log_format: LogFormat | None = None
    cgroups: Literal["auto", "off"] = "auto"
    reload_interval: NonNegative = DEFAULT_RELOAD_INTERVAL
    #: Seconds a spawn's or resume's idempotency key is remembered.
    request_key_ttl: NonNegative = DEFAULT_REQUEST_KEY_TTL
    #: A new worker's pipes go to an output relay once their descriptor numbers come at
    #: or above this (None: the default worked out from the limit, `default_relay_above`).
    relay_above: Annotated[int, msgspec.Meta(ge=0, le=MAX_RELAY_ABOVE)] | None = None
    #: The daemon's cap on workers running at once (`--max-running`); None: none.
    max_running: MaxRunning | None = None
    #: Where the cgroup v1 hierarchies are looked for, each a directory named after its
    #: controller (`--cgroup-v1-root`); None: where /proc/self/mountinfo says.
    cgroup_v1_root: Path | None = None

    def command_line(self) -> list[str]:
        """The options of `subagentd` that give these very settings: a reload's exec passes
        them, so the next image's settings are its command line's, which no other
        process can change (a file in the state dir, any of the user's processes can)."""
        options = [
            f"--socket={self.socket}",
            f"--state-dir={self.state_dir}",
            f"--config={self.config}",
            f"--finished-ttl={self.finished_ttl!r}",
            f"--keep-archives={self.keep_archives_days!r}",
            f"--cgroups={self.cgroups}",
            f"--reload-interval={self.reload_interval!r}",
            f"--request-key-ttl={self.request_key_ttl!r}",
        ]
        if self.idle_exit is not None:
            options.append(f"--idle-exit={self.idle_exit!r}")
        if self.relay_above is not None:
            options.append(f"--relay-above={self.relay_above}")
        if self.max_running is not None:
            options.append(f"--max-running={self.max_running}")
        if self.log_format is not None:
            options.append(f"--log-format={self.log_format}")
        if self.cgroup_v1_root is not None:
            options.append(f"--cgroup-v1-root={self.cgroup_v1_root}")
        return options


def encode_path(obj: Any) -> Any:
    """msgspec's enc_hook for the paths in `Settings` (msgpack has no path type)."""
    if isinstance(obj, Path):
        return str(obj)
    # msgspec's protocol for a hook: NotImplementedError means "not a type of mine",
    # and msgspec reports the value as one it cannot encode.
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def decode_path(kind: type, obj: Any) -> Any:
    """msgspec's dec_hook: a path back from its text."""
    if kind is Path and isinstance(obj, str):
        return Path(obj)
    raise NotImplementedError(f"cannot decode {kind.__name__}")  # msgspec's protocol, as above
