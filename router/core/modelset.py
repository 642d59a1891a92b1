"""The configured models: the catalogue, one record (``ModelRuntime``) per model, and the
snapshot of each that its owner last published (``runtime.ModelSnapshot``).

``ModelSet`` is the one writer of all three: models come and go only here (a preset added or
removed, a new catalogue taken as a diff, a removed model's record dropped once nothing of it
runs), and a model's snapshot is replaced only when the record's owner publishes one after a
change (``publish``). What those changes mean for each model's lifecycle is
``modelchanges``'. The core reads ``records``; everything outside it reads ``published``.
"""

from __future__ import annotations

from ..config import reconfig
from ..config.presets import ModelPreset
from ..config.sources import Catalogue
from ..logs import LogRing
from .runtime import ModelRuntime, ModelSnapshot, snapshot_of


class ModelSet:
    def __init__(self, catalogue: Catalogue, log_lines: int) -> None:
        self.catalogue = catalogue
        self._log_lines = log_lines
        self.records: dict[str, ModelRuntime] = {}
        self.published: dict[str, ModelSnapshot] = {}  # in the records' order
        for preset in catalogue.models.values():
            self._record(preset)

    def _record(self, preset: ModelPreset) -> ModelRuntime:
        runtime = self.records[preset.id] = ModelRuntime(preset, LogRing(self._log_lines))
        self.publish(runtime)
        return runtime

    def publish(self, runtime: ModelRuntime) -> None:
        """The model's record as it is now is what the rest of the router reads (its owner
        calls this after each change); a record already dropped publishes nothing."""
        if self.records.get(runtime.id) is runtime:
            self.published[runtime.id] = snapshot_of(runtime)

    def add(self, preset: ModelPreset) -> ModelRuntime:
        """A model added at run time: in the catalogue, with a new record."""
        catalogue = self.catalogue
        self.catalogue = Catalogue({**catalogue.models, preset.id: preset}, catalogue.aliases,
                                   catalogue.warnings)
        return self._record(preset)

    def remove(self, model_id: str) -> ModelRuntime:
        """A model out of the catalogue; its record stays until ``drop``."""
        catalogue = self.catalogue
        self.catalogue = Catalogue({k: v for k, v in catalogue.models.items() if k != model_id},
                                   catalogue.aliases, catalogue.warnings)
        return self.records[model_id]

    def replace(self, catalogue: Catalogue) -> reconfig.CatalogueDiff:
        """``catalogue`` from now on: what it changes, the added models with new records."""
        change = reconfig.diff({m: r.preset for m, r in self.records.items()},
                               catalogue.models)
        self.catalogue = catalogue
        for model_id in change.added:
            self._record(catalogue.models[model_id])
        return change

    def drop(self, runtime: ModelRuntime) -> bool:
        """Drop a removed model's record (nothing of it runs any more); whether it went."""
        if self.records.get(runtime.id) is runtime and runtime.id not in self.catalogue.models:
            del self.records[runtime.id]
            del self.published[runtime.id]
            return True
        return False
