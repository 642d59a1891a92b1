"""A request's wait for its model: one call from "which model" to a lease on a serving replica.

``ModelWait.acquire`` is the whole wait, as the edge and the scheduler simulation make it:

* a serving model: a lease at once (``leases.take``), no await, no task;
* otherwise: the model's one load task is started if none is pending (``LoadWanted``; the
  lifecycle refuses what cannot happen now), and the request awaits it (shielded: a waiter
  that leaves never cancels a load others share) until the model serves, within its wait
  budget (``--wait-budget``, the preset's ``wait-budget``, the request's header: the least),
  while its client is there (``Ends.client_gone``) and the router's shutdown grace lasts
  (``Ends.shutdown_over``). Each of those ends the wait with its own answer: 503 with
  ``Retry-After``, ``ClientGone``, the shutdown's 503.
* a load cancelled for a reconfiguration starts over with the new configuration; the last
  waiter to leave cancels a load started on demand that has spawned nothing yet
  (``NobodyWaits``).

A request that takes a slot (its ``turn``: ``slotqueue``) then also waits, in the same call,
under the same budget and ends, for one of the model's slots: at once when one is free and
nobody waits, else in the model's slot queue. A wait that runs out there is the same 503.

This module is the one writer of ``ModelRuntime.waiting``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import clock, otel
from ..config.settings import Settings
from ..errors import (
    BadRequest,
    ClientGone,
    LoadFailed,
    ModelNotFound,
    ModelNotLoaded,
    QueueFull,
    RouterError,
    ShuttingDown,
    WaitBudgetExceeded,
)
from ..serving.affinity import Prefix
from ..serving.leases import Lease, Leases
from ..serving.slotqueue import SlotQueue
from ..teams.fairshare import Turn
from .admission import Admission
from .executor import Executor
from .lifecycle import ALREADY_RUNNING, CLOSING, CRASH_LOOP, LoadWanted, NobodyWaits, Refuse, Status
from .runtime import ModelRuntime, WaitBegan, WaitEnded


@dataclass(frozen=True)
class Ends:
    """What ends a wait besides its model and its budget: ``client_gone`` returns when the
    client went away; ``shutdown_over`` is set when the shutdown's grace period is over, and
    the wait then raises ``shutdown_error()``."""

    client_gone: Callable[[], Awaitable[Any]] | None = None
    shutdown_over: asyncio.Event | None = None
    shutdown_error: Callable[[], RouterError] | None = None


NOTHING_ELSE = Ends()


class ModelWait:
    def __init__(self, settings: Settings, executor: Executor, admission: Admission,
                 leases: Leases, slots: SlotQueue,
                 models: Callable[[], Iterable[ModelRuntime]]) -> None:
        self._settings = settings
        self._executor = executor
        self._admission = admission
        self._leases = leases
        self._slots = slots
        self._models = models

    @property
    def slots(self) -> SlotQueue:
        """The slot queue (read by the simulation's invariants)."""
        return self._slots

    @property
    def total(self) -> int:
        """Requests waiting for any model."""
        return sum(r.waiting for r in self._models())

    def lease_now(self, runtime: ModelRuntime, prefix: Prefix | None = None,
                  turn: Turn | None = None) -> Lease | None:
        """A lease on a replica of a model that serves, taken at once (no await, no task),
        with a slot for ``turn`` when given; None when it does not serve or, for a turn, no
        slot is free or others wait for one."""
        if not runtime.serving or (turn is not None
                                   and not self._slots.start_now(runtime, turn)):
            return None
        return self._leases.take(runtime, prefix=prefix, turn=turn)

    async def acquire(self, runtime: ModelRuntime, *, autoload: bool = True,
                      budget: float | None = None, prefix: Prefix | None = None,
                      ends: Ends = NOTHING_ELSE, turn: Turn | None = None) -> Lease:
        """A lease on a serving replica of ``runtime`` (chosen by the prompt's ``prefix`` if
        given: ``affinity``), with one of its slots for ``turn`` when given, loading it if
        allowed. Raises ModelNotLoaded, QueueFull, LoadFailed, WaitBudgetExceeded, ClientGone
        or the shutdown's error."""
        lease = self.lease_now(runtime, prefix, turn)
        if lease is not None:
            return lease
        if not autoload and runtime.status is Status.UNLOADED:
            raise ModelNotLoaded(runtime.id)
        total = self.total
        if total >= self._settings.max_queue:
            raise QueueFull(f"{total} requests are already waiting for models "
                            f"(limit {self._settings.max_queue}); try again later",
                            headers={"Retry-After": "1"})
        own = runtime.preset.wait_budget or self._settings.wait_budget
        seconds = min(budget, own) if budget else own
        self._executor.apply(runtime, WaitBegan())
        watchers = start_watchers(ends)
        deadline = clock.now() + seconds
        try:
            while True:
                await self._until_serving(runtime, deadline, seconds, watchers, ends)
                if turn is None:
                    return self._leases.take(runtime, prefix=prefix)
                lease = self.lease_now(runtime, prefix, turn)
                if lease is not None:
                    return lease
                otel.note("llama_router.wait.slot", True)  # (the wait span: ``forward``)
                if await self._slots.wait_turn(runtime, turn, deadline, watchers):
                    return self._leases.take(runtime, prefix=prefix, turn=turn)
                raise_if_ended(watchers, ends)
                if clock.now() >= deadline:
                    raise self._budget_exceeded(runtime, seconds, slot=True)
        finally:
            for watcher in watchers:
                watcher.cancel()
            self._executor.apply(runtime, WaitEnded())
            if runtime.waiting == 0:
                self._executor.apply(runtime, NobodyWaits())

    async def _until_serving(self, runtime: ModelRuntime, deadline: float, seconds: float,
                             watchers: list[asyncio.Future[Any]], ends: Ends) -> None:
        while not runtime.serving:
            if runtime.removed:
                raise ModelNotFound(runtime.id, [])
            # The load task, made in this wait's context: its span's parent is the wait that
            # started it; every wait for it links it (``Loader.load``).
            task = self.load_task(runtime, on_demand=True)
            if otel.on:
                otel.note("llama_router.wait.load", True)
                otel.link(self._executor.loads.span_of(runtime.id))
            remaining = deadline - clock.now()
            if remaining <= 0:
                raise self._budget_exceeded(runtime, seconds)
            load = asyncio.shield(task)
            try:
                done, _ = await asyncio.wait({load, *watchers}, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not load.done():
                    load.cancel()  # the shield only: the load goes on for the others
            failed = load.exception() if load.done() and not load.cancelled() else None
            raise_if_ended(watchers, ends)  # also when the load ended in the same instant
            if load not in done:
                raise self._budget_exceeded(runtime, seconds)
            if failed is not None:
                raise failed  # LoadFailed
            # Else the model serves (or was taken again: loop), or its load was cancelled for
            # a reconfiguration: start over with the new configuration (an unload ends the
            # load with LoadFailed instead).

    def load_task(self, runtime: ModelRuntime, *, on_demand: bool,
                  explicit: bool = False) -> asyncio.Task[None]:
        """The model's load task, started if none is pending (``LoadWanted``); raises what
        the lifecycle refuses (``explicit``: POST /models/load) or LoadFailed for a preset
        without a model."""
        preset = runtime.preset
        if preset.model_path is None and preset.hf_repo is None and preset.upstream is None:
            raise LoadFailed(f"model '{runtime.id}' has no model file")
        refused = self._executor.command(runtime,
                                         LoadWanted(explicit=explicit, on_demand=on_demand))
        if refused is not None:
            raise refusal(runtime, refused)
        assert runtime.load_task is not None
        return runtime.load_task

    def load_again(self, runtime: ModelRuntime) -> None:
        """Start a load that nobody waits for (a preset added with ``load-on-startup``)."""
        with contextlib.suppress(LoadFailed):
            self.load_task(runtime, on_demand=False)

    def _budget_exceeded(self, runtime: ModelRuntime, seconds: float, *, slot: bool = False
                         ) -> WaitBudgetExceeded:
        if slot:
            return WaitBudgetExceeded(
                f"no slot of model '{runtime.id}' was free within the wait budget of "
                f"{seconds:g} s ({self._slots.waiting(runtime.id)} requests wait for one)",
                headers={"Retry-After": "5"})
        position = self._admission.position(runtime.id)
        where = f", queue position {position}" if position is not None else ""
        return WaitBudgetExceeded(
            f"model '{runtime.id}' was not ready within the wait budget of {seconds:g} s "
            f"(status: {runtime.status.value}{where})", headers={"Retry-After": "5"})


def start_watchers(ends: Ends) -> list[asyncio.Future[Any]]:
    """One future per end of the wait that can come (none for a wait with no client)."""
    watchers: list[asyncio.Future[Any]] = []
    if ends.client_gone is not None:
        watchers.append(asyncio.ensure_future(ends.client_gone()))
    if ends.shutdown_over is not None:
        watchers.append(asyncio.ensure_future(ends.shutdown_over.wait()))
    return watchers


def raise_if_ended(watchers: list[asyncio.Future[Any]], ends: Ends) -> None:
    """Raise what ended the wait, if a watcher did (the shutdown first: it answers for
    every request it ends)."""
    ended = [w for w in watchers if w.done() and not w.cancelled()]
    if not ended:
        return
    if ends.shutdown_over is not None and ends.shutdown_over.is_set():
        assert ends.shutdown_error is not None
        raise ends.shutdown_error()
    raise ClientGone("client disconnected while waiting for its model")


def refusal(runtime: ModelRuntime, refused: Refuse) -> RouterError:
    """What a client is told about a command the lifecycle refused."""
    if refused.reason == CLOSING:
        return ShuttingDown("the router is shutting down and starts no new loads")
    if refused.reason == CRASH_LOOP:
        failure = runtime.failure
        last = f" (last: {failure.message})" if failure else ""
        return LoadFailed(
            f"model '{runtime.id}' failed {runtime.state.failures_in_row} times in a "
            f"row{last}; not restarting it. Fix the cause, then POST /models/load.")
    what = "is already running" if refused.reason == ALREADY_RUNNING else "is not running"
    return BadRequest(f"model '{runtime.id}' {what} (status: {runtime.status.value})")
