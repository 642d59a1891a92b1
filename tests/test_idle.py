"""The idle TTL rule (router.core.liveness.idle_expired), on plain run state."""

from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType

from router.children.process import ChildProcess
from router.config.presets import ModelPreset
from router.core.lifecycle import ModelState, Status
from router.core.liveness import idle_expired
from router.core.runtime import ModelRuntime
from router.logs import LogRing
from router.serving.load import Replica


def serving(ttl: float | None = None, pin: bool = False, min_resident: float = 0.0,
            **state: object) -> ModelRuntime:
    preset = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}), ttl=ttl,
                         pin=pin, min_resident=min_resident)
    runtime = ModelRuntime(preset, LogRing(10), state=ModelState(Status.LOADED, **state))
    runtime.state = replace(runtime.state, replicas=tuple([Replica(object.__new__(ChildProcess))]))
    runtime.load.used_at = 100.0
    return runtime


def test_the_default_ttl_applies_unless_the_preset_sets_one() -> None:
    assert not idle_expired(serving(), 60.0, 159.0)
    assert idle_expired(serving(), 60.0, 160.0)
    assert not idle_expired(serving(ttl=120.0), 60.0, 160.0)
    assert idle_expired(serving(ttl=120.0), 0.0, 220.0)


def test_zero_means_never() -> None:
    assert not idle_expired(serving(), 0.0, 1e9)
    assert not idle_expired(serving(ttl=0.0), 60.0, 1e9)


def test_only_an_idle_serving_model_expires() -> None:
    busy = serving()
    busy.load.in_flight = 1
    waited_for = serving()
    waited_for.waiting = 1
    draining = serving(draining=True)
    for runtime in (busy, waited_for, draining):
        assert not idle_expired(runtime, 60.0, 1e9)
    stopped = serving()
    stopped.state = ModelState(Status.UNLOADED)
    assert not idle_expired(stopped, 60.0, 1e9)


def test_a_pinned_model_never_expires() -> None:
    assert not idle_expired(serving(pin=True), 60.0, 1e9)
    assert not idle_expired(serving(ttl=5.0, pin=True), 0.0, 1e9)


def test_min_resident_outlasts_a_shorter_ttl() -> None:
    """Loaded at 90, used last at 100, ``ttl`` 10 and ``min-resident`` 30: kept until 120."""
    assert not idle_expired(serving(ttl=10.0, min_resident=30.0, loaded_at=90.0), 0.0, 119.0)
    assert idle_expired(serving(ttl=10.0, min_resident=30.0, loaded_at=90.0), 0.0, 120.0)
    # a min-resident shorter than the TTL changes nothing
    assert idle_expired(serving(ttl=10.0, min_resident=5.0, loaded_at=90.0), 0.0, 110.0)


def test_a_requests_keep_alive_is_the_ttl_of_its_load() -> None:
    kept = serving(ttl=10.0)
    kept.keep_alive = 30.0
    assert not idle_expired(kept, 0.0, 129.0) and idle_expired(kept, 0.0, 130.0)
    assert kept.idle_ttl(5.0) == 30.0
    kept.keep_alive = math.inf  # negative on the wire: no idle TTL
    assert not idle_expired(kept, 60.0, 1e9) and kept.idle_ttl(60.0) == 0.0
    kept.keep_alive = None  # a stop began: the preset's again
    assert kept.idle_ttl(5.0) == 10.0


def test_keep_alive_0_unloads_once_idle_as_an_explicit_unload_would() -> None:
    pinned = serving(pin=True, min_resident=60.0, loaded_at=99.0)
    pinned.keep_alive = 0.0
    assert idle_expired(pinned, 0.0, 100.0)  # neither the pin nor min-resident hold it
    pinned.load.in_flight = 1
    assert not idle_expired(pinned, 0.0, 100.0)  # not while a request runs
