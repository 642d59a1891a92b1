"""The hot path's bookkeeping: a request holds one replica of a serving model while it runs.
The leases are the one writer of what runs on a model's children (``load``: the model's and
each replica's requests in flight, prefixes, pace, backlog).

``Leases.take`` picks a replica (the one with the most free slots, or by the request's prompt
prefix when it has one: ``route``) and counts the request in flight, without awaiting
anything, so nothing can stop the model between "it serves" and "it is in use".
``Lease.release`` gives it back exactly once, however the request ended. The parts that act
on what leases change are told directly, through what the core hands down: the CPU gate hears
of a model's first request in flight and its last one done (``gate``: ``CpuGate.busy``,
``CpuGate.idle``), the lifecycle of that last one (``idle``), and the executor of the last
request of a replica that has left its model (a crash, a replacement: ``on_replica_done``). A
routing decision by prefix is counted by ``on_routed`` (the metrics), when set.

For a model that keeps its conversations, ``Leases.place`` takes the request's slot of its
replica and has what it needs first done (``warm.conversations``: a displaced conversation
saved, its own restored).

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
from ..config.presets import ModelPreset
from ..http.tail import ResponseTail
from ..teams.fairshare import Turn
from ..warm.conversations import Conversations, SlotUse
from .affinity import Decision, Prefix, choose_among
from .load import Replica, Served
from .pace import Option, Ticket, by_cost

RoutedCallback = Callable[[str, str], None]  # (model id, affinity decision)
Idle = Callable[[Served], None]  # the model's last request in flight ended
TurnEnd = Callable[[Served, Turn, float], None]  # (model, turn, its cost's correction)


class Gate(Protocol):
    """What takes turns among busy models (``cpugate.CpuGate``)."""

    def busy(self, model: str) -> None: ...

    def idle(self, model: str) -> None: ...


class Lease:
    """A request's hold on one replica; ``release()`` exactly once when the response ends."""

    __slots__ = (
        "_leases",
        "_released",
        "correction",
        "replica",
        "runtime",
        "slot_use",
        "ticket",
        "turn",
    )

    def __init__(self, leases: Leases, runtime: Served, replica: Replica,
                 ticket: Ticket | None = None, turn: Turn | None = None) -> None:
        self._leases = leases
        self.runtime = runtime
        self.replica = replica
        self.ticket = ticket
        self.turn = turn  # its place in the slot queue, for a request that takes a slot
        self.correction = 0.0  # what its turn really cost less what it was expected to
        self.slot_use: SlotUse | None = None  # its slot, where the router chose it
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
        if self._released or (self.ticket is None and (self.slot_use is None
                                                       or conversations is None)):
            return
        timings = tail.timings  # read once
        if timings is None:
            return
        if self.ticket is not None:
            self.replica.pace.learn(timings, self.ticket.chars, self.ticket.cached_chars)
        if self.slot_use is not None and conversations is not None:
            conversations.learn(self.runtime.preset, self.slot_use, timings.prompt_n,
                                timings.cache_n, timings.predicted_n)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self.slot_use is not None:
                Conversations.end(self.slot_use)
            # Its slot goes to the next request first: the model is never idle in between.
            if self.turn is not None and self._leases.on_turn_end is not None:
                self._leases.on_turn_end(self.runtime, self.turn, self.correction)
            self._leases.release(self.runtime, self.replica, self.ticket)


class Leases:
    def __init__(self, *, gate: Gate, idle: Idle,
                 on_replica_done: Callable[[Replica], None],
                 conversations: Conversations | None = None,
                 on_turn_end: TurnEnd | None = None) -> None:
        self._gate = gate
        self._idle = idle
        self._on_replica_done = on_replica_done
        self.conversations = conversations  # slots placed for the conversations kept
        self.on_routed: RoutedCallback | None = None
        self.on_turn_end = on_turn_end  # the slot queue's (``slotqueue.SlotQueue.ended``)

    def keeps_conversations(self, preset: ModelPreset) -> bool:
        """Whether the requests of a model with ``preset`` are placed in its slots
        (``place``)."""
        return self.conversations is not None and self.conversations.keeps(preset)

    async def place(self, lease: Lease, prefix: Prefix, credential: bytes,
                    wanted: int | None = None, pinned: bool = True) -> int | None:
        """The slot the lease's request runs in (its ``id_slot``; ``wanted``: the one it
        names, given when the book honours it: ``SlotBook.plan``), once what it needs first is
        done (``Conversations.prepare``: a displaced conversation saved, its own restored,
        another owner's erased; ``pinned``: whether the child runs it in that slot, else every
        slot it may choose is made safe for it); None: the child chooses. The slot is taken
        at once (no await); the lease's release frees it, also when this is cancelled."""
        conversations, replica, runtime = self.conversations, lease.replica, lease.runtime
        preset, book = runtime.preset, replica.book
        if conversations is None or book is None or not conversations.keeps(preset,
                                                                            book.fingerprint):
            return None
        slot_use = lease.slot_use = conversations.plan(
            preset, book, prefix.stable, conversations.owner_of(credential, preset), wanted,
            pinned)
        if slot_use.slot is None:
            return None
        speed = replica.pace.prompt_s_per_char
        index = runtime.replicas.index(replica) if replica in runtime.replicas else 0
        await conversations.prepare(preset, slot_use, replica.child, index * runtime.slots,
                                    None if speed is None else speed * prefix.chars)
        return slot_use.slot

    def take(self, runtime: Served, replica: Replica | None = None,
             prefix: Prefix | None = None, turn: Turn | None = None) -> Lease:
        """Hold ``replica`` of a serving model for one request (with its slot's ``turn``, for
        one that takes a slot); default: by the prompt's ``prefix`` (``affinity``, ``pace``)
        when given, else the least busy."""
        ticket = None
        now = clock.now()
        if replica is None:
            if prefix is None:
                replica = least_busy(runtime)
            else:
                replica, decision, work, cached = route(runtime, prefix)
                replica.prefixes.record(prefix.keys)
                ticket = replica.backlog.add(work, prefix.chars, cached, now, runtime.slots)
                if self.on_routed is not None:
                    self.on_routed(runtime.preset.id, decision)
        replica.in_flight += 1
        load = runtime.load
        load.in_flight += 1
        load.used_at = now
        if load.in_flight == 1:
            self._gate.busy(runtime.id)
        return Lease(self, runtime, replica, ticket, turn)

    def release(self, runtime: Served, replica: Replica, ticket: Ticket | None = None) -> None:
        replica.in_flight -= 1
        load = runtime.load
        load.in_flight -= 1
        assert replica.in_flight >= 0 and load.in_flight >= replica.in_flight, \
            "a lease given back twice, or never taken"
        load.used_at = now = clock.now()
        if ticket is not None:
            replica.backlog.remove(ticket, now, runtime.slots)
        if replica.in_flight == 0 and replica not in runtime.replicas:
            self._on_replica_done(replica)
        if load.in_flight == 0:
            self._gate.idle(runtime.id)
            self._idle(runtime)


def least_busy(runtime: Served) -> Replica:
    """The replica with the most free slots (ties: the first)."""
    return max(runtime.replicas, key=lambda r: runtime.slots - r.in_flight)


def route(runtime: Served, prefix: Prefix) -> tuple[Replica, Decision, float, int]:
    """The replica for a request with prompt ``prefix``: the decision, the request's expected
    work there in seconds (``pace.by_cost``; until a child has shown its speed, by load:
    ``affinity.choose_among``, and 0), and the characters of its prompt that replica's table
    holds (pure: the lease records the keys in the table of the replica it takes)."""
    replicas = runtime.replicas
    size = runtime.slots
    now = clock.now()
    matches = [r.prefixes.longest(prefix.keys) for r in replicas]
    choice = by_cost([Option(match, r.in_flight, size,
                             r.backlog.wait(now, r.in_flight, size), r.pace)
                      for match, r in zip(matches, replicas, strict=True)], prefix)
    if choice is None:
        index, decision = choose_among([(r.in_flight, size) for r in replicas], matches)
        work = 0.0
    else:
        index, decision, work = choice.index, choice.decision, choice.work_s
    return replicas[index], decision, work, prefix.sizes[matches[index] - 1] \
        if matches[index] else 0
