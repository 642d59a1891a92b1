"""Reconfiguration as a pure diff (router.config.reconfig)."""

from __future__ import annotations

from types import MappingProxyType

from router.config.presets import ModelPreset
from router.config.reconfig import diff, needs_restart


def preset(model_id: str, replicas: int = 1, ttl: float | None = None, **args: str) -> ModelPreset:
    return ModelPreset(id=model_id, args=MappingProxyType({"model": f"/m/{model_id}.gguf",
                                                           **args}),
                       replicas=replicas, ttl=ttl)


def test_added_removed_restarted_and_updated_models() -> None:
    old = {"same": preset("same"), "args": preset("args"), "reps": preset("reps"),
           "ttl": preset("ttl"), "gone": preset("gone")}
    new = {"same": preset("same"), "args": preset("args", **{"ctx-size": "4096"}),
           "reps": preset("reps", replicas=2), "ttl": preset("ttl", ttl=60.0),
           "new": preset("new")}
    change = diff(old, new)
    assert change.added == ["new"] and change.removed == ["gone"]
    assert change.restart == ["args", "reps"]  # the running child cannot take these
    assert change.update == ["ttl"]  # router-side only: applied in place
    assert change.summary() == {"added": ["new"], "removed": ["gone"],
                                "changed": ["args", "reps"]}


def test_an_identical_catalogue_changes_nothing() -> None:
    models = {"a": preset("a"), "b": preset("b", **{"ctx-size": "512"})}
    copy = {"a": preset("a"), "b": preset("b", **{"ctx-size": "512"})}
    change = diff(models, copy)
    assert (change.added, change.removed, change.restart, change.update) == ([], [], [], [])


def test_only_arguments_and_replicas_need_a_restart() -> None:
    assert needs_restart(preset("a"), preset("a", **{"threads": "2"}))
    assert needs_restart(preset("a"), preset("a", replicas=3))
    assert not needs_restart(preset("a"), preset("a", ttl=5.0))
