"""The hot path's bookkeeping: a request holds one replica of a serving model while it runs.

``Leases.take`` picks a replica (the one with the most free slots, or by the request's prompt
prefix keys when it has them: ``ModelRuntime.route``) and counts the request in flight,
without awaiting anything, so nothing can stop the model between "it serves" and "it is in
use". ``Lease.release`` gives it back exactly once, however the request ended. The owner (the
supervisor) hears of the transitions it acts on through callbacks: a model's first request in
flight (``on_busy``), its last one done (``on_idle``), and the last request of a replica that
has left its model (a crash, a replacement) done (``on_replica_done``). A routing decision by
prefix is reported to ``on_routed`` (the metrics), when set.
"""

from __future__ import annotations

from collections.abc import Callable

from . import clock
from .backend import Backend
from .runtime import ModelRuntime, Replica

ModelCallback = Callable[[ModelRuntime], None]
RoutedCallback = Callable[[str, str], None]  # (model id, affinity decision)


class Lease:
    """A request's hold on one replica; ``release()`` exactly once when the response ends."""

    __slots__ = ("_leases", "_released", "replica", "runtime")

    def __init__(self, leases: Leases, runtime: ModelRuntime, replica: Replica) -> None:
        self._leases = leases
        self.runtime = runtime
        self.replica = replica
        self._released = False

    @property
    def child(self) -> Backend:
        return self.replica.child

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._leases.release(self.runtime, self.replica)


class Leases:
    def __init__(self, *, on_busy: ModelCallback, on_idle: ModelCallback,
                 on_replica_done: Callable[[Replica], None]) -> None:
        self._on_busy = on_busy
        self._on_idle = on_idle
        self._on_replica_done = on_replica_done
        self.on_routed: RoutedCallback | None = None

    def take(self, runtime: ModelRuntime, replica: Replica | None = None,
             keys: tuple[int, ...] | None = None) -> Lease:
        """Hold ``replica`` of a serving model for one request; default: by the prompt's
        prefix ``keys`` (``affinity``) when given, else the least busy."""
        if replica is None:
            if keys is None:
                replica = runtime.pick_replica()
            else:
                replica, decision = runtime.route(keys)
                if self.on_routed is not None:
                    self.on_routed(runtime.preset.id, decision)
        replica.in_flight += 1
        runtime.in_flight += 1
        runtime.last_used = clock.now()
        if runtime.in_flight == 1:
            self._on_busy(runtime)
        return Lease(self, runtime, replica)

    def release(self, runtime: ModelRuntime, replica: Replica) -> None:
        replica.in_flight -= 1
        runtime.in_flight -= 1
        runtime.last_used = clock.now()
        if replica.in_flight == 0 and replica not in runtime.replicas:
            self._on_replica_done(replica)
        if runtime.in_flight == 0:
            self._on_idle(runtime)
