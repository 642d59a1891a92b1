"""Pure planning: who may start, who must be evicted. No I/O, no clocks, no asyncio.

The supervisor takes a snapshot of every model, asks ``plan_admission`` what to do for the
model it wants to start, carries the plan out, and asks again. Keeping the decision a pure
function of a snapshot makes every policy exhaustively unit-testable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """A model's lifecycle state, as shown in ``/models`` (``status.value``)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    STOPPING = "stopping"

    @property
    def holds_process(self) -> bool:
        return self is not Status.UNLOADED


@dataclass(frozen=True)
class ModelSnapshot:
    id: str
    status: Status
    in_flight: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class Admission:
    """``admit``: start the target now. ``evict``: stop these first (then plan again)."""

    admit: bool
    evict: tuple[str, ...] = ()


def plan_admission(models: Sequence[ModelSnapshot], target: str, models_max: int) -> Admission:
    """Decide whether ``target`` may start under ``models_max`` (<= 0: unlimited).

    Every model holding a process (loading, loaded, stopping) uses a slot; a stopping model
    keeps its slot until it has exited. When full, evict loaded models with nothing in flight,
    least recently used first, just enough to make room once the stopping ones are gone.
    Loading models and models with requests in flight are never evicted.
    """
    if models_max <= 0:
        return Admission(admit=True)
    others = [m for m in models if m.id != target]
    used = sum(1 for m in others if m.status.holds_process)
    if used < models_max:
        return Admission(admit=True)
    stopping = sum(1 for m in others if m.status is Status.STOPPING)
    needed = used - models_max + 1 - stopping
    if needed <= 0:
        return Admission(admit=False)
    idle = sorted((m for m in others if m.status is Status.LOADED and m.in_flight == 0),
                  key=lambda m: (m.last_used, m.id))
    return Admission(admit=False, evict=tuple(m.id for m in idle[:needed]))
