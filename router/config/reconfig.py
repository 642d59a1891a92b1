"""Reconfiguration as a pure diff: what a new catalogue changes for the running models.

``diff`` compares the model presets by id: ``added`` and ``removed`` ids, and among the ids
in both, ``restart`` (llama-server arguments or replica count differ: the running child must
be replaced) and ``update`` (only router-side fields differ, e.g. ``ttl`` or aliases: applied
in place, the child keeps running). The supervisor applies it without dropping a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .presets import ModelPreset


@dataclass(frozen=True)
class CatalogueDiff:
    added: list[str]
    removed: list[str]
    restart: list[str]
    update: list[str]

    def summary(self) -> dict[str, list[str]]:
        """As reported to clients (``models_reload`` events, ``POST /models/reload``)."""
        return {"added": self.added, "removed": self.removed, "changed": self.restart}


def needs_restart(old: ModelPreset, new: ModelPreset) -> bool:
    """A running child cannot take the new preset: its arguments or replica count differ
    (or, for a remote upstream, its address or key)."""
    return (dict(old.args) != dict(new.args) or old.replicas != new.replicas
            or old.upstream != new.upstream or old.upstream_key != new.upstream_key)


def diff(old: Mapping[str, ModelPreset], new: Mapping[str, ModelPreset]) -> CatalogueDiff:
    kept = sorted(old.keys() & new.keys())
    return CatalogueDiff(
        added=sorted(new.keys() - old.keys()), removed=sorted(old.keys() - new.keys()),
        restart=[m for m in kept if needs_restart(old[m], new[m])],
        update=[m for m in kept if not needs_restart(old[m], new[m]) and old[m] != new[m]])
