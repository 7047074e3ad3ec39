"""The daemon's life from start to stop: take the state dir and the socket (bound,
socket-activated, or handed over by a reload), adopt or recover the workers,
serve until SIGTERM, idle exit or a stop, and shut down gracefully.

Kept apart from `_main` so that `subagentd --check`, which a reload runs in a
child on the critical path, imports none of it.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import trio

from subagentd.protocol import package_version
from subagentd.protocol.errors import RemoteError

from .._collector import UNSEEN
from .._daemon import Daemon
from .._faults import FAULT_ENV, read_faults
from .._logging import get_logger
from .._settings import Settings
from ..core._recovering import RecoveryProgress
from ..core._registry import DEFAULT_GRACE
from ..processes._cgroup import Cgroups, CgroupsUnavailable
from ..processes._controllers import Controllers
from ..processes._launcher import LocalLauncher
from ..processes._process import reap
from ..processes._relay import Relays, default_relay_above
from ..serving._handover import Handover
from ..serving._listener import ControlSocket, activated_socket, bind_control_socket
from ..serving._notify import notify
from ..serving._server import Server
from ..serving._waiting import WaitingServer
from ..store._legacy import import_old_state, mark_old_state_imported
from ..store._statedir import StateDir
from ..store._store import STORE_NAME, Store
from ._carried import take_back
from ._checkpoint import KEEP_HANDED_FAULT, KEPT_CHECKPOINT, CarriedWorker, Checkpoint
from ._rebuilt import with_live_workers
from ._recovery import recover
from ._reload import NO_CARRY_ENV, RELOAD_SIGNALS, Reloader, adopt, reload_reply
from ._resume import Resumer
from ._store_wait import StoreWaiting, WaitStopped

log = get_logger()

#: SUBAGENTD_FAULT's (point, target) that keeps the adopted checkpoint, renamed to
#: KEPT_CHECKPOINT, for a test to read what was carried.
KEEP_CHECKPOINT_FAULT = KEEP_HANDED_FAULT

#: How long what start-up made is kept from the garbage collector: see `_collect_from_now_on`.
START_UP_UNSEEN_SECONDS = 30.0


async def _until_signal(
    signals: AsyncIterator[int], reloader: Reloader, nursery: trio.Nursery, done: trio.CancelScope
) -> None:
    """SIGTERM and SIGINT stop the daemon; SIGHUP reloads it, as `subagentctl reload` does."""
    async for signum in signals:
        if signum == signal.SIGHUP:
            log.info("daemon.reload_signal")
            nursery.start_soon(_reload_quietly, reloader)
            continue
        log.info("daemon.stopping", signal=signal.Signals(signum).name)
        done.cancel()
        return


async def _hurry_on_signal(signals: AsyncIterator[int], daemon: Daemon) -> None:
    """A second SIGTERM or SIGINT while workers stop: no more grace, KILL every tree now.

    Endings are still written (journals, records, wakes) as each tree goes.
    """
    async for signum in signals:
        if signum != signal.SIGHUP:  # a reload is refused while stopping anyway
            log.warning("daemon.hurried", signal=signal.Signals(signum).name)
            daemon.launcher.graces.end_all()
            return


async def _reload_quietly(reloader: Reloader) -> None:
    try:
        reply = await reloader.reload(None, 0)
    except RemoteError as exc:  # busy (rate limit) or refused (shutting down)
        log.warning("reload.refused", error=str(exc))
        return
    if reply is not None:
        log.warning("reload.refused", error=getattr(reply, "message", ""))


async def _until_idle(
    daemon: Daemon, server: Server, seconds: float, done: trio.CancelScope
) -> None:
    """Return once nothing has happened for `seconds` and stopping would cost nothing:
    no connection open, no worker running, no result owed (`Registry.holds_park`)."""
    while True:
        activity = daemon.activity
        if server.connections or daemon.registry.holds_park():
            await activity.wait()
            continue
        with trio.move_on_after(seconds) as quiet:
            await activity.wait()
        if quiet.cancelled_caught:
            log.info("daemon.idle_exit", idle_non_negative=seconds)
            done.cancel()
            return


async def serve(
    settings: Settings,
    handoff_path: Path | None = None,
    handoff: Checkpoint | None = None,
    problems: Sequence[str] = (),
    rebuilt_pipes: dict[int, int] | None = None,
) -> None:
    """Serve with `settings`; `handoff`: the checkpoint a reload's exec handed this image
    (at `handoff_path`, if a file), whose descriptors it adopts; `problems`: what taking
    it over found wrong, for `info`; `rebuilt_pipes`: the pipes of a handoff rebuilt from
    the kernel (`_rebuilt`: its live workers are found once the store is open)."""
    if handoff is not None and rebuilt_pipes is None:
        missing = take_back(handoff)
        if missing:
            log.error("reload.descriptors_missing", descriptors=missing)
    state_dir = StateDir(settings.state_dir)
    state_dir.acquire(
        lock_fd=handoff.lock_fd if handoff is not None and handoff.lock_fd >= 0 else None,
        lock_file_fd=handoff.lock_file_fd if handoff is not None else None,
    )
    try:
        if handoff is not None and handoff.listen_fd >= 0:
            control = ControlSocket.inherited(
                handoff.listen_fd, settings.socket, owned=handoff.listen_owned
            )
        else:
            control = activated_socket(settings.socket) or bind_control_socket(settings.socket)
    except BaseException:
        state_dir.release()
        raise
    cgroups, tree_tracking = _tree_tracking(settings)
    try:
        store = await _open_store(settings, control, handoff)
        daemon = Daemon(
            state_dir,
            socket_path=settings.socket,
            config_path=settings.config,
            finished_ttl=settings.finished_ttl,
            keep_archives_days=settings.keep_archives_days,
            request_key_ttl=settings.request_key_ttl,
            launcher=LocalLauncher(
                cgroups, tree_tracking, _relays(settings), _controllers(settings, cgroups)
            ),
            faults=read_faults(os.environ.get(FAULT_ENV, "")),
            store=store,
            max_running=settings.max_running,
        )
    except BaseException as exc:  # the store cannot be opened (a newer schema, no disk)
        if isinstance(exc, WaitStopped) and handoff is not None:
            await _end_carried(handoff, LocalLauncher(cgroups, tree_tracking))
        control.remove()
        state_dir.release()
        raise
    daemon.store.problems.extend(problems)
    if handoff is not None and rebuilt_pipes is not None:
        handoff = with_live_workers(handoff, daemon.store.held_workers()[0], rebuilt_pipes)
    # An older image's record.json and run files, taken into the store once.
    unread = _import_old_state(daemon)
    adopted: list[Handover] = []
    if handoff is None:
        # A restart serves while it recovers (`_recover_serving`): from here on, until the
        # registry is rebuilt, requests that need it are answered `recovering`.
        daemon.recovering = RecoveryProgress(trio.current_time())
    else:
        carried, stopped = await adopt(daemon, handoff, unread)
        adopted = [
            Handover(
                c.fd,
                [reload_reply(daemon, rid, carried, stopped) for rid in c.request_ids],
                c.unread,
                frozenset(c.delivered),
                caller=c.caller,
            )
            for c in handoff.requesters
        ]
        if handoff_path is not None:  # a file, from an image before version 4
            _remove_checkpoint(handoff_path, keep=KEEP_CHECKPOINT_FAULT in daemon.faults)
        log.info(
            "reload.adopted",
            image_generation=daemon.image_generation,
            carried_live=carried,
            stopped_by_reload=stopped,
        )
        _old_state_rebuilt(daemon, unread)
    server = Server(daemon, Resumer(daemon))
    reloader = Reloader(
        daemon,
        server,
        checkpoint_path=settings.state_dir / "checkpoint",
        control=control,
        settings=settings,
        no_carry=frozenset(filter(None, os.environ.get(NO_CARRY_ENV, "").split(","))),
        # A reload ends when the new image serves: its rate limit counts from here, not
        # from the exec (a busy machine may take longer than the limit to start us).
        last_reload=trio.current_time() if handoff is not None else -math.inf,
    )
    server.reloader = reloader
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(control.sock))
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            # Blocked by the image before us across the exec; ours to take now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOAD_SIGNALS)
            async with trio.open_nursery() as nursery:
                reloader.nursery = nursery
                if daemon.recovering is not None:
                    await nursery.start(server.serve, listener, [])
                    if not await _recover_serving(daemon, signals, unread):
                        nursery.cancel_scope.cancel()  # stopped before it had recovered
                        return
                await nursery.start(daemon.run)
                if daemon.recovering is not None:
                    daemon.recovering = None  # every request is answered from here on
                    daemon.touch()  # and the streams held meanwhile go on
                if handoff is not None:
                    await nursery.start(server.serve, listener, adopted)
                notify("READY=1", f"MAINPID={os.getpid()}", "STATUS=serving")
                daemon.supervisor.serving()
                log.info(
                    "daemon.serving",
                    socket=str(settings.socket),
                    state_dir=str(settings.state_dir),
                    version=package_version(),
                    image_generation=daemon.image_generation,
                )
                _collect_from_now_on(nursery)
                async with trio.open_nursery() as until_stop:
                    until_stop.start_soon(
                        _until_signal, signals, reloader, nursery, until_stop.cancel_scope
                    )
                    if settings.idle_exit is not None:
                        until_stop.start_soon(
                            _until_idle,
                            daemon,
                            server,
                            settings.idle_exit,
                            until_stop.cancel_scope,
                        )
                notify("STOPPING=1", "STATUS=stopping workers")
                # Requests still get answers while workers stop (status, watch);
                # spawns, resumes and reloads are refused from here on.
                daemon.spawner.shutting_down = True
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as stopping:
                        stopping.start_soon(_hurry_on_signal, signals, daemon)
                        await daemon.shutdown()
                        stopping.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
    finally:
        daemon.afterwards.now()  # ended workers' cgroups go before their parent's
        daemon.launcher.close(anything_live=bool(daemon.supervisor))
        control.remove()
        await listener.aclose()
        daemon.store.close()
        state_dir.release()
        log.info("daemon.stopped")


async def _end_carried(handoff: Checkpoint, launcher: LocalLauncher) -> None:
    """Stopped before its store opened: end every worker the handoff carried (TERM, then
    KILL after the default grace: their records, with their own, are not read yet), and
    reap them, as a stop would. Their endings are the next start's to write (each is
    `interrupted` there, its tree gone). A handoff rebuilt from the kernel knows none yet
    (the store names them): those run on, as they would have before it."""

    async def end(worker: CarriedWorker) -> None:
        killed = await launcher.end_leftover_tree(
            worker.id, worker.pid, worker.pid_start, DEFAULT_GRACE
        )
        await reap(worker.pid)
        log.warning("worker.stopped_before_serving", worker=worker.id, processes=killed)

    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            for worker in handoff.live:
                nursery.start_soon(end, worker)


async def _open_store(
    settings: Settings, control: ControlSocket, handoff: Checkpoint | None
) -> Store:
    """The store, waited for while another process holds a lock on it (or, for a
    handoff, while it cannot be opened at all): clients are told so meanwhile."""
    waiting = StoreWaiting(
        settings.state_dir / STORE_NAME,
        handoff.store_lock_fd if handoff is not None else None,
        handoff=handoff is not None,
    )
    store = waiting.try_open()
    if store is not None:
        return store
    server = WaitingServer(
        waiting.told,
        socket_path=str(settings.socket),
        state_dir=str(settings.state_dir),
        image_generation=handoff.image_generation + 1 if handoff is not None else 1,
    )
    return await waiting.open(control.sock, server)


async def _recover_serving(daemon: Daemon, signals: AsyncIterator[int], unread: list[str]) -> bool:
    """Recover (`recover`, then the sweep of leftover cgroups) while the server answers
    what it can (`daemon.recovering` says how far along); False if SIGTERM or SIGINT came
    first: what is not yet taken back stays in the store for the next start, each worker
    whole (its ending is one transaction), and the image stops. A SIGHUP meanwhile is
    refused: there is nothing to reload yet."""
    log.info("recovery.serving", pid=os.getpid())
    notify(f"MAINPID={os.getpid()}", "STATUS=recovering")
    stopped = False
    async with trio.open_nursery() as recovering:

        async def until_stop() -> None:
            nonlocal stopped
            async for signum in signals:
                if signum == signal.SIGHUP:
                    log.warning("reload.refused", error="the daemon is still recovering")
                    continue
                log.warning("daemon.stopping", signal=signal.Signals(signum).name, recovered=False)
                stopped = True
                recovering.cancel_scope.cancel()
                return

        recovering.start_soon(until_stop)
        await recover(daemon, unread=unread)
        assert daemon.recovering is not None
        daemon.recovering.begin("sweeping", 0, trio.current_time())
        await daemon.launcher.sweep(daemon.supervisor)
        _old_state_rebuilt(daemon, unread)
        recovering.cancel_scope.cancel()
    return not stopped


def _old_state_rebuilt(daemon: Daemon, unread: list[str]) -> None:
    """What did not read of an older image's records, rebuilt by recovery into the store:
    not to be looked for again."""
    if unread:
        try:
            mark_old_state_imported(daemon.store)
        except OSError as exc:  # looked for, and rebuilt, again at the next start
            daemon.problems.disk_failed("store (an older state dir)", exc)


def _collect_from_now_on(nursery: trio.Nursery) -> None:
    """Turn garbage collection on (off from the start: see __main__.py), with what start-up
    made (the modules, the adopted registry and tasks: ~170,000 objects at 1,000 workers)
    out of its sight for START_UP_UNSEEN_SECONDS. Else the first collections, just as the
    first clients are served, scanned all of it twice over (gen0 then gen1: ~100 ms each on
    a loaded machine, in-process). Given back after, so a cycle among them is still freed."""
    UNSEEN.hold()
    gc.enable()

    async def give_back() -> None:
        await trio.sleep(START_UP_UNSEEN_SECONDS)
        UNSEEN.let_go()  # unless a stop of many hides them still (`_collector`)

    nursery.start_soon(give_back)


def _remove_checkpoint(path: Path, *, keep: bool) -> None:
    """Adopted: the checkpoint is spent (`keep`: renamed aside, for a test to read)."""
    if keep:
        path.replace(path.with_name(KEPT_CHECKPOINT))
    path.unlink(missing_ok=True)


def _import_old_state(daemon: Daemon) -> list[str]:
    """`import_old_state`; if it cannot be done, the daemon serves on and says why."""
    try:
        return import_old_state(daemon.store, daemon.state_dir.root, daemon.state_dir.archives)
    except OSError as exc:
        problem = (
            f"the records of an earlier version in {daemon.state_dir.root} could not be "
            f"imported ({exc.strerror or exc}): they are imported at the next start"
        )
        log.error("store.old_state_not_imported", problem=problem)
        daemon.store.problems.append(problem)
        return []


def _tree_tracking(settings: Settings) -> tuple[Cgroups | None, str]:
    """Per-worker cgroups where they can be had (and are wanted); else /proc scans, saying why."""
    if settings.cgroups == "off":
        return None, "/proc scan (cgroups turned off: --cgroups off)"
    try:
        cgroups = Cgroups.find(settings.state_dir)
    except CgroupsUnavailable as exc:
        log.warning("daemon.no_cgroups", reason=str(exc), then="finding trees by scanning /proc")
        return None, f"/proc scan ({exc})"
    return cgroups, f"cgroup {cgroups.base}"


def _controllers(settings: Settings, cgroups: Cgroups | None) -> Controllers:
    """Where the kernel can enforce workers' limits; none with --cgroups off."""
    if settings.cgroups == "off":
        return Controllers.off("cgroups are turned off (--cgroups off)")
    controllers = Controllers.find(
        settings.state_dir, v1_root=settings.cgroup_v1_root, cgroups=cgroups
    )
    for kind, control in controllers.controls.items():
        if not control.enforced:
            log.info("daemon.limit_not_enforced", kind=kind, why=control.how)
    return controllers


def _relays(settings: Settings) -> Relays:
    """The output relays, past the threshold the settings give or the limit's default."""
    above = settings.relay_above
    if above is None:
        above = default_relay_above(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return Relays(above)
