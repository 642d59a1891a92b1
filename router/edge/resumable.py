"""Resumable streams across children, as llama.cpp's router routes them.

llama-server keeps the stream of a request sent with ``X-Conversation-Id: <id>`` so a client
can resume it after a disconnect. Through a router the client no longer knows which child has
it, so the router remembers, per conversation id, the model and the very child (replica) that
serves it (``StreamOwners``, filled by the proxy), and answers:

* ``GET /v1/stream?conv_id=<id>&from=N``: relayed to the owning child; 404 "Stream not found
  or expired" when no running child owns it, 503 while its model is still loading or
  downloading (retry later). Never loads a model.
* ``POST /v1/streams/lookup {"conversation_ids": [...]}``: asks only the owning children, each
  for its own ids, and returns their sessions in one array (``[]`` for an unreadable body;
  the body is read through the request's context, as every body: at most 1 MiB, 413 past it).
* ``DELETE /v1/stream?conv_id=<id>``: forwarded to the owning child (which stops it), the
  mapping is forgotten; 204 whatever happened.

A stream belongs to the API key that started it (``RequestContext.key_hash``: a keyed hash,
never the key): for any other key, resuming, looking up or stopping it is answered exactly as
for an id nobody uses (404, nothing, 204). A conversation id is held by the key and the model
that started its stream while the router remembers it, until ``DELETE /v1/stream`` or until
the child (or peer) that keeps it is gone: a request with that id from another key, or for
another model, is refused with 409 (``StreamTaken``) and moves nothing (the same key
and model move it to the replica that serves the new request, as before). Without API keys
every request has the same (empty) owner.

A conversation a gateway sent to a peer (``nodes``) is owned by that peer: resumes, lookups
and stops for it go to the peer through the hop (``hop``: the peer key, the via chain,
deadlines, a bounded answer) while it is up, and the peer finds its own child the same way; a
request that passed through that peer already is never sent back to it (as for an id nobody
uses).

The table is bounded: the least recently used conversations are forgotten first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..children.backend import Backend
from ..errors import (
    BadRequest,
    MalformedBody,
    NestedTooDeeply,
    NotFound,
    RouterError,
    Unavailable,
    UpstreamError,
)
from ..http.proxy import direct_body, relay, upstream_headers
from ..http.requests import RequestContext, context, parse_json
from ..peers import hop
from ..peers.peer import Peer

if TYPE_CHECKING:
    from ..core.view import Models
    from ..http.shutdown import Shutdown

Owner = Backend | Peer  # the child that serves a conversation, or the peer it went to

DEFAULT_CAPACITY = 10_000
CHILD_TIMEOUT_S = 5.0
MAX_LOOKUP_BYTES = 1 << 20  # a lookup's body, and a peer's answer to one


class StreamTaken(RouterError):
    """A request with a conversation id that another key's or another model's stream holds."""

    status = 409
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("X-Conversation-Id is in use by another stream (of another model or "
                         "API key): use a new conversation id, or end that stream first with "
                         "DELETE /v1/stream")


class StreamOwners:
    """Conversation id → (model id, the child or peer serving it once known, the key hash of
    its owner); a bounded LRU."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, tuple[str, Owner | None, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def claim(self, conv_id: str, model: str, key: str, child: Owner | None = None,
              *, running: Callable[[str, Owner], bool] | None = None) -> Claim:
        """Remember that ``key``'s request for ``model`` uses ``conv_id`` (served by ``child``
        once known: ``Claim.served_by``). StreamTaken when another key or model holds
        the id, unless the child that kept its stream is known to be gone (``running`` says
        whether it serves)."""
        found = self._owners.get(conv_id)
        if found is not None and (found[0], found[2]) != (model, key):
            held_by = found[1]
            if held_by is None or running is None or running(found[0], held_by):
                raise StreamTaken()
        self._owners[conv_id] = (model, child, key)
        self._owners.move_to_end(conv_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)
        return Claim(self, conv_id, model, key, running)

    def owner(self, conv_id: str, key: str) -> tuple[str, Owner | None] | None:
        """The model and child of ``key``'s conversation; None for an id unknown or held by
        another key (the two are never told apart)."""
        found = self._owners.get(conv_id)
        if found is None or not hmac.compare_digest(found[2], key):
            return None
        self._owners.move_to_end(conv_id)
        return found[0], found[1]

    def forget(self, conv_id: str, key: str) -> None:
        """Forget ``key``'s conversation (another key's is left alone)."""
        if self.owner(conv_id, key) is not None:
            del self._owners[conv_id]


@dataclass(frozen=True, slots=True)
class Claim:
    """A request's claim on its conversation id, made once (``route.decide``); the node or
    child that serves the request is recorded on it when known."""

    owners: StreamOwners
    conv_id: str
    model: str
    key: str
    running: Callable[[str, Owner], bool] | None

    def served_by(self, owner: Owner) -> None:
        """Record the child (or peer) that serves the claimed conversation now; claims it
        anew if the table forgot it meanwhile (it may still be refused then)."""
        self.owners.claim(self.conv_id, self.model, self.key, owner, running=self.running)


def serves(models: Models) -> Callable[[str, Owner], bool]:
    """Whether a model's child (or a peer) still serves: where a stream may still be kept."""
    def running(model: str, child: Owner) -> bool:
        if isinstance(child, Peer):
            return child.up
        view = models.view(model)
        return view is not None and view.serves_through(child)
    return running


def _running_owner(owners: StreamOwners, models: Models,
                   conv_id: str, request: RequestContext) -> tuple[str, Owner] | None:
    """The owning model and child of the request's key's conversation, if that child still
    serves (or peer, if it is up and the request did not pass through it)."""
    found = owners.owner(conv_id, request.key_hash)
    if found is None:
        return None
    model, child = found
    if child is None or not serves(models)(model, child):
        return None
    if isinstance(child, Peer) and hop.passed(child, request):
        return None  # never sent back round a loop of routers
    return model, child


def _conv_id(request: Request) -> str:
    conv_id = context(request.scope).params.get("conv_id", "")
    if not conv_id:
        raise BadRequest("Missing conversation id in path")
    return conv_id


class StreamResume:
    """``GET /v1/stream``: relay the owning child's replay of the stream."""

    def __init__(self, models: Models, owners: StreamOwners,
                 shutdown: Shutdown | None = None) -> None:
        self.models = models
        self.owners = owners
        self.shutdown = shutdown  # ends the replay with the envelope after the grace period

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        conv_id = _conv_id(request)
        ctx = context(scope)
        running = _running_owner(self.owners, self.models, conv_id, ctx)
        if running is None:
            found = self.owners.owner(conv_id, ctx.key_hash)
            view = self.models.view(found[0]) if found else None
            if view is not None and view.loading:
                raise Unavailable("Stream owner model is loading, retry later",
                                         headers={"Retry-After": "1"})
            raise NotFound("Stream not found or expired")
        model, child = running
        params = ctx.params
        query = QueryParams({"conv_id": conv_id, **(
            {"from": params["from"]} if "from" in params else {})})
        if isinstance(child, Peer):  # the peer finds its child
            await hop.relay(child, scope, ctx, receive, send, "GET",
                            f"/v1/stream?{query}".encode(), b"", shutdown=self.shutdown)
            return
        lease = self.models.lease_child(model, child)
        if lease is None:
            raise NotFound("Stream not found or expired")
        try:
            await relay(child.connections, "GET", f"/v1/stream?{query}".encode(),
                        upstream_headers(scope["headers"]), b"", receive=receive, send=send,
                        shutdown=self.shutdown, direct=direct_body(scope))
        finally:
            lease.release()


async def lookup(request: Request, models: Models, owners: StreamOwners,
                 client: httpx.AsyncClient) -> Response:
    """``POST /v1/streams/lookup``: the owning children's sessions for the given ids."""
    ctx = context(request.scope)
    # Through the request's context, as every body: bounded, and a client that stops sending
    # (the server's body deadline) or leaves ends it quietly (``ClientGone``).
    raw = await ctx.read(request.receive, MAX_LOOKUP_BYTES, parse=False)
    try:
        body = parse_json(raw)
        ids = [i for i in body.get("conversation_ids", []) if isinstance(i, str) and i]
    except NestedTooDeeply:
        raise  # a 400 envelope
    except (MalformedBody, AttributeError, TypeError):
        return JSONResponse([])
    per_child: dict[Owner, list[str]] = {}
    for conv_id in ids:
        running = _running_owner(owners, models, conv_id, ctx)
        if running is not None:
            per_child.setdefault(running[1], []).append(conv_id)

    async def ask(child: Owner, wanted: list[str]) -> list[Any]:
        try:
            if isinstance(child, Peer):
                status, raw = await hop.ask(
                    child, "POST", b"/v1/streams/lookup",
                    json.dumps({"conversation_ids": wanted}).encode(), request=ctx,
                    deadline=CHILD_TIMEOUT_S, limit=MAX_LOOKUP_BYTES)
            else:
                response = await client.post(child.base_url + "/v1/streams/lookup",
                                             json={"conversation_ids": wanted},
                                             timeout=CHILD_TIMEOUT_S)
                status, raw = response.status_code, response.content
            sessions = hop.read_json(raw) if status == 200 else []  # a peer's or a child's
        except (httpx.HTTPError, UpstreamError, ValueError):
            return []
        return [s for s in sessions if isinstance(s, dict)] if isinstance(sessions, list) else []

    answers = await asyncio.gather(*(ask(c, w) for c, w in per_child.items()))
    return JSONResponse([session for sessions in answers for session in sessions])


async def stop(request: Request, models: Models, owners: StreamOwners,
               client: httpx.AsyncClient) -> Response:
    """``DELETE /v1/stream``: the owning child stops the stream; the mapping is forgotten.
    Another key's stream is left alone, with the same 204."""
    conv_id = _conv_id(request)
    ctx = context(request.scope)
    running = _running_owner(owners, models, conv_id, ctx)
    owners.forget(conv_id, ctx.key_hash)
    if running is not None:
        owner = running[1]
        target = f"/v1/stream?{QueryParams({'conv_id': conv_id})}"
        if isinstance(owner, Peer):
            with contextlib.suppress(UpstreamError):  # the peer is gone: so is its stream
                await hop.ask(owner, "DELETE", target.encode(), request=ctx,
                              deadline=CHILD_TIMEOUT_S, limit=MAX_LOOKUP_BYTES)
        else:
            with contextlib.suppress(httpx.HTTPError):  # the child is gone: so is its stream
                await client.delete(owner.base_url + target, timeout=CHILD_TIMEOUT_S)
    return Response(status_code=204, media_type="application/json")
