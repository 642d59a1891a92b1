"""The configured models: the catalogue and one record (``ModelRuntime``) per model.

``ModelSet`` is the one writer of both: models come and go only here (a preset added or
removed through the API, a reloaded configuration applied as a diff), and a removed model's
record is dropped once nothing of it runs (``Forget``). The supervisor and everything else
read ``catalogue`` and ``records``.
"""

from __future__ import annotations

from ..changes import Changes
from ..config import reconfig
from ..config.presets import ModelPreset
from ..config.sources import Catalogue
from ..logs import LogRing
from .accounting import Accounting
from .executor import Executor
from .lifecycle import Forgotten, Listed, Reset, Retire
from .runtime import ModelRuntime, Unestimated
from .wait import ModelWait


class ModelSet:
    def __init__(self, catalogue: Catalogue, log_lines: int) -> None:
        self.catalogue = catalogue
        self._log_lines = log_lines
        self.records: dict[str, ModelRuntime] = {
            mid: self._record(preset) for mid, preset in catalogue.models.items()}

    def wire(self, executor: Executor, accounting: Accounting, wait: ModelWait,
             changes: Changes) -> None:
        """The parts a change drives (made after the records they read)."""
        self._executor = executor
        self._accounting = accounting
        self._wait = wait
        self._changes = changes

    def _record(self, preset: ModelPreset) -> ModelRuntime:
        return ModelRuntime(preset, LogRing(self._log_lines))

    def add(self, preset: ModelPreset) -> ModelRuntime:
        """Add a model at run time (``POST /models``)."""
        catalogue = self.catalogue
        self.catalogue = Catalogue({**catalogue.models, preset.id: preset}, catalogue.aliases,
                                   catalogue.warnings)
        runtime = self.records[preset.id] = self._record(preset)
        self._executor.apply(runtime, Listed())
        return runtime

    def remove(self, model_id: str) -> None:
        """Forget a model that is not running (``DELETE /models``)."""
        runtime = self.records[model_id]
        catalogue = self.catalogue
        self.catalogue = Catalogue({k: v for k, v in catalogue.models.items() if k != model_id},
                                   catalogue.aliases, catalogue.warnings)
        self.forget(runtime)

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]:
        """Apply a new catalogue as a diff, without dropping a request.

        * new models are listed (and loaded if ``load-on-startup``);
        * removed models stop taking requests, finish what they have, stop, and disappear;
        * changed models (llama-server args or replicas) finish their in-flight requests on
          the old child, then stop and load again; requests arriving meanwhile wait for the
          new child;
        * unchanged models keep their child (same pid); other preset fields update in place.
        """
        records = self.records
        change = reconfig.diff({m: r.preset for m, r in records.items()}, catalogue.models)
        self.catalogue = catalogue
        for model_id in change.added:
            records[model_id] = self._record(catalogue.models[model_id])
        for model_id in change.removed:
            runtime = records[model_id]
            self._executor.apply(runtime, Retire("removed", removed=True,
                                                 idle=runtime.in_flight == 0))
        for model_id in change.update:
            self._executor.set_preset(records[model_id], catalogue.models[model_id])
        for model_id in change.restart:
            runtime = records[model_id]
            self._executor.set_preset(runtime, catalogue.models[model_id])
            self._executor.apply(runtime, Unestimated())
            self._executor.apply(runtime, Reset())
            self._executor.apply(runtime, Retire("reconfigured", removed=False,
                                                 idle=runtime.in_flight == 0))
        for model_id in change.added:
            if catalogue.models[model_id].load_on_startup:
                self._wait.load_again(records[model_id])
        self._changes.notify()
        return change.summary()

    def forget(self, runtime: ModelRuntime) -> None:
        """Drop a removed model's record (``Forget``: nothing of it runs any more)."""
        if self.records.get(runtime.id) is runtime and runtime.id not in self.catalogue.models:
            del self.records[runtime.id]
            self._executor.apply(runtime, Forgotten())
