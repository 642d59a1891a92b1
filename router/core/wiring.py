"""The scheduling core's composition root: ``wire`` makes its parts and connects them, and
holds nothing itself; ``Supervisor`` (the façade) answers the app over the ``Core`` it gets.

Every connection points down or sideways, never up into the façade:

* the spawner tells the executor of a child's start, progress and exit (lifecycle events);
* the executor starts loads through the loader and downloads through it too;
* admission evicts, drains and undrains through the executor (``Stop``, ``Drain``,
  ``Undrain``);
* leases tell the CPU gate and the executor of a model's first and last request in flight,
  and the executor of a replica's last request after it left its model;
* warm swaps (``warm``, with ``--state-dir``) name the children's slot directory for the
  spawner, save before the executor's stops and restore within the loader's loads;
* liveness kills through the executor; the model set tells the executor, accounting and the
  wait of models added, changed and removed.

``Background`` owns the core's loops (idle reaper, accounting's sampler, liveness probes, the
CPU gate) from ``start`` to ``close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..changes import Changes
from ..config.settings import Settings
from ..config.sources import Catalogue
from ..events import EventBus
from ..host.cpus import OtherWork, machine_cores
from ..host.gpus import GpuDevice
from ..llama.flags import FlagTable
from ..serving.leases import Leases
from ..serving.slotqueue import SlotQueue
from ..warm.conversations import Conversations
from ..warm.statestore import StateStore
from ..warm.swaps import WarmSwaps
from .accounting import Accounting
from .admission import Admission
from .cpugate import CpuGate
from .executor import Executor
from .lifecycle import Drain, Undrain
from .liveness import Liveness, reap_idle
from .loader import Loader
from .modelchanges import ModelChanges
from .modelset import ModelSet
from .runtime import ModelRuntime, cpu_turn_members
from .spawner import Spawner
from .wait import ModelWait

log = logging.getLogger("router.supervisor")


@dataclass(frozen=True)
class Core:
    """The parts of the scheduling core, wired (``wire``)."""

    settings: Settings
    events: EventBus
    cores: list[int]  # shared among CPU children (``cpus``); empty when CPU sharing is off
    gpus: list[GpuDevice]
    model_set: ModelSet
    model_changes: ModelChanges
    changes: Changes
    cpu_gate: CpuGate
    accounting: Accounting
    spawner: Spawner
    executor: Executor
    admission: Admission
    liveness: Liveness
    leases: Leases
    wait: ModelWait
    background: Background
    warm: WarmSwaps | None  # warm swaps (``--state-dir``); None: off


def wire(settings: Settings, catalogue: Catalogue, table: FlagTable, binary: Path,
         client: httpx.AsyncClient, events: EventBus, *, gpus: list[GpuDevice] | None = None,
         gpu_budgets: dict[str, int] | None = None, cores: list[int] | None = None,
         spawner: Spawner | None = None, states: StateStore | None = None,
         build: str = "unknown", warm: WarmSwaps | None = None,
         other_work: OtherWork | None = None) -> Core:
    """The core over ``catalogue``; ``spawner``: what starts the children (default:
    llama-server processes and remote upstreams; the scheduler simulation passes one that
    starts fake children); ``states``: the saved slot states of warm swaps (None: off), for
    children of the llama-server ``build``; ``warm``: the warm swaps themselves (the
    simulation passes its own); ``other_work``: what the machine does besides (default: read
    from ``/proc``; tests pass their own)."""
    shared = (cores if cores is not None else machine_cores()) if settings.cpu_sharing else []
    devices = list(gpus or [])
    model_set = ModelSet(catalogue, settings.log_lines)
    models = model_set.records
    cpu_gate = CpuGate(lambda: cpu_turn_members(models.values()))
    other_work = other_work or OtherWork()  # sampled by the accounting, read at each spawn
    accounting = Accounting(devices, other_work)
    changes = Changes()
    if warm is None and states is not None:
        warm = WarmSwaps(states, build, client, events)
    if warm is not None:
        warm.drop_turned_off(runtime.preset for runtime in models.values())
    spawner = spawner or Spawner(binary, table, client, events, router_port=settings.port,
                                 cores=shared, gpus=devices, models=models.values,
                                 other_work=other_work,
                                 upstream_timeout=settings.upstream_timeout,
                                 slot_dir=warm.slot_dir if warm is not None else None,
                                 private=bool(settings.api_key)
                                 or settings.api_key_file is not None)

    def loading(executor: Executor) -> Loader:  # the executor's loads, with their admission
        evict, drain, undrain = _room_makers(models, executor)
        admission = Admission(settings, accounting, executor.apply, changes,
                              memory_budget=settings.memory_budget_bytes(),
                              gpu_budgets=dict(gpu_budgets or {}),
                              models=model_set.published.values,
                              evict=evict, drain=drain, undrain=undrain)
        return Loader(settings, executor, spawner, admission, accounting, changes, warm=warm)

    executor = Executor(settings, spawner, events, changes, model_set, loading=loading,
                        warm=warm)
    liveness = Liveness(interval=settings.liveness_interval, timeout=settings.liveness_timeout,
                        misses=settings.liveness_misses, is_paused=cpu_gate.is_paused,
                        on_unresponsive=executor.kill_unresponsive)
    slots = SlotQueue(changes)
    leases = Leases(gate=cpu_gate, idle=executor.idle,
                    on_replica_done=executor.close_pool_later,
                    conversations=Conversations(warm) if warm is not None else None,
                    on_turn_end=slots.ended)
    admission = executor.loads.admission
    wait = ModelWait(settings, executor, admission, leases, slots, models.values)
    _forget_removed(events, spawner, slots, warm, leases.conversations)
    model_changes = ModelChanges(model_set, executor, wait, changes)
    background = Background(settings, models, executor, accounting, liveness, cpu_gate,
                            cpu_sharing=bool(shared))
    return Core(settings, events, shared, devices, model_set, model_changes, changes, cpu_gate,
                accounting, spawner, executor, admission, liveness, leases, wait, background,
                warm)


def _forget_removed(events: EventBus, spawner: Spawner, slots: SlotQueue, warm: WarmSwaps | None,
                    conversations: Conversations | None) -> None:
    """Every table kept per model drops a removed model on the one signal its ``Forgotten``
    publishes (``events.MODEL_REMOVED``): its command line, its slot queue, its saved states
    and counters (they go with its preset), its conversations."""
    events.on_removed(spawner.forget)
    events.on_removed(slots.forget)
    if warm is not None:
        events.on_removed(warm.forget)
    if conversations is not None:
        events.on_removed(conversations.forget)


def _room_makers(models: dict[str, ModelRuntime], executor: Executor) -> tuple[
        Callable[[str], None], Callable[[str, str], None], Callable[[str], None]]:
    """What admission does to make room, as lifecycle events through the executor."""

    def evict(model_id: str) -> None:
        executor.stop(models[model_id], "evicted")

    def drain(model_id: str, waiting_for: str) -> None:
        runtime = models[model_id]
        if not runtime.draining:
            log.info("draining to make room for %s", waiting_for,
                     extra={"event": "drain", "model": runtime.id})
        executor.apply(runtime, Drain(waiting_for, idle=runtime.in_flight == 0))

    def undrain(model_id: str) -> None:
        runtime = models.get(model_id)
        if runtime is not None and runtime.state.drained_for is not None:
            log.info("serving again: no load waits for its room",
                     extra={"event": "undrain", "model": runtime.id})
            executor.apply(runtime, Undrain())

    return evict, drain, undrain


class Background:
    """The core's loops, from ``start`` until ``close``."""

    def __init__(self, settings: Settings, models: dict[str, ModelRuntime],
                 executor: Executor, accounting: Accounting, liveness: Liveness,
                 cpu_gate: CpuGate, *, cpu_sharing: bool) -> None:
        self._settings = settings
        self._models = models
        self._executor = executor
        self._accounting = accounting
        self._liveness = liveness
        self._cpu_gate = cpu_gate
        self._cpu_sharing = cpu_sharing
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        models = self._models.values
        self._tasks = [
            asyncio.create_task(reap_idle(models, self._settings.idle_timeout,
                                          self._executor.stop), name="idle-reaper"),
            asyncio.create_task(self._accounting.run(models, self._executor.apply),
                                name="accounting"),
            asyncio.create_task(self._liveness.run(models), name="liveness")]
        if self._cpu_sharing:
            self._cpu_gate.start()

    async def close(self) -> None:
        """Cancel the loops, and continue every child the CPU gate paused."""
        for task in self._tasks:
            task.cancel()
        await self._cpu_gate.close()
