"""sd_notify by hand: a datagram to $NOTIFY_SOCKET, when the service manager gave one.

Small enough not to need a library: one sendto of "KEY=VALUE" lines. The
path may be in the abstract namespace (a leading "@").
"""

from __future__ import annotations

import os
import socket
import time


def notify(*assignments: str) -> bool:
    """Send e.g. ``notify("READY=1")``; False when not run by a service manager."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            # Never waits: a listener that does not read (its queue holds 10 datagrams
            # by default) must not hang the daemon; what it would not take is dropped.
            sock.sendto("\n".join(assignments).encode(), socket.MSG_DONTWAIT, address)
        except OSError:
            return False
    return True


def monotonic_usec() -> str:
    """The MONOTONIC_USEC= assignment systemd wants with RELOADING=1."""
    return f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
