"""What a peer sends, read as input (``router/peers/hop.py``'s ``read_json``,
``router/peers/catalogue.py``'s ``bounded``, ``router/peers/peerstate.py``'s ``Listing.facts``):
a number that is not finite is unknown wherever a peer's JSON is read (its listing, its events,
its ``/props``), so that the answers made of them stay JSON; each entry of a listing is read
once, within the bounds of an entry, and a request never walks it again."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from standin_peer import StandInPeer, collect, running_peer, wait_for

from router.events import EventBus
from router.observe.metrics import exposition_of, merge_child_metrics
from router.peers import catalogue, peerstate
from router.peers.catalogue import (
    MAX_ENTRY_CHARS,
    MAX_ENTRY_DEPTH,
    MAX_ENTRY_ITEMS,
    MAX_ENTRY_VALUES,
    bounded,
    merge_entries,
)
from router.peers.hop import read_json
from router.peers.peerstate import Heard, Listing, NodeFacts, facts_of
from router.peers.placement import candidates


def strict(value: Any) -> str:
    """``value`` as this router's answers write it (Starlette's ``JSONResponse``): a
    number that is not finite raises ValueError."""
    return json.dumps(value, allow_nan=False)


# --------------------------------------------------------------------- non-finite numbers

@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999",
                                  "1E400"])
def test_a_number_that_is_not_finite_is_read_as_unknown(text: str) -> None:
    assert read_json(f'{{"a": {text}, "b": [{text}, 1.5, 2]}}') == {"a": None,
                                                                   "b": [None, 1.5, 2]}


def test_a_peers_json_nested_too_deep_is_malformed_not_a_crash() -> None:
    with pytest.raises(ValueError, match="nested too deep"):
        read_json(b"[" * 200_000 + b"]" * 200_000)


@pytest.mark.parametrize("status", [
    {"load_s": 10**400}, {"load_s": -(10**400)},
    {"replicas": [{"pace": {"prompt_ms_per_kchar": 10**400}}]},
])
def test_a_number_past_any_float_is_an_unknown_fact(status: Any) -> None:
    assert facts_of({"status": status}) == NodeFacts()


NON_FINITE_LISTING = (
    b'{"object": "list", "data": ['
    b'{"id": "m", "object": "model", "status": {"value": "loaded", "load_s": NaN,'
    b' "replicas": [{"pace": {"prompt_ms_per_kchar": Infinity}}, {"in_flight": -Infinity}]},'
    b' "created": 1e999},'
    b'{"id": "n", "object": "model", "status": {"value": NaN, "states": {"bytes": NaN}}}]}')


async def test_non_finite_numbers_in_a_listing_and_its_events_are_unknown() -> None:
    """One ``NaN`` in a peer's listing made the gateway's ``/models`` a 500 for every client
    (its JSON encoder refuses it); its events would carry it to every subscriber."""
    events = EventBus()
    relayed: list[dict[str, Any]] = []
    async with StandInPeer("node-a", {}) as stand_in:
        stand_in.listing = NON_FINITE_LISTING
        async with running_peer(stand_in, events) as peer:
            await wait_for(lambda: peer.up)
            listener = asyncio.create_task(collect(events, relayed))
            try:
                assert peer.models["m"]["status"]["load_s"] is None
                assert peer.models["m"]["created"] is None
                assert peer.status_of("n") == "unloaded"  # a NaN status: unknown
                assert peer.facts["m"] == NodeFacts()  # nothing it said is a fact
                assert peer.facts["n"] == NodeFacts(keeps=True)
                listing = [merge_entries(m, [peer], None, "gw") for m in peer.models]
                strict(listing)  # the answers made of it are JSON
                await stand_in.events.put({"model": "m", "event": "status_change",
                                           "data": {"status": "loaded",
                                                    "progress": float("nan"),
                                                    "eta": float("inf")}})
                await wait_for(lambda: any(e.get("event") == "status_change"
                                           for e in relayed))
            finally:
                listener.cancel()
    (event,) = [e for e in relayed if e.get("event") == "status_change"]
    assert event["data"] == {"status": "loaded", "progress": None, "eta": None}
    strict(event)


def test_a_peers_metrics_keep_nan_as_the_text_format_writes_it() -> None:
    """Metrics are relayed as text, not JSON: ``NaN`` and ``+Inf`` are values of the
    Prometheus text format (a summary with no observations, a bucket's bound), kept as such
    and never an error."""
    families = merge_child_metrics([({"node": "a"}, "# TYPE g gauge\ng NaN\nh +Inf\n"
                                                   "i 1e999\n")])
    text = exposition_of(families.values()).decode()
    assert 'g{node="a"} NaN' in text and 'i{node="a"} +Inf' in text


# --------------------------------------------------------------------- entries read once

def test_an_entry_is_copied_within_its_bounds() -> None:
    entry = {"id": "m", "status": {"value": "loaded", "replicas": [{"pace": None}] * 1000},
             "aliases": ["a"] * 300, "tags": []}
    copy = bounded(entry)
    assert copy is not None and copy is not entry
    assert len(copy["status"]["replicas"]) == MAX_ENTRY_ITEMS == len(copy["aliases"])
    assert copy["status"]["replicas"][0] == {"pace": None}
    assert copy["status"]["replicas"][0] is not entry["status"]["replicas"][0]  # a copy
    small = {"id": "m", "status": {"value": "loaded", "args": ["-m", "x.gguf"]}}
    assert bounded(small) == small


@pytest.mark.parametrize("entry", [
    {"id": "m", "status": {"value": "loaded"},
     "x": {f"k{i}": i for i in range(MAX_ENTRY_VALUES)}},
    {"id": "m", "status": {"value": "loaded"}, "x": "y" * (MAX_ENTRY_CHARS + 1)},
    {"id": "m", "status": {"value": "loaded"}, "x": [[[0] * 200] * 200]},
    {"id": "m", "status": {"value": "loaded"},
     "x": json.loads("[" * (MAX_ENTRY_DEPTH + 1) + "]" * (MAX_ENTRY_DEPTH + 1))},
])
def test_an_entry_over_its_bounds_is_not_copied(entry: dict[str, Any]) -> None:
    started = time.perf_counter()
    assert bounded(entry) is None
    assert time.perf_counter() - started < 0.5  # the walk stops at the bound


async def test_an_entry_over_its_bounds_is_its_id_and_status(
        caplog: pytest.LogCaptureFixture) -> None:
    wide = {"id": "wide", "object": "model", "node": "far", "status": {
        "value": "loaded", "states": {}, "load_s": 1.0,
        "x": {f"k{i}": i for i in range(MAX_ENTRY_VALUES)}}}
    listing = {"object": "list", "data": [wide, {"id": "m", "status": {"value": "loaded"}}]}
    events = EventBus()
    async with StandInPeer("node-a", {}) as stand_in:
        stand_in.listing = json.dumps(listing).encode()
        async with running_peer(stand_in, events) as peer:
            await wait_for(lambda: peer.up)
            assert dict(peer.models["wide"]) == {"id": "wide", "object": "model",
                                                 "node": "far",
                                                 "status": {"value": "loaded"}}
            assert peer.facts["wide"] == NodeFacts()  # what it said of its node: unknown
            assert peer.models["m"]["status"] == {"value": "loaded"}
    assert "1 /models entries over the bounds of an entry" in caplog.text


async def test_a_huge_entry_is_read_once_and_never_walked_by_a_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """2,500,000 replica records in one entry (inside the 16 MiB cap): read once as the
    listing arrives, cut to its first ``MAX_ENTRY_ITEMS``; a request reads the facts kept."""
    replicas = b",".join([b'{"pace":{"prompt_ms_per_kchar":40}}'] * 2
                         + [b"{}"] * (2_500_000 - 2))
    raw = (b'{"object":"list","data":[{"id":"big","object":"model","status":{"value":'
           b'"unloaded","states":{},"load_s":0.5,"replicas":[' + replicas + b"]}}]}")
    assert len(raw) < catalogue.MAX_LISTING_BYTES
    events = EventBus()
    async with StandInPeer("node-a", {}) as stand_in:
        stand_in.listing = raw
        async with running_peer(stand_in, events) as peer:
            await wait_for(lambda: peer.up, 60)
            entry = peer.models["big"]
            assert len(entry["status"]["replicas"]) == MAX_ENTRY_ITEMS
            assert peer.facts["big"] == NodeFacts(True, 0.5, 40e-6)
            read: list[object] = []
            monkeypatch.setattr(peerstate, "facts_of",
                                lambda e: read.append(e) or NodeFacts())
            started = time.perf_counter()
            for _ in range(200):
                (candidate,) = candidates([peer], "big", None, "gw")
                strict(merge_entries("big", [peer], None, "gw"))
            per_request = (time.perf_counter() - started) / 200
            assert candidate.facts == NodeFacts(True, 0.5, 40e-6)
            assert read == []  # never read again
            assert per_request < 0.01, per_request  # 1.3 s when each request walked it
            # A status event changes the status, not what the listing said of the node.
            before = peer.facts
            peer.apply(Heard("big", "loaded"))
            assert peer.status_of("big") == "loaded" and peer.facts == before
            assert read == []


def test_a_listing_made_without_facts_reads_them_once() -> None:
    listing = Listing({"m": {"status": {"states": {}, "load_s": 2}}}, {"m": "m"})
    assert listing.facts == {"m": NodeFacts(True, 2.0, None)}
    again = Listing(listing.models, listing.ids, {"m": NodeFacts()})
    assert again.facts["m"] == NodeFacts()  # given: kept, not read again
