"""Middleware and error handlers: request metrics and activity, the API key, and the
switch that sends every non-local path to the proxy before any routing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .activity import Activity
from .errors import (
    InternalError,
    RouterError,
    Unauthorized,
    envelope,
    send_error,
    send_unexpected,
)
from .forward import proxy
from .keyfile import KeyScope, scope_of
from .keys import Forbidden, check_path, key_hash
from .metrics import RouterMetrics
from .paths import KNOWN_ENDPOINTS, PUBLIC_PATHS, READ_METHODS
from .requests import BODY_TIMED_OUT, CONTEXT, RequestContext, context
from .state import Shutdown, error_response
from .webui import StaticUI

log = logging.getLogger("router.middleware")


class ApiKeyMiddleware:
    """Require one of ``keys`` as ``Authorization: Bearer <k>`` or ``X-Api-Key: <k>``.

    Every decision reads the request's context (``requests.RequestContext``), the one the
    router acts on: whether the request is public, the role it needs. A key with a scope
    (``keys.ApiKey``) gets 403 for a request its roles do not reach, and leaves its scope in
    the context for the checks that know the model (``keys.resolve_in_scope``); a full-access
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
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        request = context(scope)
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
        key_scope = self.scopes[found - 1]
        if key_scope is not None:
            try:
                check_path(key_scope, request)
            except Forbidden as exc:
                await send_error(send, exc)
                return
            request.key_scope = key_scope
        await self.app(scope, receive, send)


CLIENT_CLOSED_REQUEST = 499  # counted for a request whose client left before any answer


class RequestMetricsMiddleware:
    """Count every request by model, endpoint and status, time it to its first and last body
    byte, and record it in ``activity``: requests to a model, and every other request that is
    not a GET/HEAD/OPTIONS (load, unload, pull, ...); reads without a model (model list,
    metrics, logs, event streams, the web UI's and the dashboard's files and polls) are only
    counted. It is the edge: the request's context (``requests.RequestContext``) is made
    here, before anything else looks at the request; a request its parse refused
    (``RequestContext.refused``) is answered here, and so is a failure that nothing inside
    answered, with the envelope (500)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], RouterMetrics | None],
                 activity: Activity | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.activity = activity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = scope[CONTEXT] = RequestContext(scope)
        started = time.perf_counter()
        status = 0  # until the response starts
        # The body chunks are recorded in the context (``RequestContext.sent``): those sent
        # here, and those a relay writes to the client directly (``proxy.DirectBody``).
        sent = request.sent

        async def send_wrapper(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.body":
                body = message.get("body")
                if body:
                    sent(body)
            elif message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if request.refused is not None:  # refused by its one parse (two conversation ids)
                await send_error(send_wrapper, request.refused)
            else:
                await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            # uvicorn cancels what is left a little after the shutdown grace period (see
            # server.RouterServer): a request that has not answered yet still gets the 503.
            shutdown = None if status else _grace_over(scope)
            if shutdown is None:
                status = status or 500
                raise
            await send_error(send_wrapper, shutdown.error())
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
        except Exception as exc:
            if status:  # answered (a route's failure, by Starlette's error middleware) or
                raise   # answering: past a clean answer
            # Nothing answered it: the envelope, as Starlette's error middleware answers a
            # route's failure (the proxy answers its own: this is a middleware's).
            await send_unexpected(send_wrapper, scope, exc)
        except BaseException:
            status = status or 500
            raise
        finally:
            # Ended without an answer and without an error: the client went away first.
            status = status or CLIENT_CLOSED_REQUEST
            if BODY_TIMED_OUT in scope:  # the HTTP server answered 408 instead (``http11``)
                status = 408
            ended = time.perf_counter()
            first = request.first_sent
            self._observe(request, status, ended - started, first - started if first else None)

    def _observe(self, request: RequestContext, status: int, total_s: float,
                 ttft_s: float | None) -> None:
        model = request.model_id
        proxied = not request.local
        tokens = request.tail().tokens if proxied and model else None
        metrics = self.metrics()
        if metrics is not None:
            path = request.path
            metrics.observe_request(model, path if path in KNOWN_ENDPOINTS else "other", status,
                                    total_s, ttft_s if proxied and model else None,
                                    tokens if proxied and model else None)
        if self.activity is not None and (model or request.method not in READ_METHODS):
            self.activity.add(
                model=model, method=request.method, path=request.path, status=status,
                started=time.time() - total_s, total_s=total_s, ttft_s=ttft_s, tokens=tokens,
                queue_s=(request.queue_s or 0.0) if proxied and model else None,
                proxied=proxied)


def _grace_over(scope: Scope) -> Shutdown | None:
    """The router's shutdown, once its grace period is over (else None)."""
    state = getattr(getattr(scope.get("app"), "state", None), "router", None)
    shutdown: Shutdown | None = getattr(state, "shutdown", None)
    return shutdown if shutdown is not None and shutdown.over.is_set() else None


async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = "File Not Found" if exc.status_code == 404 else str(exc.detail)
    return JSONResponse(envelope(exc.status_code, message), status_code=exc.status_code,
                        headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError(exc))



class ProxyMiddleware:
    """Send every path the router does not answer itself to ``proxy`` before any routing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not context(scope).local:
            await proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


# For Starlette's exception middleware: every answer the router makes is the JSON envelope.
EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    RouterError: _router_error, HTTPException: _http_error, Exception: _unexpected}
