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

Each entry of a listing is read once, as the listing arrives (``bounded``): a copy with at
most ``MAX_ENTRY_ITEMS`` items of each list in it (replicas, aliases, tags, args, nodes...; the
rest is ignored), and an entry still over ``MAX_ENTRY_VALUES`` values, ``MAX_ENTRY_CHARS``
characters of strings or ``MAX_ENTRY_DEPTH`` levels is read as its id and status only (what it
says of its node unknown). The peer's state reads its facts from it then (``Listing.facts``);
nothing walks an entry per request. JSON is read by ``hop.read_json`` (a number that is not
finite is unknown).

A model that several nodes list (peers, and this router) is one model with replicas across
machines: ``merge_entries`` makes its one entry, ``across_nodes`` its status in events.
"""

from __future__ import annotations

import contextlib
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
# One entry of it, read once (``bounded``): the items kept of each list in it; past the others
# it is read as its id and status only.
MAX_ENTRY_ITEMS = 256
MAX_ENTRY_VALUES = 8192  # each object, list, key, string, number, true, false and null
MAX_ENTRY_CHARS = 256 << 10  # of its strings and keys together
MAX_ENTRY_DEPTH = 32
MAX_STATUS_CHARS = 64  # a model's status in a peer's listing or events ("loaded", ...)


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
    data = hop.read_json(raw).get("data")
    if not isinstance(data, list):
        raise ValueError("no data list")
    if len(data) > MAX_LISTING_MODELS:
        raise _refused(peer, f"its /models lists {len(data)} models, more than the "
                             f"{MAX_LISTING_MODELS} a peer may list")
    return _listing(peer, data)


def _listing(peer: Peer, data: list[Any]) -> Listing:
    """The peer's entries (``data``) as its listing: each read once (``bounded``), those
    over the bounds said in one line."""
    models: dict[str, dict[str, Any]] = {}
    ids: dict[str, str] = {}
    over = 0
    for raw in data:
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            continue
        peer_id = raw["id"]
        local = peer.local_id(peer_id)
        entry = bounded(raw)
        over += entry is None
        entry = _foreign(entry or _bare(raw), peer.own_instance)
        if entry is None:
            continue  # this router's own model, listed back by a peer that fronts it
        entry.setdefault("node", peer.node)
        entry["id"] = local
        models[local] = entry
        ids[local] = peer_id
    if over:
        log.warning("peer %s: %d /models entries over the bounds of an entry, read as their "
                    "id and status only", peer.node, over, extra={"event": "peer_entry_bounded"})
    return Listing(models, ids)


class _Over(Exception):
    """An entry over one of the bounds of an entry."""


def bounded(entry: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of a peer's ``/models`` entry within the bounds of an entry: each list in it
    cut to its first ``MAX_ENTRY_ITEMS`` items; None when it is still over
    ``MAX_ENTRY_VALUES`` values, ``MAX_ENTRY_CHARS`` characters or ``MAX_ENTRY_DEPTH``
    levels (the walk stops there: it costs at most that much, whatever the entry holds)."""
    left = [MAX_ENTRY_VALUES, MAX_ENTRY_CHARS]

    def copy(value: Any, depth: int) -> Any:
        left[0] -= 1
        if isinstance(value, str):
            left[1] -= len(value)
        if left[0] < 0 or left[1] < 0 or depth > MAX_ENTRY_DEPTH:
            raise _Over
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                left[1] -= len(key)
                out[key] = copy(item, depth + 1)
            return out
        if isinstance(value, list):
            return [copy(item, depth + 1) for item in value[:MAX_ENTRY_ITEMS]]
        return value

    try:
        return copy(entry, 0)  # type: ignore[no-any-return]
    except _Over:
        return None


def _bare(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry over the bounds, as its id and status only (and where it is, for a peer that
    lists it from another node: ``node``, ``instance``)."""
    status = entry.get("status")
    value = status.get("value") if isinstance(status, dict) else status
    where = {key: entry[key] for key in ("node", "instance")
             if isinstance(entry.get(key), str) and len(entry[key]) <= MAX_STATUS_CHARS * 4}
    return {"id": entry["id"], "object": "model", "status": {"value": _status(value)},
            **where}


def _status(value: object) -> str | None:
    """A model's status as a peer gives it: a short string, else unknown."""
    return value if isinstance(value, str) and len(value) <= MAX_STATUS_CHARS else None


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
                    heard = read_event(peer, hop.read_json(event.data))
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
    status = _status(data.get("status"))
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
    # A copy of the entry and of its status, the two levels written here (a peer's entry is
    # never changed in place: a new one comes with the next listing).
    if local is not None:
        entry = dict(local)
    else:
        source = next((p for p in peers if p.up), peers[0])
        entry = dict(source.models[model_id])
        entry["id"] = model_id
    status: dict[str, Any] = dict(entry["status"]) if isinstance(entry.get("status"), dict) \
        else {}
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
