"""Carries out a model's lifecycle: applies events (``lifecycle.transition``) and performs the
effects they return, and runs what produces the events of a serving model.

* ``apply`` is the only writer of ``ModelRuntime.state``: it switches the state, publishes
  the model's snapshot (``ModelSet.publish``: what everything outside the core reads) and
  the change's events, and starts the effects' work (start the load task, stop the
  children, replace crashed replicas, cancel a load or download, forget a removed model)
  without awaiting, then wakes everything waiting for a change (``changes``). The work it
  starts reports back through ``apply`` again; a command the lifecycle refuses comes back as
  its ``Refuse``. A fact (``runtime.Fact``) is recorded and published the same way.
* ``forget`` is the one step that removes a model: its record and snapshot, its saved slot
  states and counters (``warm``), the spawner's cache of its command line.
* The executor owns the tasks that carry out effects: each model's load task (``StartLoad``:
  ``load`` in a task that reports ``LoadEnded`` when it ends, before anyone awaiting it
  resumes), its download task (``download``, with the flag its worker thread reads), stop and
  replacement tasks. It is the one writer of ``ModelRuntime``'s task fields and its preset;
  everything else about a run (failure, backoff clock, download progress, killed replicas)
  is in the state, written by ``transition``.
* Every serving child has an exit watcher: a child that exits while its model is loaded
  (not asked to stop) is a crash, ``ReplicaExited``; the last replica's crash unloads the
  model, an earlier one is replaced one child at a time under the crash backoff.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from .. import clock, otel
from ..changes import Changes
from ..children.backend import Backend
from ..children.process import ChildError, ChildExited
from ..config.presets import ModelPreset
from ..config.settings import Settings
from ..errors import LoadFailed, ModelUnloaded
from ..events import EventBus
from ..serving.load import Replica, Served, book_of, new_replica
from ..warm.choice import PREFIX_KEYS
from ..warm.swaps import SlotHolder, WarmSwaps
from .admission import Admission
from .lifecycle import (
    DRAINED,
    SHUTDOWN,
    UNLOADED,
    CancelDownload,
    CancelLoad,
    CancelReplacement,
    ChildGone,
    Effect,
    Event,
    Failure,
    FailureCounted,
    Forget,
    Forgotten,
    Idle,
    KillReplica,
    LoadEnded,
    Publish,
    Refuse,
    ReplaceReplicas,
    ReplicaExited,
    ReplicaFailed,
    ReplicaStarted,
    ReplicaUnresponsive,
    StartLoad,
    Status,
    Stop,
    StopChildren,
    Stopped,
    Unload,
    transition,
)
from .modelset import ModelSet
from .runtime import (
    FACTS,
    Estimated,
    Fact,
    KeptAlive,
    LoadTimed,
    ModelRuntime,
    QueueJoined,
    QueueLeft,
    Unestimated,
    WaitBegan,
    WaitEnded,
)
from .spawner import Spawner, SpawnReports

log = logging.getLogger("router.supervisor")

FAILURE_LOG_LINES = 20
BACKOFF_CAP_S = 30.0



# The stops whose model comes back as it was: its slots are saved first (warm swaps). The
# router's own shutdown too: a restarted router resumes its conversations warm.
WARM_STOPS = frozenset({DRAINED, UNLOADED, "idle", SHUTDOWN})


def backoff_s(failures_in_row: int) -> float:
    """Delay before the next start after ``failures_in_row`` consecutive failures: 0, 1, 2, 4…"""
    return 0.0 if failures_in_row <= 1 else min(2.0 ** (failures_in_row - 2), BACKOFF_CAP_S)


class Loads(Protocol):
    """What runs a model's load and its download (``loader.Loader``), each as the task the
    executor starts for it, reporting back through ``Executor.apply``."""

    admission: Admission

    async def load(self, runtime: ModelRuntime) -> None: ...

    async def fetch_files(self, runtime: ModelRuntime, cancel: threading.Event) -> None: ...

    def span_of(self, model_id: str) -> object | None: ...


class Executor:
    def __init__(self, settings: Settings, spawner: Spawner, events: EventBus, changes: Changes,
                 model_set: ModelSet, *, loading: Callable[[Executor], Loads],
                 warm: WarmSwaps | None = None) -> None:
        """``loading`` makes what runs loads and downloads (``loader.Loader``, with its
        admission) for this executor, which starts those tasks and hears their events."""
        self.settings = settings
        self._warm = warm  # saves the slots before a stop that keeps them (``warm``)
        self._spawner = spawner
        self._events = events
        self._changes = changes
        # Publishes each model's snapshot after a change; drops a removed model's record.
        self._model_set = model_set
        # Cancelled tasks still stopping what they started (a replacement child).
        self._ending: set[asyncio.Task[Any]] = set()
        self.loads = loading(self)  # made last: it may call back into this executor

    # ----------------------------------------------------------------- events in

    def idle(self, model: Served) -> None:
        """The leases' word that the model's last request in flight ended: its ``Idle``; and
        the unload a request's ``keep_alive: 0`` asked for once it is idle (``KeptAlive``)."""
        assert isinstance(model, ModelRuntime)  # the leases are handed records only
        self.apply(model, Idle())
        if model.keep_alive == 0 and model.waiting == 0 and model.status is Status.LOADED:
            log.info("idle; unloading as a request's keep_alive 0 asked",
                     extra={"event": "keep_alive_unload", "model": model.id})
            self.command(model, Unload(explicit=False))

    def apply(self, runtime: ModelRuntime, event: Event | Fact) -> None:
        """Move the model through ``event`` and start its effects (an event that cannot happen
        now raises InvalidTransition); or record a ``runtime.Fact``."""
        if isinstance(event, FACTS):
            note(runtime, event)
            self._model_set.publish(runtime)
        else:
            self.command(runtime, event)

    def command(self, runtime: ModelRuntime, event: Event) -> Refuse | None:
        """``apply`` for a command (``LoadWanted``, ``Unload``): its ``Refuse`` if the
        lifecycle refuses it now (then nothing changed)."""
        # A remote upstream never enters a crash loop: its failures are another machine's
        # outages, retried under the backoff, not a configuration to fix.
        limit = self.settings.crash_loop_limit if runtime.preset.upstream is None \
            else sys.maxsize
        before = runtime.state
        runtime.state, effects = transition(runtime.id, before, event, crash_loop_limit=limit)
        if runtime.state is not before:  # a change (the last request's Idle is mostly none)
            self._model_set.publish(runtime)  # before its effects: their events read it
        refused = None
        for effect in effects:
            if isinstance(effect, Refuse):
                refused = effect
            else:
                self._perform(runtime, effect)
        self._changes.notify()
        return refused

    def stop(self, runtime: ModelRuntime, reason: str) -> asyncio.Task[None] | None:
        """Stop a loaded model now (marked stopping in this loop step, so planners see it);
        the task that stops it, or None when it was not loaded."""
        if runtime.status is Status.LOADED:
            self.apply(runtime, Stop(reason))
        return runtime.stop_task

    def forget(self, runtime: ModelRuntime) -> None:
        """Drop a removed model once nothing of it runs (``Forget``; a model removed while
        not running): its record and snapshot here, and everything the other parts keep of
        it (its saved states and counters, its cached command line, its conversations, its
        slot queue) on the one signal its ``Forgotten`` publishes (``events.MODEL_REMOVED``,
        ``EventBus.on_removed``); a model added again under its id starts from nothing."""
        if self._model_set.drop(runtime):
            self.apply(runtime, Forgotten())

    def set_preset(self, runtime: ModelRuntime, preset: ModelPreset) -> None:
        """The model's preset from now on (a reconfiguration; a download that resolved its
        files). One that turns warm swaps off removes the model's saved states at once, also
        those a stop under way is writing."""
        runtime.preset = preset
        self._model_set.publish(runtime)
        if self._warm is not None and not preset.warm_swaps:
            self._warm.fingerprint_of(preset)

    def start_download(self, runtime: ModelRuntime) -> asyncio.Task[None]:
        """The model's download task, started unless one runs (shared by the load and by
        ``POST /models``)."""
        if runtime.download_task is None or runtime.download_task.done():
            runtime.download_cancel = cancel = threading.Event()
            runtime.download_task = _task(self.loads.fetch_files(runtime, cancel),
                                          f"download:{runtime.id}")
        return runtime.download_task

    def cancel_download(self, runtime: ModelRuntime) -> asyncio.Task[None] | None:
        """Stop the model's download (an unload, a reconfiguration, the shutdown): the worker
        thread sees the flag, the task its cancellation. The task, if one runs."""
        task = runtime.download_task
        if task is None or task.done():
            return None
        runtime.download_cancel.set()
        task.cancel()
        return task

    async def settle(self) -> None:
        """Until every cancelled task has stopped the children it started (the shutdown
        waits for this: no child may outlive the router's own stop), and the slot states
        their stops wrote are kept."""
        while self._ending:
            await asyncio.gather(*self._ending, return_exceptions=True)
        if self._warm is not None:  # the slot states the stops wrote are kept
            await self._warm.settle()

    def backoff_left(self, runtime: ModelRuntime) -> float:
        """Seconds until the model may start a child again after its recent failures."""
        failure = runtime.state.failure
        since = failure.clock_at if failure is not None else 0.0
        return since + backoff_s(runtime.state.failures_in_row) - clock.now()

    # ----------------------------------------------------------------- effects out

    def _perform(self, runtime: ModelRuntime, effect: Effect) -> None:
        match effect:
            case Publish(kind, data):
                self._events.publish(runtime.id, kind, dict(data) or None)
            case KillReplica(replica, why):
                self._kill_replica(runtime, replica, why)
            case StopChildren(reason, replicas):
                note(runtime, KeptAlive(None))  # a request's keep_alive lasts for one load
                runtime.stop_task = _task(self._stop_children(runtime, reason, replicas),
                                          f"stop:{runtime.id}")
            case CancelReplacement():
                task = runtime.replace_task
                if task is not None:
                    task.cancel()  # stops a replacement child still starting
                    runtime.replace_task = None
                    if not task.done():  # its child is being stopped: ``settle`` waits
                        self._ending.add(task)
                        task.add_done_callback(self._ending.discard)
            case ReplaceReplicas():
                if runtime.replace_task is None or runtime.replace_task.done():
                    runtime.replace_task = _task(self._replace_replicas(runtime),
                                                 f"replace:{runtime.id}")
            case CancelLoad(reason):
                task = runtime.load_task
                if task is not None and not task.done():
                    log.info("load cancelled: %s", reason, extra={"model": runtime.id})
                    task.cancel(reason)  # its waiters learn why (``Loader.load``, ``acquire``)
            case CancelDownload():
                self.cancel_download(runtime)
            case StartLoad():
                task = _task(self.loads.load(runtime), f"load:{runtime.id}")
                runtime.load_task = task
                # Also when cancelled before it ran a step (its body then never runs).
                task.add_done_callback(lambda _: self.apply(runtime, LoadEnded()))
            case Forget():
                self.forget(runtime)
            case FailureCounted(crash_loop):
                if crash_loop:
                    log.error("failed %d times in a row; not restarting until POST /models/load",
                              runtime.state.failures_in_row,
                              extra={"event": "crash_loop", "model": runtime.id})

    async def _stop_children(self, runtime: ModelRuntime, reason: str,
                             replicas: tuple[Replica, ...]) -> None:
        """Stop every replica. An unload ends the requests in flight first, each with the
        unload's 503 (``proxy.relay``): the router's connections to the child close, so the
        child stops generating and exits at once instead of after its stop timeout."""
        timeout = runtime.preset.stop_timeout
        seconds = self.settings.stop_timeout if timeout is None else timeout
        if reason == UNLOADED:
            ended = ModelUnloaded(runtime.id)
            for replica in replicas:
                if replica.in_flight:
                    replica.child.connections.abort_all(ended)
        warm = self._warm if reason in WARM_STOPS else None
        if warm is not None:  # bounded; the files are checked and kept while they stop
            held = [SlotHolder(r.child, tuple(r.prefixes.recent(PREFIX_KEYS))
                               if runtime.preset.prefix_routing else (), r.book)
                    for r in replicas]
            with otel.span("warm save", attributes={"llama_router.model": runtime.id}) as span:
                written = await warm.write(runtime.preset, held)
                if span is not None:
                    span.set_attribute("llama_router.warm.states", len(written))
            warm.keep_soon(runtime.preset, written)
        codes = await asyncio.gather(*(r.child.stop(seconds) for r in replicas))
        runtime.stop_task = None
        self.apply(runtime, Stopped(clean=all(code == 0 for code in codes)))

    # ----------------------------------------------------------------- crashes

    def watch_exit(self, runtime: ModelRuntime, replica: Replica) -> None:
        """Turn the exit of a serving replica that nobody asked to stop into ReplicaExited."""
        _task(self._watch_exit(runtime, replica), f"exit:{runtime.id}")

    async def _watch_exit(self, runtime: ModelRuntime, replica: Replica) -> None:
        code = await replica.child.wait_exit()
        killed = next((why for r, why in runtime.state.killed if r is replica), None)
        if ((replica not in runtime.replicas and killed is None)
                or runtime.status is not Status.LOADED):
            return  # an intended stop; _stop_children records it
        message = killed or f"llama-server exited unexpectedly with code {code}"
        failure = Failure(message, code, tuple(runtime.logs.tail(FAILURE_LOG_LINES)),
                          clock.now())
        log.error("%s", message, extra={"event": "crashed", "model": runtime.id,
                                        "pid": replica.child.pid, "exit_code": code})
        ran_for = clock.now() - (replica.child.started_at or clock.now())
        self.apply(runtime, ReplicaExited(replica, code, ran_for, failure))  # out of service
        if replica.in_flight == 0:  # else the last request to finish closes it
            self.close_pool_later(replica)
        await replica.child.stop(0)  # reap the group

    async def _replace_replicas(self, runtime: ModelRuntime) -> None:
        """Start one child after the backoff to bring a serving model back towards its replica
        count; a failure or the next crash asks for another (``lifecycle``). Cancelled when
        the model stops."""
        delay = self.backoff_left(runtime)
        if delay > 0:  # nothing shortens a backoff; a stop cancels this task
            await asyncio.sleep(delay)
        if (runtime.crash_loop or not runtime.serving
                or len(runtime.replicas) >= runtime.preset.replicas):
            return
        timeout = runtime.preset.load_timeout or self.settings.load_timeout
        children: list[Backend] = []  # its cores count as held while it starts (``starting``)
        [share] = self._spawner.cpu_shares(runtime, 1)
        try:
            await self._spawner.spawn_ready(runtime, children, timeout, clock.now(), share,
                                            SpawnReports(self.apply))
        except BaseException as exc:
            # Cancelled meanwhile (the model is stopping): the cancel goes on after the stop.
            await to_the_end(self.stop_started(runtime, children))
            if not isinstance(exc, Exception):  # cancelled: the model is stopping
                raise
            failure = failure_from(exc)
            log.error("replica restart failed: %s", failure.message,
                      extra={"event": "replica_failed", "model": runtime.id})
            runtime.replace_task = None
            self.apply(runtime, ReplicaFailed(failure))
            return
        replica = new_replica(children[-1], book=book_of(runtime.preset, self._warm))
        log.info("replica restarted", extra={
            "event": "replica_restarted", "model": runtime.id, "pid": replica.child.pid,
            "port": replica.child.port})
        runtime.replace_task = None
        self.apply(runtime, ReplicaStarted(replica))
        self.watch_exit(runtime, replica)
        if len(runtime.replicas) < runtime.preset.replicas:
            self._perform(runtime, ReplaceReplicas())

    async def stop_started(self, runtime: ModelRuntime, children: list[Backend]) -> None:
        """Stop children a failed or cancelled start left, each then ``ChildGone``."""
        await asyncio.gather(*(c.stop(0) for c in children))
        for child in children:
            self.apply(runtime, ChildGone(child))
        children.clear()

    def kill_unresponsive(self, runtime: ModelRuntime, child: Backend, why: str) -> None:
        """A serving child stopped answering (``liveness``): ``ReplicaUnresponsive`` takes it
        out of service at once and kills it (``KillReplica``); its exit watcher then handles
        it as a crash, with ``why`` as the failure."""
        replica = next((r for r in runtime.replicas if r.child is child), None)
        if replica is not None:
            self.apply(runtime, ReplicaUnresponsive(replica, why))

    def _kill_replica(self, runtime: ModelRuntime, replica: Replica, why: str) -> None:
        """Kill an unresponsive replica; the state keeps ``why`` (``killed``), which its exit
        watcher reports the crash with."""
        log.error("%s", why, extra={"event": "unresponsive", "model": runtime.id,
                                    "pid": replica.child.pid})
        replica.child.kill_now()

    def close_pool_later(self, replica: Replica) -> None:
        _task(replica.child.close_pool(), "close-pool")


def failure_from(exc: BaseException) -> Failure:
    """What a failed start is counted as, now (``clock``)."""
    now = clock.now()
    if isinstance(exc, ChildExited):
        return Failure(str(exc), exc.exit_code, tuple(exc.last_lines), now)
    if isinstance(exc, ChildError):
        return Failure(str(exc), None, tuple(exc.last_lines), now)
    if isinstance(exc, LoadFailed):
        return Failure(exc.message, None, (), now)
    return Failure(f"could not start llama-server: {exc}", None, (), now)


async def to_the_end(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` (stopping children a start left) to its end even if the caller is
    cancelled meanwhile, then let that cancellation through: a second cancel must not skip
    the rest of the caller's cleanup (the lifecycle event after it) nor leave a child behind."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


def _task(coro: Any, name: str) -> asyncio.Task[Any]:
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(consume_exception)
    return task


def consume_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def note(runtime: ModelRuntime, fact: Fact) -> None:
    """Record ``fact`` in the model's record: the owner's one way to change what its
    lifecycle does not."""
    match fact:
        case Estimated():
            runtime.estimate, runtime.n_layer = fact.estimate, fact.n_layer
            runtime.estimate_devices = dict(fact.devices)
            runtime.cache_ram_mib = fact.cache_ram_mib
            runtime.estimated, runtime.estimate_due = not fact.again, fact.again
        case Unestimated():
            runtime.estimate, runtime.estimate_devices = 0, {}
            runtime.cache_ram_mib = runtime.n_layer = None
            runtime.estimated = runtime.estimate_due = False
        case QueueJoined(at):
            runtime.queued_since = at
        case QueueLeft():
            runtime.queued_since = None
        case LoadTimed(seconds):
            runtime.last_load_s = seconds
        case WaitBegan():
            runtime.waiting += 1
        case WaitEnded():
            runtime.waiting -= 1
        case KeptAlive(seconds):
            runtime.keep_alive = seconds
