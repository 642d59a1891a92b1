"""API keys at the edge: which role a request needs, whether its key's scope reaches it.

The key files' grammar and ``KeyScope`` are in ``keyfile.py`` (read by ``settings``). Which
paths each role reaches is in ``paths.py`` (``INFER_PATHS`` and the rest), checked by
``needed_role``. ``ApiKeyMiddleware`` finds a presented key's scope by comparing it with every
key in constant time, checks the role of the request and leaves the scope in the request's
context (``requests.RequestContext.key_scope``) for the places that know the model: the proxy
(``route.decide``) and the routes naming a model or listing models. The role and the model
are read from that same context, which the router routes by: the key check and the router
never read a request differently. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from ..config.keyfile import ADMIN, INFER, METRICS, UNLIMITED, KeyScope, policy_of, scope_of
from ..errors import BadRequest, RouterError, Unauthorized, send_error
from ..http.paths import (
    ADMIN_PROXIED_PREFIXES,
    ADMIN_PROXIED_WRITES,
    INFER_PATHS,
    LISTING_PATHS,
    METRICS_PATHS,
    PUBLIC_PATHS,
    READ_METHODS,
)
from ..http.requests import RequestContext, context
from ..teams.members import PRIORITY_HEADER, MemberError, member_of

if TYPE_CHECKING:
    from ..llama.webui import StaticUI


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


def _member_refusal(error: MemberError) -> RouterError:
    return Forbidden(str(error)) if error.status == 403 else BadRequest(str(error))


def key_scope_of(scope: Scope) -> KeyScope | None:
    """The scope the API key middleware left for this request; None: full access."""
    return context(scope).key_scope


class ApiKeyMiddleware:
    """Require one of ``keys`` as ``Authorization: Bearer <k>`` or ``X-Api-Key: <k>``.

    Every decision reads the request's context (``requests.RequestContext``), the one the
    router acts on: whether the request is public, the role it needs. A key with a scope
    (``keys.ApiKey``) gets 403 for a request its roles do not reach, and leaves its scope in
    the context for the checks that know the model (``route.resolve_in_scope``); a full-access
    key (a plain string, or an ``ApiKey`` without a scope) costs nothing more than the
    comparison."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], webui: StaticUI | None = None) -> None:
        self.app = app
        scopes: dict[bytes, KeyScope] = {}
        for key in keys:
            if scopes.setdefault(key.encode(), scope_of(key)) != scope_of(key):
                raise ValueError("an API key is given twice with different scopes")
        self.keys = list(scopes)
        self.hashes = [key_hash(key) for key in self.keys]  # what owns a resumable stream
        # None: full access, nothing to check after the comparison.
        self.scopes: list[KeyScope | None] = [None if s.full else s for s in scopes.values()]
        policies = {key.encode(): policy_of(key) for key in keys}
        self.policies = [policies[key] for key in self.keys]
        self.admins = [ADMIN in s.roles for s in scopes.values()]
        self.webui = webui

    def _public(self, request: RequestContext) -> bool:
        """The health checks, the dashboard's files, and ``/`` and the web UI's files, as
        llama-server's UI files are (not with a model named: the router sends that request
        to the model, as it reads the same ``request.model``). (No OPTIONS comes here:
        ``cors.CorsMiddleware`` answers them all.)"""
        return (request.path in PUBLIC_PATHS
                or (self.webui is not None and request.method in ("GET", "HEAD")
                    and request.model is None and self.webui.is_public(request.path)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = context(scope)
        if not self.keys:
            if PRIORITY_HEADER in request.headers:
                try:  # without keys, a request may still ask for a lower class
                    request.member = member_of(UNLIMITED, False, request.headers)
                except MemberError as exc:
                    await send_error(send, _member_refusal(exc))
                    return
            await self.app(scope, receive, send)
            return
        if self._public(request):
            await self.app(scope, receive, send)
            return
        presented = request.credential()
        # Compare against every key so timing does not reveal which one matched (the keys are
        # distinct: at most one matches, and ``found`` is its position, 1-based).
        found = 0
        for position, key in enumerate(self.keys, start=1):
            found |= position * hmac.compare_digest(presented, key)
        if not found:
            await send_error(send, Unauthorized())
            return
        request.key_hash = self.hashes[found - 1]
        try:
            request.member = member_of(self.policies[found - 1], self.admins[found - 1],
                                       request.headers)
        except MemberError as exc:
            await send_error(send, _member_refusal(exc))
            return
        key_scope = self.scopes[found - 1]
        if key_scope is not None:
            try:
                check_path(key_scope, request)
            except Forbidden as exc:
                await send_error(send, exc)
                return
            request.key_scope = key_scope
        await self.app(scope, receive, send)
