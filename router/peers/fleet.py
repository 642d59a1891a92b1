"""What the nodes answer together, over every peer: ``/models`` merged with this router's
own listing (``merged_listing``), a model's status across nodes in ``/models/sse``
(``across_nodes``), and every peer's ``/metrics`` for this router's (``scrape``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..errors import UpstreamError
from ..http.requests import RequestContext
from .catalogue import merge_entries
from .hop import ask, came_through, passed
from .peer import Peer
from .peerstate import LOADED, LOADING
from .registry import Peers

if TYPE_CHECKING:
    from ..config.keyfile import KeyScope
    from ..core.view import Models


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


def across_nodes(event: dict[str, Any], peers: Peers, models: Models
                 ) -> dict[str, Any]:
    """``event`` as ``/models/sse`` sends it: for a model on several nodes, its ``status``
    is the model's across them (as ``/models`` lists it: a node unloading it does not make a
    model that another node serves look unloaded), the node's own in ``node_status``."""
    data = event.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return event
    model = event["model"]
    holders = [p for p in peers.peers.values() if p.up and model in p.models]
    local = models.view(model)
    if len(holders) + (local is not None) < 2:
        return event
    statuses = [p.status_of(model) for p in holders]
    if local is not None:
        statuses.append(local.status.public)
    best = LOADED if LOADED in statuses else LOADING if LOADING in statuses \
        else data["status"]
    if best == data["status"]:
        return event
    return {**event, "data": {**data, "status": best, "node_status": data["status"]}}


async def scrape(peers: Peers, request: RequestContext) -> list[tuple[dict[str, str], str]]:
    """Each peer's ``/metrics`` that answered, with its ``node`` label; none of those the
    scrape passed through (peers that front each other scrape each other once), and none at
    all when it came back here."""
    async def one(peer: Peer) -> tuple[dict[str, str], str] | None:
        try:
            status, text = await ask(peer, "GET", b"/metrics", request=request,
                                     deadline=peer.timeout)
        except UpstreamError:
            return None
        return ({"node": peer.node}, text.decode("utf-8", "replace")) if status == 200 \
            else None

    if came_through(request, peers.instance):
        return []
    up = [peer for peer in peers.peers.values() if peer.up and not passed(peer, request)]
    return [found for found in await asyncio.gather(*(one(p) for p in up)) if found]
