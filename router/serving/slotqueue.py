"""The slot queue: the router holds the requests that its models' slots cannot take yet.

A request that takes a slot (a completion, an embedding: ``paths.METERED_PATHS``) goes to a
model's children only while fewer such requests run there than its slots (``capacity``: each
serving replica's ``parallel``). The rest wait here, one ``fairshare.FairQueue`` per model,
and are taken in its order (priority class, then fair share between flows, then arrival)
when a slot frees: the model's requests never queue inside llama-server, where any order is
first come, first served.

* ``start_now``: the hot path. A slot is free and nobody waits: the turn starts at once, no
  await.
* ``wait_turn``: the request waits for its turn, within its wait budget, while its client is
  there and the shutdown allows (``wait.Ends``); a client that leaves frees its place and is
  charged nothing.
* preemption: a request that must wait while a request of a lower class runs, one whose
  answer has not begun (not streamed, so nothing goes to its client before the end), takes
  that one's slot back (``http.proxy.Preemption``); the request taken back waits again, first
  of its flow, charged nothing, and runs to its end after ``MAX_PREEMPTIONS`` times. llama-
  server keeps its prompt in its RAM cache, so running it again costs little more than the
  tokens it had generated.
* ``ended``: a request that held a slot has ended (``leases.Lease.release``): its real cost
  corrects its flow's service, and the freed slot goes to the next turn at once, before the
  lease is given back, so the model is never idle in between (work-conserving). Each change
  of a model (a replica added or gone: ``changes``) gives free slots out too.

A turn granted is a slot reserved: the waiter takes its lease when it wakes; a waiter that
cannot use it (its client left in the same instant, the model stopped) gives it back.
Requests to a remote upstream, which has no slots the router knows, never wait here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .. import clock
from ..changes import Changes
from ..config.keyfile import INTERACTIVE, PRIORITIES
from ..teams.fairshare import FairQueue, Turn
from .load import Served

log = logging.getLogger("router.slots")


class SlotQueue:
    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        self._queues: dict[str, FairQueue] = {}
        self._granted: dict[Turn, asyncio.Future[None]] = {}

    def forget(self, model_id: str) -> None:
        """A removed model (``EventBus.on_removed``): its queue goes (its waiters, if any,
        end as their model is gone)."""
        self._queues.pop(model_id, None)

    def queue(self, runtime: Served) -> FairQueue:
        queue = self._queues.get(runtime.id)
        if queue is None:
            queue = self._queues[runtime.id] = FairQueue()
        return queue

    def waiting(self, model_id: str) -> int:
        """Requests waiting here for a slot of the model."""
        queue = self._queues.get(model_id)
        return queue.waiting if queue is not None else 0

    def backlogged(self, model_id: str) -> dict[int, list[float]]:
        """The service of the model's flows with requests waiting, by class
        (``FairQueue.backlogged``)."""
        queue = self._queues.get(model_id)
        return queue.backlogged() if queue is not None else {}

    def running(self, model_id: str) -> int:
        """Requests holding a slot of the model."""
        queue = self._queues.get(model_id)
        return queue.running if queue is not None else 0

    @staticmethod
    def capacity(runtime: Served) -> int | None:
        """The requests the model's children take at once; None: not counted (a remote
        upstream)."""
        if runtime.preset.upstream is not None:
            return None
        return runtime.slots * len(runtime.replicas)

    def may_start(self, runtime: Served, rank: int) -> bool:
        """Whether a turn of class ``rank`` may take a slot now: one is free, and for a
        class below the interactive one, fewer of the other classes run than the slots
        that the ``interactive-slots`` of each replica leave them."""
        capacity = self.capacity(runtime)
        if capacity is None:
            return True
        queue = self._queues.get(runtime.id)
        running = queue.running if queue is not None else 0
        if running >= capacity:
            return False
        kept = runtime.preset.interactive_slots
        if rank == INTERACTIVE or not kept:
            return True
        others = running - (queue.running_interactive if queue is not None else 0)
        return others < (runtime.slots - kept) * len(runtime.replicas)

    def start_now(self, runtime: Served, turn: Turn) -> bool:
        """Start ``turn`` now when nobody waits and it may take a slot (``may_start``)."""
        queue = self.queue(runtime)
        if queue.waiting or not self.may_start(runtime, turn.rank):
            return False
        queue.start(turn)
        return True

    async def wait_turn(self, runtime: Served, turn: Turn, deadline: float,
                        watchers: list[asyncio.Future[Any]]) -> bool:
        """Until ``turn`` has a slot (True), the model no longer has a slot to give (False:
        not started), the deadline (False) or a watcher (its end: the caller raises it)."""
        queue = self.queue(runtime)
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._granted[turn] = granted
        queue.push(turn)
        self.grant(runtime)
        if not granted.done():
            self._preempt_for(runtime, queue, turn)
        used = False
        try:
            while not granted.done():
                remaining = deadline - clock.now()
                if remaining <= 0 or not runtime.loaded:
                    return False
                change = asyncio.ensure_future(self._changes.wait())
                try:
                    await asyncio.wait({granted, change, *watchers}, timeout=remaining,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()
                if any(w.done() for w in watchers):
                    return False
                self.grant(runtime)
            used = runtime.serving or self._may_grant(runtime)
            return used
        finally:
            self._granted.pop(turn, None)
            if not turn.started:
                queue.remove(turn)
            elif not used:  # granted, but nobody takes it: the next turn gets the slot
                self.ended(runtime, turn, -turn.cost)

    def ended(self, runtime: Served, turn: Turn, correction: float) -> None:
        """A started turn ended (``correction``: its real cost less its expected one): its
        slot goes to the next."""
        queue = self._queues.get(runtime.id)
        if queue is None:
            return
        queue.end(turn, correction)
        self.grant(runtime)
        if not queue.running and not queue.waiting:
            self._queues.pop(runtime.id, None)

    def grant(self, runtime: Served) -> None:
        """Give the model's free slots to the turns next in order."""
        queue = self._queues.get(runtime.id)
        if queue is None or not queue.waiting or not self._may_grant(runtime):
            return
        while (turn := queue.pop(lambda rank: self.may_start(runtime, rank))) is not None:
            granted = self._granted.get(turn)
            if granted is not None and not granted.done():
                granted.set_result(None)

    @staticmethod
    def _preempt_for(runtime: Served, queue: FairQueue, turn: Turn) -> None:
        """Take a slot back for ``turn`` from a running request of a lower class whose answer
        has not begun (``FairQueue.victim``); its slot comes free when it gives it back, and
        it waits again, first of its flow."""
        victim = queue.victim(turn)
        if victim is not None and victim.preempt is not None and victim.preempt():
            victim.preemptions += 1
            log.info("a slot taken back from a request of class %s (%s) for one of class %s",
                     PRIORITIES[victim.rank], victim.flow, PRIORITIES[turn.rank],
                     extra={"event": "preempted", "model": runtime.id})

    @staticmethod
    def _may_grant(runtime: Served) -> bool:
        """Whether the model has slots to give (``Served.has_slots``)."""
        return runtime.has_slots
