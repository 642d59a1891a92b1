"""Which node serves a request when peers (``peers``) list its model, and the relay to a peer.

``forward`` asks ``serve_across_nodes`` only when some peer that is up lists the request's
model; a router without peers never gets here. The nodes holding the model (peers, and this
router when it has the model too) are tried in ``peers.rank`` order:

* this router's turn: ``serve_across_nodes`` returns False and ``forward`` serves the request
  as any other (lease, child);
* a peer's turn: the request goes to it as the client sent it, with the peer key and the
  ``x-llama-router-via`` header (the nodes it passed through; a request that comes back to a
  node it passed is served there, never sent round again). If the peer cannot be reached, it
  is marked down at once; if it cannot be reached or answers 502, 503 or 504 and another node
  is left, the request goes to the next node: nothing has been sent to the client yet. The
  last node's answer is the client's, whatever it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlencode

import httpx
from starlette.types import Receive, Scope, Send

from .affinity import PrefixTable, request_keys
from .errors import BadRequest, ModelNotFound, Unavailable, UpstreamError, envelope
from .keys import Forbidden, KeyScope, resolve_in_scope
from .peers import (
    FAIL_OVER_STATUSES,
    LOADING,
    Candidate,
    Peer,
    Peers,
    by_prefix,
    merge_entries,
    rank,
)
from .proxy import FailOver, relay, upstream_headers
from .requests import VIA_HEADER, RequestContext
from .runtime import ModelRuntime
from .scheduler import Status
from .state import State
from .supervisor import Supervisor

log = logging.getLogger("router.nodes")


def came_through(request: RequestContext, node: str) -> bool:
    """Whether the request passed through this node already (``x-llama-router-via``)."""
    return node in request.via


def local_model(supervisor: Supervisor, key_scope: KeyScope | None, model: str
                ) -> ModelRuntime | None:
    """This router's own model named ``model``, or None; Forbidden when a scoped key may not
    use the model (here or on any node)."""
    try:
        return resolve_in_scope(supervisor, key_scope, model)
    except ModelNotFound:
        if key_scope is not None and not key_scope.allows(model):
            raise Forbidden(f"model '{model}' is not allowed for this API key") from None
        return None


def raise_if_elsewhere(peers: Peers, model: str) -> None:
    """A 503 naming the nodes when only peers that are down list ``model``."""
    holders = peers.listing().get(model)
    if holders:
        reasons = "; ".join(f"node {p.node}: {p.reason or 'not answering'}" for p in holders)
        raise Unavailable(f"model '{model}' is on nodes that are not answering ({reasons})",
                          headers={"Retry-After": "5"})


def candidates(holders: list[Peer], model: str, local: ModelRuntime | None, node: str
               ) -> list[Candidate]:
    """Every node that can serve ``model`` (the peers ``holders``, and ``local``, this
    router's own), in the order to try them."""
    found = [peer.candidate(model) for peer in holders]
    if local is not None:
        found.append(Candidate(node, local.status is Status.LOADED,
                               local.in_flight + local.waiting))
    return rank(found)


async def serve_across_nodes(state: State, scope: Scope, request: RequestContext,
                             receive: Receive, send: Send, holders: list[Peer],
                             local: ModelRuntime | None, target: bytes) -> bool:
    """Serve the request on the best node holding its model (the peers ``holders``, or
    ``local``); False when that is this router (the caller serves it). Raises like
    ``proxy.relay`` for the last node tried."""
    peers = state.peers
    assert peers is not None and request.model is not None and request.body is not None
    if came_through(request, state.node):
        return False  # it came back: served here, never sent round again
    model, body, parsed = request.model, request.body, request.parsed
    order = candidates(holders, model, local, state.node)
    keys = request_keys(parsed) if parsed is not None else ()
    if keys:  # a conversation's next turn: where its prompt is cached (``affinity``)
        tables = peers.prefixes.setdefault(model, {})
        order, decision = by_prefix(order, tables, keys)
        if decision is not None:
            state.metrics.observe_routing(model, decision)
        tables.setdefault(order[0].node, PrefixTable()).record(keys)
    for index, candidate in enumerate(order):
        peer = candidate.peer
        if peer is None:
            return False
        fail_over = FAIL_OVER_STATUSES if index < len(order) - 1 else frozenset()
        try:
            await _relay_to_peer(state, peer, scope, request, receive, send, model,
                                 candidate.peer_model or model, target, body, parsed,
                                 fail_over)
            return True
        except FailOver as exc:
            log.warning("node %s answered %d for %s; trying node %s", peer.node, exc.status,
                        model, order[index + 1].node, extra={"event": "fail_over"})
        except UpstreamError as exc:
            if index == len(order) - 1:
                raise
            log.warning("node %s failed for %s (%s); trying node %s", peer.node, model, exc,
                        order[index + 1].node, extra={"event": "fail_over"})
    return False  # not reached: the last candidate's failure is raised


async def _relay_to_peer(state: State, peer: Peer, scope: Scope, request: RequestContext,
                         receive: Receive, send: Send, model: str, peer_model: str,
                         target: bytes, body: bytes, parsed: dict[str, Any] | None,
                         fail_over: frozenset[int]) -> None:
    headers = [(k, v) for k, v in upstream_headers(scope["headers"]) if k.lower() != VIA_HEADER]
    headers += peer.auth
    headers.append(via_header(request, state.node))
    if peer_model != model:  # --peer-prefix: the peer knows the model by its own id
        body, target = _renamed(body, parsed, request, target, peer_model)
    request.node = peer.node
    conv_id = request.conv_id if body else None
    if conv_id:  # a resumable stream: resumed through the peer that has it (``resumable``)
        state.conversations.remember(conv_id, model, peer)
    peer.outstanding[model] = peer.outstanding.get(model, 0) + 1
    try:
        await relay(peer.connections, scope["method"], target, headers, body,
                    receive=receive, send=send, shutdown=state.shutdown, fail_over=fail_over)
    except UpstreamError as exc:
        cause = exc.__cause__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else exc.message
        peer.unreachable(reason)
        raise UpstreamError(f"node {peer.node} ({peer.url}) failed before answering: "
                            f"{reason}") from None
    finally:
        peer.outstanding[model] -= 1


def via_header(request: RequestContext | None, node: str) -> tuple[bytes, bytes]:
    """The ``x-llama-router-via`` header a request leaving this node carries: the chain it
    came with, and this node."""
    chain = (*request.via, node) if request is not None else (node,)
    return VIA_HEADER, ",".join(chain).encode("latin-1")


def _renamed(body: bytes, parsed: dict[str, Any] | None, request: RequestContext,
             target: bytes, model: str) -> tuple[bytes, bytes]:
    """The body's ``model`` (JSON) or the query's ``model`` (as the request's context decoded
    it) set to ``model``."""
    if parsed is not None and "model" in parsed:
        return json.dumps({**parsed, "model": model}, ensure_ascii=False).encode(), target
    if "model" in request.params:
        path = target.partition(b"?")[0]
        pairs = [(k, model if k == "model" else v) for k, v in request.params.multi_items()]
        target = path + b"?" + urlencode(pairs).encode("latin-1")
    return body, target


# --------------------------------------------------------------------- the router's own API

def merged_listing(local: list[dict[str, Any]], peers: Peers, node: str,
                   key_scope: KeyScope | None) -> list[dict[str, Any]]:
    """``/models`` with peers: this router's entries (with ``node``), merged with the same
    models on peers, then the models only peers list (those the key may see)."""
    listing = peers.listing()
    merged = []
    for entry in local:
        holders = listing.pop(entry["id"], None)
        merged.append(merge_entries(entry["id"], holders, entry, node) if holders
                      else {**entry, "node": node})
    for model_id, holders in listing.items():
        if key_scope is None or key_scope.allows(model_id):
            merged.append(merge_entries(model_id, holders, None, node))
    return merged


def across_nodes(event: dict[str, Any], peers: Peers, supervisor: Supervisor
                 ) -> dict[str, Any]:
    """``event`` as ``/models/sse`` sends it: for a model on several nodes, its ``status``
    is the model's across them (as ``/models`` lists it: a node unloading it does not make a
    model that another node serves look unloaded), the node's own in ``node_status``."""
    data = event.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return event
    model = event["model"]
    holders = [p for p in peers.peers.values() if p.up and model in p.models]
    local = supervisor.models.get(model)
    if len(holders) + (local is not None) < 2:
        return event
    statuses = [p.status_of(model) for p in holders]
    if local is not None:
        statuses.append(local.status.public)
    best = "loaded" if "loaded" in statuses else LOADING if LOADING in statuses \
        else data["status"]
    if best == data["status"]:
        return event
    return {**event, "data": {**data, "status": best, "node_status": data["status"]}}


async def scrape_peers(peers: Peers) -> list[tuple[dict[str, str], str]]:
    """Each peer's ``/metrics`` that answered, with its ``node`` label."""
    async def scrape(peer: Peer) -> tuple[dict[str, str], str] | None:
        try:
            response = await peer.client.get(f"{peer.url}/metrics", timeout=peer.timeout,
                                             headers=peer.probe_headers)
        except httpx.HTTPError:
            return None
        return ({"node": peer.node}, response.text) if response.status_code == 200 else None

    up = [peer for peer in peers.peers.values() if peer.up]
    return [found for found in await asyncio.gather(*(scrape(p) for p in up)) if found]


def admin_targets(holders: list[Peer], model: str, local: ModelRuntime | None, node: str,
                  asked: str | None, action: str) -> list[Peer | None]:
    """Where ``POST /models/load|unload`` goes (None: this router).

    ``"node"`` in the body names one node. Otherwise a load goes to this router if it has the
    model, else to the first node (``rank``) where it is not running, else to the first; an
    unload goes to every node where the model is running (this router included)."""
    if asked is not None:
        if asked == node and local is not None:
            return [None]
        chosen = [p for p in holders if p.node == asked]
        if not chosen:
            raise BadRequest(f"model '{model}' is not on a node named '{asked}' that is up")
        return [chosen[0]]
    if action == "load":
        if local is not None:
            return [None]
        order = [c.peer for c in candidates(holders, model, None, node)]
        idle = [p for p in order if p is not None and p.status_of(model) == "unloaded"]
        return [idle[0] if idle else order[0]]
    running = [p for p in holders if p.status_of(model) in ("loaded", LOADING)]
    if local is not None and (local.status is not Status.UNLOADED or not running):
        running.insert(0, None)  # type: ignore[arg-type]
    return list(running) or [holders[0]]


async def forward_admin(peer: Peer, path: str, payload: dict[str, Any], model: str
                        ) -> tuple[int, dict[str, Any]]:
    """``POST path`` with ``payload`` (its model renamed to the peer's id) to ``peer``; its
    status and JSON answer, or a 502 envelope when it cannot be reached."""
    body = {**payload, "model": peer.peer_ids.get(model, model)}
    body.pop("node", None)
    try:
        response = await peer.client.post(f"{peer.url}{path}", json=body,
                                          timeout=httpx.Timeout(None, connect=peer.timeout),
                                          headers=peer.probe_headers)
        answer = response.json()
    except httpx.HTTPError as exc:
        peer.unreachable(str(exc) or type(exc).__name__)
        return 502, envelope(502, f"node {peer.node} ({peer.url}) could not be reached: "
                                  f"{exc or type(exc).__name__}")
    except ValueError:
        return 502, envelope(502, f"node {peer.node} answered {response.status_code} without "
                                  "JSON")
    return response.status_code, answer if isinstance(answer, dict) else {"answer": answer}
