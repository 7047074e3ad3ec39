"""When a person or a model says "since": a point in time from the words they use for it.

One parser for every surface that filters a worker's output by time (subagentd-mcp's watch
and grep, ``subagentctl grep --since``), so each takes the same words. Pure: the caller
passes ``now``.
"""

from __future__ import annotations

import datetime
import math
import re

from subagentd.protocol import MAX_EPOCH

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
#: A time is said in far fewer characters than this: a longer string is refused unread.
MAX_SINCE_LENGTH = 64

SINCE_SYNTAX = (
    "a duration ago (10m, 90s, 2h, 1d, 1h30m), an ISO 8601 time "
    "(2026-01-31T12:00:00Z) or seconds since the epoch"
)


def parse_since(text: str, now: float) -> float:
    """A point in time, as seconds since the epoch (UTC), from ``10m``/``90s``/``2h``/``1d``
    (that long ago, combinable: ``1h30m``), an ISO 8601 time (UTC unless it names its
    offset), or seconds since the epoch; ValueError saying what it takes otherwise, and
    for a time before 1970 or after 9999 (what the daemon takes)."""
    if len(text) > MAX_SINCE_LENGTH:
        raise ValueError(f"at most {MAX_SINCE_LENGTH} characters")
    spoken = text.strip()
    if spoken and _AGO.sub("", spoken.replace(" ", "")) == "":
        ago = sum(float(n) * _UNITS[unit] for n, unit in _AGO.findall(spoken.replace(" ", "")))
        return _within(now - ago)
    try:
        seconds = float(spoken)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return _within(seconds)
        raise ValueError("seconds since the epoch must be finite and not negative")
    try:
        when = datetime.datetime.fromisoformat(spoken)
    except ValueError:
        raise ValueError(SINCE_SYNTAX) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return _within(when.timestamp())


def _within(when: float) -> float:
    """`when`, if the daemon takes it: from the epoch to the end of the year 9999."""
    if not (math.isfinite(when) and 0 <= when <= MAX_EPOCH):
        raise ValueError("a time between 1970 and the end of 9999")
    return when
