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
import json
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from starlette.datastructures import QueryParams
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import otel
from ..config.presets import CHOOSE_FALLBACK
from ..core.wait import Ends
from ..errors import (
    BadRequest,
    LoadFailed,
    MethodNotAllowed,
    NotFound,
    RouterError,
    UpstreamError,
    send_error,
    send_unexpected,
)
from ..http.jsonscan import object_end
from ..http.paths import (
    ADMIN_PROXIED_PREFIXES,
    API_ROOTS,
    CHILD_GET_PATHS,
    METHODS,
    RESPONSES_PATHS,
    SLOT_PATHS,
    UNPINNED_SLOT_PATHS,
)
from ..http.proxy import (
    FailOver,
    Preempted,
    Preemption,
    ResponseAborted,
    direct_body,
    for_remote,
    relay,
    upstream_headers,
    wait_disconnect,
)
from ..http.requests import (
    BODY_METHODS,
    WAIT_BUDGET_HEADER,
    RequestContext,
    context,
    parse_json,
)
from ..llama.webui import StaticUI
from ..observe import genai
from ..serving.affinity import NO_PREFIX, Prefix, request_prefix
from ..teams.fairshare import Turn
from .keepalive import FIELD as KEEP_ALIVE
from .keepalive import kept_alive
from .keys import Forbidden
from .metering import Metered
from .nodes import serve_across_nodes
from .route import Route, decide, take, virtual_route
from .state import State

if TYPE_CHECKING:
    from ..config.policy import RequestPolicy
    from ..config.presets import ModelPreset
    from ..core.view import ModelView
    from ..llama.unstreamed import Assembly
    from ..serving.leases import Lease

log = logging.getLogger("router.forward")

NO_FAIL_OVER: frozenset[int] = frozenset()
# A child's answers that a virtual model's ``choose = fallback`` takes as its target's failure
# (nothing relayed; the next target tried): llama-server's "unavailable" (loading, no slot).
FALLBACK_STATUSES = frozenset({503})


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


class ProxyMiddleware:
    """Send every path the router does not answer itself to ``proxy`` before any routing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not context(scope).local:
            await proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


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
    decide its route once (``route.decide``: the model, the nodes holding it, the
    conversation's claim), ask its team's quotas (``metering``), let the peers holding the
    model serve it, else wait for a lease on one of its replicas here (with one of its slots,
    for a metered request: ``slotqueue``) and relay to that child; again when a request of a
    higher class took the slot back before the child answered. What it used is charged once,
    however it ended."""
    state: State = scope["app"].state.router
    request = _admit(state, scope)
    body = await request.read(receive, state.models.settings.max_body_bytes)
    model = request.model or await _default_or_page(state, scope, send, request)
    if model is None:
        return  # a page of the web UI was the answer
    route = decide(state.models, state.peers, state.default, request, model, state.virtuals)
    while True:
        try:
            return await _forward_route(state, scope, receive, send, request, body, route)
        except (LoadFailed, UpstreamError, FailOver) as exc:
            virtual = route.virtual
            if virtual is None or not _falls_back(route):
                if isinstance(exc, FailOver):  # only asked for where the route falls back
                    raise UpstreamError(f"the model's child {exc}") from None
                raise
            log.info("target %s of virtual model %s failed before answering (%s); trying the "
                     "next", route.model_id, virtual.id, exc, extra={"event": "virtual_fallback"})
            # Its load failed, or its child failed (or answered 503) before the first byte:
            # the virtual model's next target (``choose = fallback``), with the body as the
            # client sent it (the next target's policy applies to that).
            if request.body is not body:
                await request.rewritten(body)
            route = virtual_route(state.models, state.peers, request, virtual, state.virtuals,
                                  _tried(route))


def _falls_back(route: Route) -> bool:
    """Whether a failure of the route's target before its first byte tries the next one: a
    virtual model's target with ``choose = fallback``, and targets left to try."""
    return route.virtual is not None and route.choice is not None \
        and bool(route.choice.rest) and route.virtual.choose == CHOOSE_FALLBACK


def _tried(route: Route) -> tuple[str, ...]:
    """The targets of a virtual model's route that refused it already: all but the rest."""
    assert route.virtual is not None and route.choice is not None
    return tuple(t for t in route.virtual.targets if t not in route.choice.rest)


async def _forward_route(state: State, scope: Scope, receive: Receive, send: Send,
                         request: RequestContext, body: bytes, route: Route) -> None:
    """The request on its route, decided: its body as its name's policy makes it, its team's
    quotas (``metering``), the peers holding the model, else a lease here and the relay."""
    route = take(state, request, route, request.conv_id if body else None)
    if route.policy and body:
        body = await _with_policy(request, route.policy, body)
    fields = request.fields
    kept = kept_alive(request.key_scope, fields[KEEP_ALIVE]) if KEEP_ALIVE in fields else None
    metered = state.meter.begin(request, route.model_id)  # 429 over a quota
    lease: Lease | None = None
    error: BaseException | None = None
    try:
        if route.holders and await serve_across_nodes(state, scope, request, receive, send,
                                                      route, request.target()):
            return
        local = route.local  # the handle on the model, decided once
        assert local is not None  # the nodes leave a request to this router only if it has it
        if kept is not None:
            state.models.keep_alive(local, kept)
        placed = _placed(state, request, local)
        prefix = _prefix(state, request, local)
        while True:
            lease = await _lease(state, receive, request, local, prefix, metered)
            if await _serve(state, scope, receive, send, request, route, local, lease,
                            (prefix or NO_PREFIX) if placed else None, body, metered):
                break
            lease.spent(0)  # preempted: its slot given back, nothing charged; it waits again
            lease.release()
            lease = None
    except BaseException as exc:
        error = exc
        raise
    finally:
        if metered is not None:
            metered.end(request, lease, error)
        if lease is not None:
            lease.learn(request.tail())
            lease.release()


async def _lease(state: State, receive: Receive, request: RequestContext, local: ModelView,
                 prefix: Prefix | None, metered: Metered | None) -> Lease:
    """A lease on a replica of the model (with a slot, for a metered request): at once when
    it serves and has one free, else after the whole wait."""
    routing = prefix if local.preset.prefix_routing else None
    turn = metered.turn if metered is not None else None
    return _lease_now(state, request, local, routing, turn) or \
        await _wait_for_lease(state, receive, request, local, routing, turn)


async def _serve(state: State, scope: Scope, receive: Receive, send: Send,
                 request: RequestContext, route: Route, local: ModelView, lease: Lease,
                 prefix: Prefix | None, body: bytes, metered: Metered | None) -> bool:
    """Relay the request to its leased child: to the slot its conversation needs (``prefix``:
    placed by the router, ``_placed``), and for a resumable stream, with the child that keeps
    it noted. False: its slot was taken back before the child answered (``Preempted``),
    nothing sent."""
    if route.conversation is not None:  # a resumable stream: the child that keeps it
        route.conversation.served_by(lease.child)
    preemption = metered.preemption() if metered is not None else None
    whole = None
    if metered is not None:
        body = metered.shaped(request, body)
        if local.preset.upstream is None:  # llama-server's answers, assembled whole
            body, whole = metered.asked_whole(request, body)
    try:
        if prefix is not None:
            body = await _in_its_slot(state, request, lease, prefix, body)
        await _relay(state, scope, receive, send, request, local, lease, body, preemption,
                     FALLBACK_STATUSES if _falls_back(route) else NO_FAIL_OVER, whole)
    except Preempted:
        return False
    finally:
        if metered is not None:
            metered.turn.preempt = None
    return True


async def _with_policy(request: RequestContext, policy: RequestPolicy, body: bytes) -> bytes:
    """The body its model's request policy makes (``policy``: fields set, replaced, removed),
    read again as the request's one reading (``RequestContext.rewritten``); the body itself
    when no rule changes it. A body that is not a JSON object (multipart, another JSON value,
    UTF-16) is refused: a policy that held only for JSON would be a bypass."""
    if request.method not in BODY_METHODS:
        return body
    if request.parsed is not None:
        whole: Any = request.parsed
    elif request.scanned is not None:
        whole = await asyncio.to_thread(parse_json, body)  # the one reader, off the loop
    else:
        whole = None
    if not isinstance(whole, dict):
        raise BadRequest(f"model '{request.model_id}' sets request fields (params., force., "
                         "strip in its preset): its requests take a JSON object body")
    changed = policy.apply(whole)
    if changed is None:
        return body
    return await request.rewritten(
        json.dumps(changed, ensure_ascii=False, separators=(",", ":")).encode())


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
    request = context(scope)
    if state.models.settings.state_dir is not None and _names_slot_files(request):
        raise Forbidden("the children's slot files are the router's own with --state-dir "
                        "(warm swaps): POST /slots/{id}?action=save or restore is refused; "
                        "erase is allowed")
    return request


def _names_slot_files(request: RequestContext) -> bool:
    """A ``/slots/{id}`` request asking a child to write or read a slot file (any ``action``
    value that could mean save or restore, however often the query repeats it)."""
    return request.path.startswith(ADMIN_PROXIED_PREFIXES) and any(
        value.strip().lower() in ("save", "restore")
        for value in request.params.getlist("action"))


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
    return request.default_to(state.default.for_request(state.models))


def _lease_now(state: State, request: RequestContext, model: ModelView,
               prefix: Prefix | None, turn: Turn | None) -> Lease | None:
    """A lease on a replica of a model that serves, taken at once (the hot path: no task, no
    await), by the prompt's ``prefix`` among its replicas when it is routed by it; None when
    the model does not serve. Its options are checked either way."""
    if not model.serving:
        return None
    _budget(request)  # checked as for any request
    return state.models.lease_now(model, prefix, turn)


async def _wait_for_lease(state: State, receive: Receive, request: RequestContext,
                          model: ModelView, prefix: Prefix | None, turn: Turn | None
                          ) -> Lease:
    """The whole wait for a model that does not serve (``wait``), ended by its budget, the
    client leaving or the shutdown."""
    models = state.models
    autoload = _autoload(request.params, models.settings.models_autoload)
    budget = _budget(request)  # the model's own wait budget caps it (``wait``)
    shutdown = state.shutdown
    waited = time.perf_counter()
    try:
        with otel.span(f"wait {model.id}", attributes=_waiting(request, model)):
            lease = await models.acquire(model, autoload=autoload, budget=budget,
                                         prefix=prefix, ends=Ends(
                                             lambda: wait_disconnect(receive), shutdown.over,
                                             shutdown.error), turn=turn)
    finally:  # for the activity record, also when the wait failed
        queued = time.perf_counter() - waited
        request.queue_s = (request.queue_s or 0.0) + queued  # each wait, when preempted
    state.metrics.queue_seconds.labels(model.preset.id).observe(queued)
    return lease


def _waiting(request: RequestContext, model: ModelView) -> dict[str, str] | None:
    """The wait span's attributes (OpenTelemetry on): the model, the request's team and class
    (what the core waits for, a load or a slot, it notes itself: ``wait``)."""
    if not otel.on:
        return None
    member = request.member
    return {"llama_router.model": model.id, "llama_router.team": member.name,
            "llama_router.class": member.priority}


def _prefix(state: State, request: RequestContext, model: ModelView) -> Prefix | None:
    """The prompt's prefix (``affinity``), read once, for a model routed by it among its
    replicas or one that keeps its conversations (``conversations``); None for others, and
    for a request with no prompt to key."""
    if request.parsed is None or not (model.preset.prefix_routing
                                      or state.models.keeps_conversations(model)):
        return None
    prefix = request_prefix(request.parsed, request.path in RESPONSES_PATHS)
    return prefix if prefix.keys else None


def _placed(state: State, request: RequestContext, model: ModelView) -> bool:
    """Whether the router places the request in one of its model's slots: a request that
    runs in one (``SLOT_PATHS``) to a model that keeps its conversations, except one that
    names its own ``id_slot`` without a key (the child's choice, as llama-server's own). With
    API keys every such request is placed, whatever its body's shape or its prompt's length,
    so that no slot serves one key another's cached prefix (``_in_its_slot``); one whose body
    cannot be placed (not a JSON object in UTF-8: multipart) is refused (400)."""
    if request.method != "POST" or request.path not in SLOT_PATHS \
            or not state.models.keeps_conversations(model):
        return False
    if _private(request, model):
        if request.body and (not request.json_object or object_end(request.body) is None):
            raise BadRequest(
                f"{request.path} with an API key takes a JSON object body (UTF-8): the router "
                "places each request in a slot that holds no other key's conversation, "
                "through its id_slot, which a multipart body cannot carry")
        return True
    return _named_slot(request) is None


def _named_slot(request: RequestContext) -> int | None:
    """The slot the request names (its ``id_slot``, as llama-server reads it: a whole number
    of 0 or more); None for none (-1, ``null``, another type, or no field)."""
    wanted = request.fields.get("id_slot")
    return wanted if type(wanted) is int and wanted >= 0 else None


def _private(request: RequestContext, model: ModelView) -> bool:
    """Whether the request's conversations are its key's own (``ModelPreset.private_to``)."""
    return model.preset.private_to(bool(request.key_hash))


async def _in_its_slot(state: State, request: RequestContext, lease: Lease, prefix: Prefix,
                       body: bytes) -> bytes:
    """The body of a completion placed in the slot its model's conversations need (its
    ``id_slot``, ``conversations``), once what that needs first is done (another owner's
    conversation erased, its own restored). A request that names its ``id_slot`` runs there
    only where the book honours it (the slot is free and holds nothing or its own key's
    conversation: ``SlotBook.honours``); else its ``id_slot`` is replaced by the router's
    choice. Unchanged where the child chooses (no slot free)."""
    pinned = request.path not in UNPINNED_SLOT_PATHS
    named = _named_slot(request) if pinned else None
    credential = request.credential() if request.key_hash else b""  # the key it matched
    slot = await state.models.place(lease, prefix, credential, named, pinned)
    if slot is None or slot == named or not pinned:
        return body
    placed = request.with_field(body, "id_slot", str(slot).encode())
    return body if placed is None else placed


def _relay(state: State, scope: Scope, receive: Receive, send: Send,
           request: RequestContext, model: ModelView, lease: Lease, body: bytes,
           preemption: Preemption | None = None, fail_over: frozenset[int] = NO_FAIL_OVER,
           whole: Assembly | None = None) -> Coroutine[Any, Any, None]:
    """Send the request to the leased replica's child (a remote upstream gets its key and
    maybe its own model name) and its answer back as the child writes it; an answer with a
    status in ``fail_over`` raises ``FailOver`` instead (nothing sent)."""
    headers = upstream_headers(scope["headers"], request)
    preset = model.preset
    target = request.target()
    if preset.upstream is not None:  # a remote upstream: its key, maybe its model name
        headers, body, target = _for_remote(request, preset, headers, body, target)
    # OpenTelemetry on: the exchange's CLIENT span, whose traceparent the child gets.
    span = genai.exchange(request, preset.id, lease.child.base_url) if otel.on else None
    if span is not None:
        headers = otel.inject(headers, span)
    relayed = relay(lease.child.connections, request.method, target, headers, body,
                    receive=receive, send=send, shutdown=state.shutdown,
                    direct=direct_body(scope), preemption=preemption, fail_over=fail_over,
                    whole=whole)
    return relayed if span is None else genai.exchanged(span, request, relayed)


def _for_remote(request: RequestContext, preset: ModelPreset,
                headers: list[tuple[bytes, bytes]], body: bytes, target: bytes
                ) -> tuple[list[tuple[bytes, bytes]], bytes, bytes]:
    """The request as the remote upstream of ``preset`` gets it (``proxy.for_remote``). The
    model it names there is the one the router decided: ``upstream-model`` when set, and for
    a request the default model took, the default's own name (its ``upstream-model``, else
    its id), and for one that came by a profile's or virtual model's name, the model's own,
    written where it named one or would (the JSON body's ``model``, the multipart field,
    ``?model=``), never the name the client gave: the upstream must not decide again what
    the key's scope was checked against."""
    by_other_name = request.defaulted or (request.model != preset.id  # a profile, a virtual
                                          and request.model not in preset.aliases)  # model
    name = preset.upstream_model or (preset.id if by_other_name else None)
    headers, body = for_remote(headers, body, request.json_scan() if name else None,
                               preset.upstream_key, name,
                               request.headers.get(b"content-type", b""),
                               add=request.defaulted)
    if name is not None and ("model" in request.params or (request.defaulted and not body)):
        target = request.target(name)
    return headers, body, target


