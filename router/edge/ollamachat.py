"""Ollama's chat, generate and embed on the router's own request path.

An Ollama request is read once (``RequestContext.read``), translated once
(``ollama.translate``) into the llama-server request it means, and from then on it *is* that
request (``RequestContext.translated``): ``forward.proxy`` routes it, checks the key's scope,
queues it in its team's turn, charges its quotas and usage, places it in a slot, warm-swaps,
sends it to a peer, exactly as if the client had sent it. Only the answer is Ollama's:
``Translating`` turns the child's event stream into NDJSON line by line as it arrives (or the
whole JSON, or an error envelope, into Ollama's), and leaves the child's own last chunks in
the request's context, so that what is charged and learned is what the child said.

A chat or generate request with no prompt is Ollama's idiom for loading its model, and with
``keep_alive`` 0 for unloading it: the router's load (any key that may use the model) and
unload (a key whose role may unload: admin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from ..config.keyfile import ADMIN
from ..errors import BadRequest, InternalError, ModelNotFound, RouterError
from ..http.http11 import BODY_WRITER
from ..http.proxy import ResponseAborted
from ..http.requests import RequestContext, context, parse_json
from ..ollama import details, translate
from ..ollama.answers import Answer, error_body, error_message, now_iso
from .forward import proxy
from .keepalive import FIELD as KEEP_ALIVE
from .keepalive import kept_alive
from .keys import Forbidden, send_ollama_error
from .route import local_model
from .state import State

log = logging.getLogger("router.ollama")

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
JSON = (b"content-type", b"application/json; charset=utf-8")
NDJSON = (b"content-type", b"application/x-ndjson")


async def send_json(send: Send, value: Any, status: int = 200) -> None:
    body = json.dumps(value, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Endpoint:
    """An Ollama route as a plain ASGI app: a failure before its answer started is answered
    in Ollama's shape (``{"error": "..."}``), a broken answer is left cut."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.handler(scope, receive, watched)
        except ResponseAborted:
            return
        except RouterError as exc:
            if not started:
                await send_ollama_error(watched, exc)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"],
                          exc_info=exc)
            if not started:
                await send_ollama_error(watched, InternalError(exc))


async def read_object(state: State, request: RequestContext, receive: Receive
                      ) -> dict[str, Any]:
    """The request's JSON object body, read once (a large one parsed off the loop)."""
    await request.read(receive, state.models.settings.max_body_bytes)
    body: Any = request.parsed
    if body is None and request.body:  # large (scanned), or a DELETE's (not read as JSON)
        body = await asyncio.to_thread(parse_json, request.body)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def known(state: State, name: str) -> bool:
    """Whether ``name`` names a model here or on a peer."""
    models = state.models
    return models.model_id(name) is not None or models.catalogue.named(name) is not None or (
        state.peers is not None and name in state.peers.listing())


class Translating:
    """The ``send`` that llama-server's answer goes through on its way to an Ollama client:
    an event stream becomes NDJSON as it arrives; a whole body (an answer or an error) is
    held to its end and translated once. The child's own last two chunks are left in the
    request's context (``RequestContext.sent_before``/``sent_last``), which is where its
    tail (timings, tokens: the lease's pace, the quotas' charge) is read."""

    __slots__ = ("_before", "_held", "_last", "_sse", "_status", "answer", "request", "send")

    def __init__(self, send: Send, answer: Answer, request: RequestContext) -> None:
        self.send = send
        self.answer = answer
        self.request = request
        self._status = 0
        self._sse = False
        self._held = bytearray()
        self._before = self._last = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            headers = message.get("headers", ())
            self._sse = self._status < 400 and any(
                name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                for name, value in headers)
            if self._sse:
                kept = [(n, v) for n, v in headers
                        if n.lower() not in (b"content-type", b"content-length")]
                await self.send({**message, "headers": [*kept, NDJSON]})
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        chunk: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if chunk:
            self._before, self._last = self._last, chunk
        if self._sse:
            out = self.answer.feed(chunk) if chunk else b""
            if not more:
                out += self.answer.end()
            if out or not more:
                await self.send({"type": "http.response.body", "body": out, "more_body": more})
        else:
            self._held += chunk
            if more:
                return
            await self._whole(bytes(self._held))
        # What the child said, not its translation, is what the tail reads.
        self.request.sent_before, self.request.sent_last = self._before, self._last

    async def _whole(self, body: bytes) -> None:
        status = self._status
        if status < 400:
            try:
                out = self.answer.whole(body)
            except (ValueError, AttributeError, TypeError, IndexError):
                status, out = 502, error_body("the model's server answered something that is "
                                              "not its JSON answer")
        else:
            out = error_body(error_message(body))
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [JSON, (b"content-length", str(len(out)).encode())]})
        await self.send({"type": "http.response.body", "body": out})


def _asks(kind: str, body: dict[str, Any], context_size: int | None) -> translate.Ask:
    if kind == "chat":
        return translate.chat(body, context_size)
    if kind == "generate":
        return translate.generate(body, context_size)
    return translate.embed(body, legacy=kind == "embeddings")


async def infer(kind: str, scope: Scope, receive: Receive, send: Send) -> None:
    """``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``."""
    started = time.perf_counter()
    state: State = scope["app"].state.router
    request = context(scope)
    body = await read_object(state, request, receive)
    given = translate.model_of(body)
    name = translate.without_latest(given, lambda n: known(state, n))
    local = local_model(state.models, request.key_scope, name)  # 404 outside the key's scope
    size = details.context_of(local.preset.args, details.facts(local.preset.model_path)) \
        if local is not None else None
    ask = _asks(kind, body, size)
    if ask.idiom is not None:
        await _idiom(state, request, local, ask, name, send)
        return
    ask.body["model"] = name
    cold = local is not None and not local.serving

    def load_s() -> float:
        if not cold or local is None:
            return 0.0
        view = state.models.view(local.id)
        loaded = view.snapshot.last_load_s if view is not None else None
        waited = request.queue_s or 0.0
        return min(waited, loaded) if loaded is not None else waited

    was = request.translated(ask.path, json.dumps(ask.body, ensure_ascii=False).encode(),
                             ask.body)
    request.model = name
    inner = {**scope, "path": ask.path, "raw_path": ask.path.encode()}
    inner.pop(BODY_WRITER, None)  # every chunk through ``Translating``
    try:
        await proxy(inner, receive, Translating(send, Answer(kind, given, started, load_s),
                                                request))
    finally:
        request.path = was  # metrics and activity: the path the client used


async def _idiom(state: State, request: RequestContext, local: Any, ask: translate.Ask,
                 name: str, send: Send) -> None:
    """Ollama's load (no prompt) and unload (no prompt, ``keep_alive`` 0) of a model."""
    if local is None:
        raise ModelNotFound(name, [])
    request.model_id = local.id
    if ask.idiom == "unload":
        if request.key_scope is not None and ADMIN not in request.key_scope.grants:
            raise Forbidden(f"this API key ({request.key_scope.describe()}) may not unload "
                            "a model (keep_alive 0 with no prompt): that needs role=admin")
        if local.serving or local.loading:
            with contextlib.suppress(BadRequest):  # stopped meanwhile: unloaded either way
                await state.models.unload(local)
    else:
        kept = kept_alive(request.key_scope, ask.body.get(KEEP_ALIVE))  # as the proxy does
        if kept is not None:
            state.models.keep_alive(local, kept)
        lease = await state.models.acquire(local)
        lease.release()
    answer: dict[str, Any] = {"model": ask.model, "created_at": now_iso()}
    if ask.kind == "chat":
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    answer.update(done=True, done_reason=ask.idiom)
    await send_json(send, answer)


def _inference(kind: str) -> Handler:
    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        await infer(kind, scope, receive, send)
    return handler


INFERENCE: dict[str, Handler] = {
    "/api/chat": _inference("chat"), "/api/generate": _inference("generate"),
    "/api/embed": _inference("embed"), "/api/embeddings": _inference("embeddings"),
}
