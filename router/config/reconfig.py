"""Reconfiguration as a pure diff: what a new catalogue changes for the running models.

``diff`` compares the model presets by id: ``added`` and ``removed`` ids, and among the ids
in both, ``restart`` (llama-server arguments or replica count differ: the running child must
be replaced) and ``update`` (only router-side fields differ, e.g. ``ttl`` or aliases: applied
in place, the child keeps running). The supervisor applies it without dropping a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

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


# The preset's fields that shape how its children start (``presets.LAUNCH``), read once.
LAUNCH_FIELDS: Final = tuple(f.name for f in fields(ModelPreset) if f.metadata.get("launch"))


def needs_restart(old: ModelPreset, new: ModelPreset) -> bool:
    """A running child cannot take the new preset: a field that shapes how its children
    start differs (``LAUNCH_FIELDS``: its arguments, replica count, slot directory, RAM
    cache, upstream)."""
    return any(_plain(getattr(old, name)) != _plain(getattr(new, name))
               for name in LAUNCH_FIELDS)


def _plain(value: object) -> object:
    return dict(value) if isinstance(value, Mapping) else value


def diff(old: Mapping[str, ModelPreset], new: Mapping[str, ModelPreset]) -> CatalogueDiff:
    kept = sorted(old.keys() & new.keys())
    return CatalogueDiff(
        added=sorted(new.keys() - old.keys()), removed=sorted(old.keys() - new.keys()),
        restart=[m for m in kept if needs_restart(old[m], new[m])],
        update=[m for m in kept if not needs_restart(old[m], new[m]) and old[m] != new[m]])
