"""Which model a proxied request gets, decided once: ``decide`` makes the request's ``Route``,
``take`` commits it to the request, and every later step (the nodes, the lease, the relay,
the conversation) reads it.

``decide`` is a pure function of the request as read (its model, key scope and via chain),
the models as last published (``core.view.Models``), the peers' listing and the default
model: it writes nothing. Its ``Route.local`` is the handle on this router's model, by which
the core takes the lease: no model is resolved by name twice.

* The model is resolved as the request's key sees the router (``resolve_in_scope``): a model
  outside a limited key's scope is not found, exactly as a name nobody uses, with a "did you
  mean" drawn from the key's own models (``not_found``), so a key cannot probe which names
  exist.
* When peers that are up list the model (``Peers.holders``, except the nodes in the request's
  via chain), the route names them and this router's own model, if any (``local_model``);
  ``nodes`` ranks them. A request that came back through this router (its via chain names
  it) is never sent round again: it is served here or refused (409, ``hop.loop_error``).
* Otherwise the model is this router's, or the default one for a name nobody uses
  (``--unknown-model-to-default``), or the request is refused: 404 in the name the client
  gave, 503 or 409 when only peers that are down or that it passed through list it
  (``raise_if_elsewhere``).
* ``take``: a request sent to the default model in place of a name nobody uses names it from
  then on (``RequestContext.default_to``); the model's id goes into the request's context
  (metrics, activity); a request carrying ``X-Conversation-Id`` claims that conversation for
  its key and model here, once (``resumable.StreamOwners.claim``); the node or child
  that serves it is recorded on that claim when known (``Claim.served_by``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config.keyfile import KeyScope
from ..errors import ModelNotFound, NotFound, Unavailable
from ..peers import hop
from .resumable import Claim, serves

if TYPE_CHECKING:
    from ..core.view import Models, ModelView
    from ..http.requests import RequestContext
    from ..peers.peer import Peer
    from ..peers.registry import Peers
    from .defaults import DefaultModel
    from .state import State


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: ``local``, this router's model (None when only peers hold it),
    and ``holders``, the peers that hold it (empty: this router alone); ``model_id``, the
    model as this router names it (the preset's id, else the name the peers list);
    ``defaulted_to``, the default model it goes to in place of a name nobody uses
    (``--unknown-model-to-default``), else None; ``conversation``, its claim on a resumable
    stream, once taken (``take``)."""

    model_id: str
    local: ModelView | None
    holders: Sequence[Peer]
    defaulted_to: str | None = None
    conversation: Claim | None = None


def decide(models: Models, peers: Peers | None, default: DefaultModel,
           request: RequestContext, model: str) -> Route:
    """The request's route for ``model`` (resolved through the default model already, when
    the request named none); raises the 404, 409 or 503 it gets instead. Writes nothing."""
    holders: Sequence[Peer] = ()
    if peers is not None and peers.peers and not hop.came_through(request, peers.instance):
        holders = peers.holders(model, request.via)  # one that came back: served here or 409
    if holders:
        local = local_model(models, request.key_scope, model)
        return Route(model if local is None else local.preset.id, local, holders)
    local, defaulted_to = _here(models, peers, default, request, model)
    return Route(local.preset.id, local, holders, defaulted_to)


def take(state: State, request: RequestContext, route: Route, conv_id: str | None) -> Route:
    """The route, committed to the request: the default model it goes to named from now on,
    its model's id in the request's context (metrics, activity), and its conversation
    claimed (refused here if another key or model holds it)."""
    if route.defaulted_to is not None:
        request.default_to(route.defaulted_to)
    request.model_id = route.model_id
    if not conv_id:
        return route
    claim = state.conversations.claim(conv_id, route.model_id, request.key_hash,
                                      running=serves(state.models))
    return replace(route, conversation=claim)


def _here(models: Models, peers: Peers | None, default: DefaultModel, request: RequestContext,
          model: str) -> tuple[ModelView, str | None]:
    """The model a request gets from this router, and the default it goes to in place of a
    name nobody uses (``--unknown-model-to-default``), if so."""
    key_scope = request.key_scope  # set by ApiKeyMiddleware for a scoped key only
    try:
        return resolve_in_scope(models, key_scope, model), None
    except ModelNotFound as exc:
        if request.defaulted:  # the default model is not this key's: never named to it
            raise NotFound('no model is named in the request, and the default model is not '
                           'one this API key may use: set "model" (GET /v1/models lists '
                           'them)') from None
        if peers is not None:
            raise_if_elsewhere(peers, model, request)
        fallback = default.for_unknown(models)  # --unknown-model-to-default
        if fallback is None:
            raise
        try:
            return resolve_in_scope(models, key_scope, fallback), fallback
        except ModelNotFound:
            raise exc from None  # not this key's either: the 404 of the name it gave


def local_model(models: Models, key_scope: KeyScope | None, model: str
                ) -> ModelView | None:
    """This router's own model named ``model``, or None; for a key limited to some models, a
    model outside them (here or on any node) is not found, as a name nobody uses."""
    try:
        return resolve_in_scope(models, key_scope, model)
    except ModelNotFound:
        if key_scope is not None and not key_scope.allows(model):
            raise not_found(models, key_scope, model) from None
        return None


def resolve_in_scope(models: Models, key_scope: KeyScope | None, name: str
                     ) -> ModelView:
    """``models.find(name)``, for a key limited to some models only among them: a model
    outside its scope is not found, exactly as a name nobody uses (``not_found``), so a key
    cannot probe which names exist."""
    if key_scope is None or key_scope.pattern is None:
        return models.find(name)
    try:
        model = models.find(name)
    except ModelNotFound:
        raise not_found(models, key_scope, name) from None
    if not key_scope.allows(model.id, model.aliases):
        raise not_found(models, key_scope, name)
    return model


def not_found(models: Models, key_scope: KeyScope, name: str) -> ModelNotFound:
    """The 404 for ``name`` as a key limited to some models sees the router: its "did you
    mean" is drawn from the names (ids and aliases) of its models alone, so it reads the same
    whether ``name`` is another model's or nobody's."""
    names = [n for model in models.views() if key_scope.allows(model.id, model.aliases)
             for n in (model.id, *model.aliases)]
    return ModelNotFound(name, difflib.get_close_matches(name, names, n=3, cutoff=0.5))


def raise_if_elsewhere(peers: Peers, model: str, request: RequestContext) -> None:
    """A 503 naming the nodes when only peers that are down list ``model``; a 409 when
    the request came back, or only nodes it passed through hold the model."""
    if request.key_scope is not None and not request.key_scope.allows(model):
        return  # not the key's: not found, as a name nobody uses
    holders = peers.listing().get(model)
    if hop.came_through(request, peers.instance) or (
            holders and any(p.up and p.via in request.via for p in holders)):
        raise hop.loop_error(request, peers.node, peers.instance,
                             f"the request for model '{model}'")
    if holders:
        reasons = "; ".join(f"node {p.node}: {p.reason or 'not answering'}" for p in holders)
        raise Unavailable(f"model '{model}' is on nodes that are not answering ({reasons})",
                          headers={"Retry-After": "5"})
