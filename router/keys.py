"""API keys at the edge: which role a request needs, whether its key's scope reaches it.

The key files' grammar and ``KeyScope`` are in ``keyfile.py`` (read by ``settings``). Which
paths each role reaches is in ``paths.py`` (``INFER_PATHS`` and the rest), checked by
``needed_role``. ``ApiKeyMiddleware`` finds a presented key's scope by comparing it with every
key in constant time, checks the role of the request and leaves the scope in the request's
context (``requests.RequestContext.key_scope``) for the places that know the model: the proxy
(``forward._forward``) and the routes naming a model or listing models. The role and the model
are read from that same context, which the router routes by: the key check and the router
never read a request differently. Keys are never logged.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

from starlette.types import Scope

from .errors import ModelNotFound, RouterError
from .keyfile import ADMIN, INFER, METRICS, KeyScope
from .paths import (
    ADMIN_PROXIED_PREFIXES,
    ADMIN_PROXIED_WRITES,
    INFER_PATHS,
    LISTING_PATHS,
    METRICS_PATHS,
    READ_METHODS,
)
from .requests import RequestContext, context

if TYPE_CHECKING:
    from .supervisor import Supervisor
    from .view import ModelView

class Forbidden(RouterError):
    """A valid API key whose scope does not reach the path or the model."""

    status = 403
    type = "permission_error"


_HASH_SECRET = secrets.token_bytes(32)  # made at start: key hashes mean nothing elsewhere


def key_hash(key: bytes) -> str:
    """What stands for a key where the router must remember who did something (the owner of
    a resumable stream): an HMAC of it under a secret made at start, never the key, and no
    plain hash that a guessed key could be checked against."""
    return hmac.new(_HASH_SECRET, key, hashlib.sha256).hexdigest()[:32]


# ---------------------------------------------------------------------------- enforcement

def needed_role(request: RequestContext) -> str:
    """The role a request needs (``admin``, ``infer`` or ``metrics``), from the path tables
    and the decoded query the router acts on."""
    path = request.path
    method = request.method
    if request.local:
        if path in METRICS_PATHS:
            return METRICS if method in READ_METHODS else ADMIN
        methods = INFER_PATHS.get(path)
        if methods is None or method not in methods:
            return ADMIN
        if path in LISTING_PATHS and request.params.get("reload"):
            return ADMIN  # GET /models?reload=1 re-reads the configuration
        return INFER
    if path in METRICS_PATHS:  # /metrics?model=: the child's own
        return METRICS if method in READ_METHODS else ADMIN
    if path.startswith(ADMIN_PROXIED_PREFIXES) or (
            path in ADMIN_PROXIED_WRITES and method not in READ_METHODS):
        return ADMIN
    return INFER


def check_path(key_scope: KeyScope, request: RequestContext) -> None:
    """Forbidden unless the key's roles reach this request."""
    role = needed_role(request)
    if role not in key_scope.grants:
        raise Forbidden(f"this API key ({key_scope.describe()}) may not use {request.method} "
                        f"{request.path[:200]}: that needs role={role}")


def key_scope_of(scope: Scope) -> KeyScope | None:
    """The scope the API key middleware left for this request; None: full access."""
    return context(scope).key_scope


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
    if not key_scope.allows_model(model):
        raise not_found(supervisor, key_scope, name)
    return model


def not_found(supervisor: Supervisor, key_scope: KeyScope, name: str) -> ModelNotFound:
    """The 404 for ``name`` as a key limited to some models sees the router: its "did you
    mean" is drawn from the names (ids and aliases) of its models alone, so it reads the same
    whether ``name`` is another model's or nobody's."""
    names = [n for model in supervisor.views() if key_scope.allows_model(model)
             for n in (model.id, *model.aliases)]
    return ModelNotFound(name, difflib.get_close_matches(name, names, n=3, cutoff=0.5))
