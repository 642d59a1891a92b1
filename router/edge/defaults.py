"""The default model: where a request that names no model goes.

``--default-model NAME`` (id or alias of a model of this router) names it. Without the
setting, a router with exactly one model (listed, its own: no ``--peer``/``--peer-dns``)
serves requests without a model with that one, as a llama-server does; the moment a second
model appears (a preset, a file in a models directory, a Hugging Face cache entry, a pull),
that stops, and such requests get the 400 that names the setting. ``/v1/models`` marks the
default (``"default": true``) and ``/props`` names it (``llama_router.default_model`` and
``default_model_from``), so the change shows; the router also logs a warning once when an
implicit default ends.

Only the router's proxied requests use it (``forward``): ``/props``, ``/metrics``, the model
listings, ``/``, the web UI's files and unknown GET paths never do. The request's context
records the choice (``requests.RequestContext.default_to``), and the key's scope is checked
against the model chosen, as for a model the request names.

``--unknown-model-to-default`` (off by default) also sends a proxied request naming a model
nobody serves to the default model; load, unload and the other admin routes still answer 404.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import ModelMissing

if TYPE_CHECKING:
    from ..config.sources import Catalogue
    from ..core.view import Models

log = logging.getLogger("router.defaults")

SETTING = "setting"  # ``default_model_from``: named by --default-model
ONLY_MODEL = "only model"  # ``default_model_from``: the router's one model


class NoDefaultModel(ModelMissing):
    """A request without a model on a router without a default model."""

    def __init__(self, models: int) -> None:
        plural = "model" if models == 1 else "models"
        super().__init__(f"; this router serves {models} {plural} and has no default model "
                         "(start it with --default-model NAME, or LLAMA_ROUTER_DEFAULT_MODEL, "
                         "to send requests without a model to one)")


def check(name: str | None, catalogue: Catalogue) -> str | None:
    """Why ``name`` cannot be the default model of ``catalogue`` (start and reload), or
    None when it can (or no default is set)."""
    if name is None or catalogue.resolve(name) is not None:
        return None
    known = sorted(m.id for m in catalogue.models.values() if m.listed)
    shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
    return (f"--default-model '{name}' is not a model of this configuration "
            f"(its models: {shown or 'none'})")


class DefaultModel:
    """Which model is the default, decided from the settings and the current models."""

    def __init__(self, name: str | None, *, unknown_to_default: bool = False,
                 peered: bool = False) -> None:
        self.name = name or None
        self.unknown_to_default = unknown_to_default
        self.peered = peered  # a router fronting peers never picks an implicit default
        self._implicit: str | None = None  # the last implicit default seen, for the warning

    def resolve(self, models: Models) -> tuple[str, str] | None:
        """The default model's id and where it comes from (``SETTING``, ``ONLY_MODEL``);
        None when there is none."""
        if self.name is not None:
            model_id = models.model_id(self.name)
            return None if model_id is None else (model_id, SETTING)
        only: str | None = None
        if not self.peered:
            listed = [m.id for m in models.views() if m.preset.listed]
            only = listed[0] if len(listed) == 1 else None
        if only != self._implicit:
            if self._implicit is not None:
                log.warning("model '%s' is no longer the default model: the router now has "
                            "%d models; requests without a model get a 400 until "
                            "--default-model names one", self._implicit,
                            sum(1 for m in models.views() if m.preset.listed),
                            extra={"event": "default_model_ended"})
            self._implicit = only
        return None if only is None else (only, ONLY_MODEL)

    def for_request(self, models: Models) -> str:
        """The model for a proxied request that names none; ``NoDefaultModel`` (400) when
        there is no default."""
        found = self.resolve(models)
        if found is None:
            raise NoDefaultModel(sum(1 for m in models.views() if m.preset.listed))
        return found[0]

    def for_unknown(self, models: Models) -> str | None:
        """The model for a proxied request naming an unknown model: the default with
        ``--unknown-model-to-default``, else None (the 404 stands)."""
        if not self.unknown_to_default:
            return None
        found = self.resolve(models)
        return None if found is None else found[0]
