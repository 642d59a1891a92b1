"""Pure planning: who may start, who must be evicted or drained. No I/O, no clocks, no asyncio.

The supervisor takes a snapshot of every model, asks ``plan_admission`` what to do for the
model at the head of its admission queue, carries the plan out, and asks again whenever
something changes. Keeping the decision a pure function of a snapshot makes every policy
exhaustively unit-testable.

Policy:

* Capacity is two limits at once: ``models_max`` models holding a process (<= 0: no limit) and
  ``memory_budget`` bytes (None: no limit). A model holds capacity while loading, loaded or
  stopping (a stopping child keeps its memory until it has exited).
* Only idle loaded models (nothing in flight, nobody queued for them) are evicted, least
  recently used first, and only as many as needed once the stopping ones are gone. Loading
  models and models with requests in flight or queued are never evicted.
* Anti-thrash with a fairness bound: while every candidate is busy, the waiting model waits.
  Requests to loaded models keep being served meanwhile. Once the head of the queue has waited
  ``fairness_s``, the least recently used busy model is *drained*: it takes no new requests,
  finishes what it has, and is then evicted like any idle model.
* A model that can never fit (its estimate alone exceeds the budget) is refused at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """A model's lifecycle state, as shown in ``/models`` (``status.value``)."""

    UNLOADED = "unloaded"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    LOADED = "loaded"
    STOPPING = "stopping"

    @property
    def holds_process(self) -> bool:
        return self not in (Status.UNLOADED, Status.DOWNLOADING)


@dataclass(frozen=True)
class ModelSnapshot:
    id: str
    status: Status
    in_flight: int = 0
    last_used: float = 0.0
    memory: int = 0  # bytes it holds (or is expected to hold) while it has processes
    draining: bool = False
    waiting: int = 0  # requests queued for it (e.g. woken by its load, not yet served)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.waiting > 0


@dataclass(frozen=True)
class Admission:
    """``admit``: start the target now. ``evict``: stop these idle models first. ``drain``: stop
    giving these busy models new requests. ``refuse``: the target can never fit (a reason)."""

    admit: bool
    evict: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    refuse: str | None = None


def plan_admission(models: Sequence[ModelSnapshot], target: str, models_max: int, *,
                   target_memory: int = 0, memory_budget: int | None = None,
                   waited_s: float = 0.0, fairness_s: float | None = None) -> Admission:
    """Decide whether ``target`` may start now, and what must make room for it."""
    if memory_budget is not None and target_memory > memory_budget:
        return Admission(admit=False, refuse=(
            f"needs an estimated {target_memory} bytes but the memory budget is "
            f"{memory_budget} bytes"))
    others = [m for m in models if m.id != target and m.status.holds_process]
    count_over = (len(others) + 1 - models_max) if models_max > 0 else 0
    bytes_over = (sum(m.memory for m in others) + target_memory - memory_budget
                  if memory_budget is not None else 0)
    if count_over <= 0 and bytes_over <= 0:
        return Admission(admit=True)

    # Stopping models free their capacity without further action.
    for m in others:
        if m.status is Status.STOPPING:
            count_over -= 1
            bytes_over -= m.memory
    idle = sorted((m for m in others if m.status is Status.LOADED and not m.busy),
                  key=lambda m: (m.last_used, m.id))
    evict: list[str] = []
    for m in idle:
        if count_over <= 0 and bytes_over <= 0:
            break
        evict.append(m.id)
        count_over -= 1
        bytes_over -= m.memory
    if count_over <= 0 and bytes_over <= 0:
        return Admission(admit=False, evict=tuple(evict))

    drain: tuple[str, ...] = ()
    if fairness_s is not None and waited_s >= fairness_s:
        busy = sorted((m for m in others if m.status is Status.LOADED and m.busy),
                      key=lambda m: (m.last_used, m.id))
        if busy and not any(m.draining for m in busy):
            drain = (busy[0].id,)
    return Admission(admit=False, evict=tuple(evict), drain=drain)
