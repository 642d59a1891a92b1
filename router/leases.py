"""The hot path's bookkeeping: a request holds one replica of a serving model while it runs.

``Leases.take`` picks a replica (the one with the most free slots) and counts the request in
flight, without awaiting anything, so nothing can stop the model between "it serves" and "it
is in use". ``Lease.release`` gives it back exactly once, however the request ended. The
owner (the supervisor) hears of the transitions it acts on through callbacks: a model's
first request in flight (``on_busy``), its last one done (``on_idle``), and the last request
of a replica that has left its model (a crash, a replacement) done (``on_replica_done``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .process import ChildProcess
from .runtime import ModelRuntime, Replica

ModelCallback = Callable[[ModelRuntime], None]


class Lease:
    """A request's hold on one replica; ``release()`` exactly once when the response ends."""

    __slots__ = ("_leases", "_released", "replica", "runtime")

    def __init__(self, leases: Leases, runtime: ModelRuntime, replica: Replica) -> None:
        self._leases = leases
        self.runtime = runtime
        self.replica = replica
        self._released = False

    @property
    def child(self) -> ChildProcess:
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

    def take(self, runtime: ModelRuntime, replica: Replica | None = None) -> Lease:
        """Hold ``replica`` (default: the least busy) of a serving model for one request."""
        replica = replica or runtime.pick_replica()
        replica.in_flight += 1
        runtime.in_flight += 1
        runtime.last_used = time.monotonic()
        if runtime.in_flight == 1:
            self._on_busy(runtime)
        return Lease(self, runtime, replica)

    def release(self, runtime: ModelRuntime, replica: Replica) -> None:
        replica.in_flight -= 1
        runtime.in_flight -= 1
        runtime.last_used = time.monotonic()
        if replica.in_flight == 0 and replica not in runtime.replicas:
            self._on_replica_done(replica)
        if runtime.in_flight == 0:
            self._on_idle(runtime)
