"""The idle TTL: a model serving nothing for its ``ttl`` (else ``--idle-timeout``) is stopped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from .. import clock
from .runtime import ModelRuntime

log = logging.getLogger("router.supervisor")

REAPER_INTERVAL_S = 1.0


def idle_expired(runtime: ModelRuntime, default_ttl: float, now: float) -> bool:
    """A serving model with nothing in flight or waiting, unused for its TTL (0: never)."""
    ttl = runtime.preset.ttl if runtime.preset.ttl is not None else default_ttl
    return bool(ttl and runtime.serving and runtime.in_flight == 0 and runtime.waiting == 0
                and now - runtime.last_used >= ttl)


async def reap_idle(models: Callable[[], Iterable[ModelRuntime]], default_ttl: float,
                    stop: Callable[[ModelRuntime, str], object]) -> None:
    """Every ``REAPER_INTERVAL_S``, stop the models whose idle TTL has run out; runs until
    cancelled."""
    while True:
        await asyncio.sleep(REAPER_INTERVAL_S)
        now = clock.now()
        for runtime in list(models()):
            if idle_expired(runtime, default_ttl, now):
                log.info("idle for %.0f s; unloading", now - runtime.last_used,
                         extra={"event": "idle_unload", "model": runtime.id})
                stop(runtime, "idle")
