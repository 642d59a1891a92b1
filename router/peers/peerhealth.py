"""A peer's health: probed, brought up, marked down.

Each peer is probed with ``GET /health`` every ``--liveness-interval`` s
(``--liveness-timeout``), as children are (``process.ask_health``; children's probe is
``upstream.probe``). Each probe's outcome is an event of the peer's state (``peer``:
``ProbeAnswered``, ``ProbeMissed``), which counts the misses in a row. After
``--liveness-misses`` failures in a row, or at once when a connection to it is refused, it is
*down*: its models are unavailable (an event says so for each) and nothing new is sent to it
until a probe answers again. Requests in flight to it end
at once (a 502 envelope, or a stream's error event), and so do the router's own calls to it,
only if it stopped answering altogether (probes timed out: frozen, or cut off): one that
refuses connections is either gone, and its connections with it, or shutting down and
finishing them in its grace period; a peer that leaves ``--peer-dns`` finishes them too.

A probe that answers a peer that is not up begins its reach (``reach``): its ``/props`` says
who it is (its instance id decides whether it is this router; its node name is a label), its
models are imported (``catalogue``), and it is up; its events are then followed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..children.process import ask_health, no_answer
from ..errors import UpstreamError
from . import catalogue, hop
from .peerstate import Identified, PeerEvent, ProbeAnswered, ProbeMissed, Reached, ReachFailed

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
    peer.apply(ProbeAnswered() if problem is None else ProbeMissed(problem, silent))


async def probe(peer: Peer) -> tuple[str | None, bool]:
    """None if ``GET /health`` answered 200 within the timeout, else what went wrong;
    and whether the peer was silent (a timeout: frozen, or the network is cut)."""
    status, problem = await ask_health(peer.client, f"{peer.url}/health", peer.timeout,
                                       peer.probe_headers)
    if problem is not None:
        return problem, problem == no_answer(peer.timeout)
    if status != 200:
        return f"/health answered {status}", False
    return None, False


async def learn_node(peer: Peer) -> Identified:
    """The peer's instance id and node name, from its ``/props`` (a llama.cpp router has
    neither: its address stays its name), each as an earlier ``/props`` said where this one
    says nothing. The instance id decides whether it is this router; the name is a label,
    made distinct (``NAME@host:port``) when another node has it too."""
    try:
        status, raw = await hop.ask(peer, "GET", b"/props", deadline=peer.timeout,
                                    limit=MAX_PROPS_BYTES)
        info = hop.read_json(raw).get("llama_router", {}) if status == 200 else {}
        node, instance = info.get("node"), info.get("instance")
    except (UpstreamError, ValueError, AttributeError):
        node = instance = None
    instance = instance if isinstance(instance, str) and instance else peer.instance
    name = node if isinstance(node, str) and node else peer.name
    label = ""
    # Labelled only when it is another router (the state decides which it is: a label for
    # this router itself would warn of a name taken, by this router).
    if name and instance != peer.own_instance:
        label = peer.label(peer, name) if peer.label is not None else name
    return Identified(instance, name, label)


async def reach(peer: Peer) -> PeerEvent | None:
    """The reach of a peer that answers (``peer.Task.REACH``): who it is, then its models;
    its end as an event (None: it is this router)."""
    peer.apply(await learn_node(peer))
    if peer.is_self:
        return None
    try:
        listing = await catalogue.import_models(peer)
    except catalogue.ListingRefused as exc:
        return ReachFailed(str(exc))
    except (UpstreamError, ValueError, TypeError, AttributeError) as exc:
        return ReachFailed(f"GET /models failed: {exc or type(exc).__name__}")
    return Reached(listing)
