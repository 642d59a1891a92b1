"""Liveness of serving children: a child that stops answering is killed, not waited on.

A child that became healthy can still freeze (SIGSTOP from outside, a deadlock, a GPU hang).
Its requests would then wait for ever: nothing else notices, because the process is alive.
So every ``interval`` seconds each serving child is probed (``Backend.probe``: a
``GET /health``) with a ``timeout``;
llama-server answers it on an HTTP thread of its own (the router keeps two free of proxied
connections, ``runtime.RESERVED_HTTP_THREADS``) without waiting for generation, so a slow
generation never looks dead. ``misses`` unanswered probes in a row (no answer in time, a
refused connection, or not 200) kill the child with SIGKILL; its exit watcher then treats it
as a crash (``executor``): in-flight requests fail with the envelope (502, or the error event
of a stream), the model restarts under the crash backoff, and the ``unresponsive`` event and
metric say why.

A remote upstream (``remote``) answers the same probe (``RemoteUpstream.probe``: its own
health path, with its key);
after its misses it is marked gone instead of killed, and handled as a crash the same way.

A child the CPU gate has paused for its turn (``cpugate``) is not answering either: a probe
that ends while it is paused is not counted.

``Misses`` is the count of health checks missed in a row, kept here for children and remote
upstreams; a peer router counts its own in its state (``peer.PeerState.missed``).

The other end of a model's life is watched here too, the idle TTL (``reap_idle``): a model
serving nothing for its ``ttl`` (else ``--idle-timeout``) is stopped, unless its preset pins
it (``pin``) or it became loaded less than its ``min-resident`` ago.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Iterable
from typing import Generic, TypeVar

from .. import clock
from ..children.backend import Backend
from ..children.remote import RemoteUpstream
from .lifecycle import UNLOADED, Status
from .runtime import ModelRuntime

log = logging.getLogger("router.liveness")

Unresponsive = Callable[[ModelRuntime, Backend, str], None]
K = TypeVar("K")


class Misses(Generic[K]):
    """Health checks missed in a row by each thing checked that is missing them."""

    def __init__(self) -> None:
        self._missed: dict[K, int] = {}

    def __getitem__(self, key: K) -> int:
        """Checks ``key`` missed in a row (0: it answered the last one)."""
        return self._missed.get(key, 0)

    def miss(self, key: K) -> int:
        """One more check missed by ``key``: how many in a row now."""
        missed = self._missed[key] = self._missed.get(key, 0) + 1
        return missed

    def answered(self, key: K) -> int:
        """``key`` answered: start again from 0; how many it had missed."""
        return self._missed.pop(key, 0)

    def forget(self, key: K) -> None:
        """Count ``key`` afresh from 0 (it was dealt with)."""
        self._missed.pop(key, None)

    def keep(self, keys: Container[K]) -> None:
        """Forget every key not in ``keys`` (no longer checked)."""
        for key in [k for k in self._missed if k not in keys]:
            del self._missed[key]


class Liveness:
    def __init__(self, *, interval: float, timeout: float,
                 misses: int, is_paused: Callable[[Backend], bool],
                 on_unresponsive: Unresponsive) -> None:
        self.interval = interval  # seconds between probe rounds; 0: no probes
        self.timeout = timeout
        self.misses = misses
        self._is_paused = is_paused
        self._on_unresponsive = on_unresponsive  # (model, child, why): kill it
        self._missed: Misses[Backend] = Misses()  # by each serving child

    def missed(self, child: Backend) -> int:
        """Health checks ``child`` missed in a row (0: it answered the last one)."""
        return self._missed[child]

    async def run(self, models: Callable[[], Iterable[ModelRuntime]]) -> None:
        """Probe every serving child each ``interval``; runs until cancelled."""
        if self.interval <= 0:
            return
        while True:
            await asyncio.sleep(self.interval)
            await self.probe_round(models())

    async def probe_round(self, models: Iterable[ModelRuntime]) -> None:
        targets = [(runtime, replica.child) for runtime in models
                   if runtime.status is Status.LOADED for replica in runtime.replicas]
        self._missed.keep({child for _, child in targets})  # the others are gone: forgotten
        await asyncio.gather(*(self._probe(runtime, child) for runtime, child in targets))

    async def _probe(self, runtime: ModelRuntime, child: Backend) -> None:
        problem = await child.probe(self.timeout)
        if problem is None:
            missed = self._missed.answered(child)
            if missed:
                log.info("answers again after %d missed health checks", missed,
                         extra={"model": runtime.id, "pid": child.pid})
            return
        if self._is_paused(child) or child.returncode is not None:
            return  # its turn is elsewhere (cpugate), or it exited: the exit watcher has it
        missed = self._missed.miss(child)
        log.warning("health check %d/%d failed: %s", missed, self.misses,
                    problem, extra={"event": "health_missed", "model": runtime.id,
                                    "pid": child.pid})
        if missed >= self.misses and runtime.status is Status.LOADED:
            self._missed.forget(child)
            if isinstance(child, RemoteUpstream):
                self._on_unresponsive(runtime, child, (
                    f"upstream {child.url} stopped answering: {missed} "
                    f"health checks in a row failed (last: {problem})"))
                return
            self._on_unresponsive(runtime, child, (
                f"llama-server stopped answering: {missed} health checks "
                f"in a row failed (last: {problem}); killed it"))


# ------------------------------------------------------------------------- the idle TTL

REAPER_INTERVAL_S = 1.0


def idle_expired(runtime: ModelRuntime, default_ttl: float, now: float) -> bool:
    """A serving model with nothing in flight or waiting, unused for its TTL (0: never); never
    a pinned one (``pin``), nor one loaded less than its ``min-resident`` ago. A request's
    ``keep_alive: 0`` is an unload once idle, as ``POST /models/unload``: pin and
    ``min-resident`` do not hold it (``Executor.idle`` does it at once; this, if the model
    was never leased after it)."""
    if not (runtime.serving and runtime.in_flight == 0 and runtime.waiting == 0):
        return False
    if runtime.keep_alive == 0:
        return True
    preset = runtime.preset
    ttl = runtime.idle_ttl(default_ttl)
    loaded_at = runtime.loaded_at
    resident = loaded_at is not None and now < loaded_at + preset.min_resident
    return bool(ttl and not preset.pin and not resident and now - runtime.last_used >= ttl)


async def reap_idle(models: Callable[[], Iterable[ModelRuntime]], default_ttl: float,
                    stop: Callable[[ModelRuntime, str], object]) -> None:
    """Every ``REAPER_INTERVAL_S``, stop the models whose idle TTL has run out; runs until
    cancelled."""
    while True:
        await asyncio.sleep(REAPER_INTERVAL_S)
        now = clock.now()
        for runtime in list(models()):
            if not idle_expired(runtime, default_ttl, now):
                continue
            if runtime.keep_alive == 0:  # an explicit unload, asked for by a request
                log.info("idle; unloading as a request's keep_alive 0 asked",
                         extra={"event": "keep_alive_unload", "model": runtime.id})
                stop(runtime, UNLOADED)
            else:
                log.info("idle for %.0f s; unloading", now - runtime.last_used,
                         extra={"event": "idle_unload", "model": runtime.id})
                stop(runtime, "idle")
