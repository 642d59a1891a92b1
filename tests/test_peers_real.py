"""Several machines behind one endpoint, on one machine: two "nodes" (llama-routers with real
llama-server children, on the loopback addresses 127.0.0.2 and 127.0.0.3) and a gateway
router on 127.0.0.1 that fronts them with ``--peer``; and discovery with ``--peer-dns``
against a DNS server the test runs.

Through the gateway: both nodes' models listed with their node, chat and streaming to each,
load/unload forwarded, the nodes' events relayed, metrics with node labels, a model on both
nodes balanced across them; a node killed mid-stream ends the stream with an error event, its
models become unavailable and requests for a model it shared go to the other node; restarted,
it is back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import (
    RouterProcess,
    SSEClient,
    llama_server_process,
    start_router,
    wait_until,
    write_presets,
)

from router.children.process import free_port

pytestmark = pytest.mark.real

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"
HANG_GUARD_S = 60.0  # generous: only catches hangs
PEER_OPTIONS = ("--liveness-interval", "0.5", "--liveness-misses", "2",
                "--liveness-timeout", "5")


def chat(client: httpx.Client, model: str, **extra: object) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **extra})


def listing(router: RouterProcess) -> dict[str, dict[str, object]]:
    return router.models()


def node_presets(tmp_path: Path, tiny_models: dict[str, Path], own: str) -> Path:
    return write_presets(tmp_path / f"{own}.ini", f"""
[*]
ctx-size = 512

[{own}]
model = {tiny_models[own]}

[shared]
model = {tiny_models["long"]}
parallel = 2
context-shift = true
""")


@contextlib.contextmanager
def node(tmp_path: Path, tiny_models: dict[str, Path], host: str, name: str, own: str,
         port: int | None = None) -> Iterator[RouterProcess]:
    with start_router(tmp_path, "--presets", str(node_presets(tmp_path, tiny_models, own)),
                      "--node-name", name, host=host, port=port) as router:
        yield router


@pytest.fixture
def cluster(tmp_path: Path, tiny_models: dict[str, Path]
            ) -> Iterator[tuple[RouterProcess, RouterProcess, RouterProcess]]:
    with node(tmp_path, tiny_models, NODE_A, "node-a", "alpha") as a, \
            node(tmp_path, tiny_models, NODE_B, "node-b", "gamma") as b, \
            start_router(tmp_path, "--peer", a.url, "--peer", b.url, "--node-name", "gw",
                         *PEER_OPTIONS) as gateway:
        assert wait_until(lambda: {"alpha", "gamma", "shared"} <= set(listing(gateway)),
                          HANG_GUARD_S), gateway.log()
        yield a, b, gateway


def status(router: RouterProcess, model: str) -> object:
    entry = listing(router).get(model) or {}
    return (entry.get("status") or {}).get("value")  # type: ignore[union-attr]


def test_models_of_both_nodes_served_through_the_gateway(
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    a, b, gateway = cluster
    models = listing(gateway)
    assert models["alpha"]["node"] == "node-a"
    assert models["gamma"]["node"] == "node-b"
    assert [n["node"] for n in models["shared"]["nodes"]] == ["node-a", "node-b"]  # type: ignore[index]
    with gateway.client() as client:
        answer = chat(client, "alpha")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "alpha"
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "gamma", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
    # Each request ran on its own node, and the gateway's listing follows their events.
    assert status(a, "alpha") == "loaded" and status(b, "alpha") is None
    assert status(b, "gamma") == "loaded"
    assert wait_until(lambda: status(gateway, "gamma") == "loaded", HANG_GUARD_S)
    # The gateway's /props names its peers.
    with gateway.client() as client:
        peers = client.get("/props").json()["llama_router"]["peers"]
    assert sorted((p["node"], p["up"]) for p in peers) == [("node-a", True), ("node-b", True)]


def test_load_unload_forwarded_and_events_relayed(
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    a, b, gateway = cluster
    events = SSEClient(gateway.url)
    events.start()
    try:
        assert events.connected.wait(HANG_GUARD_S)
        # The snapshot on subscribing: every node's models, with their node.
        assert wait_until(lambda: {(e["model"], e.get("node")) for e in events.events
                                   if e["event"] == "model_status"} == {
            ("alpha", "node-a"), ("shared", "node-a"), ("gamma", "node-b"),
            ("shared", "node-b")}, HANG_GUARD_S), events.events
        with gateway.client() as client:
            loaded = client.post("/models/load", json={"model": "gamma"})
            assert loaded.status_code == 200, loaded.text
            assert wait_until(lambda: status(b, "gamma") == "loaded", HANG_GUARD_S)

            def relayed(model: str, value: str, node: str) -> bool:
                return any(e.get("model") == model and e.get("node") == node
                           and (e.get("data") or {}).get("status") == value
                           for e in events.events)

            assert wait_until(lambda: relayed("gamma", "loaded", "node-b"), HANG_GUARD_S), \
                events.events
            # A node named in the body: the shared model loads there only.
            assert client.post("/models/load",
                               json={"model": "shared", "node": "node-a"}).status_code == 200
            assert wait_until(lambda: status(a, "shared") == "loaded", HANG_GUARD_S)
            assert status(b, "shared") == "unloaded"
            # Loaded on node-b too, then unloaded there: node-a still serves it, and the
            # event says so (the model's status across nodes; node-b's own beside it).
            assert client.post("/models/load",
                               json={"model": "shared", "node": "node-b"}).status_code == 200
            assert wait_until(lambda: relayed("shared", "loaded", "node-b"), HANG_GUARD_S)
            assert client.post("/models/unload",
                               json={"model": "shared", "node": "node-b"}).status_code == 200
            assert wait_until(lambda: any(
                e.get("node") == "node-b" and e["model"] == "shared"
                and (e.get("data") or {}).get("node_status") == "unloaded"
                and e["data"]["status"] == "loaded" for e in events.events), HANG_GUARD_S), \
                events.events
            assert status(a, "shared") == "loaded" and status(b, "shared") == "unloaded"
            unloaded = client.post("/models/unload", json={"model": "gamma"})
            assert unloaded.status_code == 200, unloaded.text
            assert wait_until(lambda: status(b, "gamma") == "unloaded", HANG_GUARD_S)
            assert wait_until(lambda: relayed("gamma", "unloaded", "node-b"), HANG_GUARD_S)
            unknown = client.post("/models/load", json={"model": "shared", "node": "nope"})
            assert unknown.status_code == 400
            assert "nope" in unknown.json()["error"]["message"]
    finally:
        events.stop.set()


def test_resumable_streams_through_the_gateway(
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    """llama.cpp's web UI resumes a stream by its conversation id: through the gateway, the
    node that has it answers."""
    _, _, gateway = cluster
    request = {"stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with gateway.client() as client:
        originals = {}
        for conv_id, model in (("conv-a", "alpha"), ("conv-b", "gamma")):
            with client.stream("POST", "/v1/chat/completions",
                               headers={"X-Conversation-Id": conv_id},
                               json={"model": model, **request}) as streamed:
                originals[conv_id] = "".join(streamed.iter_text())
            assert "[DONE]" in originals[conv_id]
        sessions = client.post("/v1/streams/lookup",
                               json={"conversation_ids": ["conv-a", "conv-b", "nope"]}).json()
        assert sorted(s["conversation_id"] for s in sessions) == ["conv-a", "conv-b"]
        for conv_id, original in originals.items():
            replay = client.get("/v1/stream", params={"conv_id": conv_id, "from": "0"})
            assert replay.status_code == 200, replay.text
            assert replay.text == original  # the bytes the node's child kept
        assert client.delete("/v1/stream", params={"conv_id": "conv-a"}).status_code == 204
        assert client.get("/v1/stream", params={"conv_id": "conv-a"}).status_code == 404
        assert client.get("/v1/stream", params={"conv_id": "conv-b"}).status_code == 200


def test_metrics_carry_each_node(
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, gateway = cluster
    with gateway.client() as client:
        assert chat(client, "alpha").status_code == 200
        assert chat(client, "gamma").status_code == 200
        text = client.get("/metrics").text
    nodes: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            nodes.setdefault(sample.labels.get("node", ""), set()).add(sample.name)
    assert set(nodes) == {"gw", "node-a", "node-b"}
    # The child's own metrics, through its node; the gateway's request counts.
    assert "llamacpp:prompt_tokens_total" in nodes["node-a"]
    assert "llamarouter_requests_total" in nodes["gw"]
    assert "llamarouter_requests_total" in nodes["node-b"]


def first_token(stream: Iterator[str]) -> None:
    for line in stream:
        if line.startswith("data: ") and '"content"' in line:
            return


def in_flight(router: RouterProcess, model: str) -> object:
    return (listing(router)[model]["status"] or {}).get("in_flight")  # type: ignore[union-attr]


def test_shared_model_balanced_then_failover_and_back(
        tmp_path: Path, tiny_models: dict[str, Path],
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    a, b, gateway = cluster
    with gateway.client() as client:
        for name in ("node-a", "node-b"):
            assert client.post("/models/load", json={"model": "shared", "node": name,
                                                     }).status_code == 200
    assert wait_until(lambda: status(a, "shared") == status(b, "shared") == "loaded",
                      HANG_GUARD_S)
    assert wait_until(lambda: all(n["status"] == "loaded" for n in
                                  listing(gateway)["shared"]["nodes"]),  # type: ignore[attr-defined]
                      HANG_GUARD_S)

    def long_stream(text: str) -> dict[str, object]:
        return {"model": "shared", "stream": True, "max_tokens": 1_000_000, "ignore_eos": True,
                "messages": [{"role": "user", "content": text}]}

    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as one, \
            httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as two:
        with one.stream("POST", "/v1/chat/completions", json=long_stream("go on")) as first:
            running = first.iter_lines()  # kept: a dropped iterator closes the stream
            first_token(running)
            busy = [in_flight(n, "shared") for n in (a, b)]
            assert sorted(busy) == [0, 1]  # type: ignore[type-var]
            # Another conversation (the same prompt would go where its prefix is cached).
            with two.stream("POST", "/v1/chat/completions",
                            json=long_stream("tell me more")) as second:
                lines = second.iter_lines()
                first_token(lines)
                # One stream on each node: the second went where nothing was outstanding.
                assert [in_flight(n, "shared") for n in (a, b)] == [1, 1]
                # That node dies mid-stream: its stream ends with an error event, at once.
                victim, host, name, own = (b, NODE_B, "node-b", "gamma") if busy[0] \
                    else (a, NODE_A, "node-a", "alpha")
                victim.proc.send_signal(signal.SIGKILL)
                tail = [line for line in lines if line.startswith("data: ")]
                assert tail and '"error"' in tail[-1], tail[-3:]
        victim.proc.wait(HANG_GUARD_S)
        # Its models become unavailable within a few seconds; nothing hangs.
        assert wait_until(lambda: listing(gateway)[own]["status"].get("unavailable"),  # type: ignore[attr-defined]
                          HANG_GUARD_S), gateway.log()
        refused = chat(one, own)
        assert refused.status_code == 503, refused.text
        assert name in refused.json()["error"]["message"]
        # The model both nodes had is served by the other one.
        for _ in range(3):
            answer = chat(one, "shared")
            assert answer.status_code == 200, answer.text
    # The node restarted on its address: back in the gateway without a restart.
    with node(tmp_path, tiny_models, host, name, own, port=victim.port):
        assert wait_until(lambda: not listing(gateway)[own]["status"].get("unavailable"),  # type: ignore[attr-defined]
                          HANG_GUARD_S), gateway.log()
        with gateway.client() as client:
            assert chat(client, own).status_code == 200


def requests_served(router: RouterProcess, model: str) -> float:
    """Chat completions ``router`` answered for ``model`` (its own metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with router.client() as client:
        text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "llamarouter_requests_total" and s.labels.get("model") == model
               and s.labels.get("endpoint") == "/v1/chat/completions")


def test_a_conversation_follows_its_prompt_cache_across_nodes(
        cluster: tuple[RouterProcess, RouterProcess, RouterProcess]) -> None:
    """A follow-up turn goes to the node that served the conversation's previous turn, even
    when the other node is less busy: its prompt is cached there."""
    a, b, gateway = cluster
    with gateway.client() as client:
        for name in ("node-a", "node-b"):
            assert client.post("/models/load", json={"model": "shared",
                                                     "node": name}).status_code == 200
    assert wait_until(lambda: all(n["status"] == "loaded" for n in
                                  listing(gateway)["shared"]["nodes"]),  # type: ignore[attr-defined]
                      HANG_GUARD_S)
    turn = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "First question?"}]
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as client:
        first = client.post("/v1/chat/completions",
                            json={"model": "shared", "messages": turn, "max_tokens": 4})
        assert first.status_code == 200, first.text
        served = [requests_served(n, "shared") for n in (a, b)]
        assert sorted(served) == [0, 1]
        home, other = (a, b) if served[0] == 1 else (b, a)
        # Keep the conversation's node busier than the other one.
        busy = {"model": "shared", "stream": True, "max_tokens": 1_000_000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "go on"}]}
        with httpx.Client(base_url=home.url, timeout=HANG_GUARD_S) as direct, \
                direct.stream("POST", "/v1/chat/completions", json=busy) as running:
            lines = running.iter_lines()
            first_token(lines)
            follow_up = [*turn, first.json()["choices"][0]["message"],
                         {"role": "user", "content": "And the second?"}]
            second = client.post("/v1/chat/completions", json={
                "model": "shared", "messages": follow_up, "max_tokens": 4})
            assert second.status_code == 200, second.text
            assert second.json()["timings"]["cache_n"] > 0  # its prefix was cached there
        # Both turns and the stream; the stream counts once its end (the client closed it)
        # reaches the node's router.
        assert wait_until(lambda: requests_served(home, "shared") == 3, HANG_GUARD_S), \
            requests_served(home, "shared")
        assert requests_served(other, "shared") == 0
        metrics = client.get("/metrics").text
    assert any(line.startswith("llamarouter_replica_routing_total{")
               and 'decision="prefix_hit"' in line and 'model="shared"' in line
               and 'node="gw"' in line for line in metrics.splitlines()), metrics


def test_a_frozen_node_never_hangs_a_request(tmp_path: Path,
                                             tiny_models: dict[str, Path]) -> None:
    """A node that stops answering altogether (SIGSTOP: its connections stay open, nothing
    comes) is marked down after its missed checks, and the stream running on it ends with an
    error event; woken up, it is back."""
    with node(tmp_path, tiny_models, NODE_A, "node-a", "alpha") as a, \
            start_router(tmp_path, "--peer", a.url, "--liveness-interval", "0.5",
                         "--liveness-timeout", "1", "--liveness-misses", "2") as gateway:
        assert wait_until(lambda: "shared" in listing(gateway), HANG_GUARD_S), gateway.log()
        request = {"model": "shared", "stream": True, "max_tokens": 1_000_000,
                   "ignore_eos": True, "messages": [{"role": "user", "content": "go on"}]}
        with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as client, \
                client.stream("POST", "/v1/chat/completions", json=request) as stream:
            lines = stream.iter_lines()
            first_token(lines)
            a.proc.send_signal(signal.SIGSTOP)
            try:
                tail = [line for line in lines if line.startswith("data: ")]
                assert tail and '"error"' in tail[-1], tail[-3:]
                assert listing(gateway)["shared"]["status"].get("unavailable")  # type: ignore[attr-defined]
            finally:
                a.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: not listing(gateway)["shared"]["status"].get("unavailable"),  # type: ignore[attr-defined]
                          HANG_GUARD_S), gateway.log()
        with gateway.client() as client:
            assert chat(client, "alpha").status_code == 200


def test_prefixed_ids_and_the_peer_key(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """``--peer-prefix``: a node's models as NODE/MODEL. The gateway checks its clients' keys
    and sends the nodes the peer key; a client's key is never what reaches a node."""
    node_keys = tmp_path / "node-keys"
    node_keys.write_text("sk-node\n")
    with start_router(tmp_path, "--presets", str(node_presets(tmp_path, tiny_models, "alpha")),
                      "--node-name", "node-a", "--api-key-file", str(node_keys),
                      host=NODE_A) as a, \
            start_router(tmp_path, "--peer", a.url, "--peer-api-key-file", str(node_keys),
                         "--peer-prefix", "--api-key", "sk-client", *PEER_OPTIONS) as gateway:
        client_auth = {"Authorization": "Bearer sk-client"}
        with gateway.client(headers=client_auth) as client:
            assert wait_until(lambda: "node-a/alpha" in {
                m["id"] for m in client.get("/models").json()["data"]}, HANG_GUARD_S), \
                gateway.log()
            answer = chat(client, "node-a/alpha")
            assert answer.status_code == 200, answer.text
            assert client.post("/models/unload",
                               json={"model": "node-a/alpha"}).status_code == 200
        with gateway.client() as anonymous:
            assert chat(anonymous, "node-a/alpha").status_code == 401
        with a.client(headers=client_auth) as direct:
            assert chat(direct, "alpha").status_code == 401  # the client's key: not the node's
        with a.client(headers={"Authorization": "Bearer sk-node"}) as node_client:
            def alpha_status() -> object:
                entries = node_client.get("/models").json()["data"]
                return next(m for m in entries if m["id"] == "alpha")["status"]["value"]

            assert wait_until(lambda: alpha_status() == "unloaded", HANG_GUARD_S)


def test_a_llama_cpp_router_as_a_peer(tmp_path: Path, tiny_models: dict[str, Path],
                                      llama_server: Path) -> None:
    """llama.cpp's own router speaks the same /models API: its models are served too."""
    port = free_port()
    presets = write_presets(tmp_path / "cpp.ini", f"""
[*]
ctx-size = 512

[beta]
model = {tiny_models["beta"]}
""")
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    url = f"http://127.0.0.1:{port}"
    with llama_server_process([str(llama_server), "--host", "127.0.0.1", "--port", str(port),
                               "--models-preset", str(presets), "--models-max", "1"], port,
                              tmp_path / "cpp-router.log", env={"LLAMA_CACHE": str(cache)}), \
            start_router(tmp_path, "--peer", url, *PEER_OPTIONS) as gateway:
        assert wait_until(lambda: "beta" in listing(gateway), HANG_GUARD_S), gateway.log()
        assert listing(gateway)["beta"]["node"] == f"127.0.0.1:{port}"
        with gateway.client() as client:
            answer = chat(client, "beta")
            assert answer.status_code == 200, answer.text
        assert wait_until(lambda: status(gateway, "beta") == "loaded", HANG_GUARD_S)


# ------------------------------------------------------------------------------ DNS discovery

class DnsServer(threading.Thread):
    """A DNS server on ``address``:53 (UDP) answering A queries for ``name`` with
    ``self.addresses`` (changed by the test); anything else: no records."""

    def __init__(self, address: str, name: str) -> None:
        super().__init__(daemon=True)
        self.name = name.rstrip(".").lower()
        self.addresses: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                query, client = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            with contextlib.suppress(Exception):
                self.sock.sendto(self.answer(query), client)

    def answer(self, query: bytes) -> bytes:
        ident, _flags, _count = struct.unpack("!HHH", query[:6])
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1:offset + 1 + length].decode().lower())
            offset += 1 + length
        qtype, _ = struct.unpack("!HH", query[offset + 1:offset + 5])
        question = query[12:offset + 5]
        found = ".".join(labels) == self.name
        records = list(self.addresses) if found and qtype == 1 else []
        rcode = 0 if found else 3  # NXDOMAIN for other names
        header = struct.pack("!HHHHHH", ident, 0x8180 | rcode, 1, len(records), 0, 0)
        answers = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4)
                           + socket.inet_aton(ip) for ip in records)
        return header + question + answers

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)
        self.sock.close()


def can_unshare_mounts() -> str | None:
    """Why the DNS test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: binds a resolv.conf of its own over /etc/resolv.conf"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}"
    return None


def test_peers_found_by_dns(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """``--peer-dns`` through the system resolver (getaddrinfo), pointed by a private
    resolv.conf at the test's DNS server: nodes appear and disappear as the name's records
    change, without a restart."""
    reason = can_unshare_mounts()
    if reason:
        pytest.skip(reason)
    name = "llama-router-node.test.internal"
    dns = DnsServer("127.0.0.53" if not _taken("127.0.0.53") else "127.0.0.54", name)
    dns.start()
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {dns.sock.getsockname()[0]}\noptions timeout:1 attempts:1\n")
    port = free_port(NODE_A)
    try:
        with node(tmp_path, tiny_models, NODE_A, "node-a", "alpha", port=port), \
                node(tmp_path, tiny_models, NODE_B, "node-b", "gamma", port=port):
            dns.addresses = [NODE_A]
            wrapper = tmp_path / "in-namespace"
            wrapper.write_text("#!/bin/sh\nmount --bind \"$RESOLV\" /etc/resolv.conf && "
                               f"exec '{sys.executable}' \"$@\"\n")
            wrapper.chmod(0o755)
            with start_router(tmp_path, "--peer-dns", f"{name}:{port}",
                              "--peer-dns-interval", "0.3", "--node-name", "gw",
                              *PEER_OPTIONS, env={"RESOLV": str(resolv)},
                              launcher=["unshare", "--mount", str(wrapper)]) as gateway:
                assert wait_until(lambda: "alpha" in listing(gateway), HANG_GUARD_S), \
                    gateway.log()
                assert "gamma" not in listing(gateway)
                dns.addresses = [NODE_A, NODE_B]  # a node joins
                assert wait_until(lambda: "gamma" in listing(gateway), HANG_GUARD_S), \
                    gateway.log()
                with gateway.client() as client:
                    assert chat(client, "gamma").status_code == 200
                dns.addresses = [NODE_B]  # a node leaves
                assert wait_until(lambda: "alpha" not in listing(gateway), HANG_GUARD_S)
                assert "gamma" in listing(gateway)
                with gateway.client() as client:
                    props = client.get("/props").json()["llama_router"]["peers"]
                assert [p["node"] for p in props] == ["node-b"]
    finally:
        dns.stop()


def _taken(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 53))
        except OSError:
            return True
    return False

