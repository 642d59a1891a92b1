"""Which browser pages may use the router: its one CORS policy (``--cors-origins``).

Browsers say where a request comes from: ``Origin`` (on every cross-origin fetch and every
POST) and ``Sec-Fetch-Site`` (on every request of a current browser). A request is
*cross-origin* when its Origin is not the router's own (the origin's host and port against
the ``Host`` header; the scheme is not compared, as a TLS proxy in front hides it), or when
``Sec-Fetch-Site`` says ``cross-site`` or ``same-site`` (another origin of the same site:
another port of localhost). A request with neither header (curl, SDKs, servers) is not a
browser's and is never refused here; neither is a page of the router's own (the web UI at
``/``, the dashboard).

``--cors-origins`` (llama-server's option, with its default ``*``) is a comma list of:

* ``*``: pages of any origin may use the inference routes;
* ``localhost``: pages of ``localhost``, ``127.0.0.1`` or ``[::1]``, any port, may use them;
* origins such as ``https://app.example``, named one by one: may use every route, the
  sensitive ones included;
* or ``none``: no page of another origin may use anything.

*Sensitive* routes change the router's state or show what other clients did: every request
that needs ``role=admin`` (``keys.needed_role``: loads, unloads, reloads, pulls, deletes,
``?reload=`` listings, logs, activity, a child's ``/slots``, writes to ``/props`` and
``/lora-adapters``), and ``DELETE /v1/stream``. The health checks and the dashboard's files
are public, never sensitive.

What a cross-origin request gets (``CorsMiddleware``, before the key check, which a
preflight never reaches):

* allowed for its route: its answer carries ``Access-Control-Allow-Origin`` (``*`` for a
  ``*`` grant, else the origin, with ``Vary: Origin``); the children's own ``Access-Control-*``
  headers never reach the client (``proxy.RESPONSE_DROP``), nor its Origin the child;
* not allowed: a 403 envelope, whatever its content type (a form post included), before
  anything reads its body, resolves its model or checks its key; a preflight not allowed is
  answered as llama-server answers it, 200 without any ``Access-Control-*`` header, which
  stops the browser as surely (the request itself, if sent anyway, gets the 403);
* without an Origin (a link, an image: the page cannot read the answer), only a sensitive
  route is refused.

``Sec-Fetch-Site`` is compared in any case.

Every ``OPTIONS`` is answered here, with 200 and an empty body as llama-server does (a
preflight is decided for the method it asks with ``Access-Control-Request-Method``): it
never reaches the key check, routing or a model.

The CORS headers' names go out in llama-server's case (``Access-Control-Allow-Origin``, not
uvicorn's lower case: ``http11.KeepCase``): its clients, llama.cpp's own tests among them,
look them up in a case-sensitive ``dict``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ..config.keyfile import ADMIN
from ..config.origins import (
    ALLOW_ORIGIN,
    FETCH_SITE,
    HOST,
    ORIGIN,
    OTHER_SITES,
    PREFLIGHT_HEADERS,
    REQUEST_METHOD,
    VARY_ORIGIN,
    CorsPolicy,
    same_origin,
)
from ..errors import RouterError, send_error
from ..http.http11 import KeepCase
from ..http.paths import PUBLIC_PATHS
from ..http.requests import RequestContext, context
from .keys import needed_role

# The names as llama-server writes them, kept on the wire (see the module docstring).
_ALLOW_ORIGIN = KeepCase(ALLOW_ORIGIN)
_VARY_ORIGIN = (KeepCase(VARY_ORIGIN[0]), VARY_ORIGIN[1])
_PREFLIGHT_HEADERS = tuple((KeepCase(name), value) for name, value in PREFLIGHT_HEADERS)
_EMPTY = (b"content-length", b"0")


class CrossOriginRefused(RouterError):
    """A request from a page of another origin that ``--cors-origins`` does not allow."""

    status = 403
    type = "permission_error"


def cross_origin(request: RequestContext) -> bool:
    """Whether a browser says the request comes from a page of another origin."""
    origin = request.headers.get(ORIGIN)
    if origin is not None and not same_origin(origin, request.headers.get(HOST)):
        return True
    return request.fetch_site in OTHER_SITES  # lower case: compared case-insensitively


def sensitive(request: RequestContext) -> bool:
    """A route that changes the router's state or shows what other clients did (see the
    module docstring)."""
    if request.path in PUBLIC_PATHS:
        return False
    if request.path == "/v1/stream" and request.local and request.method == "DELETE":
        return True
    return needed_role(request) == ADMIN


class CorsMiddleware:
    """Apply ``policy`` to every request (see the module docstring); answer every OPTIONS."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy | None = None) -> None:
        self.app = app
        self.policy = policy or CorsPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = context(scope)
        headers = request.headers
        preflight = request.method == "OPTIONS"
        if not preflight and ORIGIN not in headers and FETCH_SITE not in headers:
            await self.app(scope, receive, send)  # not from a browser: the hot path
            return
        allow = b""
        if cross_origin(request):
            asked = _as_asked(request) if preflight else request
            found = self.policy.grant(headers.get(ORIGIN), sensitive(asked))
            if found is None and preflight:  # llama-server's refusal: no CORS header
                await _empty_200(send, [])
                return
            if found is None:
                await send_error(send, _refusal(asked, headers.get(ORIGIN)))
                return
            allow = found
        extra: list[tuple[bytes, bytes]] = []
        if allow:
            extra.append((_ALLOW_ORIGIN, allow))
            if allow != b"*":
                extra.append(_VARY_ORIGIN)
        if preflight:
            await _empty_200(send, [*extra, *_PREFLIGHT_HEADERS])
        elif extra:
            await self.app(scope, receive, _adding(send, extra))
        else:
            await self.app(scope, receive, send)


async def _empty_200(send: Send, headers: list[tuple[bytes, bytes]]) -> None:
    """A preflight's answer: 200, ``headers``, an empty body."""
    await send({"type": "http.response.start", "status": 200, "headers": [*headers, _EMPTY]})
    await send({"type": "http.response.body", "body": b""})


def _as_asked(request: RequestContext) -> RequestContext:
    """A preflight as the request it asks for: its path with the method of
    ``Access-Control-Request-Method``."""
    method = request.headers.get(REQUEST_METHOD)
    if not method:
        return request
    asked = copy.copy(request)
    asked.method = method.decode("latin-1")
    return asked


def _refusal(request: RequestContext, origin: bytes | None) -> CrossOriginRefused:
    where = f"a page of {origin[:100].decode('latin-1')!r}" if origin is not None \
        else "a page of another site"
    return CrossOriginRefused(
        f"{request.method[:20]} {request.path[:200]} from {where} is refused: "
        + ("this route changes the router or shows other clients' requests, for origins "
           "named in --cors-origins only" if sensitive(request)
           else "this origin is not allowed by --cors-origins"))


def _adding(send: Send, extra: Iterable[tuple[bytes, bytes]]) -> Send:
    """``send`` with ``extra`` headers added to the response's start."""

    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return wrapped
