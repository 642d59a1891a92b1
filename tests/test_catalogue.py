"""The peers' models (``router/peers/catalogue.py``): the merged entry of a model on several nodes,
its status in events across them, and a peer's listing and events read with bounds: a listing
over the caps refused with its reason, an endless event line giving up the peer's stream and
not the peer."""

from __future__ import annotations

from typing import Any

import pytest
from standin_peer import StandInPeer, StubPeer, StubPeers, running_peer, wait_for

from router.events import EventBus
from router.http.sse import MAX_EVENT_BYTES
from router.peers import catalogue
from router.peers.catalogue import merge_entries
from router.peers.fleet import across_nodes


def test_merged_entry_for_a_model_on_several_nodes() -> None:
    a = StubPeer("node-a", {"m": "unloaded"})
    b = StubPeer("node-b", {"m": "loaded"})
    entry = merge_entries("m", [a, b], None, "gw")  # type: ignore[list-item]
    assert entry["status"]["value"] == "loaded"
    assert entry["nodes"] == [{"node": "node-a", "instance": "id-node-a", "status": "unloaded"},
                              {"node": "node-b", "instance": "id-node-b", "status": "loaded"}]
    assert "node" not in entry
    local = {"id": "m", "status": {"value": "unloaded", "pid": None}}
    entry = merge_entries("m", [b], local, "gw")  # type: ignore[list-item]
    assert [n["node"] for n in entry["nodes"]] == ["gw", "node-b"]
    assert entry["status"]["value"] == "loaded"
    assert local["status"]["value"] == "unloaded"  # not changed in place
    down = StubPeer("node-c", {"x": "loaded"}, up=False)
    entry = merge_entries("x", [down], None, "gw")  # type: ignore[list-item]
    assert entry["node"] == "node-c"
    assert entry["status"]["value"] == "unloaded" and entry["status"]["unavailable"]
    assert "node node-c: ConnectError" in entry["status"]["message"]


def test_events_of_a_model_on_several_nodes_carry_its_status_across_them() -> None:
    a = StubPeer("node-a", {"m": "loaded", "only-b": "loaded"})
    b = StubPeer("node-b", {"m": "unloaded", "only-b": "unloaded"})
    peers: Any = StubPeers(a, b)
    supervisor: Any = type("Sup", (), {"view": lambda self, model: None})()
    unloaded = {"model": "m", "event": "status_change", "data": {"status": "unloaded"},
                "node": "node-b"}
    assert across_nodes(unloaded, peers, supervisor) == {
        **unloaded, "data": {"status": "loaded", "node_status": "unloaded"}}
    loaded = {**unloaded, "data": {"status": "loaded", "info": {}}, "node": "node-a"}
    assert across_nodes(loaded, peers, supervisor) is loaded  # nothing to say
    del a.models["only-b"]  # one node: its event as it is
    alone = {**unloaded, "model": "only-b"}
    assert across_nodes(alone, peers, supervisor) is alone
    b.up = False  # a node that is down does not count
    assert across_nodes(unloaded, peers, supervisor) is unloaded


async def test_a_listing_over_the_caps_is_refused_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(catalogue, "MAX_LISTING_MODELS", 50)
    events = EventBus()
    async with StandInPeer("node-a", {f"m{i}": "loaded" for i in range(51)}) as stand_in, \
            running_peer(stand_in, events) as peer:
        await wait_for(lambda: "listing refused" in peer.reason)
        assert peer.reason == ("listing refused: its /models lists 51 models, more than the "
                               "50 a peer may list")
        assert not peer.up and not peer.models
        assert "listing refused, peer not used" in caplog.text
        # Too many bytes: refused before it is all read, whatever it holds.
        stand_in.models = {"m": "loaded"}
        stand_in.listing = b'{"data": [' + b" " * (catalogue.MAX_LISTING_BYTES + 1) + b"]}"
        await wait_for(lambda: "MiB" in peer.reason)
        assert peer.reason == ("listing refused: its /models answer is over 16 MiB, the most "
                               "a peer's listing may hold")
        # Back within the caps: used.
        stand_in.listing = None
        await wait_for(lambda: peer.up)
        assert list(peer.models) == ["m"]


async def test_an_endless_event_line_gives_up_the_stream_not_the_peer() -> None:
    events = EventBus()
    async with StandInPeer("node-a", {"m": "loaded"}) as stand_in, \
            running_peer(stand_in, events, interval=0.2) as peer:
        await wait_for(lambda: peer.up and stand_in.subscriptions)
        stand_in.endless_line = 100 << 20
        await stand_in.events.put({"model": "m", "event": "x"})  # then the endless line
        await wait_for(lambda: peer.events_problem)
        assert peer.events_problem == ("its /models/sse was given up: a line longer than "
                                       f"{MAX_EVENT_BYTES} bytes")
        assert peer.up and peer.status_of("m") == "loaded"  # the peer itself is fine
        assert stand_in.sent < 8 << 20  # read up to the cap, then the connection closed
        await wait_for(lambda: stand_in.subscriptions >= 2)  # followed again, given up again
        # A peer that sends good events again: its stream works, the problem is gone.
        stand_in.endless_line = 0
        subscribed = stand_in.subscriptions
        await wait_for(lambda: stand_in.subscriptions > subscribed)  # its "hello" event
        await wait_for(lambda: not peer.events_problem)
        await stand_in.events.put({"model": "m", "event": "status_change",
                                   "data": {"status": "unloaded"}})
        await wait_for(lambda: peer.status_of("m") == "unloaded")
