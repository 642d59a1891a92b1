"""The outermost middleware and the error handlers: every request's context is made here
(``RequestMetricsMiddleware``), and counted, timed and recorded when it ends; the API key is
checked next (``keys.ApiKeyMiddleware``, after ``cors``), then every path the router does not
answer itself goes to the proxy before any routing (``forward.ProxyMiddleware``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import otel
from ..errors import (
    InternalError,
    RouterError,
    envelope,
    send_error,
    send_unexpected,
)
from ..http.paths import KNOWN_ENDPOINTS, READ_METHODS
from ..http.requests import BODY_TIMED_OUT, CONTEXT, RequestContext
from ..observe import genai
from ..observe.activity import Activity
from ..observe.metrics import RouterMetrics

if TYPE_CHECKING:
    from ..http.shutdown import Shutdown

log = logging.getLogger("router.middleware")


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

    def __init__(self, app: ASGIApp, metrics: RouterMetrics | None,
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
        # A proxied (or Ollama's) request's server span (OpenTelemetry on: ``genai``).
        span = genai.begin(request, scope["headers"], _port(scope)) \
            if otel.on and (not request.local or request.path in genai.OPERATIONS) else None
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
                status = request.status = message["status"]
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
            self._observe(scope, request, status, ended - started,
                          first - started if first else None)
            if span is not None:
                genai.end(span, request, status)

    def _observe(self, scope: Scope, request: RequestContext, status: int, total_s: float,
                 ttft_s: float | None) -> None:
        model = request.model_id
        proxied = not request.local
        tokens = request.tail().tokens if proxied and model else None
        metrics = self.metrics
        if metrics is not None:
            path = request.path
            metrics.observe_request(model, path if path in KNOWN_ENDPOINTS else "other", status,
                                    total_s, ttft_s if proxied and model else None,
                                    tokens if proxied and model else None)
            if proxied and model:
                metrics.genai.observe(request, status, _port(scope), total_s, ttft_s)
        if self.activity is not None and (model or request.method not in READ_METHODS):
            self.activity.add(
                model=model, method=request.method, path=request.path, status=status,
                started=time.time() - total_s, total_s=total_s, ttft_s=ttft_s, tokens=tokens,
                queue_s=(request.queue_s or 0.0) if proxied and model else None,
                proxied=proxied)


def _port(scope: Scope) -> int:
    """The router's port the request came to (``server.port``)."""
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else 0


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



# For Starlette's exception middleware: every answer the router makes is the JSON envelope.
EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    RouterError: _router_error, HTTPException: _http_error, Exception: _unexpected}


def error_response(exc: RouterError) -> Response:
    """A route's failure as the envelope."""
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)
