"""The idle TTL rule (router.core.liveness.idle_expired), on plain run state."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from router.children.process import ChildProcess
from router.config.presets import ModelPreset
from router.core.lifecycle import ModelState, Status
from router.core.liveness import idle_expired
from router.core.runtime import ModelRuntime
from router.logs import LogRing
from router.serving.load import Replica


def serving(ttl: float | None = None, **state: object) -> ModelRuntime:
    preset = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}), ttl=ttl)
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
