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
* A profile's name (``profile-of``) routes to its base, this router's own model: the key's
  scope is checked against the profile's names, the route carries the profile's id (for
  quotas, usage, metrics) and its request policy (``policy``), which ``forward`` applies to
  the body once.
* A virtual model's name (``targets``) routes to the target ``virtual.choose`` picks for the
  request (its conversation's target first), this router's own or a peer's; the key's scope
  is checked against the virtual model's names. The route carries the choice; ``take``
  records it (``Virtuals.chose``).
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
from ..config.policy import RequestPolicy
from ..config.presets import ModelPreset
from ..errors import ModelNotFound, NotFound, Unavailable
from ..http.paths import RESPONSES_PATHS
from ..peers import hop
from ..serving.affinity import request_prefix
from .resumable import Claim, serves
from .virtual import Choice, Target, Virtuals, choose

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
    stream, once taken (``take``); ``policy``, the body fields its name sets, replaces or
    removes (a profile's, else its model's own; None for none)."""

    model_id: str
    local: ModelView | None
    holders: Sequence[Peer]
    defaulted_to: str | None = None
    conversation: Claim | None = None
    policy: RequestPolicy | None = None
    virtual: ModelPreset | None = None  # the virtual model it came through, if any
    choice: Choice | None = None  # and the target chosen, why, what to try next
    prefix_keys: tuple[int, ...] = ()  # the prompt's keys it was chosen by (``_keys``)


def decide(models: Models, peers: Peers | None, default: DefaultModel,
           request: RequestContext, model: str, virtuals: Virtuals | None = None) -> Route:
    """The request's route for ``model`` (resolved through the default model already, when
    the request named none); raises the 404, 409 or 503 it gets instead. Writes nothing."""
    virtual = models.catalogue.virtual(model)
    if virtual is not None:
        return virtual_route(models, peers, request, virtual, virtuals or Virtuals())
    profile = models.catalogue.profile(model)
    if profile is not None:  # its base, this router's own (``resolve_in_scope``)
        return Route(profile.id, resolve_in_scope(models, request.key_scope, model), (),
                     policy=profile.policy)
    holders: Sequence[Peer] = ()
    if peers is not None and peers.peers and not hop.came_through(request, peers.instance):
        holders = peers.holders(model, request.via)  # one that came back: served here or 409
    if holders:
        local = local_model(models, request.key_scope, model)
        return Route(model if local is None else local.preset.id, local, holders,
                     policy=local.preset.policy if local is not None else None)
    local, defaulted_to = _here(models, peers, default, request, model)
    return Route(local.preset.id, local, holders, defaulted_to, policy=local.preset.policy)


def virtual_route(models: Models, peers: Peers | None, request: RequestContext,
                   virtual: ModelPreset, virtuals: Virtuals, skip: tuple[str, ...] = ()
                   ) -> Route:
    """The route to the target of ``virtual`` chosen for the request (``virtual.choose``),
    ``skip``: targets that refused it already. 404 outside the key's scope, 503 when no
    target can serve."""
    if request.key_scope is not None and not request.key_scope.allows(virtual.id,
                                                                      virtual.aliases):
        raise not_found(models, request.key_scope, virtual.id)
    keys = _keys(request)
    targets = [_target(models, peers, request, virtual, virtuals, name, keys)
               for name in virtual.targets if name not in skip]
    choice = choose(virtual.choose, targets)
    if choice is None:
        raise Unavailable(f"no target of virtual model '{virtual.id}' can serve now "
                          f"({', '.join(virtual.targets)}): each is failed, crash-looping "
                          "or on no node that is up", headers={"Retry-After": "5"})
    profile = models.catalogue.profile(choice.target)
    local = target_model(models, choice.target)
    holders = peers.holders(choice.target, request.via) if peers is not None and \
        local is None else ()
    policy = profile.policy if profile is not None else (
        local.preset.policy if local is not None else None)
    model_id = profile.id if profile is not None else (
        local.preset.id if local is not None else choice.target)
    return Route(model_id, local, holders, policy=policy, virtual=virtual, choice=choice,
                 prefix_keys=keys)


def _keys(request: RequestContext) -> tuple[int, ...]:
    """The request's prompt prefix keys (``affinity``), for its conversation's target."""
    if request.parsed is None:
        return ()
    return request_prefix(request.parsed, request.path in RESPONSES_PATHS).stable


def target_model(models: Models, name: str) -> ModelView | None:
    """This router's model a target names (a profile: its base), or None."""
    profile = models.catalogue.profile(name)
    model_id = models.catalogue.resolve(profile.profile_of if profile is not None
                                        and profile.profile_of is not None else name)
    return models.view(model_id) if model_id is not None else None


def _target(models: Models, peers: Peers | None, request: RequestContext,
            virtual: ModelPreset, virtuals: Virtuals, name: str, keys: tuple[int, ...]
            ) -> Target:
    """What the choice reads of the target ``name`` now."""
    match = virtuals.match(virtual.id, name, keys)
    local = target_model(models, name)
    if local is not None:
        capacity = max(1, local.preset.slots * max(1, len(local.replicas())))
        return Target(name, not local.crash_loop and not local.failed, local.serving,
                      local.in_flight >= capacity, local.waiting > capacity,
                      (local.in_flight + local.waiting) / capacity, match)
    holders = peers.holders(name, request.via) if peers is not None else []
    return Target(name, bool(holders),
                  any(p.status_of(name) == "loaded" for p in holders), match=match)


def take(state: State, request: RequestContext, route: Route, conv_id: str | None) -> Route:
    """The route, committed to the request: the default model it goes to named from now on,
    its model's id in the request's context (metrics, activity), and its conversation
    claimed (refused here if another key or model holds it)."""
    if route.defaulted_to is not None:
        request.default_to(route.defaulted_to)
    request.model_id = route.model_id
    if route.virtual is not None and route.choice is not None:
        state.virtuals.chose(route.virtual, route.choice, route.prefix_keys)
        state.metrics.virtual_choices.labels(route.virtual.id, route.choice.target,
                                             route.choice.reason).inc()
    if not conv_id:
        return route
    model_id = route.local.preset.id if route.local is not None else route.model_id
    claim = state.conversations.claim(conv_id, model_id, request.key_hash,  # where it runs
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
    cannot probe which names exist. A profile's name is its base (``profile_of``), a virtual
    model's its first target here (``targets``), in the key's scope when its names are."""
    named = models.catalogue.named(name)
    if named is not None:
        if key_scope is not None and not key_scope.allows(named.id, named.aliases):
            raise not_found(models, key_scope, name)
        local = target_model(models, named.profile_of or "") if named.profile_of else next(
            (m for m in map(lambda t: target_model(models, t), named.targets) if m), None)
        if local is None:
            raise ModelNotFound(name, [])  # a virtual model with no target here
        return local
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
    names += [n for profile in models.catalogue.names.values()
              if key_scope.allows(profile.id, profile.aliases)
              for n in (profile.id, *profile.aliases)]
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
