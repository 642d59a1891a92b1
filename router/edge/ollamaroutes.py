"""Ollama's API on the router's port: its route table (``routes``, the paths of
``paths.OLLAMA_ROUTES``), and the routes that answer from what the router knows: the version,
the models (``/api/tags``), those loaded (``/api/ps``), one model (``/api/show``), and the
management routes, pulling from Hugging Face (``/api/pull``, progress as NDJSON lines) and
deleting a model of its cache (``/api/delete``). Chat, generate and embed are
``ollamachat``'s. Every answer, errors included, is in Ollama's shape; a key sees only its
models, as on ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from .. import clock
from ..config.keyfile import KeyScope
from ..core.view import ModelView
from ..errors import BadRequest
from ..events import Subscription
from ..http.paths import OLLAMA_ROUTES
from ..http.requests import context
from ..ollama import details, translate
from ..ollama.answers import error_body
from .ollamachat import INFERENCE, JSON, NDJSON, Endpoint, Handler, known, read_object, send_json
from .route import resolve_in_scope
from .routes import pull, remove_cached
from .state import State

# The Ollama version this API follows (clients such as Open WebUI read it).
OLLAMA_VERSION = "0.12.0"
FOREVER = "2318-01-01T00:00:00Z"  # a loaded model that no idle TTL stops, as Ollama shows it


def _visible(state: State, key_scope: KeyScope | None) -> list[ModelView]:
    return [m for m in state.models.views() if m.preset.listed and m.preset.upstream is None
            and (key_scope is None or key_scope.allows(m.id, m.aliases))]


def _entry(model: ModelView) -> dict[str, Any]:
    found = details.facts(model.preset.model_path)
    return {"name": model.id, "model": model.id, "modified_at": found.modified_at,
            "size": found.size, "digest": found.digest, "details": dict(found.details)}


async def version(scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(send, {"version": OLLAMA_VERSION})


async def tags(scope: Scope, receive: Receive, send: Send) -> None:
    state: State = scope["app"].state.router
    views = _visible(state, context(scope).key_scope)
    entries = await asyncio.to_thread(lambda: [_entry(m) for m in views])  # reads headers
    await send_json(send, {"models": entries})


def _expires_at(model: ModelView) -> str:
    """When its idle TTL stops it, if nothing uses it before (``liveness``): a request's
    ``keep_alive`` for this load, else its preset's ``ttl``, else ``--idle-timeout``."""
    ttl = model.idle_ttl
    if not ttl or model.preset.pin:
        return FOREVER
    left = model.snapshot.last_used + ttl - clock.now()
    stamp = datetime.fromtimestamp(time.time() + max(left, 0.0), UTC)
    return stamp.isoformat().replace("+00:00", "Z")


async def ps(scope: Scope, receive: Receive, send: Send) -> None:
    state: State = scope["app"].state.router
    loaded = [m for m in _visible(state, context(scope).key_scope) if m.serving]
    entries = []
    for model in loaded:
        entry = _entry(model)
        vram = sum(model.measured_devices().values()) or sum(
            model.snapshot.estimate_devices.values())
        size = model.measured() or model.snapshot.estimate or entry["size"]
        entry.update(size=max(size, vram), size_vram=vram,
                     expires_at=_expires_at(model),
                     context_length=details.context_of(
                         model.preset.args, details.facts(model.preset.model_path)) or 0)
        entries.append(entry)
    await send_json(send, {"models": entries})


async def show(scope: Scope, receive: Receive, send: Send) -> None:
    state: State = scope["app"].state.router
    request = context(scope)
    body = await read_object(state, request, receive)
    name = translate.without_latest(translate.model_of(body), lambda n: known(state, n))
    model = resolve_in_scope(state.models, request.key_scope, name)
    request.model_id = model.id
    found = await asyncio.to_thread(details.facts, model.preset.model_path)
    args = model.preset.args
    parameters = "\n".join(f"{k} {v}" for k, v in sorted(args.items())
                           if k not in ("model", "mmproj", "hf-repo"))
    await send_json(send, {
        "modelfile": "", "parameters": parameters, "template": found.template,
        "details": dict(found.details), "model_info": dict(found.model_info),
        "capabilities": details.capabilities(args, found.template),
        "modified_at": found.modified_at})


# A Hugging Face name as a pull takes it: owner/repo[:QUANT], no path of any other shape.
_PULLABLE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _pull_name(body: dict[str, Any]) -> str:
    name = translate.model_of(body)
    repo = name.partition(":")[0]
    if not _PULLABLE.fullmatch(name) or any(part in ("", ".", "..") or part.startswith(".")
                                            for part in repo.split("/")):
        raise BadRequest(f"{name[:200]!r} is not a Hugging Face model: pull owner/repo or "
                         "owner/repo:QUANT")
    return name


async def pull_api(scope: Scope, receive: Receive, send: Send) -> None:
    """``/api/pull``: a model already here succeeds at once; another is resolved on the Hub,
    added and downloaded, with its progress as NDJSON lines (or one answer with
    ``"stream": false``)."""
    state: State = scope["app"].state.router
    request = context(scope)
    body = await read_object(state, request, receive)
    given = translate.model_of(body)
    if known(state, translate.without_latest(given, lambda n: known(state, n))):
        resolve_in_scope(state.models, request.key_scope, given.removesuffix(
            translate.LATEST) if not known(state, given) else given)  # 404 if not the key's
        await send_json(send, {"status": "success"})
        return
    name = _pull_name(body)
    stream = body.get("stream", True) is not False
    # Subscribed before the download starts: every progress event it publishes is a line.
    async with state.events.subscribe(_is_progress) as progress:
        model, task = await pull(state.models, request.key_scope, name)
        request.model_id = model.id
        if not stream:
            await task
            view = state.models.view(model.id)
            if view is not None and view.failed:
                raise BadRequest(f"the download of '{model.id}' failed")
            await send_json(send, {"status": "success"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [NDJSON]})
        await _progress(state, model.id, task, progress, send)


def _is_progress(event: dict[str, Any]) -> bool:
    return event.get("event") == "download_progress"


async def _progress(state: State, model_id: str, task: asyncio.Task[None],
                    progress: Subscription, send: Send) -> None:
    """The download's progress as Ollama's lines, one a progress event of the model's (its
    last one included, whatever the download's speed), then ``success`` or the error."""
    async def line(value: dict[str, Any]) -> None:
        await send({"type": "http.response.body", "more_body": True,
                    "body": json.dumps(value).encode() + b"\n"})

    async def lines(event: dict[str, Any]) -> None:
        if event.get("model") != model_id:
            return
        files = (event.get("data") or {}).get("progress") or {}
        for file, counts in files.items():
            await line({"status": f"pulling {file}", "digest": file,
                        "total": counts.get("total") or 0, "completed": counts.get("done", 0)})

    await line({"status": "pulling manifest"})
    while not task.done():
        got = asyncio.ensure_future(progress.get())
        await asyncio.wait({task, got}, return_when=asyncio.FIRST_COMPLETED)
        if got.done():
            await lines(got.result())
        else:
            got.cancel()
    while not progress.queue.empty():  # published before the download's task ended
        await lines(progress.queue.get_nowait())
    view = state.models.view(model_id)
    failed = task.cancelled() or task.exception() is not None or view is None or view.failed
    last = error_body(f"the download of '{model_id}' failed") if failed else json.dumps(
        {"status": "success"}).encode()
    await send({"type": "http.response.body", "body": last + b"\n", "more_body": False})


async def delete_api(scope: Scope, receive: Receive, send: Send) -> None:
    state: State = scope["app"].state.router
    request = context(scope)
    body = await read_object(state, request, receive)
    name = translate.without_latest(translate.model_of(body), lambda n: known(state, n))
    request.model_id = name
    await remove_cached(state, request.key_scope, name)
    await send({"type": "http.response.start", "status": 200,
                "headers": [JSON, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


HANDLERS: dict[str, Handler] = {
    "/api/version": version, "/api/tags": tags, "/api/ps": ps, "/api/show": show,
    "/api/pull": pull_api, "/api/delete": delete_api, **INFERENCE,
}


def routes() -> list[BaseRoute]:
    """Ollama's routes, ``paths.OLLAMA_ROUTES`` with their handlers, each an ``Endpoint``
    (``tests/test_ollama.py`` holds the two tables equal)."""
    return [Route(path, Endpoint(HANDLERS[path]), methods=list(methods))
            for path, methods in OLLAMA_ROUTES.items()]

