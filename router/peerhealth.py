"""A peer's health: probed, brought up, marked down.

Each peer is probed with ``GET /health`` every ``--liveness-interval`` s
(``--liveness-timeout``), as children are (``process.ask_health``; children's probe is
``upstream.probe``; the misses of both counted by ``liveness.Misses``). After
``--liveness-misses`` failures in a row, or at once when a connection to it is refused, it is
*down*: its models are unavailable (an event says so for each) and nothing new is sent to it
until a probe answers again. Requests in flight to it end
at once (a 502 envelope, or a stream's error event), and so do the router's own calls to it,
only if it stopped answering altogether (probes timed out: frozen, or cut off): one that
refuses connections is either gone, and its connections with it, or shutting down and
finishing them in its grace period; a peer that leaves ``--peer-dns`` finishes them too.

A probe that answers brings a peer that is down up: its ``/props`` says who it is (its
instance id decides whether it is this router; its node name is a label), its models are
imported and its events followed (``catalogue``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from . import catalogue, hop
from .errors import UpstreamError
from .process import ask_health, no_answer

if TYPE_CHECKING:
    from .peer import Peer

log = logging.getLogger("router.peers")

MAX_PROPS_BYTES = 1 << 20  # a peer's /props answer


async def watch(peer: Peer) -> None:
    """Check ``peer`` every ``interval`` s for as long as it is configured; a check that
    fails in an unforeseen way is logged and the next one runs as usual."""
    while True:
        try:
            await check(peer)
        except Exception as exc:  # never leave a peer unwatched
            log.exception("peer %s: check failed", peer.url, exc_info=exc)
        await asyncio.sleep(peer.interval)


async def check(peer: Peer) -> None:
    problem, silent = await probe(peer)
    if problem is None:
        peer.missed.answered(peer)
        if not peer.up:
            await come_up(peer)
        elif peer.follower is None or peer.follower.done():
            catalogue.follow(peer)
    else:
        missed = peer.missed.miss(peer)
        if peer.up and missed >= peer.misses:
            peer.mark_down(f"missed {missed} health checks ({problem})", abort=silent)
        elif not peer.up:
            peer.reason = problem


async def probe(peer: Peer) -> tuple[str | None, bool]:
    """None if ``GET /health`` answered 200 within the timeout, else what went wrong;
    and whether the peer was silent (a timeout: frozen, or the network is cut)."""
    status, problem = await ask_health(peer.client, f"{peer.url}/health", peer.timeout,
                                       peer.probe_headers)
    if problem is not None:
        return problem, problem == no_answer(peer.timeout)
    if status != 200:
        return f"/health answered {status}", False
    return (peer.reason if peer.is_self else None), False


async def learn_node(peer: Peer) -> None:
    """The peer's instance id and node name, from its ``/props`` (a llama.cpp router has
    neither: its address stays its name). The instance id decides whether it is this
    router; the name is a label, made distinct (``NAME@host:port``) when another node
    has it too."""
    try:
        status, raw = await hop.ask(peer, "GET", b"/props", deadline=peer.timeout,
                                    limit=MAX_PROPS_BYTES)
        info = json.loads(raw).get("llama_router", {}) if status == 200 else {}
        node, instance = info.get("node"), info.get("instance")
    except (UpstreamError, ValueError, AttributeError):
        node = instance = None
    if isinstance(instance, str) and instance:
        peer.instance = instance
    if isinstance(node, str) and node:
        peer.name = node
    if peer.instance and peer.instance == peer.own_instance:
        if not peer.is_self:  # --peer-dns (or --peer) found this router itself
            log.warning("peer %s is this router (instance %s); not used", peer.url,
                        peer.instance, extra={"event": "peer_is_self"})
        peer.is_self = True
        peer.reason = f"it is this router (instance {peer.instance})"
        return
    if peer.name:
        peer.node = peer.label(peer, peer.name) if peer.label is not None else peer.name


async def come_up(peer: Peer) -> None:
    await learn_node(peer)
    if peer.is_self:
        return
    try:
        await catalogue.import_models(peer)
    except catalogue.ListingRefused as exc:
        peer.reason = str(exc)
        return
    except (UpstreamError, ValueError, TypeError, AttributeError) as exc:
        peer.reason = f"GET /models failed: {exc or type(exc).__name__}"
        return
    peer.up = True
    peer.reason = ""
    log.info("peer %s is up at %s with %d models", peer.node, peer.url, len(peer.models),
             extra={"event": "peer_up"})
    peer.events.publish_payload({"model": "*", "event": "peer_up", "node": peer.node,
                                 "data": {"url": peer.url, "models": sorted(peer.models)}})
    for model_id in peer.models:
        peer.publish_status(model_id)
    catalogue.follow(peer)
