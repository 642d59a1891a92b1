"""FIFO admission of loads: who may start a child next, and what must make room for it.

A load queues here once its model is ready to start (downloaded, old child gone, crash
backoff sat out). Only the head of the queue plans: it asks the pure planner
(``scheduler.plan_admission``) over every model's published snapshot
(``runtime.ModelSnapshot``), with what each holds (the larger of estimate and measurement,
``accounting``), and is admitted, or has the idle models it names stopped (``evict``) and
the busy ones drained (``drain``), or is refused because it can never fit, or cannot while
the pinned models stay (a preset's ``pin``: the refusal names them, and every request waiting
for the load gets it at once). Then it waits for a change and plans again; a model within its
``min-resident`` that stands in the way ends no wait by a change, so the head also plans again
when that residency ends (the plan's ``wake_at``: admission's own deadline, never a poll).
``admit`` returns in the loop step in which the planner admitted it, so the caller switches
the model to loading before anyone else plans: two loads cannot both take the last slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from .. import clock
from ..changes import Changes
from ..config.settings import Settings
from ..errors import LoadFailed
from ..host.memory import format_size
from .accounting import Accounting
from .lifecycle import Event, Queued, Status
from .runtime import Fact, ModelRuntime, ModelSnapshot, QueueJoined, QueueLeft
from .scheduler import AdmissionPlan, plan_admission

log = logging.getLogger("router.admission")

NEVER_LOADED_S = 1.0  # what a model never loaded yet counts for in a wait estimate
REPLAN_S = 1.0  # plan again at least this often while queued at the head
RESIDENCY_SLACK_S = 0.001  # past a residency's end, so that the next plan finds it over


class Admission:
    def __init__(self, settings: Settings, accounting: Accounting,
                 apply: Callable[[ModelRuntime, Event | Fact], None],
                 changes: Changes, *, memory_budget: int | None, gpu_budgets: dict[str, int],
                 models: Callable[[], Iterable[ModelSnapshot]],
                 evict: Callable[[str], None], drain: Callable[[str, str], None],
                 undrain: Callable[[str], None]) -> None:
        self.settings = settings
        self.memory_budget = memory_budget
        self.gpu_budgets = gpu_budgets
        self._accounting = accounting
        self._apply = apply  # the record's owner's: its estimate, its place in the queue
        self._changes = changes
        self._models = models  # the published snapshots, read by the planner
        self._evict = evict  # stop this idle model to make room
        self._drain = drain  # (busy model, for whom): take no new requests, stop when idle
        self._undrain = undrain  # serve again: the load it was drained for left the queue
        self.queue: list[ModelRuntime] = []

    def position(self, model_id: str) -> int | None:
        """The model's place in the queue (0: planning now), or None when not queued."""
        return next((i for i, r in enumerate(self.queue) if r.id == model_id), None)

    def expected_wait_s(self, model_id: str) -> float | None:
        """A rough guess of how long until the model is loaded: the last load time of every
        model queued up to and including it (``NEVER_LOADED_S`` for one never loaded)."""
        position = self.position(model_id)
        if position is None:
            return None
        return round(sum(r.last_load_s or NEVER_LOADED_S for r in self.queue[:position + 1]), 3)

    def __len__(self) -> int:
        return len(self.queue)

    async def admit(self, runtime: ModelRuntime) -> None:
        """Queue, and return once the planner admits the model; raises LoadFailed when it can
        never fit, or cannot while the pinned models stay. Cancelling it leaves the queue."""
        estimated = await self._accounting.estimate(runtime)
        if estimated is not None:
            self._apply(runtime, estimated)
        target_memory, since = runtime.estimate, clock.now()
        self._apply(runtime, QueueJoined(since))
        self.queue.append(runtime)
        self._apply(runtime, Queued(len(self.queue) - 1, self.expected_wait_s(runtime.id)))
        self._changes.notify()
        try:
            while True:
                timeout: float | None = None  # not at the head: until the next change
                if self.queue[0] is runtime:
                    wake_in = self._plan(runtime, target_memory, since)
                    if wake_in is None:
                        return
                    timeout = wake_in or None
                await self._changes.wait(timeout)
        finally:
            self.queue.remove(runtime)
            self._apply(runtime, QueueLeft())
            # Admitted or gone (its requests left, an unload): a drain made for it is no
            # longer needed; the next head drains again if it needs the room.
            for model in self._models():
                if model.state.drained_for == runtime.id:
                    self._undrain(model.id)
            self._changes.notify()

    def _plan(self, runtime: ModelRuntime, target_memory: int, since: float) -> float | None:
        """One planning round at the head of the queue: None when admitted, else how long to
        wait at most before planning again (0: until the next change)."""
        now = clock.now()
        waited = now - since
        plan = self._planned(runtime, target_memory, waited)
        if plan.refuse is not None:
            if plan.pinned:
                log.warning("refused: %s", plan.refuse,
                            extra={"event": "held_by_pins", "model": runtime.id})
                raise LoadFailed(f"cannot load '{runtime.id}': {plan.refuse}")
            raise LoadFailed(self.never_fits_message(runtime))
        if plan.admit:
            return None
        for victim in plan.evict:
            log.info("evicting least recently used", extra={"event": "evict", "model": victim})
            self._evict(victim)
        # The evicted are stopping now (``evict`` marks them in this step): one that frees
        # its model slot at once (``ModelUse.holds_slot``) may be all the room needed.
        if plan.evict and self._planned(runtime, target_memory, waited).admit:
            return None
        for busy in plan.drain:
            self._drain(busy, runtime.id)
        wake_in = REPLAN_S
        if not plan.evict and not plan.drain and waited < self.settings.fairness:
            wake_in = self.settings.fairness - waited + 0.01  # then drain a busy model
        # A minimum residency in the way ends without a change: plan again as it ends.
        if plan.wake_at is not None:
            wake_in = min(wake_in, max(plan.wake_at - now, 0.0) + RESIDENCY_SLACK_S)
        # Else waiting for a stop, a drain or a busy model's last request: each is a change.
        # Measured memory moves without one, so plan again now and then all the same.
        return wake_in

    def _planned(self, runtime: ModelRuntime, target_memory: int, waited: float) -> AdmissionPlan:
        """The planner's answer for ``runtime`` over every model as published now."""
        accounting = self._accounting
        return plan_admission(
            [m.use(accounting.memory_held(m), accounting.devices_held(m),
                   gpu=m.status is Status.STOPPING and accounting.may_hold_gpu(m))
             if m.status.holds_process else m.use(0) for m in self._models()
             if m.preset.upstream is None],  # a remote upstream holds nothing here
            runtime.id, self.settings.models_max, target_memory=target_memory,
            memory_budget=self.memory_budget, target_devices=runtime.estimate_devices,
            device_budgets=self.gpu_budgets, waited_s=waited, fairness_s=self.settings.fairness,
            now=clock.now())

    def never_fits_message(self, runtime: ModelRuntime) -> str:
        for pool, need in sorted(runtime.estimate_devices.items()):
            budget = self.gpu_budgets.get(pool)
            if budget is not None and need > budget:
                return (f"model '{runtime.id}' can never be loaded: it needs an estimated "
                        f"{format_size(need)} on {pool} but the memory budget of {pool} is "
                        f"{format_size(budget)} (--gpu-memory-budget)")
        assert self.memory_budget is not None
        return (f"model '{runtime.id}' can never be loaded: it needs an estimated "
                f"{format_size(runtime.estimate)} but the memory budget is "
                f"{format_size(self.memory_budget)} (--memory-budget)")
