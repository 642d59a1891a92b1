"""The one hop to peers (``router/peers/hop.py``, ``router/edge/nodes.py``): the via chain, a
request renamed for a prefixed peer, and the router's own calls bounded in size and time and
ended when the peer is found frozen."""

from __future__ import annotations

import asyncio
import time

import pytest
from standin_peer import HANG_GUARD_S, StandInPeer, running_peer, wait_for

from router.edge.nodes import _renamed
from router.errors import UpstreamError
from router.events import EventBus
from router.http.requests import RequestContext
from router.peers import hop
from router.peers.hop import NoAnswer, TooLarge, came_through


def test_request_renamed_for_a_prefixed_peer_and_via() -> None:
    def context(target: str, *headers: tuple[bytes, bytes]) -> RequestContext:
        path, _, query = target.partition("?")
        return RequestContext({"method": "POST", "path": path, "query_string": query.encode(),
                               "headers": list(headers)})

    chat = context("/v1/chat/completions")
    chat.body, chat.parsed = b'{"model": "a/m", "x": 1}', {"model": "a/m", "x": 1}
    body, target = _renamed(chat.body, chat, b"/v1/chat/completions", "m")
    assert body == b'{"model": "m", "x": 1}' and target == b"/v1/chat/completions"
    slots = context("/slots?mod%65l=a%2Fm&id=1")  # the decoded name is the model's
    body, target = _renamed(b"", slots, b"/slots?mod%65l=a%2Fm&id=1", "m")
    assert target == b"/slots?model=m&id=1"
    request = context("/", (b"x-llama-router-via", b"gw, node-a"), (b"x-llama-router-via", b"c"))
    assert request.via == ("gw", "node-a", "c")
    assert came_through(request, "node-a") and came_through(request, "c")
    assert not came_through(request, "node")


async def test_every_call_to_a_peer_carries_its_key_and_the_via_chain() -> None:
    """Its /props, /models and /models/sse (health probes aside: /health is never relayed)."""
    async with StandInPeer("node-a", {"m": "loaded"}) as stand_in, \
            running_peer(stand_in, EventBus()) as peer:
        await wait_for(lambda: peer.up and stand_in.subscriptions)
        assert len(stand_in.via) >= 3
        assert set(stand_in.via) == {"gw-instance"}
        assert set(stand_in.auth) == {"Bearer sk-peer"}


async def test_the_routers_own_calls_are_bounded_and_end_when_the_peer_is_frozen() -> None:
    async with StandInPeer("node-a", {"m": "loaded"}) as stand_in, \
            running_peer(stand_in, EventBus(), timeout=5.0) as peer:
        await wait_for(lambda: peer.up)
        stand_in.listing = b"[" + b"1," * 5000 + b"1]"
        with pytest.raises(TooLarge, match="more than 1000 bytes"):
            await hop.ask(peer, "GET", b"/models", deadline=5.0, limit=1000)
        # No answer in time: a clear error at the deadline.
        stand_in.chunks.put_nowait(b"data: 1\n\n")
        started = time.monotonic()
        with pytest.raises(NoAnswer, match=r"did not answer within 0\.3 s"):
            await hop.ask(peer, "GET", b"/stream", deadline=0.3)  # an endless answer
        assert time.monotonic() - started < 5.0
        # Found frozen while a call waits: it ends at once, saying so.
        following = len(peer.calls)  # its /models/sse
        call = asyncio.create_task(hop.ask(peer, "GET", b"/stream", deadline=60.0))
        await wait_for(lambda: len(peer.calls) > following)
        peer.mark_down("missed 2 health checks (no answer)", abort=True)
        with pytest.raises(UpstreamError, match="stopped answering: missed 2 health checks"):
            async with asyncio.timeout(HANG_GUARD_S):
                await call
        assert not peer.calls
