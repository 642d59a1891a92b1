"""What adding, removing and reconfiguring models means for their lifecycles: the catalogue's
changes (``modelset``) told to each model's record owner as lifecycle events.

* a new model is listed (and loaded if ``load-on-startup``);
* a removed model stops taking requests, finishes what it has, stops, and disappears (its
  record is dropped once nothing of it runs: the lifecycle's ``Forget``);
* a changed model (llama-server args or replicas) finishes its in-flight requests on the old
  child, then stops and loads again; requests arriving meanwhile wait for the new child;
* an unchanged model keeps its child (same pid); other preset fields update in place.
"""

from __future__ import annotations

from ..changes import Changes
from ..config.presets import ModelPreset
from ..config.sources import Catalogue
from .executor import Executor
from .lifecycle import Listed, Reset, Retire
from .modelset import ModelSet
from .runtime import ModelRuntime, Unestimated
from .wait import ModelWait


class ModelChanges:
    def __init__(self, model_set: ModelSet, executor: Executor, wait: ModelWait,
                 changes: Changes) -> None:
        self._model_set = model_set
        self._executor = executor
        self._wait = wait
        self._changes = changes

    def add(self, preset: ModelPreset) -> ModelRuntime:
        """Add a model at run time (``POST /models``)."""
        runtime = self._model_set.add(preset)
        self._executor.apply(runtime, Listed())
        return runtime

    def remove(self, model_id: str) -> None:
        """Forget a model that is not running (``DELETE /models``)."""
        self._executor.forget(self._model_set.remove(model_id))

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]:
        """Apply a new catalogue as a diff, without dropping a request (the module's list)."""
        records, executor = self._model_set.records, self._executor
        change = self._model_set.replace(catalogue)
        for model_id in change.removed:
            runtime = records[model_id]
            executor.apply(runtime, Retire("removed", removed=True, idle=runtime.in_flight == 0))
        for model_id in change.update:
            executor.set_preset(records[model_id], catalogue.models[model_id])
        for model_id in change.restart:
            runtime = records[model_id]
            executor.set_preset(runtime, catalogue.models[model_id])
            executor.apply(runtime, Unestimated())
            executor.apply(runtime, Reset())
            executor.apply(runtime, Retire("reconfigured", removed=False,
                                           idle=runtime.in_flight == 0))
        for model_id in change.added:
            if catalogue.models[model_id].load_on_startup:
                self._wait.load_again(records[model_id])
        self._changes.notify()
        return change.summary()
