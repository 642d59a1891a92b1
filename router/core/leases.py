"""The hot path's bookkeeping: a request holds one replica of a serving model while it runs.

``Leases.take`` picks a replica (the one with the most free slots, or by the request's prompt
prefix when it has one: ``ModelRuntime.route``) and counts the request in flight,
without awaiting anything, so nothing can stop the model between "it serves" and "it is in
use". ``Lease.release`` gives it back exactly once, however the request ended. The parts
below that act on what leases change are told directly, never through the supervisor above:
the CPU gate hears of a model's first request in flight and its last one done (``gate``:
``CpuGate.busy``, ``CpuGate.idle``), the lifecycle of that last one (``apply``:
``Executor.apply(runtime, Idle())``), and the executor of the last request of a replica that
has left its model (a crash, a replacement: ``on_replica_done``). A routing decision by
prefix is counted by ``on_routed`` (the metrics), when set.

A request routed by prefix also holds a ``pace.Ticket`` in its replica's backlog (its expected
work); when its response has ended, the child's ``timings`` in its last chunks (as the request's
context kept them) teach the replica's ``Pace`` (``Lease.learn``).

A request that takes one of its model's slots holds a ``fairshare.Turn`` (``wait``: the slot
queue); when its lease is released, what it really cost (``Lease.spent``, told by the edge)
goes to ``on_turn_end``, which gives the freed slot to the next request waiting for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .. import clock
from ..children.backend import Backend
from ..http.tail import ResponseTail
from ..teams.fairshare import Turn
from ..warm.conversations import Conversations, Placement
from .affinity import Prefix
from .lifecycle import Event, Idle
from .pace import Ticket
from .runtime import ModelRuntime, Replica

RoutedCallback = Callable[[str, str], None]  # (model id, affinity decision)
Apply = Callable[[ModelRuntime, Event], object]  # ``Executor.apply``
TurnEnd = Callable[[ModelRuntime, Turn, float], None]  # (model, turn, its cost's correction)


class Gate(Protocol):
    """What takes turns among busy models (``cpugate.CpuGate``)."""

    def busy(self, model: str) -> None: ...

    def idle(self, model: str) -> None: ...


class Lease:
    """A request's hold on one replica; ``release()`` exactly once when the response ends."""

    __slots__ = ("_leases", "_released", "correction", "placement", "replica", "runtime",
                 "ticket", "turn")

    def __init__(self, leases: Leases, runtime: ModelRuntime, replica: Replica,
                 ticket: Ticket | None = None, turn: Turn | None = None) -> None:
        self._leases = leases
        self.runtime = runtime
        self.replica = replica
        self.ticket = ticket
        self.turn = turn  # its place in the slot queue, for a request that takes a slot
        self.correction = 0.0  # what its turn really cost less what it was expected to
        self.placement: Placement | None = None  # its slot, where the router chose it
        self._released = False

    @property
    def child(self) -> Backend:
        return self.replica.child

    def spent(self, weighted_tokens: float) -> None:
        """What the request really cost, in weighted tokens (its prompt as the child counted
        it, its generated tokens weighted): its turn's charge is corrected at release."""
        if self.turn is not None:
            self.correction = weighted_tokens - self.turn.cost

    def learn(self, tail: ResponseTail) -> None:
        """Teach what the child's ``timings`` at the end of the response say: for a request
        routed by prefix, its replica's ``Pace``; for one placed in a slot, what the slot
        holds now (``conversations``). Call before ``release``."""
        conversations = self._leases.conversations
        if self._released or (self.ticket is None and (self.placement is None
                                                       or conversations is None)):
            return
        timings = tail.timings  # read once
        if timings is None:
            return
        if self.ticket is not None:
            self.replica.pace.learn(timings, self.ticket.chars, self.ticket.cached_chars)
        if self.placement is not None and conversations is not None:
            conversations.learn(self.runtime.preset, self.placement, timings.prompt_n,
                                timings.cache_n, timings.predicted_n)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self.placement is not None:
                Conversations.end(self.placement)
            # Its slot goes to the next request first: the model is never idle in between.
            if self.turn is not None and self._leases.on_turn_end is not None:
                self._leases.on_turn_end(self.runtime, self.turn, self.correction)
            self._leases.release(self.runtime, self.replica, self.ticket)


class Leases:
    def __init__(self, *, gate: Gate, apply: Apply,
                 on_replica_done: Callable[[Replica], None],
                 conversations: Conversations | None = None,
                 on_turn_end: TurnEnd | None = None) -> None:
        self._gate = gate
        self._apply = apply
        self._on_replica_done = on_replica_done
        self.conversations = conversations  # slots placed for the conversations kept
        self.on_routed: RoutedCallback | None = None
        self.on_turn_end = on_turn_end  # the slot queue's (``slotqueue.Slots.ended``)

    def place(self, lease: Lease, keys: tuple[int, ...], credential: bytes,
              wanted: int | None = None, pinned: bool = True) -> Placement | None:
        """Take a slot of the lease's replica for its request (``SlotBook.plan``: no await;
        ``wanted``: the slot it names; ``pinned``: the child runs it where it is sent), where
        its model keeps its conversations; what must happen first is
        ``Conversations.prepare``'s. None: the child chooses its slot."""
        conversations, replica = self.conversations, lease.replica
        preset = lease.runtime.preset
        book = replica.book
        if conversations is None or book is None or not conversations.keeps(preset,
                                                                            book.fingerprint):
            return None
        lease.placement = conversations.plan(
            preset, book, keys, conversations.owner_of(credential, preset), wanted, pinned)
        return lease.placement

    def take(self, runtime: ModelRuntime, replica: Replica | None = None,
             prefix: Prefix | None = None, turn: Turn | None = None) -> Lease:
        """Hold ``replica`` of a serving model for one request (with its slot's ``turn``, for
        one that takes a slot); default: by the prompt's ``prefix`` (``affinity``, ``pace``)
        when given, else the least busy."""
        ticket = None
        now = clock.now()
        if replica is None:
            if prefix is None:
                replica = runtime.pick_replica()
            else:
                replica, decision, work, cached = runtime.route(prefix, now)
                ticket = replica.backlog.add(work, prefix.chars, cached, now, runtime.slots)
                if self.on_routed is not None:
                    self.on_routed(runtime.preset.id, decision)
        replica.in_flight += 1
        counters = runtime.counters
        counters.in_flight += 1
        counters.used_at = now
        if counters.in_flight == 1:
            self._gate.busy(runtime.id)
        return Lease(self, runtime, replica, ticket, turn)

    def release(self, runtime: ModelRuntime, replica: Replica,
                ticket: Ticket | None = None) -> None:
        replica.in_flight -= 1
        counters = runtime.counters
        counters.in_flight -= 1
        assert replica.in_flight >= 0 and counters.in_flight >= replica.in_flight, \
            "a lease given back twice, or never taken"
        counters.used_at = now = clock.now()
        if ticket is not None:
            replica.backlog.remove(ticket, now, runtime.slots)
        if replica.in_flight == 0 and replica not in runtime.replicas:
            self._on_replica_done(replica)
        if counters.in_flight == 0:
            self._gate.idle(runtime.id)
            self._apply(runtime, Idle())
