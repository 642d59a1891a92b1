"""Pure planning: who may start, who must be evicted or drained. No I/O, no clocks, no asyncio.

Admission (``admission``) reads every model's use (``ModelUse``, from its published snapshot), asks
``plan_admission`` what to do for the model at the head of its admission queue, carries the
plan out, and asks again whenever something changes. Keeping the decision a pure function of
a snapshot makes every policy exhaustively unit-testable.

Policy:

* Capacity is several limits at once: ``models_max`` models holding a process (<= 0: no
  limit), ``memory_budget`` bytes of host RAM (None: no limit), and ``device_budgets`` bytes per
  GPU (``{"gpu0": ..., ...}``; a device without a budget is not checked). A model holds its
  memory while loading, loaded or stopping (a stopping child keeps it until it has exited). It
  holds a model slot while loading or loaded, and while stopping only if it may hold GPU
  memory (``ModelUse.holds_slot``): a CPU model's next load starts as the old child exits,
  within the memory budget, instead of after it.
* Only idle loaded models (nothing in flight, nobody queued for them) are evicted, least
  recently used first, and only as many as needed once the stopping ones are gone; a model is
  evicted only if it frees something still short (a model slot, or bytes in a pool that is
  over budget), so a model on another GPU is left alone. Loading
  models and models with requests in flight or queued are never evicted.
* Anti-thrash with a fairness bound: while every candidate is busy, the waiting model waits.
  Requests to loaded models keep being served meanwhile. Once the head of the queue has waited
  ``fairness_s``, the least recently used busy model is *drained*: it takes no new requests,
  finishes what it has, and is then evicted like any idle model.
* A model that can never fit (its estimate alone exceeds a budget) is refused at once.
* Residency (a preset's ``pin`` and ``min-resident``): a pinned model (``ModelUse.pinned``) is
  never evicted nor drained, whatever the limit that is short; it still counts against every
  limit. When the pinned models alone leave the target no room, no eviction could ever make
  it: the target is refused at once, naming the pins (``AdmissionPlan.pinned``), instead of
  waiting out its requests' budgets. A model within its minimum residency
  (``ModelUse.resident_until`` later than ``now``) is not evicted nor drained yet; the plan
  says when the earliest such protection that stands in the way ends (``wake_at``), and the
  caller plans again then.

Which of the candidates goes first is the eviction policy: an order over ``ModelUse``, picked
by name from ``EVICTION_POLICIES`` (one table, as uvicorn picks its loops): a new policy is one
entry there. The router's is ``DEFAULT_EVICTION``, least recently used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..host.memory import RAM as RAM  # its home; re-exported for the planner's readers
from ..host.memory import format_size
from .lifecycle import Status as Status  # its home; re-exported for older imports


@dataclass(frozen=True)
class ModelUse:
    """A model as the planner sees it: its state, its use, the memory it holds."""

    id: str
    status: Status
    in_flight: int = 0
    last_used: float = 0.0
    memory: int = 0  # host RAM it holds (or is expected to hold) while it has processes
    draining: bool = False
    waiting: int = 0  # requests queued for it (e.g. woken by its load, not yet served)
    devices: Mapping[str, int] = field(default_factory=dict)  # GPU bytes per device pool
    gpu: bool = False  # stopping, and its children may still hold GPU memory (any vendor)
    pinned: bool = False  # its preset's ``pin``: never evicted nor drained
    resident_until: float | None = None  # clock time its ``min-resident`` ends (None: none)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.waiting > 0

    def protected(self, now: float) -> bool:
        """Not to be evicted nor drained at ``now``: pinned, or within its minimum residency."""
        return self.pinned or (self.resident_until is not None and now < self.resident_until)

    @property
    def holds_slot(self) -> bool:
        """Counts against ``models_max``: a model holding a process, unless it is stopping
        and holds no GPU memory. Such a child serves nothing more and frees its host memory
        as it exits, which the memory budget counts until then; GPU memory too, but a device
        without a budget (or that nvidia-smi does not see) is not checked, so a stopping
        child that may hold GPU memory (``gpu``, or measured ``devices``) keeps its slot."""
        return self.status is not Status.STOPPING or self.gpu or any(self.devices.values())

    def pools(self) -> dict[str, int]:
        return {RAM: self.memory, **self.devices}


EvictionOrder = Callable[[ModelUse], tuple[Any, ...]]  # sorts the first to go first


def _least_recently_used(m: ModelUse) -> tuple[Any, ...]:
    return (m.last_used, m.id)


# The eviction policies by name: the order in which idle models are evicted and a busy one is
# chosen to drain. A policy sees only ``ModelUse``; ties end on the id, so plans are stable.
EVICTION_POLICIES: Mapping[str, EvictionOrder] = MappingProxyType({
    "lru": _least_recently_used,
})
DEFAULT_EVICTION = "lru"


@dataclass(frozen=True)
class AdmissionPlan:
    """``admit``: start the target now. ``evict``: stop these idle models first. ``drain``: stop
    giving these busy models new requests. ``refuse``: the target cannot fit (a reason);
    ``pinned``: with ``refuse``, the pinned models holding the room it lacks (empty: its
    estimate alone exceeds a budget). ``wake_at``: clock time at which the minimum residency
    of a model in the way ends: plan again then (None: no such protection)."""

    admit: bool
    evict: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    refuse: str | None = None
    pinned: tuple[str, ...] = ()
    wake_at: float | None = None


def plan_admission(models: Sequence[ModelUse], target: str, models_max: int, *,
                   target_memory: int = 0, memory_budget: int | None = None,
                   target_devices: Mapping[str, int] | None = None,
                   device_budgets: Mapping[str, int] | None = None,
                   waited_s: float = 0.0, fairness_s: float | None = None,
                   now: float = 0.0, eviction: str = DEFAULT_EVICTION) -> AdmissionPlan:
    """Decide whether ``target`` may start now (clock time ``now``, against which minimum
    residencies are read), and what must make room for it, the candidates taken in the order
    of the ``eviction`` policy (``EVICTION_POLICIES``). Pinned models and models within their
    minimum residency are never candidates, under any policy."""
    order = EVICTION_POLICIES[eviction]
    budgets: dict[str, int] = dict(device_budgets or {})
    if memory_budget is not None:
        budgets[RAM] = memory_budget
    need = {RAM: target_memory, **(target_devices or {})}
    reason = _never_fits(need, budgets)
    if reason is not None:
        return AdmissionPlan(admit=False, refuse=reason)
    others = [m for m in models if m.id != target and m.status.holds_process]
    shortfall = _Shortfall.of(others, need, budgets, models_max)
    if not shortfall.short():
        return AdmissionPlan(admit=True)
    held = _held_by_pins(others, need, budgets, models_max)
    if held is not None:
        return AdmissionPlan(admit=False, refuse=held[0], pinned=held[1])

    # Stopping models free their capacity without further action.
    for m in others:
        if m.status is Status.STOPPING:
            shortfall.free(m)
    movable = [m for m in others if not m.protected(now)]
    evict = _evict_idle(movable, shortfall, order)
    if not shortfall.short():
        return AdmissionPlan(admit=False, evict=evict)
    drain: tuple[str, ...] = ()
    if fairness_s is not None and waited_s >= fairness_s:
        drain = _drain_one_busy(movable, shortfall, order)
    return AdmissionPlan(admit=False, evict=evict, drain=drain,
                         wake_at=_residency_ends(others, shortfall, now))


def _never_fits(need: Mapping[str, int], budgets: Mapping[str, int]) -> str | None:
    """Why the target's estimate alone exceeds a budget, None when it does not."""
    for pool, budget in budgets.items():
        if need.get(pool, 0) > budget:
            what = "memory budget" if pool == RAM else f"memory budget of {pool}"
            return f"needs an estimated {need[pool]} bytes but the {what} is {budget} bytes"
    return None


@dataclass
class _Shortfall:
    """What the target still lacks: model slots over ``models_max``, and bytes over budget in
    each pool it is checked against."""

    count_over: int
    over: dict[str, int]

    @classmethod
    def of(cls, others: Sequence[ModelUse], need: Mapping[str, int],
           budgets: Mapping[str, int], models_max: int) -> _Shortfall:
        slots = sum(1 for m in others if m.holds_slot)
        count_over = (slots + 1 - models_max) if models_max > 0 else 0
        # Host RAM always counts; a GPU only if the target needs room on it (a device that is
        # over its budget for other reasons is not this load's business).
        over = {pool: sum(m.pools().get(pool, 0) for m in others) + need.get(pool, 0) - budget
                for pool, budget in budgets.items() if pool == RAM or need.get(pool, 0) > 0}
        return cls(count_over, over)

    def short(self) -> bool:
        return self.count_over > 0 or any(v > 0 for v in self.over.values())

    def helps(self, m: ModelUse) -> bool:
        """Stopping ``m`` frees something still short."""
        return self.count_over > 0 or any(self.over[p] > 0 and held > 0
                                          for p, held in m.pools().items() if p in self.over)

    def free(self, m: ModelUse) -> None:
        if m.holds_slot:
            self.count_over -= 1
        for pool, held in m.pools().items():
            if pool in self.over:
                self.over[pool] -= held


def _held_by_pins(others: Sequence[ModelUse], need: Mapping[str, int],
                  budgets: Mapping[str, int], models_max: int
                  ) -> tuple[str, tuple[str, ...]] | None:
    """When the pinned models loading or loaded leave the target no room under a limit,
    whatever else stops: why (the limit, the pins holding it) and those pins; else None."""
    pins = [m for m in others if m.pinned and m.status in (Status.LOADING, Status.LOADED)]
    short = _Shortfall.of(pins, need, budgets, models_max)
    if short.count_over > 0:
        names = tuple(sorted(m.id for m in pins))
        return (f"--models-max {models_max} is held by pinned models: {_listed(names)}; "
                "unload one with POST /models/unload or raise --models-max", names)
    for pool, over in sorted(short.over.items()):
        if over <= 0:
            continue
        names = tuple(sorted(m.id for m in pins if m.pools().get(pool, 0) > 0))
        budget, flag = (("memory budget", "--memory-budget") if pool == RAM
                        else (f"memory budget of {pool}", "--gpu-memory-budget"))
        return (f"the {budget} ({format_size(budgets[pool])}) is held by pinned models: "
                f"{_listed(names)}, which leave {format_size(max(0, need[pool] - over))} of "
                f"the {format_size(need[pool])} it needs; unload one with POST /models/unload "
                f"or raise {flag}", names)
    return None


def _listed(pins: Sequence[str]) -> str:
    return f"{', '.join(pins)} (pin = true)"


def _residency_ends(others: Sequence[ModelUse], shortfall: _Shortfall, now: float
                    ) -> float | None:
    """The earliest end of a minimum residency that keeps a model from freeing something
    still short (None: none does)."""
    ends = [m.resident_until for m in others
            if m.status is Status.LOADED and not m.pinned and m.resident_until is not None
            and m.resident_until > now and shortfall.helps(m)]
    return min(ends, default=None)


def _evict_idle(others: Sequence[ModelUse], shortfall: _Shortfall, order: EvictionOrder
                ) -> tuple[str, ...]:
    """Idle loaded models to stop, first in ``order`` first, each freeing something still
    short, until nothing is short or none is left; ``shortfall`` counts them as freed."""
    idle = sorted((m for m in others if m.status is Status.LOADED and not m.busy), key=order)
    evict: list[str] = []
    for m in idle:
        if not shortfall.short():
            break
        if shortfall.helps(m):
            evict.append(m.id)
            shortfall.free(m)
    return tuple(evict)


def _drain_one_busy(others: Sequence[ModelUse], shortfall: _Shortfall, order: EvictionOrder
                    ) -> tuple[str, ...]:
    """The fairness bound: the busy model first in ``order`` that would help, unless one that
    would is draining already."""
    busy = sorted((m for m in others if m.status is Status.LOADED and m.busy
                   and shortfall.helps(m)), key=order)
    if busy and not any(m.draining for m in busy):
        return (busy[0].id,)
    return ()
