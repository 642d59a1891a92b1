"""Which node serves a request when peers (``peers``) list its model, and the relay to a peer.

``forward`` asks ``serve_across_nodes`` only when some peer that is up lists the request's
model; a router without peers never gets here. The nodes holding the model (peers, and this
router when it has the model too) are tried in ``peers.rank`` order:

* this router's turn: ``serve_across_nodes`` returns False and ``forward`` serves the request
  as any other (lease, child);
* a peer's turn: the request goes to it as the client sent it, with the peer key and the
  ``x-llama-router-via`` header (the instance ids of the routers it passed through). A router
  never sends a request to a router in its via chain, and one that finds itself there serves
  it itself or refuses it (409 envelope): nothing goes round a loop. If the peer cannot be
  reached, it is marked down at once; if it cannot be reached or answers 502, 503 or 504 and
  another node is left, the request goes to the next node: nothing has been sent to the
  client yet. The last node's answer is the client's, whatever it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlencode

from starlette.types import Receive, Scope, Send

from .affinity import PrefixTable, request_keys
from .errors import (
    BadRequest,
    ModelNotFound,
    RouterError,
    Unavailable,
    UpstreamError,
    envelope,
)
from .keys import KeyScope, not_found, resolve_in_scope
from .peers import (
    ADMIN_DEADLINE_S,
    FAIL_OVER_STATUSES,
    LOADING,
    MAX_ANSWER_BYTES,
    Candidate,
    Peer,
    Peers,
    by_prefix,
    merge_entries,
    rank,
)
from .proxy import FailOver, relay, upstream_headers
from .requests import VIA_HEADER, RequestContext
from .resumable import serves
from .scheduler import Status
from .state import State
from .supervisor import Supervisor
from .upstream import Cancel
from .view import ModelView

log = logging.getLogger("router.nodes")


class NoAnswer(UpstreamError):
    """A peer took longer than the deadline of the router's own call to it."""


class AlreadyRelayed(RouterError):
    """The request passed through this router already (its via chain names it), or only
    routers it passed through hold its model: it is never relayed again."""

    status = 409
    type = "invalid_request_error"


def came_through(request: RequestContext, instance: str) -> bool:
    """Whether the request passed through the router ``instance`` already
    (``x-llama-router-via``)."""
    return instance in request.via


def loop_error(request: RequestContext, peers: Peers, what: str) -> AlreadyRelayed:
    """The refusal of a request that came back, or whose model only routers it passed
    through hold."""
    if came_through(request, peers.instance):
        return AlreadyRelayed(
            f"{what} passed through this router ({peers.node}, instance {peers.instance}) "
            "already (x-llama-router-via names it): a router relays a request at most once, "
            "so that peers which front each other never send it round. A client must not "
            "set x-llama-router-via")
    return AlreadyRelayed(f"{what} is for nodes it passed through already "
                          f"(x-llama-router-via: {', '.join(request.via)[:200]}); it is not "
                          "sent back there")


def local_model(supervisor: Supervisor, key_scope: KeyScope | None, model: str
                ) -> ModelView | None:
    """This router's own model named ``model``, or None; for a key limited to some models, a
    model outside them (here or on any node) is not found, as a name nobody uses."""
    try:
        return resolve_in_scope(supervisor, key_scope, model)
    except ModelNotFound:
        if key_scope is not None and not key_scope.allows(model):
            raise not_found(supervisor, key_scope, model) from None
        return None


def raise_if_elsewhere(peers: Peers, model: str, request: RequestContext) -> None:
    """A 503 naming the nodes when only peers that are down list ``model``; a 409 when
    the request came back, or only nodes it passed through hold the model."""
    if request.key_scope is not None and not request.key_scope.allows(model):
        return  # not the key's: not found, as a name nobody uses
    holders = peers.listing().get(model)
    if came_through(request, peers.instance) or (
            holders and any(p.up and p.via in request.via for p in holders)):
        raise loop_error(request, peers, f"the request for model '{model}'")
    if holders:
        reasons = "; ".join(f"node {p.node}: {p.reason or 'not answering'}" for p in holders)
        raise Unavailable(f"model '{model}' is on nodes that are not answering ({reasons})",
                          headers={"Retry-After": "5"})


def candidates(holders: list[Peer], model: str, local: ModelView | None, node: str
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
                             local: ModelView | None, target: bytes) -> bool:
    """Serve the request on the best node holding its model (the peers ``holders``, or
    ``local``); False when that is this router (the caller serves it). Raises like
    ``proxy.relay`` for the last node tried."""
    peers = state.peers
    assert peers is not None and request.model is not None and request.body is not None
    if came_through(request, peers.instance):
        return False  # it came back: served here or refused, never sent round again
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
    headers.append(via_header(request, peers_of(state).instance))
    if peer_model != model:  # --peer-prefix: the peer knows the model by its own id
        body, target = _renamed(body, parsed, request, target, peer_model)
    request.node = peer.node
    conv_id = request.conv_id if body else None
    if conv_id:  # a resumable stream: resumed through the peer that has it (``resumable``)
        state.conversations.claim(conv_id, request.model_id or model, request.key_hash, peer,
                                  running=serves(state.supervisor))
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


def peers_of(state: State) -> Peers:
    assert state.peers is not None
    return state.peers


def via_header(request: RequestContext | None, instance: str) -> tuple[bytes, bytes]:
    """The ``x-llama-router-via`` header a request leaving this router carries: the chain
    it came with, and this router's instance id."""
    chain = (*request.via, instance) if request is not None else (instance,)
    return VIA_HEADER, ",".join(chain).encode("latin-1")


async def ask_peer(peer: Peer, method: str, target: bytes, body: bytes,
                   request: RequestContext | None, instance: str, deadline: float
                   ) -> tuple[int, bytes]:
    """The router's own call to a peer (admin fan-out, scrapes): the same hop as proxying
    (the peer's pool, its key, the via chain, its connect deadline, the peer's abort when it
    stops answering), with a deadline for the whole answer and a bounded read. Raises
    ``UpstreamError`` when the peer cannot be reached or does not answer in time."""
    headers = [(b"content-type", b"application/json"), *peer.auth,
               via_header(request, instance)]
    cancel = Cancel()
    peer.calls.add(cancel)
    try:
        async with asyncio.timeout(deadline):
            response = await peer.connections.send(method, target, headers, body,
                                                   cancel=cancel)
            try:
                parts, size = [], 0
                while (chunk := await response.next_chunk()) is not None:
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        response.abort()
                        raise UpstreamError(f"node {peer.node} answered more than "
                                            f"{MAX_ANSWER_BYTES} bytes")
                    parts.append(chunk)
            finally:
                response.release()
    except TimeoutError:
        raise NoAnswer(f"node {peer.node} ({peer.url}) did not answer within "
                       f"{deadline:g} s") from None
    except UpstreamError as exc:
        if cancel.cancelled:
            raise UpstreamError(f"node {peer.node} ({peer.url}) stopped answering: "
                                f"{peer.reason}") from exc
        raise
    finally:
        peer.calls.discard(cancel)
    return response.status, b"".join(parts)


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
    """``/models`` with peers: this router's entries (with ``node`` and ``instance``), merged
    with the same models on peers, then the models only peers list (those the key may
    see)."""
    listing = peers.listing()
    merged = []
    for entry in local:
        holders = listing.pop(entry["id"], None)
        merged.append(merge_entries(entry["id"], holders, entry, node, peers.instance)
                      if holders else {**entry, "node": node, "instance": peers.instance})
    for model_id, holders in listing.items():
        if key_scope is None or key_scope.allows(model_id):
            merged.append(merge_entries(model_id, holders, None, node, peers.instance))
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
    local = supervisor.view(model)
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


async def scrape_peers(peers: Peers, request: RequestContext
                       ) -> list[tuple[dict[str, str], str]]:
    """Each peer's ``/metrics`` that answered, with its ``node`` label; none of those the
    scrape passed through (peers that front each other scrape each other once), and none at
    all when it came back here."""
    async def scrape(peer: Peer) -> tuple[dict[str, str], str] | None:
        try:
            status, text = await ask_peer(peer, "GET", b"/metrics", b"", request,
                                          peers.instance, peer.timeout)
        except UpstreamError:
            return None
        return ({"node": peer.node}, text.decode("utf-8", "replace")) if status == 200 \
            else None

    if came_through(request, peers.instance):
        return []
    up = [peer for peer in peers.peers.values() if peer.up and peer.via not in request.via]
    return [found for found in await asyncio.gather(*(scrape(p) for p in up)) if found]


def admin_targets(holders: list[Peer], model: str, local: ModelView | None, node: str,
                  asked: str | None, action: str) -> list[Peer | None]:
    # ``holders``: the peers that list the model, less those the request passed through.
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


async def forward_admin(peer: Peer, path: str, payload: dict[str, Any], model: str,
                        request: RequestContext, instance: str,
                        deadline: float = ADMIN_DEADLINE_S) -> tuple[int, dict[str, Any]]:
    """``POST path`` with ``payload`` (its model renamed to the peer's id) to ``peer``
    (``ask_peer``: the via chain, deadlines); its status and JSON answer, or a 502 envelope
    when it cannot be reached or does not answer in time."""
    body = {**payload, "model": peer.peer_ids.get(model, model)}
    body.pop("node", None)
    try:
        status, raw = await ask_peer(peer, "POST", path.encode(), json.dumps(body).encode(),
                                     request, instance, deadline)
    except UpstreamError as exc:
        if not isinstance(exc, NoAnswer):  # a slow peer is the probes' to judge
            peer.unreachable(exc.message)
        return 502, envelope(502, f"node {peer.node} ({peer.url}) could not be reached: "
                                  f"{exc.message}")
    try:
        answer = json.loads(raw)
    except ValueError:
        return 502, envelope(502, f"node {peer.node} answered {status} without JSON")
    return status, answer if isinstance(answer, dict) else {"answer": answer}
