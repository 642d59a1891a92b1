"""The peers' models: each peer's listing, kept live by following its events, and the one
``/models`` entry of a model across nodes.

A peer's models come from its ``GET /models`` (ids unchanged; ``NODE/ID`` with
``--peer-prefix``), through the hop (``hop.ask``) and bounded: a listing over
``MAX_LISTING_BYTES`` or with more than ``MAX_LISTING_MODELS`` models is refused whole
(``ListingRefused``), logged, and the peer is not used, its reason shown in ``/props`` and
``/models``. Its states are kept live by following its ``/models/sse`` (``follow``, through
``hop.stream`` and ``sse.aiter_events``: a line or an event over 1 MiB gives the stream up,
the peer's stream is shown broken, and the next health check follows again); each of its
events is relayed on this router's ``/models/sse`` with ``"node"`` added. What is read here
goes to the peer's state as events (``peer``: ``Listed``, ``Heard``, ...), which keeps the
listing and publishes.

A model that several nodes list (peers, and this router) is one model with replicas across
machines: ``merge_entries`` makes its one entry, ``across_nodes`` its status in events.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from typing import TYPE_CHECKING, Any

from ..errors import UpstreamError
from ..http.sse import EventTooLarge, aiter_events
from . import hop
from .peerstate import (
    LOADED,
    LOADING,
    FollowerEnded,
    Heard,
    Listed,
    Listing,
    PeerEvent,
    Resynced,
    Unreachable,
)

if TYPE_CHECKING:
    from .peer import Peer

log = logging.getLogger("router.peers")

MAX_LISTING_BYTES = 16 << 20  # a peer's /models answer
MAX_LISTING_MODELS = 10_000  # models in it
REFUSED = "listing refused: "  # how the reason of a peer whose listing was refused starts


class ListingRefused(ValueError):
    """A peer's ``/models`` over the caps: the peer is not used (the message says why)."""


async def import_models(peer: Peer) -> Listing:
    """The peer's listing, as its models (``ListingRefused`` over the caps); the peer's
    state takes it as an event (``Reached``, ``Listed``, ``Resynced``)."""
    try:
        status, raw = await hop.ask(peer, "GET", b"/models", deadline=peer.timeout * 2,
                                    limit=MAX_LISTING_BYTES)
    except hop.TooLarge:
        raise _refused(peer, f"its /models answer is over {MAX_LISTING_BYTES >> 20} MiB, "
                             "the most a peer's listing may hold") from None
    if status != 200:
        raise ValueError(f"GET /models answered {status}")
    data = json.loads(raw).get("data")
    if not isinstance(data, list):
        raise ValueError("no data list")
    if len(data) > MAX_LISTING_MODELS:
        raise _refused(peer, f"its /models lists {len(data)} models, more than the "
                             f"{MAX_LISTING_MODELS} a peer may list")
    models: dict[str, dict[str, Any]] = {}
    ids: dict[str, str] = {}
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        peer_id = entry["id"]
        local = peer.local_id(peer_id)
        entry = _foreign(entry, peer.own_instance)
        if entry is None:
            continue  # this router's own model, listed back by a peer that fronts it
        entry.setdefault("node", peer.node)
        entry["id"] = local
        models[local] = entry
        ids[local] = peer_id
    return Listing(models, ids)


def _refused(peer: Peer, why: str) -> ListingRefused:
    log.warning("peer %s: listing refused, peer not used: %s", peer.url, why,
                extra={"event": "peer_listing_refused"})
    return ListingRefused(REFUSED + why)


async def resync(peer: Peer) -> PeerEvent:
    """Import the peer's models again (``peer.Task.RESYNC``: a model it did not list, or
    events it dropped); a listing refused takes the peer down."""
    try:
        return Resynced(await import_models(peer))
    except ListingRefused as exc:
        return Unreachable(str(exc))
    except (UpstreamError, ValueError, TypeError, AttributeError):
        return Resynced()  # the next events or health check try again


async def follow(peer: Peer) -> FollowerEnded:
    """Follow the peer's events (``peer.Task.FOLLOW``) until its stream ends or is given
    up (the next health check follows again)."""
    try:
        await follow_events(peer)
    except EventTooLarge as exc:
        return FollowerEnded(f"its /models/sse was given up: {exc}")
    except Exception as exc:  # the next check follows again
        log.warning("peer %s: events stopped: %r", peer.node, exc)
    return FollowerEnded()


async def follow_events(peer: Peer) -> None:
    """Follow the peer's ``/models/sse`` until it ends (the next probe follows again)."""
    with contextlib.suppress(UpstreamError):
        async with hop.stream(peer, "GET", b"/models/sse", deadline=peer.timeout) as response:
            if response.status != 200:
                return
            # Subscribed: import again, so that nothing between the first import and the
            # subscription is missed.
            with contextlib.suppress(UpstreamError, ValueError, TypeError, AttributeError):
                peer.apply(Listed(await import_models(peer)))
            async for event in aiter_events(response.next_chunk):
                try:
                    heard = read_event(peer, json.loads(event.data))
                except ValueError:
                    heard = Heard()
                peer.apply(heard)


def read_event(peer: Peer, event: Any) -> Heard:
    """One of the peer's events, as its state takes it: the model's status, and the event
    to relay with its node and the via chain (``"via"``: the instance ids it came through).
    An event that came through this router already (routers that front each other) is not
    relayed; a model the peer did not list before, or events it dropped, import its models
    again."""
    if not isinstance(event, dict) or not isinstance(event.get("model"), str):
        return Heard()
    via = event.get("via")
    via = [v for v in via if isinstance(v, str)] if isinstance(via, list) else []
    if peer.own_instance in via:
        return Heard()
    peer_id = event["model"]
    if peer_id == "*":
        return Heard(resync=event.get("event") == "events_dropped")
    model_id = peer.local_id(peer_id)
    data: dict[str, Any] = event["data"] if isinstance(event.get("data"), dict) else {}
    status = data["status"] if isinstance(data.get("status"), str) else None
    return Heard(model_id, status, {**event, "model": model_id,
                                    "node": event.get("node", peer.node),
                                    "via": [*via, peer.via]})


# --------------------------------------------------------------------- across nodes

def _foreign(entry: dict[str, Any], own_instance: str) -> dict[str, Any] | None:
    """A peer's ``/models`` entry without this router's own node (a peer that fronts this
    router lists its models back); None when nothing else is left. The status is then the
    best of the nodes left."""
    nodes = entry.get("nodes")
    if isinstance(nodes, list):
        kept = [n for n in nodes if not (isinstance(n, dict)
                                          and n.get("instance") == own_instance)]
        if not kept:
            return None
        if len(kept) < len(nodes):
            entry["nodes"] = kept
            values = [n.get("status") for n in kept
                      if isinstance(n, dict) and not n.get("unavailable")]
            status = entry.get("status")
            if isinstance(status, dict):
                status["value"] = LOADED if LOADED in values else LOADING if LOADING in values \
                    else next((v for v in values if isinstance(v, str)), "unloaded")
        return entry
    return None if entry.get("instance") == own_instance else entry


def merge_entries(model_id: str, peers: list[Peer], local: dict[str, Any] | None,
                  own_node: str, own_instance: str = "") -> dict[str, Any]:
    """The one ``/models`` entry for a model that ``peers`` (and maybe this router, whose
    entry is ``local``) list: the local entry or the first available peer's, with ``node``
    (where it is) or ``nodes`` (each node and its status) and the best status of all."""
    nodes: list[dict[str, Any]] = []
    if local is not None:
        nodes.append({"node": own_node, "instance": own_instance,
                      "status": local["status"]["value"]})
    for peer in peers:
        nodes.append({"node": peer.node, "instance": peer.instance,
                      "status": peer.status_of(model_id),
                      **({} if peer.up else {"unavailable": True, "message": peer.reason})})
    available = [n for n in nodes if not n.get("unavailable")]
    if local is not None:
        entry = copy.deepcopy(local)
    else:
        source = next((p for p in peers if p.up), peers[0])
        entry = copy.deepcopy(dict(source.models[model_id]))
        entry["id"] = model_id
    status: dict[str, Any] = entry["status"] if isinstance(entry.get("status"), dict) else {}
    entry["status"] = status
    if not available:
        status.update(value="unloaded", unavailable=True,
                      message="; ".join(f"node {n['node']}: {n.get('message')}" for n in nodes))
    else:
        values = [n["status"] for n in available]
        status["value"] = LOADED if LOADED in values else \
            LOADING if LOADING in values else values[0]
    if len(nodes) == 1:
        entry["node"] = nodes[0]["node"]
        entry["instance"] = nodes[0]["instance"]
    else:
        entry.pop("node", None)
        entry.pop("instance", None)
        entry["nodes"] = nodes
    return entry
