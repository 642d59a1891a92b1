"""The hot path: every request the router does not answer itself goes to the child serving
its model (JSON body ``model``, multipart ``model`` field, or ``?model=``), so every
llama-server endpoint, including ones newer than this router, passes through. A GET or HEAD
without a model that is ``/`` or a file of llama.cpp's web UI (``webui.py``) gets that file
instead of the 404 it would get otherwise; any other GET or HEAD without a model gets the
404, except the child's own GET endpoints (``paths.CHILD_GET_PATHS``), which go to the
default model (``defaults``) like every other request without a model, or get the 400.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from starlette.datastructures import QueryParams
from starlette.types import Receive, Scope, Send

from .affinity import Prefix, request_prefix
from .errors import (
    BadRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RouterError,
    send_error,
    send_unexpected,
)
from .keys import resolve_in_scope
from .nodes import local_model, raise_if_elsewhere, serve_across_nodes
from .paths import (
    API_ROOTS,
    CHILD_GET_PATHS,
    METHODS,
)
from .proxy import (
    ResponseAborted,
    direct_body,
    for_remote,
    relay,
    upstream_headers,
    wait_disconnect,
)
from .requests import WAIT_BUDGET_HEADER, RequestContext, context, target_with_model
from .resumable import serves
from .state import State
from .wait import Ends
from .webui import StaticUI

if TYPE_CHECKING:
    from .leases import Lease
    from .peer import Peer
    from .presets import ModelPreset
    from .view import ModelView

log = logging.getLogger("router.forward")


def _autoload(params: QueryParams, default: bool) -> bool:
    value = params.get("autoload")
    if value is None or value == "":
        return default
    return value.lower() in ("1", "true")


def _budget(request: RequestContext) -> float | None:
    raw = request.headers.get(WAIT_BUDGET_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{WAIT_BUDGET_HEADER.decode()} must be a number of seconds, "
                         f"got {raw.decode('latin-1')!r}") from None
    if not value > 0 or value == float("inf"):  # also refuses nan
        raise BadRequest(f"{WAIT_BUDGET_HEADER.decode()} must be a positive, finite number of "
                         "seconds")
    return value


def _target(scope: Scope) -> bytes:
    """The request target as the client sent it (percent-encoding kept)."""
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope["query_string"]
    target = path + b"?" + query if query else path
    if not target.startswith(b"/") or any(c in target for c in (b" ", b"\r", b"\n")):
        raise BadRequest("malformed request target")
    return target


async def proxy(scope: Scope, receive: Receive, send: Send) -> None:
    """Every request the router does not answer itself goes to the child serving its model.

    Plain ASGI, no Starlette request object: this is the hot path. The model comes from the
    JSON body's ``model``, a multipart ``model`` field, or ``?model=``. A response whose
    body broke midway (``ResponseAborted``, already logged) is past answering: returning
    without completing it makes the ASGI server close the client's connection, so the
    truncation shows (uvicorn logs one line for it, no traceback).
    """
    try:
        await _forward(scope, receive, send)
    except ResponseAborted:
        return
    except RouterError as exc:
        await send_error(send, exc)
    except Exception as exc:
        await send_unexpected(send, scope, exc)


async def _forward(scope: Scope, receive: Receive, send: Send) -> None:
    """A proxied request, step by step: read it, name its model (or answer a web UI page),
    let the peers holding the model serve it, else resolve the model here, wait for a lease
    on one of its replicas and relay to that child. Each step reads the request context the
    edge made (``requests``) and records its decision there."""
    state: State = scope["app"].state.router
    request = _admit(state, scope)
    body = await request.read(receive, state.supervisor.settings.max_body_bytes)
    model = request.model or await _default_or_page(state, scope, send, request)
    if model is None:
        return  # a page of the web UI was the answer
    conv_id = request.conv_id if body else None  # a resumable stream (``resumable``)
    holders = _holders(state, request, model)
    if holders and await _across_nodes(state, scope, receive, send, request, model, conv_id,
                                       holders):
        return
    runtime = _resolve(state, request, model)
    request.model_id = runtime.preset.id
    if conv_id:  # a resumable stream: remember whose it is, also while the model loads
        state.conversations.claim(conv_id, runtime.id, request.key_hash,
                                  running=serves(state.supervisor))
    lease = _lease_now(state, request, runtime) or \
        await _wait_for_lease(state, receive, request, runtime)
    try:
        if conv_id:
            state.conversations.claim(conv_id, runtime.id, request.key_hash, lease.child,
                                      running=serves(state.supervisor))
        await _relay(state, scope, receive, send, request, runtime, lease, body)
    finally:
        lease.learn(request.tail())
        lease.release()


def _admit(state: State, scope: Scope) -> RequestContext:
    """The request's context, unless it is refused: while the router stops, for a method
    llama-server has no route for, or a target that is no path."""
    shutdown = state.shutdown
    if shutdown.closing.is_set():  # stopping: start nothing new (the connection closes)
        raise shutdown.refusal()
    method: str = scope["method"]
    if method not in METHODS:
        raise MethodNotAllowed(f"method {method} is not allowed")
    if not scope["path"].startswith("/"):  # "*" (OPTIONS *), or an authority
        raise BadRequest("the request target must be an absolute path such as /v1/models")
    return context(scope)


async def _default_or_page(state: State, scope: Scope, send: Send, request: RequestContext
                           ) -> str | None:
    """For a request naming no model: a web UI page (answered here: None), or the default
    model (else a 400 naming what is missing)."""
    method = request.method
    webui: StaticUI | None = scope["app"].state.webui
    if webui is not None and method in ("GET", "HEAD") and await webui.answer(
            scope, send, fallback=scope["path"].split("/")[1] not in API_ROOTS):
        return None
    if method in ("GET", "HEAD") and scope["path"] not in CHILD_GET_PATHS:
        raise NotFound("File Not Found")
    return request.default_to(state.default.for_request(state.supervisor))


def _holders(state: State, request: RequestContext, model: str) -> list[Peer] | None:
    """The peers holding the model, except those the request passed through (its via
    chain)."""
    peers = state.peers
    return peers.holders(model, request.via) if peers is not None and peers.peers else None


async def _across_nodes(state: State, scope: Scope, receive: Receive, send: Send,
                        request: RequestContext, model: str, conv_id: str | None,
                        holders: list[Peer]) -> bool:
    """Whether the peers holding the model served it (``nodes``); a model held here too
    may still fall to this router."""
    sup = state.supervisor
    local = local_model(sup, request.key_scope, model)
    request.model_id = model if local is None else local.preset.id
    if conv_id:  # refused before any node is tried if another key or model holds it
        state.conversations.claim(conv_id, request.model_id, request.key_hash,
                                  running=serves(sup))
    return await serve_across_nodes(state, scope, request, receive, send, holders, local,
                                    _target(scope))


def _resolve(state: State, request: RequestContext, model: str) -> ModelView:
    """The model a request gets here, as its key sees the router (out of scope reads as not
    found), with ``--unknown-model-to-default`` for a name nobody uses."""
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


def _lease_now(state: State, request: RequestContext, runtime: ModelView) -> Lease | None:
    """A lease on a replica of a model that serves, taken at once (the hot path: no task, no
    await); None when the model does not serve. Its options are checked either way."""
    if not runtime.serving:
        return None
    _budget(request)  # checked as for any request
    return state.supervisor.lease_now(runtime.id, _prefix(request, runtime))


async def _wait_for_lease(state: State, receive: Receive, request: RequestContext,
                          runtime: ModelView) -> Lease:
    """The whole wait for a model that does not serve (``wait``), ended by its budget, the
    client leaving or the shutdown."""
    sup = state.supervisor
    autoload = _autoload(request.params, sup.settings.models_autoload)
    budget = _budget(request)  # the model's own wait budget caps it (``wait``)
    shutdown = state.shutdown
    waited = time.perf_counter()
    try:
        lease = await sup.acquire(runtime.id, autoload=autoload, budget=budget,
                                  prefix=_prefix(request, runtime),
                                  ends=Ends(lambda: wait_disconnect(receive), shutdown.over,
                                            shutdown.error))
    finally:  # for the activity record, also when the wait failed
        request.queue_s = queued = time.perf_counter() - waited
    state.metrics.queue_seconds.labels(runtime.preset.id).observe(queued)
    return lease


def _prefix(request: RequestContext, runtime: ModelView) -> Prefix | None:
    """The prompt's prefix, for a model routed by it among its replicas (``affinity``)."""
    if request.parsed is None or not runtime.preset.prefix_routing:
        return None
    prefix = request_prefix(request.parsed)
    return prefix if prefix.keys else None


def _relay(state: State, scope: Scope, receive: Receive, send: Send,
           request: RequestContext, runtime: ModelView, lease: Lease, body: bytes
           ) -> Coroutine[Any, Any, None]:
    """Send the request to the leased replica's child (a remote upstream gets its key and
    maybe its own model name) and its answer back as the child writes it."""
    headers = upstream_headers(scope["headers"])
    preset = runtime.preset
    target = _target(scope)
    if preset.upstream is not None:  # a remote upstream: its key, maybe its model name
        headers, body, target = _for_remote(request, preset, headers, body, target)
    return relay(lease.child.connections, request.method, target, headers, body,
                 receive=receive, send=send, shutdown=state.shutdown,
                 direct=direct_body(scope))


def _for_remote(request: RequestContext, preset: ModelPreset,
                headers: list[tuple[bytes, bytes]], body: bytes, target: bytes
                ) -> tuple[list[tuple[bytes, bytes]], bytes, bytes]:
    """The request as the remote upstream of ``preset`` gets it (``proxy.for_remote``). The
    model it names there is the one the router decided: ``upstream-model`` when set, and for
    a request the default model took, the default's own name (its ``upstream-model``, else
    its id), written where it named one or would (the JSON body's ``model``, the multipart
    field, ``?model=``), never the name the client gave: the upstream must not decide again
    what the key's scope was checked against."""
    name = preset.upstream_model or (preset.id if request.defaulted else None)
    headers, body = for_remote(headers, body, request.parsed, preset.upstream_key, name,
                               request.headers.get(b"content-type", b""),
                               add=request.defaulted)
    if name is not None and ("model" in request.params or (request.defaulted and not body)):
        target = target_with_model(target, request.params, name)
    return headers, body, target


