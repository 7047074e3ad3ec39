"""The daemon's log: what it writes, that nothing logged before it is configured is
lost, and that serving needs none of structlog's imports.

Each case runs in a fresh interpreter (the log is configured once per process), as the
daemon does; the JSON lines it writes on stderr are what a user reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

#: A run of events the daemon's log and structlog (configured as the daemon configured
#: it before it had its own) must write alike: keywords, a path, bound context, an
#: exception (raised and handled), a debug event filtered out.
EVENTS = """
from pathlib import Path
log.info("worker.spawned", worker="w-1", argv=["sleep", "1"], cwd=Path("/tmp"))
bind_contextvars(conn=7)
log.warning("conn.slow", conn=8, seconds=0.25)
log.debug("conn.closed")
try:
    raise ValueError("planted")
except ValueError:
    log.exception("recovery.worker_failed", worker="w-2")
log.error("store.failed", error=OSError(28, "No space left on device"))
log.critical("reload.handoff_unreadable", then="exiting")
"""

OURS = """
from subagentd.daemon._logging import bind_contextvars, configure_logging, get_logger
configure_logging("json")
log = get_logger()
"""

STRUCTLOG = """
import logging, structlog
from structlog.contextvars import bind_contextvars
from subagentd.daemon._logging import _json
structlog.configure(
    processors=[
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(serializer=lambda e, **kw: _json.encode(e).decode()),
    ],
    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
)
log = structlog.get_logger("subagentd")
"""


def _stderr_of(script: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in done.stderr.splitlines()]


def _untimed(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{k: v for k, v in e.items() if k != "timestamp"} for e in events]


def test_json_lines_are_what_structlog_wrote() -> None:
    # Compiled as one file in both, so their tracebacks name the same lines.
    run_events = f"exec(compile({EVENTS!r}, 'events.py', 'exec'))"
    ours = _stderr_of(OURS + run_events)
    theirs = _stderr_of(STRUCTLOG + run_events)
    assert _untimed(ours) == _untimed(theirs)
    assert [list(e) for e in ours] == [list(e) for e in theirs]  # the keys' order too
    assert all(str(e["timestamp"]).endswith("Z") for e in ours)
    assert "ValueError: planted" in str(ours[2]["exception"])


def test_events_logged_before_configuring_are_written_with_their_own_times() -> None:
    events = _stderr_of(
        """
        import time
        from subagentd.daemon._logging import configure_logging, get_logger
        get_logger().info("reload.adopted", carried_live=3)
        get_logger().debug("conn.closed")
        time.sleep(0.2)
        configure_logging("json")
        get_logger().info("daemon.serving")
        """
    )
    assert [e["event"] for e in events] == ["reload.adopted", "daemon.serving"]
    assert events[0]["carried_live"] == 3
    assert str(events[0]["timestamp"]) < str(events[1]["timestamp"])


def test_serving_imports_no_structlog() -> None:
    """structlog imports rich and asyncio: ~150 ms a reload's new image spent before serving."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, subagentd.daemon._main, subagentd.daemon.lifecycle._serve\n"
            "print(sorted(m for m in ('structlog', 'rich', 'asyncio') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[]"
