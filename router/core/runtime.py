"""Run state of each model: its lifecycle state, replicas (children), counters.

One record per model, with one owner, the executor (``Executor.apply``; declared in
``docs/architecture.toml``). ``state`` (the status, the children by phase, the pending load,
the failure, the download's progress) changes only through ``lifecycle.transition``; the
other fields through the facts below, which the module that learns one sends to the owner
(its estimates from ``accounting``, its place in the queue from ``admission``, its load time
from ``loader``, its waiting requests from ``wait``). The one declared exception is the hot
path's counters, the leases' own: ``counters`` here (requests in flight, last use), and a
replica's ``in_flight``, ``prefixes``, ``pace`` and ``backlog``. Everything outside the core
reads the snapshot the owner publishes after each change (``ModelSnapshot``). A model has
``replicas`` children (1 unless its preset says ``replicas = N``); requests go to the
replica with the most free slots, or, for a model routed by prompt prefix (``replica-routing
= prefix``, see ``affinity``), to the one where their first token is expected soonest,
counting the prompt it has cached (``pace``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..children.backend import Backend
from ..config.presets import ModelPreset, slots_of
from ..logs import LogRing
from ..warm.slotbook import Conversation, SlotBook
from ..warm.swaps import WarmSwaps
from .affinity import Decision, Prefix, PrefixTable, choose_among
from .lifecycle import Failure as Failure  # its home; re-exported for the record's readers
from .lifecycle import ModelState, Status
from .pace import Backlog, Option, Pace, by_cost
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


Fact = Estimated | Unestimated | QueueJoined | QueueLeft | LoadTimed | WaitBegan | WaitEnded
FACTS = (Estimated, Unestimated, QueueJoined, QueueLeft, LoadTimed, WaitBegan, WaitEnded)


# --------------------------------------------------------------------------- the record

@dataclass(eq=False, slots=True)
class Counters:
    """A model's hot-path counters, the leases' own (the record's one declared exception):
    its requests in flight, and the clock time a request last took or released it. Read live
    through the record and through its published snapshot."""

    in_flight: int = 0
    used_at: float = 0.0


@dataclass(eq=False)
class Replica:
    child: Backend
    in_flight: int = 0
    # Prefix keys of the prompts it served lately (``affinity``); a new child starts empty,
    # as its KV cache does.
    prefixes: PrefixTable = field(default_factory=PrefixTable)
    # How fast its child computes prompts and replies (learned from its responses' timings),
    # and the expected work of the prefix-routed requests it holds (``pace``).
    pace: Pace = field(default_factory=Pace)
    backlog: Backlog = field(default_factory=Backlog)
    # What its slots hold, for a model that keeps its conversations (``conversations``).
    book: SlotBook | None = None


def new_replica(child: Backend, learned: Sequence[int] = (), book: SlotBook | None = None
                ) -> Replica:
    """A replica of a child that starts serving: its prefix table holds ``learned``, the
    keys of the states restored into it (``warm``), or nothing, as its KV cache does; its
    slots' ``book``, for a model that keeps its conversations."""
    replica = Replica(child, book=book)
    if learned:
        replica.prefixes.record(learned)
    return replica


def books(runtime: ModelRuntime, warm: WarmSwaps | None,
          held: Sequence[tuple[int, Conversation | None, int]] = ()) -> SlotBook | None:
    """The slots' book of a new replica of ``runtime``, when its model can keep its
    conversations (warm swaps cover it), holding what was restored into it (``held``:
    slot, conversation, tokens)."""
    if warm is None or not warm.covers(runtime.preset):
        return None
    book = SlotBook(runtime.slots, warm.fingerprint_of(runtime.preset))
    for slot, conversation, tokens in held:
        if 0 <= slot < book.n_slots and (conversation is not None or tokens > 0):
            book.holding(slot, conversation, tokens)
    return book


def http_threads(args: Mapping[str, str]) -> int:
    """A child's HTTP threads: ``threads-http`` from its preset, else the router's choice."""
    raw: str = args.get("threads-http", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(slots_of(args) + 4, MIN_HTTP_THREADS)


class ModelReads:
    """What a model's record and its published snapshot (``ModelSnapshot``) both answer, read
    from ``preset``, ``state`` and the leases' ``counters``."""

    __slots__ = ()
    preset: ModelPreset
    state: ModelState
    counters: Counters

    @property
    def id(self) -> str:
        return self.preset.id

    @property
    def in_flight(self) -> int:
        return self.counters.in_flight

    @property
    def last_used(self) -> float:
        """Clock time it was last used: a request's, or its load's (``clock``)."""
        used_at, loaded_at = self.counters.used_at, self.state.loaded_at
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
        state = self.state
        return state.status is Status.LOADED and not state.draining and bool(self.replicas)


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
    counters: Counters = field(default_factory=Counters)  # the leases' own
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

    def __repr__(self) -> str:
        pids = [r.child.pid for r in self.replicas]
        return (f"<Model {self.preset.id} {self.status.value} pids={pids} "
                f"in_flight={self.in_flight} waiting={self.waiting}>")

    def pick_replica(self) -> Replica:
        """The replica with the most free slots (ties: the first)."""
        return max(self.replicas, key=lambda r: self.slots - r.in_flight)

    def route(self, prefix: Prefix, now: float) -> tuple[Replica, Decision, float, int]:
        """The replica for a request with prompt ``prefix``, which then remembers its keys; the
        decision, the request's expected work there in seconds (``pace.by_cost``; until a
        child has shown its speed, by load: ``affinity.choose``, and 0), and the characters of
        its prompt that replica's table holds."""
        replicas = self.replicas
        size = self.slots
        keys = prefix.keys
        matches = [r.prefixes.longest(keys) for r in replicas]
        choice = by_cost([Option(match, r.in_flight, size,
                                 r.backlog.wait(now, r.in_flight, size), r.pace)
                          for match, r in zip(matches, replicas, strict=True)], prefix)
        if choice is None:
            index, decision = choose_among([(r.in_flight, size) for r in replicas], matches)
            work = 0.0
        else:
            index, decision, work = choice.index, choice.decision, choice.work_s
        replica = replicas[index]
        replica.prefixes.record(keys)
        return replica, decision, work, prefix.sizes[matches[index] - 1] if matches[index] else 0


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
    declaration: the leases' hot counters (``counters``: requests in flight, last use; a
    replica's in flight, prefixes, pace and backlog), which move with every request and are
    never published, and the child's log ring.

    A snapshot is also the handle a request holds on its model (``route.decide``): the core
    takes the model's lease by its id, so no model is resolved by name twice.
    """

    preset: ModelPreset
    state: ModelState
    counters: Counters  # live: the leases' own
    logs: LogRing  # live: its llama-server's recent output
    waiting: int = 0
    estimate: int = 0
    estimate_devices: Mapping[str, int] = field(default_factory=dict)
    cache_ram_mib: int | None = None
    last_load_s: float | None = None

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
        stopping children may still hold GPU memory)."""
        return ModelUse(self.id, self.status, self.in_flight, self.last_used, memory,
                        self.draining, self.waiting, devices or {}, gpu)


def snapshot_of(runtime: ModelRuntime) -> ModelSnapshot:
    """The model's record as it is now, frozen (its live counters and log ring shared)."""
    return ModelSnapshot(runtime.preset, runtime.state, runtime.counters, runtime.logs,
                         runtime.waiting, runtime.estimate,
                         MappingProxyType(dict(runtime.estimate_devices)),
                         runtime.cache_ram_mib, runtime.last_load_s)
