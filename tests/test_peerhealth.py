"""A peer's health (``router/peers/peerhealth.py``) against a stand-in peer router: models
imported with the node's name, events relayed with ``node``, down after missed checks,
requests in flight aborted only when the peer went silent, back when it answers; a peer that
is this router is not used, with its reason."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from standin_peer import HANG_GUARD_S, StandInPeer, collect, running_peer, wait_for

from router.errors import UpstreamError
from router.events import EventBus


async def test_a_peer_imports_relays_and_goes_down_when_silent() -> None:
    events = EventBus()
    seen: list[dict[str, Any]] = []
    collector = asyncio.create_task(collect(events, seen))
    async with StandInPeer("node-a", {"m": "unloaded"}) as stand_in, \
            running_peer(stand_in, events) as peer:
        await wait_for(lambda: peer.up)
        assert peer.node == "node-a"
        assert peer.models["m"]["node"] == "node-a" and peer.status_of("m") == "unloaded"
        assert set(stand_in.auth) == {"Bearer sk-peer"}  # its key with every request
        await wait_for(lambda: any(e["event"] == "peer_up" for e in seen))
        # Its events: the model table follows, and they are relayed with the node.
        await stand_in.events.put({"model": "m", "event": "status_change",
                                   "data": {"status": "loaded"}})
        await wait_for(lambda: peer.status_of("m") == "loaded")
        await wait_for(lambda: {"model": "m", "event": "status_change",
                                "data": {"status": "loaded"}, "node": "node-a",
                                "via": [stand_in.url]} in seen)  # no instance id: its address
        # An event that came through this router already is not relayed again.
        await stand_in.events.put({"model": "m", "event": "marker", "via": ["gw-instance"]})
        await stand_in.events.put({"model": "m", "event": "after"})
        await wait_for(lambda: any(e["event"] == "after" for e in seen))
        assert not any(e["event"] == "marker" for e in seen)
        # A request in flight, then the peer goes silent: down, and the request ends.
        response = await peer.connections.send("GET", b"/stream", [], b"")
        await stand_in.chunks.put(b"data: 1\n\n")
        assert await response.next_chunk() == b"data: 1\n\n"
        stand_in.silent = True
        await wait_for(lambda: not peer.up)
        assert "missed 2 health checks" in peer.reason
        with pytest.raises(UpstreamError):
            async with asyncio.timeout(HANG_GUARD_S):
                await response.next_chunk()
        response.release()
        def down() -> list[dict[str, Any]]:
            return [e for e in seen if e.get("data", {}).get("unavailable")]

        await wait_for(lambda: down())  # the collector has it once it runs
        assert down()[0]["model"] == "m" and down()[0]["node"] == "node-a"
        # It answers again: back, its models imported again.
        stand_in.silent = False
        await wait_for(lambda: peer.up)
        await wait_for(lambda: sum(e["event"] == "peer_up" for e in seen) >= 2)
    collector.cancel()


async def test_a_peer_refusing_connections_finishes_what_it_has() -> None:
    events = EventBus()
    # A long health timeout: only the refused connections may take it down (on a loaded
    # machine a 2 s check can time out, which would be silence, and abort the stream).
    async with StandInPeer("node-a", {"m": "loaded"}) as stand_in, \
            running_peer(stand_in, events, timeout=HANG_GUARD_S) as peer:
        await wait_for(lambda: peer.up)
        response = await peer.connections.send("GET", b"/stream", [], b"")
        await stand_in.stop_listening()  # shutting down: its grace period runs
        await wait_for(lambda: not peer.up)
        assert "ConnectError" in peer.reason
        await stand_in.chunks.put(b"data: still here\n\n")
        async with asyncio.timeout(HANG_GUARD_S):
            assert await response.next_chunk() == b"data: still here\n\n"
        response.release()


async def test_a_peer_that_is_this_router_is_ignored_with_its_reason() -> None:
    events = EventBus()
    async with StandInPeer("another-name", {"m": "loaded"}, instance="gw-instance") \
            as stand_in, running_peer(stand_in, events) as peer:
        await wait_for(lambda: peer.is_self)  # its instance id is this router's
        await asyncio.sleep(0.2)  # several checks: still not used
        assert not peer.up and not peer.models
        assert peer.reason == "it is this router (instance gw-instance)"
