"""Run state of each model: its lifecycle state, replicas (children), estimates, waits.

One record per model, with one owner, the executor (``Executor.apply``; declared in
``docs/architecture.toml``). ``state`` (the status, the children by phase, the pending load,
the failure, the download's progress) changes only through ``lifecycle.transition``; the
other fields through the facts below, which the module that learns one sends to the owner
(its estimates from ``accounting``, its place in the queue from ``admission``, its load time
from ``loader``, its waiting requests from ``wait``). What runs on its children, its
``load`` and each replica's, is a record of its own, the leases' (``serving.load``).
Everything outside the core reads the snapshot the owner publishes after each change
(``ModelSnapshot``). A model has ``replicas`` children (1 unless its preset says ``replicas =
N``); the leases choose which one a request takes (``serving.leases``).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..children.backend import Backend
from ..config.presets import ModelPreset, slots_of
from ..logs import LogRing
from ..serving.load import ModelLoad, Replica
from .lifecycle import Failure as Failure  # its home; re-exported for the record's readers
from .lifecycle import ModelState, Status
from .scheduler import ModelUse

# HTTP threads each child gets unless its preset sets threads-http: llama-server's own
# default (slots + 4) leaves a router multiplexing many clients short.
MIN_HTTP_THREADS = 16
# Of those, kept free of proxied connections: health polls, metrics scrapes, info fetches.
RESERVED_HTTP_THREADS = 2


# --------------------------------------------------------------------------- facts
# What changes a model's record besides its lifecycle; applied by its owner (``Executor.apply``).


@dataclass(frozen=True, slots=True)
class Estimated:
    """What its GGUF header says it needs while loaded, all replicas (``Accounting.estimate``):
    bytes of host RAM, bytes per GPU pool, the router's ``--cache-ram`` for it (None: the
    preset sets its own) and its layers. ``again``: none now, for a passing cause (out of file
    descriptors); ``Accounting.run`` reads it again."""

    estimate: int = 0
    devices: Mapping[str, int] = field(default_factory=dict)
    cache_ram_mib: int | None = None
    n_layer: int | None = None
    again: bool = False


@dataclass(frozen=True, slots=True)
class Unestimated:
    """Its file or arguments changed: its estimates are unknown until read again."""


@dataclass(frozen=True, slots=True)
class QueueJoined:
    """Its load joined the admission queue at clock time ``at``."""

    at: float


@dataclass(frozen=True, slots=True)
class QueueLeft:
    """Its load left the admission queue: admitted, or given up."""


@dataclass(frozen=True, slots=True)
class LoadTimed:
    """Its load succeeded, in ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class WaitBegan:
    """A request began waiting for it to serve."""


@dataclass(frozen=True, slots=True)
class WaitEnded:
    """A request stopped waiting for it (served, refused or gone)."""


@dataclass(frozen=True, slots=True)
class KeptAlive:
    """A request's ``keep_alive`` (``edge.keepalive``): the model's idle TTL from now until it
    stops, in seconds; ``math.inf``: no idle TTL; ``0``: unload once idle, as ``POST
    /models/unload`` would; None: its preset's TTL again (when a stop begins)."""

    seconds: float | None


Fact = (Estimated | Unestimated | QueueJoined | QueueLeft | LoadTimed | WaitBegan | WaitEnded
        | KeptAlive)
FACTS = (Estimated, Unestimated, QueueJoined, QueueLeft, LoadTimed, WaitBegan, WaitEnded,
         KeptAlive)


# --------------------------------------------------------------------------- the record

def http_threads(args: Mapping[str, str]) -> int:
    """A child's HTTP threads: ``threads-http`` from its preset, else the router's choice."""
    raw: str = args.get("threads-http", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(slots_of(args) + 4, MIN_HTTP_THREADS)


class ModelReads:
    """What a model's record and its published snapshot (``ModelSnapshot``) both answer, read
    from ``preset``, ``state`` and the leases' ``load``."""

    __slots__ = ()
    preset: ModelPreset
    state: ModelState
    load: ModelLoad
    keep_alive: float | None  # a request's idle TTL for this load (``KeptAlive``)

    @property
    def id(self) -> str:
        return self.preset.id

    @property
    def in_flight(self) -> int:
        return self.load.in_flight

    def idle_ttl(self, default: float) -> float:
        """Its idle TTL in force, in seconds (0: none): a request's ``keep_alive`` for this
        load (``math.inf``: none), else its preset's ``ttl``, else ``default`` (the router's
        ``--idle-timeout``)."""
        kept = self.keep_alive
        if kept is not None:
            return 0.0 if kept == math.inf else kept
        ttl = self.preset.ttl
        return ttl if ttl is not None else default

    @property
    def last_used(self) -> float:
        """Clock time it was last used: a request's, or its load's (``clock``)."""
        used_at, loaded_at = self.load.used_at, self.state.loaded_at
        return used_at if loaded_at is None else max(used_at, loaded_at)

    @property
    def failure(self) -> Failure | None:
        """The last failure counted (kept for messages)."""
        return self.state.failure

    @property
    def download(self) -> Mapping[str, Any] | None:
        """While downloading: bytes so far per file, ``{file: {"done", "total"}}``."""
        return self.state.download

    @property
    def status(self) -> Status:
        return self.state.status

    @property
    def progress(self) -> Mapping[str, Any] | None:
        """Load progress while loading, in llama.cpp's shape {stages, current, value}: the
        least advanced of the children being started (their own reports, see ``process``)."""
        return self.state.progress

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """Its serving replicas (none while stopping: the stop holds them)."""
        return self.state.replicas

    @property
    def starting(self) -> tuple[Backend, ...]:
        """Children started for a load or a replacement, not serving yet."""
        return self.state.starting

    @property
    def info(self) -> Mapping[str, Any] | None:
        """The child's own ``/v1/models`` entry, while loaded."""
        return self.state.info

    @property
    def loaded_at(self) -> float | None:
        """Clock time (``clock``) it became loaded."""
        return self.state.loaded_at

    @property
    def load_on_demand(self) -> bool:
        """Its pending load was started by requests (cancelled once none waits)."""
        return self.state.load_on_demand

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def failed(self) -> bool:
        return self.state.failed

    @property
    def crash_loop(self) -> bool:
        return self.state.crash_loop

    @property
    def removed(self) -> bool:
        return self.state.removed

    @property
    def child(self) -> Backend | None:
        """The first replica's child (the only one unless ``replicas`` > 1), or the first
        child still starting."""
        if self.replicas:
            return self.replicas[0].child
        return self.starting[0] if self.starting else None

    def children(self) -> list[Backend]:
        """Every process it holds: serving replicas, children starting or stopping."""
        state = self.state
        return ([r.child for r in state.replicas] + list(state.starting)
                + [r.child for r in state.stopping])

    @property
    def slots(self) -> int:
        return self.preset.slots

    @property
    def max_connections(self) -> int:
        """Proxied connections to one child at most: one per HTTP thread, less a reserve; to
        a remote upstream, its ``upstream-connections`` when set."""
        if self.preset.upstream_connections is not None:
            return self.preset.upstream_connections
        return max(1, http_threads(self.preset.args) - RESERVED_HTTP_THREADS)

    @property
    def serving(self) -> bool:
        """Whether it takes new requests: loaded, not draining, with a replica."""
        state = self.state
        return state.status is Status.LOADED and not state.draining and bool(self.replicas)

    @property
    def loaded(self) -> bool:
        return self.state.status is Status.LOADED

    @property
    def has_slots(self) -> bool:
        """Whether it has slots to give: loaded with a replica (also while draining: the
        requests it holds are served before it stops)."""
        return self.loaded and bool(self.replicas)


@dataclass
class ModelRuntime(ModelReads):
    """Mutable run state of one model."""

    preset: ModelPreset
    logs: LogRing
    estimate: int = 0  # bytes expected while loaded (all replicas), from the GGUF header
    estimate_devices: dict[str, int] = field(default_factory=dict)  # GPU bytes per pool
    cache_ram_mib: int | None = None  # the router's --cache-ram for it, once estimated
    n_layer: int | None = None  # from the GGUF header, once estimated
    state: ModelState = field(default_factory=ModelState)  # written only via ``lifecycle``
    waiting: int = 0  # requests waiting for this model to become ready
    load: ModelLoad = field(default_factory=ModelLoad)  # the leases' own (``serving.load``)
    # The tasks that carry out its lifecycle's effects, each created by the executor: its
    # download (with the flag its worker thread reads), its one load (``StartLoad``), a stop
    # (``StopChildren``), crashed replicas' replacement.
    download_task: asyncio.Task[None] | None = None
    download_cancel: threading.Event = field(default_factory=threading.Event)
    load_task: asyncio.Task[None] | None = None
    stop_task: asyncio.Task[None] | None = None
    replace_task: asyncio.Task[None] | None = None  # restarting crashed replicas
    queued_since: float | None = None  # monotonic, while waiting for admission
    last_load_s: float | None = None  # how long its last successful load took
    estimated: bool = False  # its header was read (or found unreadable for good)
    estimate_due: bool = False  # reading it failed for a passing cause: read again soon
    keep_alive: float | None = None  # a request's idle TTL for this load (``KeptAlive``)

    def __repr__(self) -> str:
        pids = [r.child.pid for r in self.replicas]
        return (f"<Model {self.preset.id} {self.status.value} pids={pids} "
                f"in_flight={self.in_flight} waiting={self.waiting}>")


def own_pids(models: Iterable[ModelRuntime]) -> list[int]:
    """The router's own processes: itself and every child of ``models`` that has a process
    (starting, serving or stopping): what ``cpus.OtherWork`` does not count as other work."""
    return [os.getpid(), *(c.pid for m in models for c in m.children() if c.pid)]


def cpu_turn_members(models: Iterable[ModelRuntime]) -> dict[str, list[Backend]]:
    """Models that compute on shared cores and have requests in flight: their children with
    more than one thread (``cpugate``)."""
    members: dict[str, list[Backend]] = {}
    for model in models:
        if model.in_flight and model.status is Status.LOADED:
            wide = [r.child for r in model.replicas if r.child.cpu and r.child.cpu.wide]
            if wide:
                members[model.id] = wide
    return members


# --------------------------------------------------------------------------- the snapshot

@dataclass(frozen=True, slots=True, eq=False)
class ModelSnapshot(ModelReads):
    """A model as its record's owner last published it: what everything outside the core reads.

    The executor, the record's one owner, publishes a model's ``ModelSnapshot`` after each change
    it applies (``ModelSet.publish``): its preset, its lifecycle state (itself immutable), the
    facts it recorded (estimates, waiting requests, place in the queue, last load time). A
    snapshot never changes; the next change publishes a new one. Two things in it are live by
    declaration: the leases' hot counters (``load``: requests in flight, last use; a
    replica's in flight, prefixes, pace and backlog), which move with every request and are
    never published, and the child's log ring.

    A snapshot is also the handle a request holds on its model (``route.decide``): the core
    takes the model's lease by its id, so no model is resolved by name twice.
    """

    preset: ModelPreset
    state: ModelState
    load: ModelLoad  # live: the leases' own
    logs: LogRing  # live: its llama-server's recent output
    waiting: int = 0
    estimate: int = 0
    estimate_devices: Mapping[str, int] = field(default_factory=dict)
    cache_ram_mib: int | None = None
    last_load_s: float | None = None
    keep_alive: float | None = None

    def __repr__(self) -> str:
        return f"<ModelSnapshot {self.preset.id} {self.state.status.value}>"

    @property
    def loading(self) -> bool:
        return self.state.status in (Status.LOADING, Status.DOWNLOADING)

    @property
    def processes(self) -> int:
        """Local processes it holds (serving and starting); a remote upstream holds none."""
        if self.preset.upstream is not None:
            return 0
        return len(self.state.replicas) + len(self.state.starting)

    def use(self, memory: int, devices: Mapping[str, int] | None = None, *,
            gpu: bool = False) -> ModelUse:
        """What the admission planner reads of it, with the memory it holds (``gpu``: its
        stopping children may still hold GPU memory), and its residency: its preset's
        ``pin``, and the end of its ``min-resident`` counted from when it became loaded."""
        preset, loaded_at = self.preset, self.state.loaded_at
        resident_until = (loaded_at + preset.min_resident
                          if preset.min_resident > 0 and loaded_at is not None else None)
        return ModelUse(self.id, self.status, self.in_flight, self.last_used, memory,
                        self.draining, self.waiting, devices or {}, gpu, pinned=preset.pin,
                        resident_until=resident_until)


def snapshot_of(runtime: ModelRuntime) -> ModelSnapshot:
    """The model's record as it is now, frozen (its live load and log ring shared)."""
    return ModelSnapshot(runtime.preset, runtime.state, runtime.load, runtime.logs,
                         runtime.waiting, runtime.estimate,
                         MappingProxyType(dict(runtime.estimate_devices)),
                         runtime.cache_ram_mib, runtime.last_load_s, runtime.keep_alive)
