"""The HTTP surface: llama.cpp router-mode endpoints, proxying by model, auth and errors.

Routes answered by the router itself: ``/health``, ``/props`` (without ``?model=``),
``/models`` and ``/v1/models``, ``/models/load``, ``/models/unload``, ``/models/sse``,
``/activity`` (``activity.py``) and the dashboard's files (``dashboard/``). Every
other request is proxied to the child serving its ``model`` (JSON body field, multipart form
field, or ``?model=``), so every llama-server endpoint, including ones newer than this router,
passes through. A GET or HEAD without a model that is ``/`` or a file of llama.cpp's web UI
(``webui.py``) gets that file instead of the 404 it would get otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import dashboard, sse
from .activity import TAIL_BYTES, Activity, activity_totals, generated_tokens, list_activity
from .downloads import HfRef, ResolveError, delete_cached, resolve_remote
from .errors import (
    BadRequest,
    ClientGone,
    MethodNotAllowed,
    ModelMissing,
    NotFound,
    RouterError,
    Unauthorized,
    envelope,
    envelope_bytes,
)
from .events import EventBus
from .leases import Lease
from .logs import LogRing
from .memory import total_ram_bytes
from .metrics import CONTENT_TYPE, RouterMetrics
from .presets import ModelPreset
from .proxy import relay, upstream_headers, wait_disconnect
from .reload import Reloader
from .requests import header, model_from_body, read_body
from .resumable import CONVERSATION_HEADER, ConversationOwners, StreamResume
from .resumable import lookup as lookup_streams
from .resumable import stop as stop_stream
from .runtime import ModelRuntime
from .scheduler import Status
from .supervisor import Supervisor
from .webui import StaticUI

log = logging.getLogger("router.app")

PUBLIC_PATHS = frozenset({"/health", "/v1/health", *dashboard.DASHBOARD_PATHS})
# GET endpoints of llama-server that need a model: without ?model= they are a 400, not a 404.
CHILD_GET_PATHS = frozenset({"/slots", "/metrics", "/lora-adapters", "/props", "/v1/props"})
# Endpoint label values for metrics; any other path is counted as "other".
KNOWN_ENDPOINTS = frozenset({
    "/health", "/v1/health", "/props", "/models", "/v1/models", "/models/load",
    "/models/unload", "/models/sse", "/metrics", "/logs", "/logs/stream", "/slots",
    "/lora-adapters", "/v1/chat/completions", "/chat/completions", "/v1/completions",
    "/completions", "/completion", "/v1/responses", "/responses", "/v1/embeddings",
    "/embeddings", "/embedding", "/v1/rerank", "/rerank", "/v1/reranking", "/reranking",
    "/v1/messages", "/v1/messages/count_tokens", "/infill", "/tokenize", "/detokenize",
    "/apply-template", "/v1/audio/transcriptions", "/audio/transcriptions", "/activity",
    "/activity/totals"})
WAIT_BUDGET_HEADER = b"x-wait-budget"
NO_PARAMS = QueryParams("")
# Paths the router answers itself; every other path is proxied. /props and /metrics with
# ?model= are the model's own, and proxied too.
LOCAL_PATHS = frozenset({
    "/health", "/v1/health", "/props", "/models", "/v1/models", "/models/load",
    "/models/unload", "/models/reload", "/models/sse", "/metrics", "/logs", "/logs/stream",
    "/activity", "/activity/totals", *dashboard.DASHBOARD_PATHS,
    "/tools", "/cors-proxy", "/v1/stream", "/v1/streams/lookup"})
MODEL_SCOPED_PATHS = frozenset({"/props", "/metrics"})
# First segments of API paths: those never get the web UI's page as an SPA fallback.
API_ROOTS = frozenset({p.split("/")[1] for p in KNOWN_ENDPOINTS | LOCAL_PATHS | CHILD_GET_PATHS}
                      | {"v1", "tools", "cors-proxy", "api"})


class State:
    """What the routes share; built by the lifespan (see ``server.py``)."""

    def __init__(self, supervisor: Supervisor, client: httpx.AsyncClient, events: EventBus,
                 build_info: str, metrics: RouterMetrics, router_log: LogRing,
                 reloader: Reloader) -> None:
        self.supervisor = supervisor
        self.client = client
        self.events = events
        self.build_info = build_info
        self.metrics = metrics
        self.router_log = router_log
        self.reloader = reloader
        self.conversations = ConversationOwners()  # resumable streams: which child has each
        self.started = int(time.time())
        self._tasks: set[asyncio.Task[Any]] = set()
        # Set when the router starts shutting down: endless streams (events, log follow) end
        # so that shutdown waits only for real requests.
        self.closing = asyncio.Event()

    def request_reload(self) -> None:
        """SIGHUP: re-read the configuration in the background."""
        task = asyncio.create_task(self.reloader.reload("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _state(request: Request) -> State:
    state: State = request.app.state.router
    return state


def error_response(exc: RouterError) -> Response:
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)


# --------------------------------------------------------------------------- local routes

async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    state = _state(request)
    settings = state.supervisor.settings
    return JSONResponse({
        "role": "router", "max_instances": settings.models_max,
        "models_autoload": settings.models_autoload, "model_alias": "llama-router",
        "model_path": "none", "default_generation_settings": {"params": None, "n_ctx": 0},
        "ui_settings": {}, "build_info": state.build_info, "cors_proxy_enabled": False,
        "config_error": state.reloader.error,
        "llama_router": budgets(state.supervisor),
    })


async def feature_disabled(request: Request) -> Response:
    """``/tools`` and ``/cors-proxy``: off in router mode, as llama.cpp's router answers."""
    return JSONResponse({"error": {"message": "this feature is disabled",
                                   "type": "feature_disabled"}}, status_code=403)


async def stream_resume(request: Request) -> Response:
    state = _state(request)
    return StreamResume(state.supervisor, state.conversations)  # type: ignore[return-value]


async def streams_lookup(request: Request) -> Response:
    state = _state(request)
    return await lookup_streams(request, state.supervisor, state.conversations, state.client)


async def stream_stop(request: Request) -> Response:
    state = _state(request)
    return await stop_stream(request, state.supervisor, state.conversations, state.client)


def budgets(supervisor: Supervisor) -> dict[str, Any]:
    """What the scheduler plans against (``/props`` ``llama_router``): bytes, None when off."""
    return {
        "models_max": supervisor.settings.models_max,
        "memory_budget": supervisor.memory_budget, "memory_total": total_ram_bytes(),
        "gpus": [{"pool": d.pool, "name": d.name, "total": d.total_bytes,
                  "budget": supervisor.gpu_budgets.get(d.pool)} for d in supervisor.gpus],
    }


def describe(runtime: ModelRuntime, supervisor: Supervisor, created: int) -> dict[str, Any]:
    """One ``/models`` entry, in llama.cpp's shape plus the router's extra status fields."""
    preset = runtime.preset
    child = runtime.child
    status: dict[str, Any] = {
        "value": runtime.status.public,
        "args": child.argv if child else supervisor.spawner.display_argv(runtime),
        "in_flight": runtime.in_flight,
        "waiting": runtime.waiting,
    }
    if child is not None:
        status.update(pid=child.pid, port=child.port)
    if runtime.loaded_at is not None:
        status["uptime_s"] = round(time.monotonic() - runtime.loaded_at, 1)
    if child is not None:
        status["cpu"] = child.cpu.describe() if child.cpu is not None else {
            "threads": preset.args.get("threads"), "cores": None,
            "placed_by": "preset" if supervisor.cores else "llama-server"}
        if supervisor.cpu_gate.is_paused(child):
            status["cpu"]["paused"] = True  # waiting for its turn on the CPU
    if preset.replicas > 1 or len(runtime.replicas) > 1:
        status["replicas"] = [{"pid": r.child.pid, "port": r.child.port,
                               "in_flight": r.in_flight,
                               **({"cpu": r.child.cpu.describe()} if r.child.cpu else {})}
                              for r in runtime.replicas]
    if runtime.status is Status.STOPPING:
        status["stopping"] = True
    if runtime.draining:
        status["draining"] = True
    if runtime.status is Status.LOADING and runtime.progress is not None:
        status["progress"] = runtime.progress
    position = supervisor.admission.position(runtime)
    if position is not None:
        status["queue_position"] = position
        status["expected_wait_s"] = supervisor.admission.expected_wait_s(runtime)
    memory: dict[str, Any] = {"estimate": runtime.estimate or None}
    if runtime.replicas:
        memory["measured"] = supervisor.accounting.measured(runtime)
    if supervisor.gpus:
        measured = supervisor.accounting.measured_devices(runtime) if runtime.replicas else {}
        memory["gpus"] = {
            pool: {"estimate": runtime.estimate_devices.get(pool),
                   **({"measured": measured.get(pool, 0)} if runtime.replicas else {})}
            for pool in sorted(runtime.estimate_devices.keys() | measured.keys())}
    status["memory"] = memory
    if preset.model_path is None and preset.hf_repo:
        status.update(downloaded=False,
                      message=f"not downloaded yet: hf-repo = {preset.hf_repo}")
    if runtime.download and runtime.status is Status.DOWNLOADING:
        status["download"] = runtime.download
    if runtime.status is Status.UNLOADED and runtime.failed and runtime.failure is not None:
        status.update(failed=True, exit_code=runtime.failure.exit_code,
                      message=runtime.failure.message, last_lines=runtime.failure.last_lines)
    if runtime.crash_loop:
        status["crash_loop"] = True
    entry: dict[str, Any] = {
        "id": preset.id, "aliases": sorted(preset.aliases), "tags": list(preset.tags),
        "object": "model", "owned_by": "llamacpp", "created": created, "status": status,
        "source": preset.source, "can_remove": preset.source == "cache",
    }
    if runtime.info and runtime.status is not Status.UNLOADED:
        for key, value in runtime.info.items():
            entry.setdefault(key, value)
    return entry


async def list_models(request: Request) -> Response:
    state = _state(request)
    if request.query_params.get("reload"):  # llama.cpp's trigger: any non-empty value
        await state.reloader.reload("GET /models?reload")
    sup = state.supervisor
    data = [describe(r, sup, state.started) for r in sup.models.values() if r.preset.listed]
    return JSONResponse({"data": data, "object": "list"})


async def _model_from_json(request: Request) -> str:
    body = await read_body(request.scope, request.receive, 1 << 20)
    model, _ = model_from_body(request.headers.get("content-type", ""), body)
    if not model:
        raise ModelMissing()
    return model


async def load_model(request: Request) -> Response:
    sup = _state(request).supervisor
    name = await _model_from_json(request)
    runtime = sup.resolve(name)
    request.scope.setdefault("state", {})["model"] = runtime.preset.id  # metrics, activity
    if runtime.status is not Status.UNLOADED:
        raise BadRequest(f"model '{runtime.preset.id}' is already running "
                         f"(status: {runtime.status.value})")
    await sup.load(name)
    if request.query_params.get("wait") in ("1", "true"):
        lease = await sup.acquire(name)
        lease.release()
    return JSONResponse({"success": True})


async def pull_model(request: Request) -> Response:
    """``POST /models {"model": "owner/repo:QUANT"}``: check it on the Hub, then download it
    into the HF cache in the background (progress on /models and /models/sse)."""
    sup = _state(request).supervisor
    name = await _model_from_json(request)
    try:
        resolution = await asyncio.to_thread(resolve_remote, HfRef.parse(name))
    except ResolveError as exc:
        raise BadRequest(str(exc)) from exc
    if sup.catalogue.resolve(resolution.id) is not None:
        raise BadRequest(f"model '{resolution.id}' already exists")
    preset = ModelPreset(id=resolution.id, source="cache",
                         args=MappingProxyType({"hf-repo": resolution.id}))
    sup.start_download(sup.add_model(preset))
    return JSONResponse({"success": True, "model": resolution.id})


async def delete_model(request: Request) -> Response:
    """``DELETE /models?model=ID``: remove a Hugging Face cache model and its files."""
    sup = _state(request).supervisor
    name = request.query_params.get("model")
    if not name:
        raise ModelMissing()
    runtime = sup.resolve(name)
    if runtime.preset.source != "cache":
        raise BadRequest(f"model '{runtime.id}' comes from {runtime.preset.source}, not the "
                         "Hugging Face cache: remove it from its preset or directory instead")
    await sup.unload(runtime.id)
    paths = [Path(p) for k in ("model", "mmproj") if (p := runtime.preset.args.get(k))]
    freed = await asyncio.to_thread(delete_cached, paths)
    sup.remove_model(runtime)
    return JSONResponse({"success": True, "freed_bytes": freed})


async def reload_models(request: Request) -> Response:
    result = await _state(request).reloader.reload("POST /models/reload")
    if not result["success"]:
        message = "configuration rejected, the previous one stays in effect:\n" + \
            "\n".join(result["errors"])
        return JSONResponse({**envelope(400, message), **result}, status_code=400)
    return JSONResponse(result)


async def unload_model(request: Request) -> Response:
    sup = _state(request).supervisor
    name = await _model_from_json(request)
    runtime = sup.resolve(name)
    request.scope.setdefault("state", {})["model"] = runtime.preset.id  # metrics, activity
    if runtime.status not in (Status.DOWNLOADING, Status.LOADING, Status.LOADED):
        raise BadRequest(f"model '{runtime.preset.id}' is not running "
                         f"(status: {runtime.status.value})")
    await sup.unload(name)
    return JSONResponse({"success": True})


async def models_sse(request: Request) -> Response:
    return EventStream(_state(request))  # type: ignore[return-value]


class EventStream:
    """``/models/sse``: a snapshot of every model's status, then live events, keep-alives."""

    def __init__(self, state: State) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self.state.events.subscribe() as subscription:
            # The snapshot is queued in the same loop step as the subscription, so every
            # later change follows it and none is missed.
            for runtime in self.state.supervisor.models.values():
                if not runtime.preset.listed:
                    continue
                subscription.offer({"model": runtime.preset.id, "event": "model_status",
                                    "data": {"status": runtime.status.public}})

            async def next_event() -> str:
                return json.dumps(await subscription.get())

            await sse.respond(scope, receive, send, next_event, self.state.closing)


async def metrics(request: Request) -> Response:
    state = _state(request)
    body = await state.metrics.exposition(state.supervisor, state.client)
    return Response(body, media_type=CONTENT_TYPE)


def _log_source(request: Request) -> tuple[str, LogRing]:
    state = _state(request)
    name = request.query_params.get("model")
    if not name:
        return "router", state.router_log
    runtime = state.supervisor.resolve(name)
    return runtime.preset.id, runtime.logs


async def logs(request: Request) -> Response:
    """Recent log lines: a model's llama-server output, or the router's own without model."""
    _, ring = _log_source(request)
    raw = request.query_params.get("lines", "100")
    if not raw.isdigit():
        raise BadRequest(f"lines must be a non-negative integer, got {raw!r}")
    lines = ring.tail(int(raw))
    return Response("".join(line + "\n" for line in lines), media_type="text/plain")


async def logs_stream(request: Request) -> Response:
    _, ring = _log_source(request)
    return LogStream(ring, _state(request).closing)  # type: ignore[return-value]


class LogStream:
    """``/logs/stream``: each new log line as an SSE event, with keep-alives."""

    def __init__(self, ring: LogRing, closing: asyncio.Event) -> None:
        self.ring = ring
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.ring.follow() as queue:  # follow first: no line is missed after the headers
            await sse.respond(scope, receive, send, queue.get, self.closing)


# --------------------------------------------------------------------------- proxy

async def _acquire_unless_disconnected(acquire: Coroutine[Any, Any, Lease],
                                       receive: Receive) -> Lease:
    """Wait for a lease, but leave the queue at once if the client goes away."""
    acquire_task = asyncio.ensure_future(acquire)
    watch_task = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({acquire_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watch_task.done() and not watch_task.cancelled()
        watch_task.cancel()
        if gone or not acquire_task.done():
            acquire_task.cancel()
        results = await asyncio.gather(watch_task, acquire_task, return_exceptions=True)
    lease = results[1]
    if gone or not acquire_task.done():
        if isinstance(lease, Lease):  # granted in the same instant: give it back
            lease.release()
        raise ClientGone("client disconnected while waiting for its model")
    return acquire_task.result()


def _autoload(params: QueryParams, default: bool) -> bool:
    value = params.get("autoload")
    if value is None or value == "":
        return default
    return value.lower() in ("1", "true")


def _budget(scope: Scope) -> float | None:
    raw = header(scope, WAIT_BUDGET_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{WAIT_BUDGET_HEADER.decode()} must be a number of seconds, "
                         f"got {raw.decode('latin-1')!r}") from None
    if value <= 0:
        raise BadRequest(f"{WAIT_BUDGET_HEADER.decode()} must be positive")
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
    JSON body's ``model``, a multipart ``model`` field, or ``?model=``.
    """
    try:
        await _forward(scope, receive, send)
    except RouterError as exc:
        await send_error(send, exc)
    except Exception as exc:
        log.exception("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
        await send_error(send, RouterError(f"internal error: {type(exc).__name__}"))


async def _forward(scope: Scope, receive: Receive, send: Send) -> None:
    state: State = scope["app"].state.router
    sup = state.supervisor
    method: str = scope["method"]
    if method not in METHODS:
        raise MethodNotAllowed(f"method {method} is not allowed")
    body = await read_body(scope, receive, sup.settings.max_body_bytes)
    model: str | None = None
    if method in ("POST", "PUT", "PATCH"):
        content_type = header(scope, b"content-type") or b""
        model, _ = model_from_body(content_type.decode("latin-1"), body)
    params = QueryParams(scope["query_string"]) if scope["query_string"] else NO_PARAMS
    model = model or params.get("model")
    if not model:
        webui: StaticUI | None = scope["app"].state.webui
        if webui is not None and method in ("GET", "HEAD") and await webui.answer(
                scope, send, fallback=scope["path"].split("/")[1] not in API_ROOTS):
            return
        if method == "GET" and scope["path"] not in CHILD_GET_PATHS:
            raise NotFound("File Not Found")
        raise ModelMissing()
    budget = _budget(scope)  # the supervisor caps it by the model's own wait budget
    runtime = sup.resolve(model)
    request_state = scope.setdefault("state", {})
    request_state["model"] = runtime.preset.id
    autoload = _autoload(params, sup.settings.models_autoload)
    conv_id = header(scope, CONVERSATION_HEADER) if body else None
    if conv_id:  # a resumable stream: remember whose it is, also while the model loads
        state.conversations.remember(conv_id.decode("latin-1"), runtime.id)
    if runtime.serving:  # hot path: no waiting, no tasks
        lease = await sup.acquire(model, autoload=autoload, budget=budget)
    else:
        waited = time.perf_counter()
        try:
            lease = await _acquire_unless_disconnected(
                sup.acquire(model, autoload=autoload, budget=budget), receive)
        finally:  # for the activity record, also when the wait failed
            request_state["queue_s"] = queued = time.perf_counter() - waited
        state.metrics.queue_seconds.labels(runtime.preset.id).observe(queued)
    if conv_id:
        state.conversations.remember(conv_id.decode("latin-1"), runtime.id, lease.child)
    try:
        await relay(lease.child.connections, method, _target(scope),
                    upstream_headers(scope["headers"]), body, receive=receive, send=send)
    finally:
        lease.release()


async def send_error(send: Send, exc: RouterError) -> None:
    """Answer with the error's envelope and headers, in plain ASGI."""
    body = envelope_bytes(exc.status, exc.message, exc.type)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- middleware

class ApiKeyMiddleware:
    """Require one of ``keys`` as ``Authorization: Bearer <k>`` or ``X-Api-Key: <k>``."""

    def __init__(self, app: ASGIApp, keys: list[str], webui: StaticUI | None = None) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.webui = webui

    def _ui_file(self, scope: Scope) -> bool:
        """``/`` and the web UI's files are public, as llama-server's UI files are (not with
        anything naming a model in the query: that goes to a child)."""
        return (self.webui is not None and scope["method"] in ("GET", "HEAD")
                and self.webui.is_public(scope["path"]) and b"model" not in scope["query_string"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS
                or scope["method"] == "OPTIONS" or self._ui_file(scope)):
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                presented = value[7:].strip() if value[:7].lower() == b"bearer " else value
            elif name == b"x-api-key" and not presented:
                presented = value.strip()
        # Compare against every key so timing does not reveal which one matched.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(presented, key)
        if ok:
            await self.app(scope, receive, send)
            return
        await send_error(send, Unauthorized())


class RequestMetricsMiddleware:
    """Count every request by model, endpoint and status, time it to its first and last body
    byte, and record it in ``activity``: requests to a model, and every other request that is
    not a GET/HEAD/OPTIONS (load, unload, pull, ...); reads without a model (model list,
    metrics, logs, event streams, the web UI's and the dashboard's files and polls) are only
    counted."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], RouterMetrics | None],
                 activity: Activity | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.activity = activity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        first = 0.0  # when the first non-empty body chunk went out
        # The last two non-empty body chunks (a stream ends with its last event, then
        # "data: [DONE]"), for the token count. The streaming hot path: no copies here.
        previous = last = b""

        async def send_wrapper(message: Any) -> None:
            nonlocal status, first, previous, last
            if message["type"] == "http.response.body":
                body = message.get("body")
                if body:
                    if not first:
                        first = time.perf_counter()
                    previous, last = last, body
            elif message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            ended = time.perf_counter()
            tail = previous[-TAIL_BYTES:] + last[-TAIL_BYTES:] if last else b""
            self._observe(scope, status, ended - started, first - started if first else None,
                          tail)

    def _observe(self, scope: Scope, status: int, total_s: float, ttft_s: float | None,
                 tail: bytes) -> None:
        request_state = scope.get("state", {})
        model: str = request_state.get("model", "")
        proxied = not ProxyMiddleware._is_local(scope)
        tokens = generated_tokens(tail) if proxied and model and tail else None
        metrics = self.metrics()
        if metrics is not None:
            path = scope["path"]
            metrics.observe_request(model, path if path in KNOWN_ENDPOINTS else "other", status,
                                    total_s, ttft_s if proxied and model else None,
                                    tokens if proxied and model else None)
        if self.activity is not None and (model or scope["method"] not in READ_METHODS):
            self.activity.add(
                model=model, method=scope["method"], path=scope["path"], status=status,
                started=time.time() - total_s, total_s=total_s, ttft_s=ttft_s, tokens=tokens,
                queue_s=request_state.get("queue_s", 0.0) if proxied and model else None,
                proxied=proxied)


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
    return JSONResponse(envelope(500, f"internal error: {type(exc).__name__}"), status_code=500)


Lifespan = Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ProxyMiddleware:
    """Send every path the router does not answer itself to ``proxy`` before any routing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._is_local(scope):
            await proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    @staticmethod
    def _is_local(scope: Scope) -> bool:
        path = scope["path"]
        if path not in LOCAL_PATHS:
            return False
        if path in MODEL_SCOPED_PATHS and scope["query_string"]:
            return not QueryParams(scope["query_string"]).get("model")
        return True


def create_app(lifespan: Lifespan, api_keys: list[str],
               webui: StaticUI | None = None) -> Starlette:
    """The router's ASGI app; ``webui``: the web UI served at ``/``, None for none."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/models", list_models, methods=["GET"]),
        Route("/models", pull_model, methods=["POST"]),
        Route("/models", delete_model, methods=["DELETE"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/models/load", load_model, methods=["POST"]),
        Route("/models/unload", unload_model, methods=["POST"]),
        Route("/models/reload", reload_models, methods=["POST"]),
        Route("/models/sse", models_sse, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/logs", logs, methods=["GET"]),
        Route("/logs/stream", logs_stream, methods=["GET"]),
        Route("/tools", feature_disabled, methods=["GET", "POST"]),
        Route("/cors-proxy", feature_disabled, methods=["GET", "POST"]),
        Route("/v1/stream", stream_resume, methods=["GET"]),
        Route("/v1/stream", stream_stop, methods=["DELETE"]),
        Route("/v1/streams/lookup", streams_lookup, methods=["POST"]),
        Route("/activity", list_activity, methods=["GET"]),
        Route("/activity/totals", activity_totals, methods=["GET"]),
        *dashboard.routes(),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        RouterError: _router_error, HTTPException: _http_error, Exception: _unexpected}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.add_middleware(ProxyMiddleware)
    app.state.webui = webui
    app.add_middleware(ApiKeyMiddleware, keys=api_keys, webui=webui)

    def current_metrics() -> RouterMetrics | None:
        state = getattr(app.state, "router", None)
        return state.metrics if state is not None else None

    app.state.activity = activity = Activity()
    app.add_middleware(RequestMetricsMiddleware, metrics=current_metrics, activity=activity)
    return app

