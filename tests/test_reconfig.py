"""Reconfiguration as a pure diff (router.config.reconfig)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from router.config.envvars import ChildEnv
from router.config.policy import RequestPolicy
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


# A value of each type a preset's field holds, and another (the change tried on it).
_CHANGED: dict[str, object] = {
    "id": "other", "args": MappingProxyType({"model": "/m.gguf", "threads": "3"}),
    "source": "models-dir", "origin": None, "aliases": ("x",), "tags": ("t",),
    "load_on_startup": True, "stop_timeout": 7.0, "load_timeout": 7.0, "wait_budget": 7.0,
    "ttl": 7.0, "pin": True, "min_resident": 7.0, "replicas": 2,
    "replica_routing": "least-busy", "dedup_cache_models": True,
    "listed": False, "warm_swaps": False, "shared_conversations": True, "interactive_slots": 1,
    "upstream": "http://127.0.0.1:9", "upstream_model": "x", "upstream_key": "k",
    "upstream_connections": 3, "profile_of": "base",
    "policy": RequestPolicy(MappingProxyType({"temperature": 0.2})),
    "env": ChildEnv({"CUDA_VISIBLE_DEVICES": "1"}), "targets": ("a", "b"), "choose": "spillover",
}


def test_the_fields_that_shape_a_launch_are_exactly_those_that_restart(help_table: Any
                                                                        ) -> None:
    """``needs_restart`` is derived from the fields marked as shaping a launch, and the marks
    are held to the spawner: a field whose change changes how a child starts
    (``Spawner.launch_of``: its command line with the router's slot directory and private RAM
    cache, or a remote upstream's address, key and connections; a child and a remote each)
    is marked, and a field that changes nothing there is not. A new field must be listed."""
    import dataclasses
    from pathlib import Path

    import httpx

    from router.config.reconfig import LAUNCH_FIELDS
    from router.core.spawner import Spawner
    from router.events import EventBus

    spawner = Spawner(Path("/bin/llama-server"), help_table, httpx.AsyncClient(), EventBus(),
                      router_port=8080, cores=[], gpus=[], models=list,
                      slot_dir=lambda p: Path("/states", p.id) if p.warm_swaps else None,
                      private=True)
    names = [f.name for f in dataclasses.fields(ModelPreset)]
    assert set(names) == set(_CHANGED), "a new preset field: say how it may change here"
    child = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}))
    remote = ModelPreset(id="m", args=MappingProxyType({}), upstream="http://127.0.0.1:8")
    shaping = set()
    for name in names:
        if name == "id":  # compared by id: a reconfiguration never changes it
            continue
        for base in (child, remote):
            changed = dataclasses.replace(base, **{name: _CHANGED[name]})
            if spawner.launch_of(changed) != spawner.launch_of(base):
                shaping.add(name)
            assert needs_restart(base, changed) == (name in LAUNCH_FIELDS), name
    assert shaping == set(LAUNCH_FIELDS)
