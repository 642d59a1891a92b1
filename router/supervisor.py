"""The façade over model lifecycles: what the app asks of the models, in one place.

Concurrency model (one asyncio loop, no threads):

* A model's state changes only through ``lifecycle.transition``, applied by the ``Executor``;
  every change publishes its event and wakes everything waiting for a change (``changes``).
* ``acquire`` is the hot path: for a serving model it takes a lease on a replica (``leases``)
  without awaiting anything, so no eviction can slip in between "is loaded" and "is in use".
* Each model has at most one load task (``Loader.load``), started by the executor when the
  lifecycle accepts a ``LoadWanted`` (which also refuses loads and unloads that cannot happen
  now); every request for that model awaits it (shielded, so a waiter that gives up never
  cancels a load others share).
* Admission is FIFO across models (``admission``); the planner's evictions and drains come
  back here as lifecycle events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import httpx

from .accounting import Accounting
from .admission import Admission
from .affinity import Prefix
from .backend import Backend
from .changes import Changes
from .cpugate import CpuGate
from .cpus import machine_cores
from .errors import (
    ModelNotFound,
)
from .events import EventBus
from .executor import Executor
from .flags import FlagTable
from .gpus import GpuDevice
from .idle import reap_idle
from .leases import Lease, Leases, RoutedCallback
from .lifecycle import (
    ChildGone,
    ChildStarted,
    Closing,
    Drain,
    Idle,
    LoadProgress,
    Undrain,
    Unload,
)
from .liveness import Liveness
from .loader import Loader
from .memory import total_ram_bytes
from .modelset import ModelSet
from .presets import ModelPreset
from .runtime import ModelRuntime, cpu_turn_members
from .settings import Settings
from .sources import Catalogue
from .spawner import Spawner
from .view import ModelView
from .wait import NOTHING_ELSE, Ends, ModelWait, refusal

log = logging.getLogger("router.supervisor")


class Supervisor:
    def __init__(self, settings: Settings, catalogue: Catalogue, table: FlagTable,
                 binary: Path, client: httpx.AsyncClient, events: EventBus, *,
                 gpus: list[GpuDevice] | None = None,
                 gpu_budgets: dict[str, int] | None = None,
                 cores: list[int] | None = None, spawner: Spawner | None = None) -> None:
        """``spawner``: what starts the children (default: llama-server processes and remote
        upstreams; the scheduler simulation passes one that starts fake children)."""
        self.settings = settings
        # Cores shared among CPU children (``cpus``); empty when CPU sharing is off.
        self.cores = (cores if cores is not None else machine_cores()) \
            if settings.cpu_sharing else []
        self.cpu_gate = CpuGate(lambda: cpu_turn_members(self.models.values()))
        self.gpus = list(gpus or [])
        self.accounting = Accounting(self.gpus)
        self.model_set = ModelSet(catalogue, settings.log_lines)
        self.models = self.model_set.records  # read-only here: ``ModelSet`` writes it
        self.events = events
        self.changes = Changes()
        self._reaper: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self.spawner = spawner or Spawner(binary, table, client, events,
                                          router_port=settings.port, cores=self.cores,
                                          gpus=self.gpus, models=self.models.values,
                                          upstream_timeout=settings.upstream_timeout)
        self.executor = Executor(settings, self.spawner, events, self.changes,
                                 load=self._load, forget=self.model_set.forget,
                                 download=lambda r, cancel: self.loader.fetch_files(r, cancel))
        self.spawner.on_progress = lambda runtime, progress: self.executor.apply(
            runtime, LoadProgress(progress))
        self.spawner.on_started = lambda runtime, child: self.executor.apply(
            runtime, ChildStarted(child))
        self.spawner.on_gone = lambda runtime, child: self.executor.apply(
            runtime, ChildGone(child))
        self.admission = Admission(
            settings, self.accounting, self.executor.apply, self.changes,
            memory_budget=settings.memory_budget_bytes(), gpu_budgets=dict(gpu_budgets or {}),
            models=self.models.values,
            evict=self._evict,
            drain=self._drain,
            undrain=self._undrain)
        self.loader = Loader(settings, self.executor, self.spawner, self.admission,
                             self.accounting, self.changes)
        self.liveness = Liveness(interval=settings.liveness_interval,
                                 timeout=settings.liveness_timeout,
                                 misses=settings.liveness_misses,
                                 is_paused=self.cpu_gate.is_paused,
                                 on_unresponsive=self.executor.kill_unresponsive)
        self.leases = Leases(on_busy=self._on_busy, on_idle=self._on_idle,
                             on_replica_done=self.executor.close_pool_later)
        self.wait = ModelWait(settings, self.executor, self.admission, self.leases,
                              self.models.values)
        self.model_set.wire(self.executor, self.accounting, self.wait, self.changes)

    # ----------------------------------------------------------------- lookups

    def resolve(self, name: str) -> ModelRuntime:
        model_id = self.catalogue.resolve(name)
        if model_id is None:
            raise ModelNotFound(name, self.catalogue.close_matches(name))
        return self.models[model_id]

    def view(self, model_id: str) -> ModelView | None:
        """A read-only view of the model with this id (not an alias), or None."""
        runtime = self.models.get(model_id)
        return None if runtime is None else ModelView(runtime, self)

    def views(self) -> list[ModelView]:
        """A read-only view of every model, in catalogue order."""
        return [ModelView(runtime, self) for runtime in self.models.values()]

    def model_id(self, name: str) -> str | None:
        """The id a name (id or alias) stands for, or None."""
        return self.catalogue.resolve(name)

    def close_matches(self, name: str) -> list[str]:
        """Names close to an unknown one, for "did you mean"."""
        return self.catalogue.close_matches(name)

    def find(self, name: str) -> ModelView:
        """The model a request names (id or alias); raises ModelNotFound."""
        return ModelView(self.resolve(name), self)

    def budgets(self) -> dict[str, Any]:
        """What the scheduler plans against (``/props`` ``llama_router``): bytes, None when
        off."""
        return {
            "models_max": self.settings.models_max,
            "memory_budget": self.admission.memory_budget, "memory_total": total_ram_bytes(),
            "gpus": [{"pool": d.pool, "name": d.name, "total": d.total_bytes,
                      "budget": self.admission.gpu_budgets.get(d.pool)} for d in self.gpus],
        }

    @property
    def cpu_turns(self) -> int:
        """Turns the CPU gate has given so far (``cpugate``)."""
        return self.cpu_gate.turns

    @property
    def children_paused(self) -> int:
        return len(self.cpu_gate.paused)

    def on_routed(self, callback: RoutedCallback) -> None:
        """Report each replica choice by prompt prefix to ``callback`` (the metrics)."""
        self.leases.on_routed = callback

    @property
    def total_waiting(self) -> int:
        return self.wait.total

    # ----------------------------------------------------------------- requests

    def lease_now(self, name: str, prefix: Prefix | None = None) -> Lease | None:
        """A lease on a replica of a model that serves, taken at once; None when it does not
        serve (then ``acquire`` waits for it)."""
        return self.wait.lease_now(self.resolve(name), prefix)

    async def acquire(self, name: str, *, autoload: bool = True, budget: float | None = None,
                      prefix: Prefix | None = None, ends: Ends = NOTHING_ELSE) -> Lease:
        """A lease on a serving replica of the model a request names (``wait``: loading it if
        allowed, within the wait budget, while ``ends`` lets it wait)."""
        return await self.wait.acquire(self.resolve(name), autoload=autoload, budget=budget,
                                       prefix=prefix, ends=ends)

    def lease_child(self, model: str, child: Backend) -> Lease | None:
        """A lease on the very replica running ``child`` while its model serves (resuming a
        stream that child keeps); None when it no longer does. Never loads anything."""
        runtime = self.models.get(model)
        if runtime is None or not runtime.serving:
            return None
        replica = next((r for r in runtime.replicas if r.child is child), None)
        return None if replica is None else self.leases.take(runtime, replica)

    def _on_busy(self, runtime: ModelRuntime) -> None:
        self.cpu_gate.busy(runtime.id)

    def _on_idle(self, runtime: ModelRuntime) -> None:
        self.cpu_gate.idle(runtime.id)
        self.executor.apply(runtime, Idle())

    # ----------------------------------------------------------------- loading

    async def _load(self, runtime: ModelRuntime) -> None:
        await self.loader.load(runtime)

    async def load(self, name: str) -> ModelRuntime:
        """Start loading a model and return at once (``POST /models/load``); BadRequest if
        it is not unloaded. An explicit load also clears a crash loop."""
        runtime = self.resolve(name)
        self.wait.load_task(runtime, on_demand=False, explicit=True)
        return runtime

    def start_download(self, runtime: ModelRuntime) -> asyncio.Task[None]:
        """Download an hf-repo model into the HF cache (``POST /models``)."""
        return self.executor.start_download(runtime)

    def _evict(self, model_id: str) -> None:
        self.executor.stop(self.models[model_id], "evicted")

    def _drain(self, model_id: str, waiting_for: str) -> None:
        runtime = self.models[model_id]
        if not runtime.draining:
            log.info("draining to make room for %s", waiting_for,
                     extra={"event": "drain", "model": runtime.id})
        self.executor.apply(runtime, Drain(waiting_for, idle=runtime.in_flight == 0))

    def _undrain(self, model_id: str) -> None:
        runtime = self.models.get(model_id)
        if runtime is not None and runtime.state.drained_for is not None:
            log.info("serving again: no load waits for its room",
                     extra={"event": "undrain", "model": runtime.id})
            self.executor.apply(runtime, Undrain())

    # ----------------------------------------------------------------- the catalogue

    @property
    def catalogue(self) -> Catalogue:
        return self.model_set.catalogue

    def add_model(self, preset: ModelPreset) -> ModelRuntime:
        """Add a model at run time (``POST /models``)."""
        return self.model_set.add(preset)

    def remove_model(self, model_id: str) -> None:
        """Forget a model that is not running (``DELETE /models``)."""
        self.model_set.remove(model_id)

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]:
        """Apply a new catalogue as a diff, without dropping a request (``ModelSet``)."""
        return self.model_set.reconfigure(catalogue)

    # ----------------------------------------------------------------- stopping

    async def unload(self, name: str, *, explicit: bool = True) -> ModelRuntime:
        """Cancel a download or load of the model, or stop its children (``lifecycle.Unload``);
        returns once it is unloaded. ``explicit`` (``POST /models/unload``): BadRequest when
        nothing runs or loads."""
        runtime = self.resolve(name)
        busy = [t for t in (runtime.download_task, runtime.load_task)
                if t is not None and not t.done()]
        refused = self.executor.command(runtime, Unload(explicit=explicit))
        if refused is not None:
            raise refusal(runtime, refused)
        for task in busy:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(task)
        if runtime.stop_task is not None:
            await asyncio.shield(runtime.stop_task)
        return runtime

    def start(self) -> None:
        """Start background work (the idle reaper, measurement, liveness probes); ``close()``
        stops it."""
        self._reaper = asyncio.create_task(
            reap_idle(self.models.values, self.settings.idle_timeout, self.executor.stop),
            name="idle-reaper")
        if self.cores:
            self.cpu_gate.start()
        self._sampler = asyncio.create_task(self.accounting.run(self.models.values),
                                            name="accounting")
        self._prober = asyncio.create_task(self.liveness.run(self.models.values),
                                           name="liveness")

    async def close(self) -> None:
        """Stop every child (loading ones are killed); used at shutdown."""
        if self._reaper is not None:
            self._reaper.cancel()
        for task in (self._sampler, self._prober):
            if task is not None:
                task.cancel()
        await self.cpu_gate.close()  # continue every paused child before stopping them
        busy = [task for r in self.models.values() for task in (r.download_task, r.load_task)
                if task is not None and not task.done()]
        for runtime in list(self.models.values()):
            self.executor.apply(runtime, Closing())  # cancels them; no load starts from now
        await asyncio.gather(*busy, return_exceptions=True)
        for runtime in self.models.values():
            self.executor.stop(runtime, "shutdown")
        stops = [r.stop_task for r in self.models.values() if r.stop_task is not None]
        await asyncio.gather(*stops, return_exceptions=True)
        await self.executor.settle()  # replacement children cancelled by the stops

    def kill_all_now(self) -> None:
        for runtime in self.models.values():
            for child in runtime.children():
                child.kill_now()

    # ----------------------------------------------------------------- startup

    async def load_startup_models(self) -> None:
        startup = [r for r in self.models.values() if r.preset.load_on_startup]
        await asyncio.gather(*(self.wait.load_task(r, on_demand=False) for r in startup))

    async def wait_startup_models(self) -> list[str]:
        """Wait until every load-on-startup model is loaded or failed; the failed ones."""
        failed = []
        for runtime in self.models.values():
            if not runtime.preset.load_on_startup:
                continue
            try:
                task = runtime.load_task or self.wait.load_task(runtime, on_demand=False)
                await asyncio.shield(task)
            except Exception:
                pass
            if not runtime.serving:
                failed.append(runtime.id)
        return failed
