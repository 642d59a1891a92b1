"""Which model a proxied request gets, decided once: ``decide`` makes the request's ``Route``
and every later step (the nodes, the lease, the relay, the conversation) reads it.

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
* A request carrying ``X-Conversation-Id`` claims that conversation for its key and model here,
  once (``resumable.ConversationOwners.claim``); the node or child that serves it is recorded
  on that claim when known (``Claim.served_by``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.keyfile import KeyScope
from ..errors import ModelNotFound, NotFound, Unavailable
from ..peers import hop
from .resumable import Claim, serves

if TYPE_CHECKING:
    from ..core.supervisor import Supervisor
    from ..core.view import ModelView
    from ..http.requests import RequestContext
    from ..peers.peer import Peer
    from ..peers.registry import Peers
    from .state import State


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: ``local``, this router's model (None when only peers hold it),
    and ``holders``, the peers that hold it (empty: this router alone); ``model_id``, the
    model as this router names it (the preset's id, else the name the peers list);
    ``conversation``, its claim on a resumable stream, if any."""

    model_id: str
    local: ModelView | None
    holders: Sequence[Peer]
    conversation: Claim | None


def decide(state: State, request: RequestContext, model: str, conv_id: str | None) -> Route:
    """The request's route for ``model`` (resolved through the default model already, when
    the request named none); raises the 404, 409 or 503 it gets instead. Records the model's
    id in the request's context (metrics, activity)."""
    sup = state.supervisor
    peers = state.peers
    holders: Sequence[Peer] = ()
    if peers is not None and peers.peers and not hop.came_through(request, peers.instance):
        holders = peers.holders(model, request.via)  # one that came back: served here or 409
    local = local_model(sup, request.key_scope, model) if holders else \
        _here(state, request, model)
    request.model_id = model_id = model if local is None else local.preset.id
    claim = None
    if conv_id:  # refused here if another key or model holds it
        claim = state.conversations.claim(conv_id, model_id, request.key_hash,
                                          running=serves(sup))
    return Route(model_id, local, holders, claim)


def _here(state: State, request: RequestContext, model: str) -> ModelView:
    """The model a request gets from this router, with ``--unknown-model-to-default`` for a
    name nobody uses."""
    sup = state.supervisor
    key_scope = request.key_scope  # set by ApiKeyMiddleware for a scoped key only
    try:
        return resolve_in_scope(sup, key_scope, model)
    except ModelNotFound as exc:
        if request.defaulted:  # the default model is not this key's: never named to it
            raise NotFound('no model is named in the request, and the default model is not '
                           'one this API key may use: set "model" (GET /v1/models lists '
                           'them)') from None
        if state.peers is not None:
            raise_if_elsewhere(state.peers, model, request)
        fallback = state.default.for_unknown(sup)  # --unknown-model-to-default
        if fallback is None:
            raise
        try:
            return resolve_in_scope(sup, key_scope, request.default_to(fallback))
        except ModelNotFound:
            raise exc from None  # not this key's either: the 404 of the name it gave


def local_model(supervisor: Supervisor, key_scope: KeyScope | None, model: str
                ) -> ModelView | None:
    """This router's own model named ``model``, or None; for a key limited to some models, a
    model outside them (here or on any node) is not found, as a name nobody uses."""
    try:
        return resolve_in_scope(supervisor, key_scope, model)
    except ModelNotFound:
        if key_scope is not None and not key_scope.allows(model):
            raise not_found(supervisor, key_scope, model) from None
        return None


def resolve_in_scope(supervisor: Supervisor, key_scope: KeyScope | None, name: str
                     ) -> ModelView:
    """``supervisor.find(name)``, for a key limited to some models only among them: a model
    outside its scope is not found, exactly as a name nobody uses (``not_found``), so a key
    cannot probe which names exist."""
    if key_scope is None or key_scope.pattern is None:
        return supervisor.find(name)
    try:
        model = supervisor.find(name)
    except ModelNotFound:
        raise not_found(supervisor, key_scope, name) from None
    if not key_scope.allows(model.id, model.aliases):
        raise not_found(supervisor, key_scope, name)
    return model


def not_found(supervisor: Supervisor, key_scope: KeyScope, name: str) -> ModelNotFound:
    """The 404 for ``name`` as a key limited to some models sees the router: its "did you
    mean" is drawn from the names (ids and aliases) of its models alone, so it reads the same
    whether ``name`` is another model's or nobody's."""
    names = [n for model in supervisor.views() if key_scope.allows(model.id, model.aliases)
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
