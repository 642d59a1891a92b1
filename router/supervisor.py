"""Carries out model lifecycles: load on demand, admit, evict, drain, stop, notice crashes.

Concurrency model (one asyncio loop, no threads):

* Only this module changes a model's ``status``; every change publishes one event and wakes
  everything waiting for a change (``changes``).
* ``acquire`` is the hot path: for a serving model it picks a replica and bumps ``in_flight``
  without awaiting anything, so no eviction can slip in between "is loaded" and "is in use".
* Each model has at most one load task; every request for that model awaits it (shielded, so
  a waiter that gives up never cancels a load others share). A load waits for the model's old
  child to be gone, sits out the crash backoff, then queues for admission.
* Admission is FIFO across models (``admission``): only the head of the queue asks the planner
  (``scheduler.plan_admission``) for room, stops the idle victims and drains the busy ones it
  names, and waits for changes until admitted. Admission and the switch to ``loading`` happen
  in the same loop step, so two loads cannot both take the last slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx

from . import reconfig
from .accounting import Accounting
from .admission import Admission
from .changes import Changes
from .cpugate import CpuGate
from .cpus import (
    machine_cores,
)
from .downloads import DownloadCancelled, HfRef, download, resolve_remote
from .errors import LoadFailed, ModelNotFound, ModelNotLoaded, QueueFull, WaitBudgetExceeded
from .events import EventBus
from .flags import FlagTable
from .gpus import GpuDevice
from .leases import Lease, Leases
from .lifecycle import Event, transition
from .logs import LogRing
from .presets import ModelPreset
from .process import (
    ChildError,
    ChildExited,
    ChildProcess,
)
from .runtime import Failure, ModelRuntime, Replica
from .scheduler import Status
from .settings import Settings
from .sources import Catalogue
from .spawner import Spawner

log = logging.getLogger("router.supervisor")

PORT_RETRIES = 3
FAILURE_LOG_LINES = 20
STABLE_RUN_S = 60.0  # a child that ran this long before crashing resets the crash count
BACKOFF_CAP_S = 30.0
REAPER_INTERVAL_S = 1.0
DOWNLOAD_EVENT_INTERVAL_S = 0.25


def backoff_s(failures_in_row: int) -> float:
    """Delay before the next load after ``failures_in_row`` consecutive failures: 0, 1, 2, 4…"""
    return 0.0 if failures_in_row <= 1 else min(2.0 ** (failures_in_row - 2), BACKOFF_CAP_S)


class Supervisor:
    def __init__(self, settings: Settings, catalogue: Catalogue, table: FlagTable,
                 binary: Path, client: httpx.AsyncClient, events: EventBus, *,
                 gpus: list[GpuDevice] | None = None,
                 gpu_budgets: dict[str, int] | None = None,
                 cores: list[int] | None = None) -> None:
        self.settings = settings
        # Cores shared among CPU children (``cpus``); empty when CPU sharing is off.
        self.cores = (cores if cores is not None else machine_cores()) \
            if settings.cpu_sharing else []
        self.cpu_gate = CpuGate(self._cpu_turn_members)
        self.gpus = list(gpus or [])
        self.accounting = Accounting(self.gpus)
        self.catalogue = catalogue
        self.events = events
        self.models: dict[str, ModelRuntime] = {
            mid: ModelRuntime(preset, LogRing(settings.log_lines))
            for mid, preset in catalogue.models.items()}
        self.changes = Changes()
        self._reaper: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._last_failure_at: dict[str, float] = {}
        self.spawner = Spawner(binary, table, client, events, router_port=settings.port,
                               cores=self.cores, gpus=self.gpus, models=self.models.values)
        self.admission = Admission(
            settings, self.accounting, events, self.changes,
            memory_budget=settings.memory_budget_bytes(), gpu_budgets=dict(gpu_budgets or {}),
            models=self.models.values,
            evict=self._evict, drain=self._drain_for)
        self.leases = Leases(on_busy=self._on_busy, on_idle=self._on_idle,
                             on_replica_done=self._close_pool_later)

    # ----------------------------------------------------------------- lookups

    def resolve(self, name: str) -> ModelRuntime:
        model_id = self.catalogue.resolve(name)
        if model_id is None:
            raise ModelNotFound(name, self.catalogue.close_matches(name))
        return self.models[model_id]

    def _cpu_turn_members(self) -> dict[str, list[ChildProcess]]:
        """Models that compute on shared cores and have requests in flight: their children
        with more than one thread (``cpugate``)."""
        members: dict[str, list[ChildProcess]] = {}
        for model in self.models.values():
            if model.in_flight and model.status is Status.LOADED:
                wide = [r.child for r in model.replicas if r.child.cpu and r.child.cpu.wide]
                if wide:
                    members[model.id] = wide
        return members

    @property
    def total_waiting(self) -> int:
        return sum(r.waiting for r in self.models.values())

    async def acquire(self, name: str, *, autoload: bool = True,
                      budget: float | None = None) -> Lease:
        """Wait until the model serves (loading it if allowed) and hold a replica for one
        request. Raises ModelNotLoaded, QueueFull, LoadFailed or WaitBudgetExceeded."""
        runtime = self.resolve(name)
        if runtime.serving:
            return self.leases.take(runtime)
        if not autoload and runtime.status is Status.UNLOADED:
            raise ModelNotLoaded(runtime.id)
        if self.total_waiting >= self.settings.max_queue:
            raise QueueFull(f"{self.total_waiting} requests are already waiting for models "
                            f"(limit {self.settings.max_queue}); try again later",
                            headers={"Retry-After": "1"})
        seconds = min(budget, self._budget_of(runtime)) if budget else self._budget_of(runtime)
        deadline = time.monotonic() + seconds
        unloads = runtime.unloads
        runtime.waiting += 1
        try:
            while not runtime.serving:
                if runtime.removed:
                    raise ModelNotFound(runtime.id, [])
                task = self._ensure_load_task(runtime, on_demand=True)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._budget_exceeded(runtime, seconds)
                try:
                    await asyncio.wait_for(asyncio.shield(task), remaining)
                except TimeoutError:
                    raise self._budget_exceeded(runtime, seconds) from None
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if not task.cancelled() or (current is not None and current.cancelling()):
                        raise  # this request itself was cancelled (its client went away)
                    # The load was cancelled by someone else: an unload ends the wait; a
                    # reconfiguration starts it over with the new configuration.
                    if runtime.unloads != unloads:
                        raise LoadFailed(f"model '{runtime.id}' was unloaded while this "
                                         "request waited for it") from None
            return self.leases.take(runtime)
        finally:
            runtime.waiting -= 1
            if runtime.waiting == 0:
                self._cancel_unwanted_load(runtime)

    def lease_child(self, model: str, child: ChildProcess) -> Lease | None:
        """A lease on the very replica running ``child`` while its model serves (resuming a
        stream that child keeps); None when it no longer does. Never loads anything."""
        runtime = self.models.get(model)
        if runtime is None or not runtime.serving:
            return None
        replica = next((r for r in runtime.replicas if r.child is child), None)
        return None if replica is None else self.leases.take(runtime, replica)

    def _on_busy(self, runtime: ModelRuntime) -> None:
        self.cpu_gate.notify()

    def _on_idle(self, runtime: ModelRuntime) -> None:
        self.cpu_gate.notify()
        if runtime.stop_when_idle is not None:
            self._begin_stop(runtime, runtime.stop_when_idle)
        self.changes.notify()

    def _budget_of(self, runtime: ModelRuntime) -> float:
        return runtime.preset.wait_budget or self.settings.wait_budget

    def _budget_exceeded(self, runtime: ModelRuntime, seconds: float) -> WaitBudgetExceeded:
        position = self.admission.position(runtime)
        where = f", queue position {position}" if position is not None else ""
        return WaitBudgetExceeded(
            f"model '{runtime.id}' was not ready within the wait budget of {seconds:g} s "
            f"(status: {runtime.status.value}{where})", headers={"Retry-After": "5"})

    def _cancel_unwanted_load(self, runtime: ModelRuntime) -> None:
        """A load started by requests that nobody waits for any more, and that has not
        spawned anything yet, is cancelled (it would only evict someone for nothing)."""
        task = runtime.load_task
        if (task is not None and not task.done() and runtime.load_on_demand
                and runtime.status is Status.UNLOADED):
            log.info("load cancelled: no request waits for it", extra={"model": runtime.id})
            task.cancel()

    # ----------------------------------------------------------------- loading

    def _ensure_load_task(self, runtime: ModelRuntime, *, on_demand: bool) -> asyncio.Task[None]:
        if runtime.load_task is None or runtime.load_task.done():
            if runtime.crash_loop:
                failure = runtime.failure
                last = f" (last: {failure.message})" if failure else ""
                raise LoadFailed(
                    f"model '{runtime.id}' failed {runtime.failures_in_row} times in a row"
                    f"{last}; not restarting it. Fix the cause, then POST /models/load.")
            if runtime.preset.model_path is None and runtime.preset.hf_repo is None:
                raise LoadFailed(f"model '{runtime.id}' has no model file")
            runtime.load_on_demand = on_demand
            runtime.load_task = asyncio.create_task(self._load(runtime),
                                                    name=f"load:{runtime.id}")
            runtime.load_task.add_done_callback(_consume_exception)
        elif not on_demand:
            runtime.load_on_demand = False
        return runtime.load_task

    async def load(self, name: str) -> ModelRuntime:
        """Start loading a model and return at once (``POST /models/load``). An explicit
        load also clears a crash loop."""
        runtime = self.resolve(name)
        runtime.crash_loop = False
        runtime.failures_in_row = 0
        self._ensure_load_task(runtime, on_demand=False)
        return runtime

    async def _load(self, runtime: ModelRuntime) -> None:
        if runtime.preset.model_path is None:  # an hf-repo model not in the cache yet
            await asyncio.shield(self.start_download(runtime))
        while runtime.status is not Status.UNLOADED:  # an old child is draining or stopping
            await self.changes.wait()
        delay = (self._last_failure_at.get(runtime.id, 0.0) + backoff_s(runtime.failures_in_row)
                 - time.monotonic())
        if delay > 0:
            log.info("waiting %.1f s before restarting after %d failures", delay,
                     runtime.failures_in_row, extra={"model": runtime.id})
            await asyncio.sleep(delay)
        await self.admission.admit(runtime)
        self._set_status(runtime, Event.ADMITTED)
        started = time.monotonic()
        preset = runtime.preset
        timeout = preset.load_timeout or self.settings.load_timeout
        children: list[ChildProcess] = []
        runtime.spawning = children
        try:
            results = await asyncio.gather(
                *(self.spawner.spawn_ready(runtime, children, timeout, started, share)
                  for share in self.spawner.cpu_shares(runtime, preset.replicas)),
                return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException as exc:
            runtime.spawning = []
            await asyncio.shield(asyncio.gather(*(c.stop(0) for c in children)))
            if isinstance(exc, asyncio.CancelledError):
                runtime.failed = False
                self._set_status(runtime, Event.LOAD_FAILED, reason="cancelled")
                raise
            failure = _failure_from(exc)
            self._record_failure(runtime, failure, crashed_after=None)
            self._set_status(runtime, Event.LOAD_FAILED)
            log.error("load failed: %s", failure.message,
                      extra={"event": "load_failed", "model": runtime.id})
            raise LoadFailed(_load_failed_message(runtime.id, failure)) from exc
        runtime.spawning = []
        runtime.replicas = [Replica(child) for child in children]
        runtime.info = await self.spawner.model_info(children[0])
        runtime.loaded_at = runtime.last_used = time.monotonic()
        duration = round(runtime.loaded_at - started, 4)
        runtime.last_load_s = duration
        info = {**runtime.info, "id": runtime.id} if runtime.info else None
        self._set_status(runtime, Event.READY, duration=duration,
                         **({"info": info} if info else {}))
        log.info("loaded", extra={"event": "loaded", "model": runtime.id,
                                  "pid": children[0].pid, "port": children[0].port,
                                  "duration": duration})
        for replica in runtime.replicas:
            self._start_exit_watch(runtime, replica)

    def _evict(self, model_id: str) -> None:
        self._begin_stop(self.models[model_id], "evicted")

    def _drain_for(self, model_id: str, waiting_for: str) -> None:
        self._drain(self.models[model_id], waiting_for)

    def _drain(self, runtime: ModelRuntime, waiting_for: str) -> None:
        if runtime.draining:
            return
        runtime.draining = True
        log.info("draining to make room for %s", waiting_for,
                 extra={"event": "drain", "model": runtime.id})
        self.events.publish(runtime.id, "status_change",
                            {"status": runtime.status.public, "draining": True})
        self.changes.notify()

    # ----------------------------------------------------------------- downloading

    def start_download(self, runtime: ModelRuntime) -> asyncio.Task[None]:
        """Download an hf-repo model into the HF cache (one task per model, shared)."""
        if runtime.download_task is None or runtime.download_task.done():
            runtime.download_cancel = threading.Event()
            runtime.download_task = asyncio.create_task(self._download(runtime),
                                                        name=f"download:{runtime.id}")
            runtime.download_task.add_done_callback(_consume_exception)
        return runtime.download_task

    async def _download(self, runtime: ModelRuntime) -> None:
        preset = runtime.preset
        assert preset.hf_repo is not None
        loop = asyncio.get_running_loop()
        last_event = 0.0

        def on_progress(name: str, done: int, total: int | None) -> None:  # event loop
            nonlocal last_event
            runtime.download[name] = {"done": done, "total": total}
            now = time.monotonic()
            if now - last_event >= DOWNLOAD_EVENT_INTERVAL_S or done == total:
                last_event = now
                self.events.publish(runtime.id, "download_progress",
                                    {"progress": dict(runtime.download)})

        def progress(name: str, done: int, total: int | None) -> None:  # worker thread
            loop.call_soon_threadsafe(on_progress, name, done, total)

        runtime.download = {}
        self._set_status(runtime, Event.DOWNLOAD)
        log.info("downloading %s", preset.hf_repo, extra={"event": "download",
                                                          "model": runtime.id})
        try:
            ref = HfRef.parse(preset.hf_repo)
            resolution = await asyncio.to_thread(resolve_remote, ref, preset.args.get("hf-file"))
            paths = await asyncio.to_thread(download, resolution, progress,
                                            runtime.download_cancel.is_set)
        except asyncio.CancelledError:
            runtime.download_cancel.set()
            self.events.publish(runtime.id, "download_failed", {"error": "cancelled"})
            self._set_status(runtime, Event.DOWNLOAD_FAILED, reason="cancelled")
            raise
        except Exception as exc:
            message = f"download of {preset.hf_repo} failed: {exc}"
            log.error("%s", message, extra={"event": "download_failed", "model": runtime.id})
            self.events.publish(runtime.id, "download_failed", {"error": str(exc)})
            if not isinstance(exc, DownloadCancelled):
                self._record_failure(runtime, Failure(message, None, []), crashed_after=None)
            self._set_status(runtime, Event.DOWNLOAD_FAILED)
            raise LoadFailed(f"model '{runtime.id}': {message}") from exc
        args = {**preset.args, "model": str(paths[0])}
        if resolution.mmproj is not None:
            args["mmproj"] = str(paths[-1])
        runtime.preset = replace(preset, args=MappingProxyType(args))
        self.accounting.forget(runtime.id)
        log.info("downloaded %s", resolution.id, extra={"event": "downloaded",
                                                       "model": runtime.id})
        self.events.publish(runtime.id, "download_finished")
        self._set_status(runtime, Event.DOWNLOADED)

    def add_model(self, preset: ModelPreset) -> ModelRuntime:
        """Add a model at run time (``POST /models``)."""
        models = {**self.catalogue.models, preset.id: preset}
        self.catalogue = Catalogue(models, self.catalogue.aliases, self.catalogue.warnings)
        runtime = ModelRuntime(preset, LogRing(self.settings.log_lines))
        self.models[preset.id] = runtime
        self.events.publish(preset.id, "model_status", {"status": runtime.status.public})
        return runtime

    def remove_model(self, runtime: ModelRuntime) -> None:
        """Forget a model that is not running (``DELETE /models``)."""
        models = {k: v for k, v in self.catalogue.models.items() if k != runtime.id}
        self.catalogue = Catalogue(models, self.catalogue.aliases, self.catalogue.warnings)
        self._forget(runtime)

    # ----------------------------------------------------------------- stopping

    async def unload(self, name: str) -> ModelRuntime:
        runtime = self.resolve(name)
        runtime.unloads += 1  # requests waiting for its load end (``acquire``)
        download = runtime.download_task
        if download is not None and not download.done():
            runtime.download_cancel.set()
            download.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await download
        task = runtime.load_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if runtime.status is Status.LOADED:
            await self._stop(runtime, "unloaded")
        elif runtime.stop_task is not None:
            await asyncio.shield(runtime.stop_task)
        return runtime

    def _begin_stop(self, runtime: ModelRuntime, reason: str) -> asyncio.Task[None] | None:
        """Mark a loaded model stopping now (so planners see it) and stop it in a task."""
        if runtime.status is not Status.LOADED or not runtime.replicas:
            return None
        if runtime.replace_task is not None:
            runtime.replace_task.cancel()  # stops a replacement child still starting
            runtime.replace_task = None
        self._set_status(runtime, Event.STOP, reason=reason)
        runtime.stop_task = asyncio.create_task(self._finish_stop(runtime),
                                                name=f"stop:{runtime.id}")
        runtime.stop_task.add_done_callback(_consume_exception)
        return runtime.stop_task

    async def _stop(self, runtime: ModelRuntime, reason: str) -> None:
        task = self._begin_stop(runtime, reason)
        if task is not None:
            await task

    async def _finish_stop(self, runtime: ModelRuntime) -> None:
        timeout = runtime.preset.stop_timeout
        seconds = self.settings.stop_timeout if timeout is None else timeout
        replicas, runtime.replicas = runtime.replicas, []
        codes = await asyncio.gather(*(r.child.stop(seconds) for r in replicas))
        runtime.info = None
        runtime.loaded_at = None
        runtime.draining = False
        runtime.stop_when_idle = None
        runtime.stop_task = None
        # llama.cpp's router reports the exit code of a stop (0: the child exited as asked);
        # a child that had to be killed is not a failure of the model, so no code then.
        clean = all(code == 0 for code in codes)
        self._set_status(runtime, Event.STOPPED, **({"exit_code": 0} if clean else {}))
        if runtime.removed:
            self._forget(runtime)
        elif runtime.restart_after_stop:
            runtime.restart_after_stop = False
            with contextlib.suppress(LoadFailed):
                self._ensure_load_task(runtime, on_demand=False)

    async def _watch_exit(self, runtime: ModelRuntime, replica: Replica) -> None:
        code = await replica.child.wait_exit()
        if replica not in runtime.replicas or runtime.status is not Status.LOADED:
            return  # an intended stop; _finish_stop records it
        runtime.replicas.remove(replica)
        failure = Failure(f"llama-server exited unexpectedly with code {code}", code,
                          runtime.logs.tail(FAILURE_LOG_LINES))
        ran_for = time.monotonic() - (replica.child.started_at or time.monotonic())
        self._record_failure(runtime, failure, crashed_after=ran_for)
        log.error("child exited unexpectedly with code %s", code,
                  extra={"event": "crashed", "model": runtime.id, "pid": replica.child.pid,
                         "exit_code": code})
        await replica.child.stop(0)  # reap the group
        if replica.in_flight == 0:  # else the last request to finish closes it
            self._close_pool_later(replica)
        if not runtime.replicas:
            runtime.info = None
            runtime.loaded_at = None
            runtime.draining = False
            self._set_status(runtime, Event.LAST_REPLICA_EXITED)
        elif runtime.replace_task is None or runtime.replace_task.done():
            runtime.replace_task = asyncio.create_task(self._replace_replicas(runtime),
                                                       name=f"replace:{runtime.id}")
            runtime.replace_task.add_done_callback(_consume_exception)

    async def _replace_replicas(self, runtime: ModelRuntime) -> None:
        """Bring a model that still serves back to its replica count after crashes, one child
        at a time, with the same backoff and crash-loop limit as whole loads. Cancelled when
        the model stops."""
        while (runtime.status is Status.LOADED and not runtime.draining
               and not runtime.crash_loop
               and 0 < len(runtime.replicas) < runtime.preset.replicas):
            delay = (self._last_failure_at.get(runtime.id, 0.0)
                     + backoff_s(runtime.failures_in_row) - time.monotonic())
            if delay > 0:
                await asyncio.sleep(delay)
                continue  # check again: the model may have stopped meanwhile
            timeout = runtime.preset.load_timeout or self.settings.load_timeout
            children: list[ChildProcess] = []
            [share] = self.spawner.cpu_shares(runtime, 1)
            runtime.spawning = children  # its cores count as held while it starts
            try:
                await self.spawner.spawn_ready(runtime, children, timeout, time.monotonic(), share)
            except BaseException as exc:
                runtime.spawning = []
                await asyncio.shield(asyncio.gather(*(c.stop(0) for c in children)))
                if not isinstance(exc, Exception):  # cancelled: the model is stopping
                    raise
                failure = _failure_from(exc)
                self._record_failure(runtime, failure, crashed_after=None)
                log.error("replica restart failed: %s", failure.message,
                          extra={"event": "replica_failed", "model": runtime.id})
                continue
            runtime.spawning = []
            replica = Replica(children[-1])
            runtime.replicas.append(replica)
            self._start_exit_watch(runtime, replica)
            log.info("replica restarted", extra={
                "event": "replica_restarted", "model": runtime.id, "pid": replica.child.pid,
                "port": replica.child.port})
            self.events.publish(runtime.id, "replica_restarted",
                                {"pid": replica.child.pid, "replicas": len(runtime.replicas)})

    def _start_exit_watch(self, runtime: ModelRuntime, replica: Replica) -> None:
        watcher = asyncio.create_task(self._watch_exit(runtime, replica),
                                      name=f"exit:{runtime.id}")
        watcher.add_done_callback(_consume_exception)

    def _close_pool_later(self, replica: Replica) -> None:
        task = asyncio.create_task(replica.child.close_pool())
        task.add_done_callback(_consume_exception)

    def _record_failure(self, runtime: ModelRuntime, failure: Failure,
                        crashed_after: float | None) -> None:
        if crashed_after is not None and crashed_after >= STABLE_RUN_S:
            runtime.failures_in_row = 0
        runtime.failures_in_row += 1
        runtime.failure = failure
        runtime.failed = True
        self._last_failure_at[runtime.id] = time.monotonic()
        if runtime.failures_in_row >= self.settings.crash_loop_limit:
            runtime.crash_loop = True
            log.error("failed %d times in a row; not restarting until POST /models/load",
                      runtime.failures_in_row, extra={"event": "crash_loop", "model": runtime.id})

    # ----------------------------------------------------------------- live reconfiguration

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]:
        """Apply a new catalogue as a diff, without dropping a request.

        * new models are listed (and loaded if ``load-on-startup``);
        * removed models stop taking requests, finish what they have, stop, and disappear;
        * changed models (llama-server args or replicas) finish their in-flight requests on
          the old child, then stop; requests arriving meanwhile wait for the new child;
        * unchanged models keep their child (same pid); other preset fields update in place.
        """
        change = reconfig.diff({m: r.preset for m, r in self.models.items()}, catalogue.models)
        self.catalogue = catalogue
        for model_id in change.added:
            self.models[model_id] = ModelRuntime(catalogue.models[model_id],
                                                 LogRing(self.settings.log_lines))
        for model_id in change.removed:
            runtime = self.models[model_id]
            runtime.removed = True
            self._retire(runtime, "removed")
        for model_id in change.update:
            self.models[model_id].preset = catalogue.models[model_id]
        for model_id in change.restart:
            runtime = self.models[model_id]
            runtime.preset = catalogue.models[model_id]
            self.accounting.forget(model_id)
            runtime.estimate = 0
            runtime.estimate_devices = {}
            runtime.cache_ram_mib = None
            runtime.crash_loop = False
            runtime.failures_in_row = 0
            self._retire(runtime, "reconfigured")
        for model_id in change.added:
            if catalogue.models[model_id].load_on_startup:
                with contextlib.suppress(LoadFailed):
                    self._ensure_load_task(self.models[model_id], on_demand=False)
        self.changes.notify()
        return change.summary()

    def _retire(self, runtime: ModelRuntime, reason: str) -> None:
        """Stop a model's current child once its in-flight requests are done."""
        task = runtime.load_task
        if runtime.status is Status.LOADING and task is not None and not task.done():
            task.cancel()  # waiters start over, with the new configuration
        if runtime.status is Status.LOADED:
            runtime.draining = True
            runtime.stop_when_idle = reason
            runtime.restart_after_stop = not runtime.removed
            if runtime.in_flight == 0:
                self._begin_stop(runtime, reason)
        elif runtime.status is Status.UNLOADED and runtime.removed:
            if task is not None and not task.done():
                task.cancel()
            self._forget(runtime)

    def _forget(self, runtime: ModelRuntime) -> None:
        if self.models.get(runtime.id) is runtime and runtime.id not in self.catalogue.models:
            del self.models[runtime.id]
            self.events.publish(runtime.id, "model_remove")

    # ----------------------------------------------------------------- idle TTL

    def start(self) -> None:
        """Start background work (the idle reaper, GPU measurement); ``close()`` stops it."""
        self._reaper = asyncio.create_task(self._reap_idle(), name="idle-reaper")
        if self.cores:
            self.cpu_gate.start()
        self._sampler = asyncio.create_task(self.accounting.run(self.models.values),
                                            name="accounting")

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.monotonic()
            for runtime in self.models.values():
                ttl = runtime.preset.ttl if runtime.preset.ttl is not None \
                    else self.settings.idle_timeout
                if (ttl and runtime.serving and runtime.in_flight == 0
                        and runtime.waiting == 0 and now - runtime.last_used >= ttl):
                    log.info("idle for %.0f s; unloading", now - runtime.last_used,
                             extra={"event": "idle_unload", "model": runtime.id})
                    self._begin_stop(runtime, "idle")

    # ----------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Stop every child (loading ones are killed); used at shutdown."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._sampler is not None:
            self._sampler.cancel()
        await self.cpu_gate.close()  # continue every paused child before stopping them
        loads = [r.load_task for r in self.models.values()
                 if r.load_task is not None and not r.load_task.done()]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        await asyncio.gather(*(self._stop(r, "shutdown") for r in self.models.values()),
                             return_exceptions=True)
        stops = [r.stop_task for r in self.models.values() if r.stop_task is not None]
        await asyncio.gather(*stops, return_exceptions=True)

    def kill_all_now(self) -> None:
        for runtime in self.models.values():
            for replica in runtime.replicas:
                replica.child.kill_now()
            for child in runtime.spawning:
                child.kill_now()

    async def load_startup_models(self) -> None:
        startup = [r for r in self.models.values() if r.preset.load_on_startup]
        await asyncio.gather(*(self._ensure_load_task(r, on_demand=False) for r in startup))

    async def wait_startup_models(self) -> list[str]:
        """Wait until every load-on-startup model is loaded or failed; the failed ones."""
        failed = []
        for runtime in self.models.values():
            if not runtime.preset.load_on_startup:
                continue
            try:
                task = runtime.load_task or self._ensure_load_task(runtime, on_demand=False)
                await asyncio.shield(task)
            except Exception:
                pass
            if not runtime.serving:
                failed.append(runtime.id)
        return failed

    # ----------------------------------------------------------------- state

    def _set_status(self, runtime: ModelRuntime, event: Event, **extra: Any) -> None:
        """Move the model through ``event`` (``lifecycle``: an event that cannot happen now
        raises InvalidTransition) and publish it: ``status_change`` with llama.cpp's status
        value, except the start of a load (llama.cpp's ``model_status``) and of a stop (the
        router's own ``stopping``: the status clients see stays ``loaded`` until the process
        has exited)."""
        status = transition(runtime.id, runtime.status, event)
        previous, runtime.status = runtime.status, status
        data: dict[str, Any] = {"status": status.public, **extra}
        runtime.progress = None
        if status is Status.STOPPING or status is Status.LOADING:
            # A stop starting is the router's own event; a load starting is llama.cpp's
            # "model_status" (its progress then comes as "status_change").
            self.events.publish(runtime.id, "stopping" if status is Status.STOPPING
                                else "model_status", data)
            self.changes.notify()
            return
        if status is Status.LOADED:
            runtime.failed = False
        if status is Status.UNLOADED:
            data["was_running"] = previous.holds_process
            if runtime.failed and runtime.failure is not None:
                data["failed"] = True
                data["exit_code"] = runtime.failure.exit_code
        self.events.publish(runtime.id, "status_change", data)
        self.changes.notify()

def _failure_from(exc: BaseException) -> Failure:
    if isinstance(exc, ChildExited):
        return Failure(str(exc), exc.exit_code, exc.last_lines)
    if isinstance(exc, ChildError):
        return Failure(str(exc), None, exc.last_lines)
    if isinstance(exc, LoadFailed):
        return Failure(exc.message, None, [])
    return Failure(f"could not start llama-server: {exc}", None, [])


def _load_failed_message(model_id: str, failure: Failure) -> str:
    last = next((line for line in reversed(failure.last_lines) if line.strip()), "")
    detail = f"; last log line: {last}" if last else ""
    return f"model '{model_id}' failed to load: {failure.message}{detail}"


def _consume_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
