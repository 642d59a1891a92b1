"""Resumable streams across children, as llama.cpp's router routes them.

llama-server keeps the stream of a request sent with ``X-Conversation-Id: <id>`` so a client
can resume it after a disconnect. Through a router the client no longer knows which child has
it, so the router remembers, per conversation id, the model and the very child (replica) that
serves it (``ConversationOwners``, filled by the proxy), and answers:

* ``GET /v1/stream?conv_id=<id>&from=N``: relayed to the owning child; 404 "Stream not found
  or expired" when no running child owns it, 503 while its model is still loading or
  downloading (retry later). Never loads a model.
* ``POST /v1/streams/lookup {"conversation_ids": [...]}``: asks only the owning children, each
  for its own ids, and returns their sessions in one array (``[]`` for an unreadable body).
* ``DELETE /v1/stream?conv_id=<id>``: forwarded to the owning child (which stops it), the
  mapping is forgotten; 204 whatever happened.

A conversation a gateway sent to a peer (``nodes``) is owned by that peer: resumes, lookups
and stops for it go to the peer (with the peer key) while it is up, and the peer finds its own
child the same way.

The table is bounded: the least recently used conversations are forgotten first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import httpx
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .backend import Backend
from .errors import BadRequest, NotFound, Unavailable
from .peers import Peer
from .proxy import relay, upstream_headers
from .requests import VIA_HEADER, context

if TYPE_CHECKING:
    from .state import Shutdown
    from .supervisor import Supervisor

Owner = Backend | Peer  # the child that serves a conversation, or the peer it went to

DEFAULT_CAPACITY = 10_000
CHILD_TIMEOUT_S = 5.0


class ConversationOwners:
    """Conversation id → (model id, the child or peer serving it once known); bounded LRU."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, tuple[str, Owner | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, conv_id: str, model: str, child: Owner | None = None) -> None:
        self._owners[conv_id] = (model, child)
        self._owners.move_to_end(conv_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, conv_id: str) -> tuple[str, Owner | None] | None:
        found = self._owners.get(conv_id)
        if found is not None:
            self._owners.move_to_end(conv_id)
        return found

    def forget(self, conv_id: str) -> None:
        self._owners.pop(conv_id, None)


def _running_owner(owners: ConversationOwners, supervisor: Supervisor,
                   conv_id: str) -> tuple[str, Owner] | None:
    """The owning model and child, if that child still serves (or peer, if it is up)."""
    found = owners.owner(conv_id)
    if found is None:
        return None
    model, child = found
    if child is None:
        return None
    if isinstance(child, Peer):
        return (model, child) if child.up else None
    view = supervisor.view(model)
    if view is None or not view.serves_through(child):
        return None
    return model, child


def _conv_id(request: Request) -> str:
    conv_id = context(request.scope).params.get("conv_id", "")
    if not conv_id:
        raise BadRequest("Missing conversation id in path")
    return conv_id


class StreamResume:
    """``GET /v1/stream``: relay the owning child's replay of the stream."""

    def __init__(self, supervisor: Supervisor, owners: ConversationOwners,
                 shutdown: Shutdown | None = None) -> None:
        self.supervisor = supervisor
        self.owners = owners
        self.shutdown = shutdown  # ends the replay with the envelope after the grace period

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        conv_id = _conv_id(request)
        running = _running_owner(self.owners, self.supervisor, conv_id)
        if running is None:
            found = self.owners.owner(conv_id)
            view = self.supervisor.view(found[0]) if found else None
            if view is not None and view.loading:
                raise Unavailable("Stream owner model is loading, retry later",
                                         headers={"Retry-After": "1"})
            raise NotFound("Stream not found or expired")
        model, child = running
        params = context(scope).params
        query = QueryParams({"conv_id": conv_id, **(
            {"from": params["from"]} if "from" in params else {})})
        if isinstance(child, Peer):  # the peer finds its child
            via = ",".join((*context(scope).via, child.own_instance))
            headers = [*(h for h in upstream_headers(scope["headers"]) if h[0] != VIA_HEADER),
                       *child.auth, (VIA_HEADER, via.encode("latin-1"))]
            await relay(child.connections, "GET", f"/v1/stream?{query}".encode(), headers, b"",
                        receive=receive, send=send, shutdown=self.shutdown)
            return
        lease = self.supervisor.lease_child(model, child)
        if lease is None:
            raise NotFound("Stream not found or expired")
        try:
            await relay(child.connections, "GET", f"/v1/stream?{query}".encode(),
                        upstream_headers(scope["headers"]), b"", receive=receive, send=send,
                        shutdown=self.shutdown)
        finally:
            lease.release()


async def lookup(request: Request, supervisor: Supervisor, owners: ConversationOwners,
                 client: httpx.AsyncClient) -> Response:
    """``POST /v1/streams/lookup``: the owning children's sessions for the given ids."""
    try:
        body = json.loads(await request.body())
        ids = [i for i in body.get("conversation_ids", []) if isinstance(i, str) and i]
    except (ValueError, AttributeError, TypeError):
        return JSONResponse([])
    per_child: dict[Owner, list[str]] = {}
    for conv_id in ids:
        running = _running_owner(owners, supervisor, conv_id)
        if running is not None:
            per_child.setdefault(running[1], []).append(conv_id)

    async def ask(child: Owner, wanted: list[str]) -> list[Any]:
        url, headers = _where(child)
        try:
            response = await client.post(url + "/v1/streams/lookup", headers=headers,
                                         json={"conversation_ids": wanted},
                                         timeout=CHILD_TIMEOUT_S)
            sessions = response.json() if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []
        return [s for s in sessions if isinstance(s, dict)] if isinstance(sessions, list) else []

    answers = await asyncio.gather(*(ask(c, w) for c, w in per_child.items()))
    return JSONResponse([session for sessions in answers for session in sessions])


async def stop(request: Request, supervisor: Supervisor, owners: ConversationOwners,
               client: httpx.AsyncClient) -> Response:
    """``DELETE /v1/stream``: the owning child stops the stream; the mapping is forgotten."""
    conv_id = _conv_id(request)
    running = _running_owner(owners, supervisor, conv_id)
    owners.forget(conv_id)
    if running is not None:
        url, headers = _where(running[1])
        with contextlib.suppress(httpx.HTTPError):  # the child is gone: so is its stream
            await client.delete(url + "/v1/stream", headers=headers,
                                params={"conv_id": conv_id}, timeout=CHILD_TIMEOUT_S)
    return Response(status_code=204, media_type="application/json")


def _where(owner: Owner) -> tuple[str, dict[str, str]]:
    """The base URL to ask the owner at, and the headers to ask with (a peer's key)."""
    if isinstance(owner, Peer):
        return owner.url, {k: v for k, v in owner.probe_headers.items() if k != "connection"}
    return owner.base_url, {}
