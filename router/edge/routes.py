"""The routes the router answers itself: llama.cpp router mode's (``/health``, ``/props``
without ``?model=``, ``/models`` and ``/v1/models``, ``/models/load``, ``/models/unload``,
``/models/sse``, ``/tools``, resumable streams) and its own (``/models/reload``, pulls and
removals, ``/metrics``, ``/logs``, ``/activity``, the dashboard).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from .. import dashboard
from ..config.downloads import HfRef, HubUnreachable, ResolveError, delete_cached, resolve_remote
from ..config.keyfile import KeyScope
from ..config.presets import ModelPreset
from ..core.lifecycle import Status
from ..core.view import Models, ModelView
from ..errors import (
    BadRequest,
    MalformedBody,
    ModelMissing,
    NestedTooDeeply,
    RouterError,
    UpstreamError,
    envelope,
)
from ..http import sse
from ..http.paths import LOCAL_ROUTES
from ..http.requests import context, parse_json
from ..logs import LogRing
from ..observe.activity import activity_totals, list_activity
from ..observe.metrics import CONTENT_TYPE, merge_child_metrics, only_models, render_merged
from ..peers.fleet import across_nodes, merged_listing, scrape
from ..peers.hop import came_through, forward_admin, loop_error
from ..peers.placement import admin_targets
from .keys import Forbidden, key_scope_of
from .resumable import StreamResume
from .resumable import lookup as lookup_streams
from .resumable import stop as stop_stream
from .route import local_model, resolve_in_scope, target_model
from .state import State, _state


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


# How long ``/props`` waits for the default model's own ``/props`` (answered without the model,
# even while the child sleeps); past it, the router's fields alone.
CHILD_PROPS_TIMEOUT_S = 2.0
# The fields llama.cpp's router fills with placeholders "so the UI doesn't break": a default
# model's own answer replaces them.
PLACEHOLDERS = {"model_alias": "llama-router", "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0}}


async def props(request: Request) -> Response:
    """The router's ``/props``; the configuration's errors (file paths) and the peers (their
    addresses) only for a key with full access (admin for every model); the default model
    only for a key that may use it, and then, as a single llama-server answers, its own
    ``/props`` fields under the router's (``_default_props``)."""
    state = _state(request)
    settings = state.models.settings
    key_scope = key_scope_of(request.scope)
    full = key_scope is None
    default_id, default_from = _default_model(state, key_scope)
    single = await _default_props(state, default_id) if default_id is not None else {}
    return JSONResponse({
        **PLACEHOLDERS, **single,
        "role": "router", "max_instances": settings.models_max,
        "models_autoload": settings.models_autoload,
        "ui_settings": {}, "build_info": state.build_info, "cors_proxy_enabled": False,
        "config_error": state.reloader.error if full else None,
        "llama_router": {**state.models.budgets(), "node": state.node,
                         "instance": state.peers.instance if state.peers is not None else "",
                         "default_model": default_id, "default_model_from": default_from,
                         **({"peers": state.peers.describe()} if full and state.peers
                            is not None and state.peers.configured else {})},
    })


async def _default_props(state: State, model_id: str) -> dict[str, Any]:
    """What a llama-server serving the default model alone answers in ``/props``: its child's
    own fields while it is loaded (``model_path``, ``total_slots``, the generation settings,
    ``is_sleeping``: llama-server answers ``/props`` without waking), else ``is_sleeping``
    true (the next request loads it, as a sleeping llama-server wakes). Nothing is loaded
    for it; a child that does not answer in ``CHILD_PROPS_TIMEOUT_S`` adds nothing."""
    view = state.models.view(model_id)
    if view is None or view.status is not Status.LOADED:
        return {"is_sleeping": True}
    for replica in view.replicas():
        if replica.missed_checks:
            continue
        try:
            answer = await state.client.get(replica.base_url + "/props",
                                            timeout=CHILD_PROPS_TIMEOUT_S)
            found = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(found, dict):
            return {k: v for k, v in found.items() if isinstance(k, str)}
    return {}


def _default_model(state: State, key_scope: KeyScope | None) -> tuple[str | None, str | None]:
    """The default model's id and where it comes from (``defaults``), as this key may see
    them: (None, None) when there is none, or it is not the key's."""
    found = state.default.resolve(state.models)
    if found is None:
        return None, None
    view = state.models.view(found[0])
    if view is None or (key_scope is not None and not key_scope.allows(view.id, view.aliases)):
        return None, None
    return found


async def feature_disabled(request: Request) -> Response:
    """``/tools`` and ``/cors-proxy``: off in router mode, as llama.cpp's router answers."""
    return JSONResponse({"error": {"message": "this feature is disabled",
                                   "type": "feature_disabled"}}, status_code=403)


async def stream_resume(request: Request) -> Response:
    state = _state(request)
    return StreamResume(state.models, state.conversations,  # type: ignore[return-value]
                        state.shutdown)


async def streams_lookup(request: Request) -> Response:
    state = _state(request)
    return await lookup_streams(request, state.models, state.conversations, state.client)


async def stream_stop(request: Request) -> Response:
    state = _state(request)
    return await stop_stream(request, state.models, state.conversations, state.client)


async def list_models(request: Request) -> Response:
    state = _state(request)
    if context(request.scope).params.get("reload"):  # llama.cpp's: any non-empty value
        await state.reloader.reload("GET /models?reload")
    models = state.models
    key_scope = key_scope_of(request.scope)
    data = [m.entry(state.started) for m in models.views() if m.preset.listed
            and (key_scope is None or key_scope.allows(m.id, m.aliases))]
    data += _profile_entries(models, state.started, key_scope)
    data += _virtual_entries(state, key_scope)
    default_id, _ = _default_model(state, key_scope)
    for entry in data:
        if entry["id"] == default_id:
            entry["default"] = True  # where requests without a model go (``defaults``)
    skipped: list[dict[str, str]] = []
    if state.peers is not None and state.peers.peers:
        data = merged_listing(data, state.peers, state.node, key_scope)
        skipped = state.peers.skipped()
    return JSONResponse({"data": data, "object": "list",
                         **({"skipped_peers": skipped} if skipped else {})})


def _profile_entries(models: Models, created: int, key_scope: KeyScope | None
                     ) -> list[dict[str, Any]]:
    """The profiles' ``/models`` entries (those in the key's scope): each its base's entry
    (its status is its base's) under its own names, with its base and its request policy."""
    entries = []
    for profile in models.catalogue.profiles:
        base_id = models.catalogue.resolve(profile.profile_of or "")
        base = models.view(base_id) if base_id is not None else None
        if base is None or (key_scope is not None
                            and not key_scope.allows(profile.id, profile.aliases)):
            continue
        entry = base.entry(created)
        entry.update(id=profile.id, aliases=sorted(profile.aliases), tags=list(profile.tags),
                     can_remove=False, profile_of=base.id)
        entry.pop("policy", None)
        if profile.policy:
            entry["policy"] = profile.policy.describe()
        entries.append(entry)
    return entries


def _virtual_entries(state: State, key_scope: KeyScope | None) -> list[dict[str, Any]]:
    """The virtual models' ``/models`` entries (those in the key's scope): their targets and
    how they choose, loaded while a target here is, the target that served last and why."""
    models = state.models
    entries = []
    for virtual in models.catalogue.virtuals:
        if key_scope is not None and not key_scope.allows(virtual.id, virtual.aliases):
            continue
        loaded = any(view is not None and view.serving
                     for view in (target_model(models, t) for t in virtual.targets))
        entries.append({
            "id": virtual.id, "aliases": sorted(virtual.aliases), "tags": list(virtual.tags),
            "object": "model", "owned_by": "llamacpp", "created": state.started,
            "status": {"value": "loaded" if loaded else "unloaded"}, "source": "preset",
            "can_remove": False, "targets": list(virtual.targets), "choose": virtual.choose,
            **state.virtuals.describe(virtual.id)})
    return entries


async def _model_from_json(request: Request) -> str:
    model, _ = await _admin_request(request)
    return model


async def _admin_request(request: Request) -> tuple[str, dict[str, Any] | None]:
    """The model a load/unload names, and the JSON body (None if it is not JSON)."""
    ctx = context(request.scope)
    await ctx.read(request.receive, 1 << 20)
    if not ctx.model:
        raise ModelMissing()
    return ctx.model, ctx.parsed


async def _on_peers(request: Request, action: str, name: str,
                    payload: dict[str, Any] | None) -> Response | None:
    """A load/unload of a model that peers list (or that names a ``node``): forwarded to the
    node(s) it concerns (``nodes.admin_targets``). None: this router's own business."""
    state = _state(request)
    peers = state.peers
    asked = payload.get("node") if payload else None
    if peers is None or not peers.peers:
        return None
    ctx = context(request.scope)
    if came_through(ctx, peers.instance):  # it came back: never relayed again
        raise loop_error(ctx, peers.node, peers.instance, f"this {action} of model '{name}'")
    holders = peers.holders(name, ctx.via)  # never back to a router it passed through
    if not holders and not asked:
        if ctx.via and peers.holders(name) and state.models.model_id(name) is None:
            raise loop_error(ctx, peers.node, peers.instance, f"this {action} of model '{name}'")
        return None
    if asked is not None and not isinstance(asked, str):
        raise BadRequest('"node" must be a node name (GET /models shows them)')
    key_scope = key_scope_of(request.scope)
    local = local_model(state.models, key_scope, name)
    targets = admin_targets(holders, name, local, state.node, asked, action)
    if targets == [None]:
        return None
    ctx.model_id = name
    results: dict[str, Any] = {}
    status = 200
    for peer in targets:
        if peer is None:
            assert local is not None  # this router is a target only when it has the model
            try:
                await (state.models.load(local) if action == "load"
                       else state.models.unload(local))
                results[state.node] = {"success": True}
            except RouterError as exc:
                results[state.node] = exc.envelope()
                status = exc.status
            continue
        code, answer = await forward_admin(peer, f"/models/{action}", payload or {}, name,
                                           ctx)
        results[peer.node] = answer
        if code >= 400:
            status = code
    if len(targets) == 1:
        return JSONResponse(next(iter(results.values())), status_code=status)
    succeeded = [n for n, r in results.items() if r.get("success")]
    return JSONResponse({"success": bool(succeeded), "nodes": results},
                        status_code=200 if succeeded else status)


async def load_model(request: Request) -> Response:
    models = _state(request).models
    name, payload = await _admin_request(request)
    if (forwarded := await _on_peers(request, "load", name, payload)) is not None:
        return forwarded
    model = resolve_in_scope(models, key_scope_of(request.scope), name)
    context(request.scope).model_id = model.preset.id  # metrics, activity
    await models.load(model)  # BadRequest unless unloaded (the lifecycle decides)
    if context(request.scope).params.get("wait") in ("1", "true"):
        lease = await models.acquire(model)
        lease.release()
    return JSONResponse({"success": True})


async def pull_model(request: Request) -> Response:
    """``POST /models {"model": "owner/repo:QUANT"}``: check it on the Hub, then download it
    into the HF cache in the background (progress on /models and /models/sse)."""
    name = await _model_from_json(request)
    model, _ = await pull(_state(request).models, key_scope_of(request.scope), name)
    return JSONResponse({"success": True, "model": model.id})


async def pull(models: Models, key_scope: KeyScope | None, name: str
               ) -> tuple[ModelView, asyncio.Task[None]]:
    """Check ``name`` (``owner/repo[:QUANT]``) on the Hub, add it as a model of the HF cache
    and start its download: the model and the download's task. Also Ollama's pull."""
    try:
        resolution = await asyncio.to_thread(resolve_remote, HfRef.parse(name))
    except ResolveError as exc:
        raise BadRequest(str(exc)) from exc
    except HubUnreachable as exc:
        raise UpstreamError(str(exc)) from exc
    if key_scope is not None and not key_scope.allows(resolution.id):
        raise Forbidden(f"model '{resolution.id}' is not allowed for this API key")
    if models.model_id(resolution.id) is not None:
        raise BadRequest(f"model '{resolution.id}' already exists")
    preset = ModelPreset(id=resolution.id, source="cache",
                         args=MappingProxyType({"hf-repo": resolution.id}))
    model = models.add_model(preset)
    return model, models.start_download(model)


async def delete_model(request: Request) -> Response:
    """``DELETE /models?model=ID``: remove a Hugging Face cache model and its files."""
    name = context(request.scope).model
    if not name:
        raise ModelMissing()
    freed = await remove_cached(_state(request), key_scope_of(request.scope), name)
    return JSONResponse({"success": True, "freed_bytes": freed})


async def remove_cached(state: State, key_scope: KeyScope | None, name: str) -> int:
    """Remove the Hugging Face cache model ``name`` and its files: the bytes freed. Also
    Ollama's delete."""
    models = state.models
    runtime = resolve_in_scope(models, key_scope, name)
    if runtime.preset.source != "cache":
        raise BadRequest(f"model '{runtime.id}' comes from {runtime.preset.source}, not the "
                         "Hugging Face cache: remove it from its preset or directory instead")
    default = state.default
    if default.name is not None and models.model_id(default.name) == runtime.id:
        raise BadRequest(f"model '{runtime.id}' is the default model (--default-model): "
                         "restart the router with another default before removing it")
    await models.unload(runtime, explicit=False)
    paths = [Path(p) for k in ("model", "mmproj") if (p := runtime.preset.args.get(k))]
    freed: int = await asyncio.to_thread(delete_cached, paths)
    models.remove_model(runtime.id)
    return freed


_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


async def _allow_empty(request: Request) -> bool:
    """The reload's ``allow_empty`` option: ``?allow_empty=true`` or a JSON body
    ``{"allow_empty": true}``; false when absent (a bodiless POST, as before)."""
    ctx = context(request.scope)
    query = ctx.params.get("allow_empty")
    if query is not None:
        if query.lower() not in _TRUE + _FALSE:
            raise BadRequest(f"allow_empty must be true or false, not '{query}'")
        return query.lower() in _TRUE
    body = await ctx.read(request.receive, 1 << 16, parse=False)
    if not body.strip():
        return False
    try:
        options = parse_json(body)  # the one reader of a client's JSON (its depth guard)
    except NestedTooDeeply:
        raise
    except MalformedBody as exc:
        raise BadRequest(f"reload options must be a JSON object: {exc.message}") from None
    if not isinstance(options, dict):
        raise BadRequest("reload options must be a JSON object")
    value = options.get("allow_empty", False)
    if not isinstance(value, bool):
        raise BadRequest(f"allow_empty must be true or false, not {json.dumps(value)}")
    return value


async def reload_models(request: Request) -> Response:
    """``POST /models/reload``: re-read the configuration now. A configuration without models
    is refused while models are configured, unless ``allow_empty`` is given."""
    allow_empty = await _allow_empty(request)
    result = await _state(request).reloader.reload("POST /models/reload",
                                                   allow_empty=allow_empty)
    if not result["success"]:
        message = "configuration rejected, the previous one stays in effect:\n" + \
            "\n".join(result["errors"])
        return JSONResponse({**envelope(400, message), **result}, status_code=400)
    return JSONResponse(result)


async def unload_model(request: Request) -> Response:
    models = _state(request).models
    name, payload = await _admin_request(request)
    if (forwarded := await _on_peers(request, "unload", name, payload)) is not None:
        return forwarded
    model = resolve_in_scope(models, key_scope_of(request.scope), name)
    context(request.scope).model_id = model.preset.id  # metrics, activity
    await models.unload(model)  # BadRequest when nothing runs or loads (the lifecycle decides)
    return JSONResponse({"success": True})


async def models_sse(request: Request) -> Response:
    return EventStream(_state(request), key_scope_of(request.scope))  # type: ignore[return-value]


class EventStream:
    """``/models/sse``: a snapshot of every model's status (every one, however many), then
    live events, keep-alives. A key limited to some models gets only their events; router-wide
    events (``"model": "*"``: reloads, peers coming and going with their addresses) and a
    down peer's reason go only to a key with full access (admin for every model)."""

    def __init__(self, state: State, key_scope: KeyScope | None = None) -> None:
        self.state = state
        self.full = key_scope is None or key_scope.full
        self.key_scope = key_scope if key_scope is not None and key_scope.pattern else None

    def _shows(self, model_id: str) -> bool:
        if model_id == "*":
            return self.full
        if self.key_scope is None:
            return True
        model = self.state.models.view(model_id)
        return self.key_scope.allows(model_id, model.aliases if model else ())

    def _accepts(self, event: dict[str, Any]) -> bool:
        model = event.get("model")
        return isinstance(model, str) and (self._shows(model) or bool(self._profiles_of(model)))

    def _profiles_of(self, model_id: str) -> list[str]:
        """The ids of the profiles of ``model_id`` this stream shows: each gets its base's
        events under its own id (its status is its base's)."""
        return [p.id for p in self.state.models.catalogue.profiles
                if p.profile_of == model_id and (self.key_scope is None
                                                 or self.key_scope.allows(p.id, p.aliases))]

    def _as_seen(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """An event of a model as this stream sends it: itself where the key sees the model,
        and a copy under each profile of it that the key sees."""
        model = event.get("model")
        if not isinstance(model, str) or model == "*" or event.get("node"):
            return [event]
        return [*([event] if self._shows(model) else []),
                *({**event, "model": profile} for profile in self._profiles_of(model))]

    def _snapshot(self) -> list[dict[str, Any]]:
        snapshot: list[dict[str, Any]] = [
            seen for model in self.state.models.views() if model.preset.listed
            for seen in self._as_seen({"model": model.id, "event": "model_status",
                                       "data": {"status": model.status.public}})]
        peers = self.state.peers
        for model_id, holders in (peers.listing() if peers is not None else {}).items():
            if self._shows(model_id):
                for peer in holders:  # each node's state, as its events will update it
                    data: dict[str, Any] = {"status": peer.status_of(model_id)
                                            if peer.up else "unloaded"}
                    if not peer.up:
                        data["unavailable"] = True
                        if self.full:
                            data["message"] = peer.reason
                    snapshot.append({"model": model_id, "event": "model_status",
                                     "data": data, "node": peer.node, "via": [peer.via]})
        return snapshot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self.state.events.subscribe(self._accepts) as subscription:
            # The snapshot is taken in the same loop step as the subscription, so every later
            # change follows it and none is missed; it is sent ahead of the queue, which
            # bounds only the live events.
            snapshot = self._snapshot()
            snapshot.reverse()
            peers = self.state.peers

            async def next_event() -> str:
                if snapshot:
                    return json.dumps(snapshot.pop())
                seen = self._as_seen(await subscription.get())
                while not seen:  # a base the key sees only through its profiles, none now
                    seen = self._as_seen(await subscription.get())
                event, rest = seen[0], seen[1:]
                snapshot.extend(reversed(rest))  # sent next, in order
                if peers is not None and peers.peers:
                    event = across_nodes(event, peers, self.state.models)
                    data = event.get("data")
                    if not self.full and isinstance(data, dict) and "message" in data \
                            and data.get("unavailable"):  # a down node's reason: its address
                        event = {**event, "data": {k: v for k, v in data.items()
                                                   if k != "message"}}
                return json.dumps(event)

            await sse.respond(scope, receive, send, next_event, self.state.closing)


async def metrics(request: Request) -> Response:
    state = _state(request)
    body = await state.metrics.exposition(state.models, state.client)
    if state.peers is not None and state.peers.peers:  # every node's, with a node label
        texts = [({"node": state.node}, body.decode()),
                 *await scrape(state.peers, context(request.scope))]
        body = "".join(render_merged(merge_child_metrics(texts))).encode()
    key_scope = key_scope_of(request.scope)
    if key_scope is not None and key_scope.pattern is not None:  # only its models' series
        models = state.models

        def allows(model_id: str) -> bool:
            view = models.view(model_id)
            return key_scope.allows(model_id, view.aliases if view is not None else ())

        body = only_models(body, allows)
    return Response(body, media_type=CONTENT_TYPE)


def _log_source(request: Request) -> tuple[str, LogRing]:
    state = _state(request)
    name = context(request.scope).params.get("model")
    key_scope = key_scope_of(request.scope)
    if not name:
        if key_scope is not None and key_scope.pattern is not None:
            raise Forbidden(f"this API key ({key_scope.describe()}) may read its models' logs "
                            "(?model=), not the router's own, which covers every model")
        return "router", state.router_log
    runtime = resolve_in_scope(state.models, key_scope_of(request.scope), name)
    return runtime.preset.id, runtime.logs


async def logs(request: Request) -> Response:
    """Recent log lines: a model's llama-server output, or the router's own without model."""
    _, ring = _log_source(request)
    raw = context(request.scope).params.get("lines", "100")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):  # "²" is a digit, not ASCII
        raise BadRequest(f"lines must be a whole number from 0 to 999999999, got {raw[:20]!r}")
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


async def usage(request: Request) -> Response:
    """``GET /usage`` (admin): what each team used, per model, since the usage was first kept
    (``teams.usage``): requests, prompt and generated tokens, seconds queued, refusals;
    ``?format=csv`` for a spreadsheet. Teams are named by their keys' ``name=``, never by a
    key."""
    ledger = _state(request).usage
    form = request.query_params.get("format", "json")
    if form == "csv":
        return Response(ledger.csv(), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="usage.csv"'})
    if form != "json":
        raise BadRequest(f"format must be json or csv, not '{form[:40]}'")
    return JSONResponse({"kept": ledger.store is not None,
                         "usage": [vars(row) for row in ledger.rows()]})


# Each route the router answers itself, (path, method) -> its handler; which routes there are
# is ``paths.LOCAL_ROUTES``, the one list (``tests/test_architecture.py`` holds the two equal).
HANDLERS: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
    ("/health", "GET"): health, ("/v1/health", "GET"): health, ("/props", "GET"): props,
    ("/models", "GET"): list_models, ("/models", "POST"): pull_model,
    ("/models", "DELETE"): delete_model, ("/v1/models", "GET"): list_models,
    ("/models/load", "POST"): load_model, ("/models/unload", "POST"): unload_model,
    ("/models/reload", "POST"): reload_models, ("/models/sse", "GET"): models_sse,
    ("/metrics", "GET"): metrics, ("/logs", "GET"): logs, ("/logs/stream", "GET"): logs_stream,
    ("/tools", "GET"): feature_disabled, ("/tools", "POST"): feature_disabled,
    ("/cors-proxy", "GET"): feature_disabled, ("/cors-proxy", "POST"): feature_disabled,
    ("/v1/stream", "GET"): stream_resume, ("/v1/stream", "DELETE"): stream_stop,
    ("/v1/streams/lookup", "POST"): streams_lookup, ("/activity", "GET"): list_activity,
    ("/activity/totals", "GET"): activity_totals, ("/usage", "GET"): usage,
}


def routes() -> list[BaseRoute]:
    """The route table: ``paths.LOCAL_ROUTES`` with their handlers, and the dashboard's files
    (every other path is proxied: ``paths``)."""
    return [*(Route(path, HANDLERS[path, method], methods=[method])
              for path, methods in LOCAL_ROUTES.items() for method in methods),
            *dashboard.routes()]
