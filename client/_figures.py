"""A worker's usage (`Usage`) as a person reads it: CPU seconds and %, memory in binary
units, the same in `subagentctl status`, `ls`, `info`, `top` and the MCP tools' text."""

from __future__ import annotations

from subagentd.protocol import Usage

_UNITS = ("B", "K", "M", "G", "T", "P")


def memory_text(size: int | None) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1 ("113M",
    "1.5G"); three significant digits at most; "-" for none."""
    if size is None:
        return "-"
    value, unit = float(max(size, 0)), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)}B"
    shown = f"{value:.1f}" if value < 10 else f"{value:.0f}"
    return shown + _UNITS[unit]


def percent_text(percent: float | None) -> str:
    """A CPU % ("57.0", "180"); "-" for none."""
    if percent is None:
        return "-"
    return f"{percent:.1f}" if percent < 100 else f"{percent:.0f}"


def cpu_text(usage: Usage) -> str:
    """CPU seconds and recent % together: "1.43 s, 57.0%"."""
    return f"{usage.cpu_seconds:.2f} s, {percent_text(usage.cpu_percent)}%"


def memory_now_and_peak(usage: Usage) -> str:
    """Memory now and at peak: "113M now, 120M at peak"."""
    return f"{memory_text(usage.memory)} now, {memory_text(usage.memory_peak)} at peak"


def usage_line(usage: Usage) -> str:
    """All of it in one line, for a listing or the MCP tools' text."""
    return (
        f"cpu {cpu_text(usage)}; memory {memory_now_and_peak(usage)}; "
        f"{usage.processes} process{'' if usage.processes == 1 else 'es'} ({usage.source})"
    )
