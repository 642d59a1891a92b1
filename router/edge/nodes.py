"""A request served across nodes: which node, and the fail-over to the next.

``forward`` asks ``serve_across_nodes`` only when some peer that is up lists the request's
model; a router without peers never gets here. The nodes holding the model (peers, and this
router when it has the model too) are tried in ``placement.rank`` order (a conversation's
next turn first where its prompt is cached, ``placement.by_prefix``, or kept on disk while its
model is not loaded there, ``placement.by_saved_state``):

* this router's turn: ``serve_across_nodes`` returns False and ``forward`` serves the request
  as any other (lease, child);
* a peer's turn: the request goes to it through the hop (``hop.relay``: as the client sent
  it, with the peer key and the via chain; a request the default model took names it there,
  so that the peer does not choose again). A router never sends a request to a router in its
  via chain, and one that finds itself there serves it itself or refuses it (409 envelope):
  nothing goes round a loop. If the peer cannot be reached, it is marked down at once; if it
  cannot be reached or answers 502, 503 or 504 and another node is left, the request goes to
  the next node: nothing has been sent to the client yet. The last node's answer is the
  client's, whatever it is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from .. import otel
from ..errors import UpstreamError
from ..http.paths import RESPONSES_PATHS
from ..http.proxy import FailOver, with_model
from ..http.requests import BODY_METHODS, RequestContext
from ..observe import genai
from ..peers import hop
from ..peers.peer import Peer
from ..peers.placement import by_prefix, by_saved_state, candidates
from ..serving.affinity import NO_PREFIX, PrefixTable, request_prefix
from .state import State

if TYPE_CHECKING:
    from .route import Route

log = logging.getLogger("router.nodes")

FAIL_OVER_STATUSES = frozenset({502, 503, 504})


async def serve_across_nodes(state: State, scope: Scope, request: RequestContext,
                             receive: Receive, send: Send, route: Route, target: bytes) -> bool:
    """Serve the request on the best node holding its model (the peers ``route.holders``,
    or this router's ``route.local``); False when that is this router (the caller serves
    it). Raises like ``proxy.relay`` for the last node tried."""
    peers = state.peers
    assert peers is not None and request.model is not None and request.body is not None
    # The model as the nodes name it: a virtual model's target, else the one requested.
    model = route.model_id if route.virtual is not None else request.model
    parsed = request.parsed
    order = candidates(route.holders, model, route.local, state.node)
    prefix = request_prefix(parsed, request.path in RESPONSES_PATHS) if parsed is not None \
        else NO_PREFIX
    keys = prefix.keys
    if keys:  # a conversation's next turn: where its prompt is cached or kept (``affinity``)
        tables = peers.prefixes.setdefault(model, {})
        kept = by_saved_state(order, tables, prefix)
        order, decision = kept if kept is not None else by_prefix(order, tables, keys)
        if decision is not None:
            state.metrics.observe_routing(model, decision)
        tables.setdefault(order[0].node, PrefixTable()).record(keys)
    for index, candidate in enumerate(order):
        peer = candidate.peer
        if peer is None:
            return False
        fail_over = FAIL_OVER_STATUSES if index < len(order) - 1 else frozenset()
        try:
            await _relay_to_peer(state, peer, scope, request, receive, send, route, model,
                                 candidate.peer_model or model, target, fail_over)
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
                         receive: Receive, send: Send, route: Route, model: str,
                         peer_model: str, target: bytes, fail_over: frozenset[int]) -> None:
    body = request.body or b""
    # --peer-prefix: the peer knows the model by its own id; a request the default model took
    # names it, so that the peer serves the model the router decided (not its own default).
    if peer_model != request.model or request.defaulted:  # a virtual model's target too
        body, target = _renamed(body, request, target, peer_model)
    request.node = peer.node
    if route.conversation is not None:  # resumed through the peer that has it
        route.conversation.served_by(peer)
    # OpenTelemetry on: the exchange's CLIENT span, whose traceparent the peer continues.
    span = genai.exchange(request, peer_model, peer.url, peer.node) if otel.on else None
    with peer.sending(model):
        relayed = hop.relay(peer, scope, request, receive, send, scope["method"], target, body,
                            shutdown=state.shutdown, fail_over=fail_over, span=span)
        await (relayed if span is None else genai.exchanged(span, request, relayed))


def _renamed(body: bytes, request: RequestContext, target: bytes, model: str
             ) -> tuple[bytes, bytes]:
    """The body's ``model`` (JSON, or the multipart field) and the query's ``model`` (as the
    request's context decoded it) set to ``model``; for a request the default model took,
    added where it names none (the query of a bodiless one)."""
    add = request.defaulted
    if request.method in BODY_METHODS and body:
        body = with_model(body, request.json_scan(), request.headers.get(b"content-type", b""),
                          model, add=add)
    if "model" in request.params or (add and not body):
        target = request.target(model)
    return body, target
