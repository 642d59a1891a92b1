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

A stream belongs to the API key that started it (``RequestContext.key_hash``: a keyed hash,
never the key): for any other key, resuming, looking up or stopping it is answered exactly as
for an id nobody uses (404, nothing, 204). A conversation id is held by the key and the model
that started its stream while the router remembers it, until ``DELETE /v1/stream`` or until
the child (or peer) that keeps it is gone: a request with that id from another key, or for
another model, is refused with 409 (``ConversationTaken``) and moves nothing (the same key
and model move it to the replica that serves the new request, as before). Without API keys
every request has the same (empty) owner.

A conversation a gateway sent to a peer (``nodes``) is owned by that peer: resumes, lookups
and stops for it go to the peer (with the peer key) while it is up, and the peer finds its own
child the same way.

The table is bounded: the least recently used conversations are forgotten first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .backend import Backend
from .errors import BadRequest, MalformedBody, NestedTooDeeply, NotFound, RouterError, Unavailable
from .peers import Peer
from .proxy import relay, upstream_headers
from .requests import VIA_HEADER, context, parse_json

if TYPE_CHECKING:
    from .state import Shutdown
    from .supervisor import Supervisor

Owner = Backend | Peer  # the child that serves a conversation, or the peer it went to

DEFAULT_CAPACITY = 10_000
CHILD_TIMEOUT_S = 5.0


class ConversationTaken(RouterError):
    """A request with a conversation id that another key's or another model's stream holds."""

    status = 409
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("X-Conversation-Id is in use by another stream (of another model or "
                         "API key): use a new conversation id, or end that stream first with "
                         "DELETE /v1/stream")


class ConversationOwners:
    """Conversation id → (model id, the child or peer serving it once known, the key hash of
    its owner); a bounded LRU."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, tuple[str, Owner | None, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def claim(self, conv_id: str, model: str, key: str, child: Owner | None = None,
              *, running: Callable[[str, Owner], bool] | None = None) -> None:
        """Remember that ``key``'s request for ``model`` uses ``conv_id`` (served by ``child``
        once known). ConversationTaken when another key or model holds the id, unless the
        child that kept its stream is known to be gone (``running`` says whether it serves)."""
        found = self._owners.get(conv_id)
        if found is not None and (found[0], found[2]) != (model, key):
            held_by = found[1]
            if held_by is None or running is None or running(found[0], held_by):
                raise ConversationTaken()
        self._owners[conv_id] = (model, child, key)
        self._owners.move_to_end(conv_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

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


def serves(supervisor: Supervisor) -> Callable[[str, Owner], bool]:
    """Whether a model's child (or a peer) still serves: where a stream may still be kept."""
    def running(model: str, child: Owner) -> bool:
        if isinstance(child, Peer):
            return child.up
        view = supervisor.view(model)
        return view is not None and view.serves_through(child)
    return running


def _running_owner(owners: ConversationOwners, supervisor: Supervisor,
                   conv_id: str, key: str) -> tuple[str, Owner] | None:
    """The owning model and child of ``key``'s conversation, if that child still serves (or
    peer, if it is up)."""
    found = owners.owner(conv_id, key)
    if found is None:
        return None
    model, child = found
    if child is None or not serves(supervisor)(model, child):
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
        key = context(scope).key_hash
        running = _running_owner(self.owners, self.supervisor, conv_id, key)
        if running is None:
            found = self.owners.owner(conv_id, key)
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
        body = parse_json(await request.body())
        ids = [i for i in body.get("conversation_ids", []) if isinstance(i, str) and i]
    except NestedTooDeeply:
        raise  # a 400 envelope
    except (MalformedBody, AttributeError, TypeError):
        return JSONResponse([])
    per_child: dict[Owner, list[str]] = {}
    key = context(request.scope).key_hash
    for conv_id in ids:
        running = _running_owner(owners, supervisor, conv_id, key)
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
    """``DELETE /v1/stream``: the owning child stops the stream; the mapping is forgotten.
    Another key's stream is left alone, with the same 204."""
    conv_id = _conv_id(request)
    key = context(request.scope).key_hash
    running = _running_owner(owners, supervisor, conv_id, key)
    owners.forget(conv_id, key)
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
