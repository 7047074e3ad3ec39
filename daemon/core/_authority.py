"""Who may ask what: every permission decision the daemon makes on a connection, in one place.

Whom a connection acts as is settled once, at its hello (`caller_at_hello`): where workers
have cgroups, a connection from inside a worker's acts as that worker, whatever token it
gives or omits; one from outside every worker's acts for the user, or as the worker whose
token it gives. Without cgroups, the token alone says (advisory: a worker that omits it is
the user). The user may do everything; a worker reaches only its subtree
(protocol/README.md, Authority). Pure: it walks workers' parents through the function it
is given (the registry, then the archive) and touches nothing else; the server asks it once
per request, before dispatch.
"""

from __future__ import annotations

from collections.abc import Callable

from subagentd.protocol import (
    Cancel,
    ClientMessage,
    Collect,
    Grep,
    Pause,
    Resume,
    Send,
    Spawn,
    Status,
    Stop,
    Subscribe,
    Unpause,
    Wait,
    WaitFor,
    Watch,
    op,
)
from subagentd.protocol.errors import Forbidden, NotFound

#: A worker's parent (None: it is top-level); raises NotFound for an id never seen.
ParentOf = Callable[[str], str | None]
#: A worker's id for a token it was given, None for a token no worker holds.
WorkerForToken = Callable[[str], str | None]


def caller_at_hello(
    token: str | None, within: str | None, worker_for_token: WorkerForToken
) -> str | None:
    """Whom a connection acts as (a worker's id; None: the user), from the `token` its hello
    gave and the worker whose cgroup the kernel says its peer is `within` (None: no
    worker's, or no cgroups to tell); raises Forbidden for a token it may not give.

    Inside a worker's cgroup the connection is that worker: with no token (a host that
    dropped the environment), or with its own. Another worker's token there is refused,
    not obeyed: a worker cannot borrow a reach it was not given.
    """
    if token is None:
        return within
    holder = worker_for_token(token)
    if holder is None:
        raise Forbidden("this worker token is not known (its worker has been reaped?)")
    if within is not None and holder != within:
        raise Forbidden(
            f"this connection comes from inside worker {within}'s cgroup, so it acts as "
            f"{within}, and may not present worker {holder}'s token; connect without a "
            f"token (unset SUBAGENTD_TOKEN) or with {within}'s own"
        )
    return holder


class Authority:
    def __init__(self, parent_of: ParentOf) -> None:
        self._parent_of = parent_of

    def check(self, caller: str | None, request: ClientMessage) -> None:
        """Return if `caller` (a worker's id; None: the user) may send `request`, else raise
        Forbidden; NotFound for a worker it names that the daemon never saw."""
        if caller is None:
            return
        if not request.for_workers:
            raise Forbidden(
                f"{op(request)} is not for a worker's connection (this one acts as worker "
                f"{caller}): runs, turns, fences and reloads belong to whoever runs the "
                "workflow, not to a worker in it"
            )
        match request:
            case Spawn(parent=parent, after=after, after_ok=after_ok, after_ready=after_ready):
                if parent is not None:
                    self._reach(caller, parent)  # none given: the new worker is the caller's
                for named in (*after, *after_ok, *after_ready):
                    self._reach(caller, named)
            case (
                Status(worker=worker)
                | Watch(worker=worker)
                | Collect(worker=worker)
                | Wait(worker=worker)
                | Resume(worker=worker)
                | Grep(worker=worker)
                | WaitFor(worker=worker)
                | Send(worker=worker)
            ):
                self._reach(caller, worker)
            case Stop(worker=worker):
                # An id never seen is answered `found: false`, to anyone: it tells nothing.
                self._reach(caller, worker, unseen_allowed=True)
            case Pause(worker=worker, run=run) | Unpause(worker=worker, run=run) if (
                run is None
            ) != (worker is None):
                if worker is None:
                    raise Forbidden(
                        f"worker {caller} may {op(request)} only a worker in its subtree "
                        "(worker: <id>), not a run"
                    )
                self._reach(caller, worker)
            case Subscribe(run=run, worker=worker) if (run is None) != (worker is None):
                if worker is None:
                    raise Forbidden(
                        f"worker {caller} may subscribe only to the wakes of a worker in its "
                        "subtree (worker: <id>), not to a run's"
                    )
                self._reach(caller, worker)
            case Cancel(scope=scope):
                kind, _, target = scope.partition(":")
                if kind != "worker":
                    raise Forbidden(
                        f"worker {caller} may cancel only worker:<id> in its subtree, not {scope!r}"
                    )
                self._reach(caller, target)
        # The rest (list_workers, ack, info, abort; a subscribe, pause or unpause of not
        # exactly one target, which is invalid) a worker may send as it is; a listing
        # shows it only what it `sees`.

    def sees(self, caller: str | None, worker_id: str) -> bool:
        """Whether `caller` (None: the user) may see `worker_id`, in a listing say."""
        if caller is None:
            return True
        try:
            self._reach(caller, worker_id)
        except (Forbidden, NotFound):
            return False
        return True

    def _reach(self, caller: str, worker_id: str, *, unseen_allowed: bool = False) -> None:
        """Return if `worker_id` is `caller` or was delegated by it at any depth, archived
        and released ones included; raise Forbidden if not, NotFound if it was never seen
        (unless `unseen_allowed`)."""
        if worker_id == caller:
            return
        try:
            current = self._parent_of(worker_id)
        except NotFound:
            if unseen_allowed:
                return
            raise
        walked = {worker_id}
        while current is not None and current != caller and current not in walked:
            walked.add(current)
            try:
                current = self._parent_of(current)
            except NotFound:
                current = None  # an ancestor no longer known: not shown to be within
        if current != caller:
            raise Forbidden(
                f"worker {caller} may act only on itself and the workers it delegated to, "
                f"not on {worker_id}"
            )
