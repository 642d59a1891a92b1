"""What each of a peer's tasks runs (``peer.Peer`` starts and ends them as its state says):
its health checks (``peerhealth.watch``), the reach of a peer that answers again
(``peerhealth.reach``), the follower of its events (``catalogue.follow``) and the import of
its models again (``catalogue.resync``)."""

from __future__ import annotations

from . import catalogue, peerhealth
from .peer import Peer
from .peerstate import PeerEvent, Task


async def perform(peer: Peer, task: Task) -> PeerEvent | None:
    """Run ``task`` of ``peer`` until it ends: the event that reports its end (none for the
    health checks, which end only when they are ended)."""
    if task is Task.WATCH:
        await peerhealth.watch(peer)
        return None
    if task is Task.REACH:
        return await peerhealth.reach(peer)
    if task is Task.FOLLOW:
        return await catalogue.follow(peer)
    return await catalogue.resync(peer)
