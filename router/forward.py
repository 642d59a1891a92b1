"""The hot path: every request the router does not answer itself goes to the child serving
its model (JSON body ``model``, multipart ``model`` field, or ``?model=``), so every
llama-server endpoint, including ones newer than this router, passes through. A GET or HEAD
without a model that is ``/`` or a file of llama.cpp's web UI (``webui.py``) gets that file
instead of the 404 it would get otherwise; any other GET or HEAD without a model gets the
404, except the child's own GET endpoints (``paths.CHILD_GET_PATHS``), which go to the
default model (``defaults``) like every other request without a model, or get the 400.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from starlette.datastructures import QueryParams
from starlette.types import Receive, Scope, Send

from .affinity import Prefix, request_prefix
from .errors import (
    BadRequest,
    ClientGone,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RouterError,
    send_error,
    send_unexpected,
)
from .keys import resolve_in_scope
from .leases import Lease
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
from .state import Shutdown, State
from .webui import StaticUI

if TYPE_CHECKING:
    from .presets import ModelPreset

log = logging.getLogger("router.forward")


async def _acquire_unless_disconnected(acquire: Coroutine[Any, Any, Lease],
                                       receive: Receive, shutdown: Shutdown) -> Lease:
    """Wait for a lease, but leave the queue at once if the client goes away or the
    shutdown grace period ends (then with the shutdown's 503)."""
    acquire_task = asyncio.ensure_future(acquire)
    watch_task = asyncio.ensure_future(wait_disconnect(receive))
    over_task = asyncio.ensure_future(shutdown.over.wait())
    try:
        await asyncio.wait({acquire_task, watch_task, over_task},
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watch_task.done() and not watch_task.cancelled()
        over = over_task.done() and not over_task.cancelled()
        watch_task.cancel()
        over_task.cancel()
        if gone or over or not acquire_task.done():
            acquire_task.cancel()
        results = await asyncio.gather(watch_task, over_task, acquire_task,
                                       return_exceptions=True)
    lease = results[2]
    if gone or over or not acquire_task.done():
        if isinstance(lease, Lease):  # granted in the same instant: give it back
            lease.release()
        if over:
            raise shutdown.error()
        raise ClientGone("client disconnected while waiting for its model")
    return acquire_task.result()


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
    state: State = scope["app"].state.router
    shutdown = state.shutdown
    if shutdown.closing.is_set():  # stopping: start nothing new (the connection closes)
        raise shutdown.refusal()
    sup = state.supervisor
    method: str = scope["method"]
    if method not in METHODS:
        raise MethodNotAllowed(f"method {method} is not allowed")
    if not scope["path"].startswith("/"):  # "*" (OPTIONS *), or an authority
        raise BadRequest("the request target must be an absolute path such as /v1/models")
    request = context(scope)
    body = await request.read(receive, sup.settings.max_body_bytes)
    parsed = request.parsed
    model = request.model  # the body's, else ?model=: what the key check saw too
    if not model:
        webui: StaticUI | None = scope["app"].state.webui
        if webui is not None and method in ("GET", "HEAD") and await webui.answer(
                scope, send, fallback=scope["path"].split("/")[1] not in API_ROOTS):
            return
        if method in ("GET", "HEAD") and scope["path"] not in CHILD_GET_PATHS:
            raise NotFound("File Not Found")
        model = request.default_to(state.default.for_request(sup))  # else a 400 naming it
    budget = _budget(request)  # the supervisor caps it by the model's own wait budget
    key_scope = request.key_scope  # set by ApiKeyMiddleware for a scoped key only
    peers = state.peers
    # The peers holding the model, except those the request passed through (its via chain).
    holders = peers.holders(model, request.via) if peers is not None and peers.peers else None
    conv_id = request.conv_id if body else None  # a resumable stream (``resumable``)
    if holders:  # on other nodes too (``nodes``)
        local = local_model(sup, key_scope, model)
        request.model_id = model if local is None else local.preset.id
        if conv_id:  # refused before any node is tried if another key or model holds it
            state.conversations.claim(conv_id, request.model_id, request.key_hash,
                                      running=serves(sup))
        if await serve_across_nodes(state, scope, request, receive, send, holders, local,
                                    _target(scope)):
            return
    try:
        runtime = resolve_in_scope(sup, key_scope, model)  # a read-only view
    except ModelNotFound as exc:
        if request.defaulted:  # the default model is not this key's: never named to it
            raise NotFound('no model is named in the request, and the default model is not '
                           'one this API key may use: set "model" (GET /v1/models lists '
                           'them)') from None
        if peers is not None:
            raise_if_elsewhere(peers, model, request)
        fallback = state.default.for_unknown(sup)  # --unknown-model-to-default
        if fallback is None:
            raise
        model = request.default_to(fallback)
        try:
            runtime = resolve_in_scope(sup, key_scope, model)
        except ModelNotFound:
            raise exc from None  # not this key's either: the 404 of the name it gave
    request.model_id = runtime.preset.id
    autoload = _autoload(request.params, sup.settings.models_autoload)
    prefix: Prefix | None = None  # the prompt's prefix, for replicas (``affinity``)
    if parsed is not None and runtime.preset.prefix_routing:
        prefix = request_prefix(parsed)
        if not prefix.keys:
            prefix = None
    if conv_id:  # a resumable stream: remember whose it is, also while the model loads
        state.conversations.claim(conv_id, runtime.id, request.key_hash, running=serves(sup))
    if runtime.serving:  # hot path: no waiting, no tasks
        lease = await sup.acquire(model, autoload=autoload, budget=budget, prefix=prefix)
    else:
        waited = time.perf_counter()
        try:
            lease = await _acquire_unless_disconnected(
                sup.acquire(model, autoload=autoload, budget=budget, prefix=prefix), receive,
                shutdown)
        finally:  # for the activity record, also when the wait failed
            request.queue_s = queued = time.perf_counter() - waited
        state.metrics.queue_seconds.labels(runtime.preset.id).observe(queued)
    try:
        if conv_id:
            state.conversations.claim(conv_id, runtime.id, request.key_hash, lease.child,
                                      running=serves(sup))
        headers = upstream_headers(scope["headers"])
        preset = runtime.preset
        target = _target(scope)
        if preset.upstream is not None:  # a remote upstream: its key, maybe its model name
            headers, body, target = _for_remote(request, preset, headers, body, target)
        await relay(lease.child.connections, method, target, headers, body,
                    receive=receive, send=send, shutdown=shutdown, direct=direct_body(scope))
    finally:
        lease.learn(request.sent_before, request.sent_last)
        lease.release()


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


