"""Peers on their own (``router/peers.py``, ``router/nodes.py``): settings, the order nodes are
tried in, the merged listing, where load/unload go, and one ``Peer`` against a stand-in peer
router: models imported with the node's name, events relayed with ``node``, down after missed
checks, requests in flight aborted only when the peer went silent, back when it answers.
The real thing, with real nodes, is ``test_peers_real.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.errors import BadRequest, UpstreamError
from router.events import EventBus
from router.nodes import _renamed, across_nodes, admin_targets, came_through
from router.peers import (
    Candidate,
    Peer,
    PeerError,
    Peers,
    dns_target,
    merge_entries,
    peer_url,
    rank,
    read_peer_key,
)
from router.process import free_port
from router.requests import RequestContext
from router.server import _check_peers
from router.settings import ConfigurationError, Settings

HANG_GUARD_S = 20.0


# ----------------------------------------------------------------------------- settings

def test_peer_urls_and_dns_targets() -> None:
    assert peer_url("http://10.0.0.1:8080") == "http://10.0.0.1:8080"
    assert peer_url("http://node-a/") == "http://node-a:80"
    assert peer_url("http://[fd00::1]:9000") == "http://[fd00::1]:9000"
    for bad in ("https://x:1", "x:1", "http://x:1/v1", "http://:1", "http://x:99999"):
        with pytest.raises(PeerError, match="--peer"):
            peer_url(bad)
    assert dns_target("llama-router-node.default.svc.cluster.local:8080") == (
        "llama-router-node.default.svc.cluster.local", 8080)
    for bad in ("name", "name:", ":80", "name:http", "name:0"):
        with pytest.raises(PeerError, match="NAME:PORT"):
            dns_target(bad)


def test_peer_key_file(tmp_path: Path) -> None:
    key = tmp_path / "peer-key"
    key.write_text("# the nodes' key\n\n  sk-peer  \n")
    assert read_peer_key(key) == "sk-peer"
    key.write_text("# nothing\n")
    with pytest.raises(PeerError, match="holds no key"):
        read_peer_key(key)
    with pytest.raises(PeerError, match="No such file"):
        read_peer_key(tmp_path / "missing")
    assert read_peer_key(None) is None


def test_the_peer_key_file_is_read_as_an_api_key_file(tmp_path: Path) -> None:
    """One parser: the first key of a key file (its scope is the peer's business), the
    same comments, the same refusals naming the file and line."""
    key = tmp_path / "peer-key"
    key.write_text("sk-node  role=infer  # the nodes' key\nsk-other\n")
    assert read_peer_key(key) == "sk-node"
    key.write_text("# the nodes' key\nsk-node#2026\n")
    with pytest.raises(PeerError) as caught:
        read_peer_key(key)
    assert str(caught.value).startswith(f"--peer-api-key-file {key}, line 2: '#' inside word 1")
    assert "sk-node" not in str(caught.value)
    key.write_text("sk-node colour=blue\n")
    with pytest.raises(PeerError, match="line 1: unknown field 'colour'"):
        read_peer_key(key)
    key.write_bytes(b"\xff\xfe\n")
    with pytest.raises(PeerError, match="--peer-api-key-file"):
        read_peer_key(key)


def test_bad_peer_settings_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="expected http://host:port"):
        _check_peers(Settings(peer=["10.0.0.1:8080"]))
    with pytest.raises(ConfigurationError, match="NAME:PORT"):
        _check_peers(Settings(peer_dns=["nodes"]))
    with pytest.raises(ConfigurationError, match="holds no key"):
        empty = tmp_path / "empty"
        empty.write_text("")
        _check_peers(Settings(peer=["http://a:1"], peer_api_key_file=empty))
    # Lists from the environment are comma separated, as every other list.
    assert Settings(peer="http://a:1, http://b:2").peer == ["http://a:1", "http://b:2"]


# ----------------------------------------------------------------------------- choices

def test_rank_loaded_then_least_outstanding_then_local() -> None:
    local_cold = Candidate("gw", loaded=False, outstanding=0)
    busy = Candidate("a", loaded=True, outstanding=2, peer=object())  # type: ignore[arg-type]
    idle = Candidate("b", loaded=True, outstanding=0, peer=object())  # type: ignore[arg-type]
    local_idle = Candidate("gw", loaded=True, outstanding=0)
    assert [c.node for c in rank([local_cold, busy, idle])] == ["b", "a", "gw"]
    assert rank([idle, local_idle])[0] is local_idle  # a tie: no network hop


class StubPeer:
    def __init__(self, node: str, statuses: dict[str, str], up: bool = True) -> None:
        self.node = node
        self.instance = f"id-{node}"
        self.via = self.instance
        self.up = up
        self.reason = "" if up else "ConnectError"
        self.models = {m: {"id": m, "status": {"value": s}, "node": node}
                       for m, s in statuses.items()}
        self.peer_ids = {m: m for m in statuses}
        self.outstanding: dict[str, int] = {}

    def status_of(self, model: str) -> str:
        return str(self.models[model]["status"]["value"])

    def candidate(self, model: str) -> Candidate:
        return Candidate(self.node, self.status_of(model) == "loaded",
                         self.outstanding.get(model, 0), self, model)  # type: ignore[arg-type]


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


class StubPeers:
    def __init__(self, *peers: StubPeer) -> None:
        self.peers = {p.node: p for p in peers}

    def holders(self, model: str, passed: tuple[str, ...] = ()) -> list[StubPeer]:
        return [p for p in self.peers.values() if p.up and model in p.models
                and p.via not in passed]


def test_where_load_and_unload_go() -> None:
    a = StubPeer("node-a", {"m": "loaded"})
    b = StubPeer("node-b", {"m": "unloaded"})
    holders: Any = StubPeers(a, b).holders("m")
    local: Any = type("Local", (), {"status": None, "in_flight": 0, "waiting": 0})()
    assert admin_targets(holders, "m", None, "gw", None, "load") == [b]  # not running there
    assert admin_targets(holders, "m", local, "gw", None, "load") == [None]  # this router's
    assert admin_targets(holders, "m", None, "gw", "node-a", "load") == [a]
    assert admin_targets(holders, "m", None, "gw", None, "unload") == [a]  # where it runs
    with pytest.raises(BadRequest, match="no-such-node"):
        admin_targets(holders, "m", None, "gw", "no-such-node", "load")


def test_request_renamed_for_a_prefixed_peer_and_via() -> None:
    def context(target: str, *headers: tuple[bytes, bytes]) -> RequestContext:
        path, _, query = target.partition("?")
        return RequestContext({"method": "POST", "path": path, "query_string": query.encode(),
                               "headers": list(headers)})

    chat = context("/v1/chat/completions")
    body, target = _renamed(b'{"model": "a/m", "x": 1}', {"model": "a/m", "x": 1}, chat,
                            b"/v1/chat/completions", "m")
    assert json.loads(body) == {"model": "m", "x": 1} and target == b"/v1/chat/completions"
    slots = context("/slots?mod%65l=a%2Fm&id=1")  # the decoded name is the model's
    body, target = _renamed(b"", None, slots, b"/slots?mod%65l=a%2Fm&id=1", "m")
    assert target == b"/slots?model=m&id=1"
    request = context("/", (b"x-llama-router-via", b"gw, node-a"), (b"x-llama-router-via", b"c"))
    assert request.via == ("gw", "node-a", "c")
    assert came_through(request, "node-a") and came_through(request, "c")
    assert not came_through(request, "node")


# ----------------------------------------------------------------------------- one peer

class StandInPeer:
    """A peer router on a free port: ``/health``, ``/props`` (its node name), ``/models``,
    ``/models/sse`` (events put on ``events``), and ``/stream`` (an event stream that sends
    a chunk per item put on ``chunks``). ``silent``: /health never answers."""

    def __init__(self, node: str, models: dict[str, str], instance: str = "") -> None:
        self.node = node
        self.instance = instance
        self.models = models
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()
        self.silent = False
        self.server: asyncio.Server | None = None
        self.url = ""
        self.auth: list[str | None] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError,
                                 asyncio.CancelledError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split(" ", 2)[1]
            self.auth.append(next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                                   if line.lower().startswith("authorization:")), None))
            if path == "/health" and self.silent:
                await asyncio.sleep(3600)
            if path in ("/models/sse", "/stream"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                while True:
                    if path == "/stream":
                        data = await self.chunks.get()
                    else:
                        data = b"data: " + json.dumps(await self.events.get()).encode() + \
                            b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
            answer: dict[str, Any] = {"status": "ok"}
            if path == "/props":
                answer = {"role": "router", "llama_router": {"node": self.node, **(
                    {"instance": self.instance} if self.instance else {})}}
            elif path == "/models":
                answer = {"object": "list", "data": [
                    {"id": m, "object": "model", "status": {"value": s}}
                    for m, s in self.models.items()]}
            body = json.dumps(answer).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> StandInPeer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop_listening(self) -> None:
        """Refuse new connections; those open stay (a router shutting down)."""
        assert self.server is not None
        self.server.close()

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            self.server.close_clients()  # type: ignore[attr-defined]  # 3.13


async def wait_for(predicate: Any, timeout: float = HANG_GUARD_S) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (peer state, no event to await)
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_peer(stand_in: StandInPeer, events: EventBus, **options: Any) -> Any:
    async with httpx.AsyncClient() as client:
        peer = Peer(stand_in.url, client=client, events=events, own_node="gw",
                    own_instance="gw-instance", api_key="sk-peer",
                    **{"interval": 0.05, "timeout": 2.0, "misses": 2, **options})
        peer.start()
        try:
            yield peer
        finally:
            await peer.close()


async def collect(events: EventBus, into: list[dict[str, Any]]) -> None:
    async with events.subscribe() as subscription:
        while True:
            into.append(await subscription.get())


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
    async with StandInPeer("node-a", {"m": "loaded"}) as stand_in, \
            running_peer(stand_in, events) as peer:
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


async def test_a_peer_with_this_routers_name_is_another_node() -> None:
    events = EventBus()
    async with StandInPeer("gw", {"m": "loaded"}, instance="other-instance") as stand_in, \
            httpx.AsyncClient() as client:
        peers = Peers(client=client, events=events, own_node="gw", instance="gw-instance",
                      interval=0.05, timeout=2.0)
        peers.sync("--peer", [stand_in.url])
        peer = peers.peers[stand_in.url]
        try:
            await wait_for(lambda: peer.up)
            assert not peer.is_self and peer.name == "gw"
            assert peer.node == f"gw@127.0.0.1:{peer.port}"  # a distinct label
            assert [p.node for p in peers.holders("m")] == [peer.node]
        finally:
            await peers.close()


async def test_peer_set_follows_its_sources() -> None:
    async with httpx.AsyncClient() as client:
        peers = Peers(client=client, events=EventBus(), own_node="gw", interval=0.05,
                      timeout=0.2)
        nowhere = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
        peers.sync("dns", nowhere)
        peers.sync("--peer", nowhere[:1])
        assert set(peers.peers) == set(nowhere)
        peers.sync("dns", [])  # the static source still names the first
        assert list(peers.peers) == nowhere[:1]
        await asyncio.sleep(0.2)  # unreachable: probed, never up, nothing hangs
        assert not peers.holders("m")
        assert peers.describe()[0]["up"] is False
        await asyncio.wait_for(peers.close(), HANG_GUARD_S)
        assert not peers.peers


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


def test_a_conversation_goes_back_to_the_node_that_has_its_prefix() -> None:
    from router.affinity import PrefixTable, chat_keys
    from router.peers import NODE_SLOTS, by_prefix

    first_turn = [{"role": "system", "content": "long"}, {"role": "user", "content": "q1"}]
    follow_up = chat_keys([*first_turn, {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "q2"}])
    b_table = PrefixTable()
    b_table.record(chat_keys(first_turn))
    tables = {"b": b_table}
    a = Candidate("a", loaded=True, outstanding=0, peer=object())  # type: ignore[arg-type]
    b = Candidate("b", loaded=True, outstanding=2, peer=object())  # type: ignore[arg-type]
    cold = Candidate("gw", loaded=False, outstanding=0)
    order = rank([cold, a, b])
    assert [c.node for c in order] == ["a", "b", "gw"]
    chosen, decision = by_prefix(order, tables, follow_up)
    assert [c.node for c in chosen] == ["b", "a", "gw"] and decision == "prefix_hit"
    # The holder saturated while another node has room: the other node.
    busy = Candidate("b", loaded=True, outstanding=NODE_SLOTS, peer=b.peer)
    chosen, decision = by_prefix(rank([a, busy]), tables, follow_up)
    assert chosen[0].node == "a" and decision == "override"
    # A new conversation: the least busy; no keys, or one loaded node: the order as it was.
    chosen, decision = by_prefix(order, tables, chat_keys([{"role": "user", "content": "x"}]))
    assert chosen[0].node == "a" and decision == "miss"
    assert by_prefix(order, tables, ()) == (order, None)
    assert by_prefix([a, cold], tables, follow_up) == ([a, cold], None)
