"""Every error subagentd raises, in one hierarchy, and the stable codes on the wire.

    SubagentdError
    ├── TransportError            the socket, not the daemon, failed
    │   ├── DaemonUnavailable     nothing answers at the socket path
    │   └── ConnectionLost        the daemon went away mid-conversation
    ├── ProtocolError             bytes that are not a valid frame or message
    │   └── FrameTooLarge
    └── RemoteError               the daemon refused a request; `.code` is stable
        ├── NotFound              not_found
        ├── Invalid               invalid
        ├── Forbidden             forbidden
        ├── Refused               refused
        │   ├── RunStopped        run_stopped
        │   └── Frozen            frozen
        ├── Busy                  busy
        ├── Reloading             reloading (retry after `retry_after` seconds)
        ├── Recovering            recovering (a restart is taking its workers back:
        │                         retry after `retry_after` seconds)
        ├── UnsupportedVersion    unsupported_version
        ├── TooLarge              too_large
        └── Internal              internal

Transport failures are mapped at the client boundary with ``raise ... from exc``;
a daemon refusal arrives as an ``Error`` message and becomes the subclass for its code.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class ErrorCode(enum.StrEnum):
    NOT_FOUND = "not_found"
    INVALID = "invalid"
    FORBIDDEN = "forbidden"
    REFUSED = "refused"
    RUN_STOPPED = "run_stopped"
    FROZEN = "frozen"
    BUSY = "busy"
    RELOADING = "reloading"
    RECOVERING = "recovering"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"


class SubagentdError(Exception):
    """Base of every error raised by subagentd's libraries."""


class TransportError(SubagentdError):
    pass


class DaemonUnavailable(TransportError):
    """No daemon answers at the socket path."""


class ConnectionLost(TransportError):
    """The connection closed before the answer arrived."""


class ProtocolError(SubagentdError):
    """The peer sent bytes that are not a valid frame or message."""


class FrameTooLarge(ProtocolError):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class RemoteError(SubagentdError):
    """The daemon refused a request. ``code`` is one of `ErrorCode`. ``stopped_by_reload``:
    for a reload that failed, the workers it had stopped before failing (else empty)."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        stopped_by_reload: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.stopped_by_reload = list(stopped_by_reload)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class NotFound(RemoteError):
    code = ErrorCode.NOT_FOUND


class Invalid(RemoteError):
    code = ErrorCode.INVALID


class Forbidden(RemoteError):
    code = ErrorCode.FORBIDDEN


class Refused(RemoteError):
    code = ErrorCode.REFUSED


class RunStopped(Refused):
    code = ErrorCode.RUN_STOPPED


class Frozen(Refused):
    code = ErrorCode.FROZEN


class Busy(RemoteError):
    code = ErrorCode.BUSY


class Reloading(RemoteError):
    code = ErrorCode.RELOADING


class Recovering(RemoteError):
    """Not answered yet: the daemon is taking its workers back after a restart, and this
    request needs what it is taking back; nothing was done, so it may be sent again (after
    `retry_after` seconds), whatever it asks."""

    code = ErrorCode.RECOVERING


class UnsupportedVersion(RemoteError):
    code = ErrorCode.UNSUPPORTED_VERSION


class TooLarge(RemoteError):
    code = ErrorCode.TOO_LARGE


class Internal(RemoteError):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        NotFound,
        Invalid,
        Forbidden,
        Refused,
        RunStopped,
        Frozen,
        Busy,
        Reloading,
        Recovering,
        UnsupportedVersion,
        TooLarge,
        Internal,
    )
}


def remote_error(
    code: str,
    message: str,
    retry_after: float | None = None,
    *,
    stopped_by_reload: Sequence[str] = (),
) -> RemoteError:
    """The exception for an error that arrived on the wire; unknown codes stay `RemoteError`."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = RemoteError(message, retry_after=retry_after, stopped_by_reload=stopped_by_reload)
        err.code = code  # type: ignore[assignment]  # a newer daemon's code, kept verbatim
        return err
    return cls(message, retry_after=retry_after, stopped_by_reload=stopped_by_reload)
