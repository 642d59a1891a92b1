"""The set of peers (``router/peers/registry.py``): settings, distinct labels for nodes that share a
name, and the peers following their sources. The real thing, with real nodes, is
``test_peers_real.py``; each concept's own tests are ``test_peerhealth.py``,
``test_catalogue.py``, ``test_placement.py`` and ``test_peer_hop.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from standin_peer import HANG_GUARD_S, StandInPeer, wait_for

from router.children.process import free_port
from router.config.settings import ConfigurationError, Settings
from router.events import EventBus
from router.peers.registry import PeerError, Peers, dns_target, peer_url, read_peer_key
from router.server import _check_peers


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
