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
* Admission is FIFO across models (``admission``); the planner's evictions and drains go
  to the executor as lifecycle events.
* The parts are made and connected by the composition root (``wiring.wire``); every
  connection points down, none back up into this façade.
* Outside the core, the models are ``view.Models``: each read as the snapshot its record's
  owner last published (``ModelView``), and acted on by the view ``find`` gave (the handle:
  the record is reached by its id, never by resolving a name again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..children.backend import Backend
from ..config.presets import ModelPreset
from ..config.sources import Catalogue
from ..errors import (
    ModelNotFound,
)
from ..host.memory import total_ram_bytes
from ..serving.affinity import Prefix
from ..serving.leases import Lease, RoutedCallback
from ..teams.fairshare import Turn
from .lifecycle import (
    Closing,
    Unload,
)
from .runtime import KeptAlive, ModelRuntime
from .view import ModelView
from .wait import NOTHING_ELSE, Ends, refusal
from .wiring import Core

log = logging.getLogger("router.supervisor")


class Supervisor:
    """The façade: what the app asks of the models (``view.Models``, and the server's start
    and stop), answered by the core's parts (``wiring.wire`` made and connected them; this
    class holds no state of its own)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.settings = core.settings
        self.events = core.events
        self.cores = core.cores
        self.gpus = core.gpus
        self.model_set = core.model_set
        self.models = core.model_set.records  # read-only here: ``ModelSet`` writes it
        self.changes = core.changes
        self.cpu_gate = core.cpu_gate
        self.accounting = core.accounting
        self.spawner = core.spawner
        self.executor = core.executor
        self.admission = core.admission
        self.liveness = core.liveness
        self.leases = core.leases
        self.wait = core.wait
        self.background = core.background
        self.warm = core.warm

    # ----------------------------------------------------------------- lookups

    def resolve(self, name: str) -> ModelRuntime:
        model_id = self.catalogue.resolve(name)
        if model_id is None:
            raise ModelNotFound(name, self.catalogue.close_matches(name))
        return self.models[model_id]

    def view(self, model_id: str) -> ModelView | None:
        """The model with this id (not an alias) as last published, or None."""
        snapshot = self.model_set.published.get(model_id)
        return None if snapshot is None else ModelView(snapshot, self.core)

    def views(self) -> list[ModelView]:
        """Every model as last published, in catalogue order."""
        return [ModelView(snapshot, self.core) for snapshot in self.model_set.published.values()]

    def model_id(self, name: str) -> str | None:
        """The id a name (id or alias) stands for, or None."""
        return self.catalogue.resolve(name)

    def close_matches(self, name: str) -> list[str]:
        """Names close to an unknown one, for "did you mean"."""
        return self.catalogue.close_matches(name)

    def find(self, name: str) -> ModelView:
        """The model a request names (id or alias), as last published: the request's handle
        on it (``lease_now``, ``acquire``); raises ModelNotFound."""
        runtime = self.resolve(name)
        return ModelView(self.model_set.published[runtime.id], self.core)

    def _record(self, model: ModelView) -> ModelRuntime:
        """The record a handle stands for (by its id: no name is resolved again); ModelNotFound
        when the model was removed since."""
        runtime = self.models.get(model.id)
        if runtime is None:
            raise ModelNotFound(model.id, [])
        return runtime

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

    @property
    def cpu_other_work(self) -> float | None:
        """Cores' worth of CPU the machine spent outside the router and its children over
        the last sample (``cpus.OtherWork``); None before two samples."""
        other = self.accounting.other_work
        return other.cores if other is not None else None

    def on_routed(self, callback: RoutedCallback) -> None:
        """Report each replica choice by prompt prefix to ``callback`` (the metrics)."""
        self.leases.on_routed = callback

    @property
    def total_waiting(self) -> int:
        return self.wait.total

    # ----------------------------------------------------------------- requests

    def lease_now(self, model: ModelView, prefix: Prefix | None = None,
                  turn: Turn | None = None) -> Lease | None:
        """A lease on a replica of the model (the handle ``find`` gave) when it serves, taken
        at once, with a slot for ``turn`` when one is free; None when it does not serve or
        has no slot free (then ``acquire`` waits)."""
        return self.wait.lease_now(self._record(model), prefix, turn)

    async def acquire(self, model: ModelView, *, autoload: bool = True,
                      budget: float | None = None, prefix: Prefix | None = None,
                      ends: Ends = NOTHING_ELSE, turn: Turn | None = None) -> Lease:
        """A lease on a serving replica of the model (the handle ``find`` gave; ``wait``:
        loading it if allowed, and a slot for ``turn``, within the wait budget, while
        ``ends`` lets it wait)."""
        return await self.wait.acquire(self._record(model), autoload=autoload, budget=budget,
                                       prefix=prefix, ends=ends, turn=turn)

    def keeps_conversations(self, model: ModelView) -> bool:
        """Whether the model's requests are placed in its slots (``Leases.place``)."""
        return self.leases.keeps_conversations(model.preset)

    async def place(self, lease: Lease, prefix: Prefix, credential: bytes,
                    wanted: int | None = None, pinned: bool = True) -> int | None:
        """The slot the lease's request runs in, once what it needs first is done
        (``Leases.place``); None: the child chooses."""
        return await self.leases.place(lease, prefix, credential, wanted, pinned)

    def lease_child(self, model: str, child: Backend) -> Lease | None:
        """A lease on the very replica running ``child`` while its model serves (resuming a
        stream that child keeps); None when it no longer does. Never loads anything."""
        runtime = self.models.get(model)
        if runtime is None or not runtime.serving:
            return None
        replica = next((r for r in runtime.replicas if r.child is child), None)
        return None if replica is None else self.leases.take(runtime, replica)

    # ----------------------------------------------------------------- loading

    async def load(self, model: ModelView) -> None:
        """Start loading the model (the handle ``find`` gave) and return at once (``POST
        /models/load``); BadRequest if it is not unloaded. An explicit load also clears a
        crash loop."""
        self.wait.load_task(self._record(model), on_demand=False, explicit=True)

    def start_download(self, model: ModelView) -> asyncio.Task[None]:
        """Download an hf-repo model into the HF cache (``POST /models``)."""
        return self.executor.start_download(self._record(model))

    # ----------------------------------------------------------------- the catalogue

    @property
    def catalogue(self) -> Catalogue:
        return self.model_set.catalogue

    def add_model(self, preset: ModelPreset) -> ModelView:
        """Add a model at run time (``POST /models``); the handle on it."""
        runtime = self.core.model_changes.add(preset)
        return ModelView(self.model_set.published[runtime.id], self.core)

    def remove_model(self, model_id: str) -> None:
        """Forget a model that is not running (``DELETE /models``)."""
        self.core.model_changes.remove(model_id)

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]:
        """Apply a new catalogue as a diff, without dropping a request (``modelchanges``)."""
        return self.core.model_changes.reconfigure(catalogue)

    # ----------------------------------------------------------------- stopping

    def keep_alive(self, model: ModelView, seconds: float) -> None:
        """A request's ``keep_alive`` (``edge.keepalive``): the model's idle TTL until it next
        stops (``math.inf``: none; 0: unload once its requests are done)."""
        self.executor.apply(self._record(model), KeptAlive(seconds))

    async def unload(self, model: ModelView, *, explicit: bool = True) -> None:
        """Cancel a download or load of the model (the handle ``find`` gave), or stop its
        children (``lifecycle.Unload``); returns once it is unloaded. ``explicit`` (``POST
        /models/unload``): BadRequest when nothing runs or loads."""
        runtime = self._record(model)
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

    def start(self) -> None:
        """Start background work (the idle reaper, measurement, liveness probes, the CPU
        gate); ``close()`` stops it."""
        self.background.start()

    async def close(self) -> None:
        """Stop every child (loading ones are killed); used at shutdown."""
        await self.background.close()  # continues every paused child before they stop
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
