"""Routers that front each other, against the real llama-server: two routers on one machine,
each started with ``--peer`` at the other and the same (default) node name, list each other's
models out of the box, serve and load and unload them, and never relay a request round the
loop. Each kind of call that crosses from one to the other (the listing, proxied chat, load
and unload, metrics scrapes, ``/models/sse`` events, resumable stream lookup, replay and
stop) is made through either router a few times: its answer is checked, and the connections
between the two routers are counted before and after (they stay bounded: a bounce used to
open thousands in seconds). An admin call to a frozen (SIGSTOPped) peer is answered within a
deadline; a client that sets ``x-llama-router-via`` itself gets a clear refusal. Figures:
build/reliability/peers_loop_calls.json, frozen_peer_admin.json."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support import RouterProcess, SSEClient, start_router, wait_until, write_presets

from router.children.process import free_port

pytestmark = pytest.mark.real

FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
ANSWER_DEADLINE_S = 20.0  # generous: liveness checks below find a frozen peer in ~2 s
LIVENESS = ("--liveness-interval", "0.5", "--liveness-timeout", "1", "--liveness-misses", "2")


def record(name: str, figures: dict[str, object]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")


@contextlib.contextmanager
def two_routers(tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path],
                liveness: tuple[str, ...] = LIVENESS
                ) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    """Router A (model alpha) and router B (model beta) on 127.0.0.1, each a peer of the
    other, both with the default node name (this machine's host name)."""
    port_a, port_b = free_port(), free_port()
    while port_b == port_a:
        port_b = free_port()
    presets = {}
    for name in ("alpha", "beta"):
        presets[name] = write_presets(tmp_path / f"{name}.ini", "version = 1\n[*]\n"
                                      f"ctx-size = 1024\n[{name}]\nmodel = {tiny_models[name]}\n")
    common = ("--llama-server", str(llama_server), *liveness)
    with start_router(tmp_path, "--presets", str(presets["alpha"]), "--peer",
                      f"http://127.0.0.1:{port_b}", *common, port=port_a) as a, \
            start_router(tmp_path, "--presets", str(presets["beta"]), "--peer",
                         f"http://127.0.0.1:{port_a}", *common, port=port_b) as b:
        yield a, b


def listing(router: RouterProcess) -> dict[str, dict[str, object]]:
    with router.client() as client:
        return {m["id"]: m for m in client.get("/models").json()["data"]}


def status_on(router: RouterProcess, model: str) -> object:
    status = listing(router)[model]["status"]
    assert isinstance(status, dict)
    return status["value"]


def wait_status(router: RouterProcess, model: str, value: str) -> None:
    assert wait_until(lambda: status_on(router, model) == value, 30), listing(router)


def unload_all(a: RouterProcess, b: RouterProcess) -> None:
    """Each router's own model unloaded (the module's tests share the pair)."""
    for router, own in ((a, "alpha"), (b, "beta")):
        with router.client() as client:
            assert client.post("/models/unload", json={"model": own}).status_code in (200, 400)
        wait_status(router, own, "unloaded")


def open_between(a: RouterProcess, b: RouterProcess) -> int:
    """The TCP connections open from either router to the other's port (the routers' own
    sockets: the pools of the hop, event followers, health probes)."""
    found = 0
    for router, other in ((a, b), (b, a)):
        with contextlib.suppress(psutil.NoSuchProcess):
            found += sum(1 for conn in psutil.Process(router.proc.pid).net_connections("tcp")
                         if conn.raddr and conn.raddr.port == other.port)
    return found


def closed_lately(a: RouterProcess, b: RouterProcess) -> int:
    """Sockets in TIME_WAIT to or from either router's port: connections closed within the
    last minute (the test's own clients and the health probes included)."""
    ports = {a.port, b.port}
    return sum(1 for conn in psutil.net_connections("tcp")
               if conn.status == psutil.CONN_TIME_WAIT and conn.laddr and conn.raddr
               and (conn.laddr.port in ports or conn.raddr.port in ports))


def settled_count(a: RouterProcess, b: RouterProcess) -> int:
    """The most connections open between the routers over a second of watching: anything
    still bouncing between them would show here (thousands within seconds)."""
    most, deadline = 0, time.monotonic() + 1.0
    while time.monotonic() < deadline:
        most = max(most, open_between(a, b))
        time.sleep(0.1)
    return most


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, llama_server: Path,
         tiny_models: dict[str, Path]) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    """One pair of routers that front each other for the module's tests (the machine is
    small), each listing the other's model."""
    with two_routers(tmp_path_factory.mktemp("pair"), llama_server, tiny_models,
                     liveness=("--liveness-interval", "1")) as (a, b):
        assert wait_until(lambda: "beta" in listing(a) and "alpha" in listing(b), 30), \
            (listing(a), listing(b))
        yield a, b


ROUNDS = 5  # each kind of call, this many times through each router
OPEN_BOUND = 24  # the pools hold what they need; a bounce opened thousands in seconds
CLOSED_BOUND = 400  # TIME_WAIT growth over a kind's rounds (clients and probes included)
FIGURES_BY_KIND: dict[str, dict[str, object]] = {}


@contextlib.contextmanager
def bounded(kind: str, a: RouterProcess, b: RouterProcess) -> Iterator[None]:
    """Counts the connections between the routers before and after the block, asserts they
    stay bounded, and records the figures (build/reliability/peers_loop_calls.json)."""
    before, closed_before = open_between(a, b), closed_lately(a, b)
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    after, closed_after = settled_count(a, b), closed_lately(a, b)
    FIGURES_BY_KIND[kind] = {"rounds": ROUNDS, "open_before": before, "open_after": after,
                             "time_wait_before": closed_before,
                             "time_wait_after": closed_after, "seconds": round(took, 2)}
    record("peers_loop_calls", FIGURES_BY_KIND)
    assert after <= OPEN_BOUND, FIGURES_BY_KIND[kind]
    assert closed_after - closed_before <= CLOSED_BOUND, FIGURES_BY_KIND[kind]
    for router in (a, b):
        assert router.proc.poll() is None


def test_out_of_the_box_each_lists_the_other(
        pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    with bounded("listing", a, b):
        props_a = httpx.get(a.url + "/props").json()["llama_router"]
        props_b = httpx.get(b.url + "/props").json()["llama_router"]
        assert props_a["instance"] and props_a["instance"] != props_b["instance"]
        assert props_a["node"] == props_b["node"]  # the same host name
        for _ in range(ROUNDS):
            for router, own, other, other_props in ((a, "alpha", "beta", props_b),
                                                    (b, "beta", "alpha", props_a)):
                seen = listing(router)
                assert set(seen) == {"alpha", "beta"}  # its own model is not listed back
                assert seen[other]["node"] != seen[own]["node"]  # distinct labels
                assert seen[other]["instance"] == other_props["instance"]
                assert "nodes" not in seen[own], seen[own]  # one node: not its own echoed
        assert "has the node name" in a.log() and "has the node name" in b.log()


CHAT_CASES = (("a", "beta"), ("b", "alpha"), ("a", "alpha"), ("b", "beta"))


def test_proxied_chat(pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    routers = {"a": a, "b": b}
    with bounded("chat", a, b):
        for _ in range(ROUNDS):
            for name, model in CHAT_CASES:
                with routers[name].client() as client:
                    answer = client.post("/v1/chat/completions",
                                         json={"model": model, **CHAT})
                    assert answer.status_code == 200, (model, answer.text)
                    assert answer.json()["choices"][0]["message"]["content"]
                    with client.stream("POST", "/v1/chat/completions",
                                       json={"model": model, "stream": True, **CHAT}) as streamed:
                        assert streamed.status_code == 200
                        assert "data: [DONE]" in streamed.read().decode()


def test_load_and_unload_through_either(pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    unload_all(a, b)
    with bounded("load_unload", a, b), a.client() as client_a, b.client() as client_b:
        for _ in range(ROUNDS):
            for client, model, home in ((client_a, "beta", b), (client_b, "alpha", a)):
                # Through the router that does not have it: forwarded once, no bounce.
                answer = client.post("/models/load", json={"model": model})
                assert answer.status_code == 200 and answer.json()["success"], answer.text
                wait_status(home, model, "loaded")
                answer = client.post("/models/unload", json={"model": model})
                assert answer.status_code == 200 and answer.json()["success"], answer.text
                wait_status(home, model, "unloaded")


def test_metrics_scrape(pair: tuple[RouterProcess, RouterProcess]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    a, b = pair
    with a.client() as client:  # a child on each side: their samples come through
        for model in ("alpha", "beta"):
            assert client.post("/v1/chat/completions",
                               json={"model": model, **CHAT}).status_code == 200
    # How each router labels itself and the other (the same host name: the other's is made
    # distinct).
    labels = {router.port: (listing(router)[own]["node"], listing(router)[other]["node"])
              for router, own, other in ((a, "alpha", "beta"), (b, "beta", "alpha"))}
    with bounded("metrics", a, b):
        for _ in range(ROUNDS):
            for router in (a, b):
                with router.client() as client:
                    text = client.get("/metrics").text
                seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
                nodes = set()
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        assert key not in seen, key  # a scrape relayed back shows twice
                        seen.add(key)
                        nodes.add(sample.labels.get("node"))
                # Its own and the other's, each once: the other's scrape of it is not
                # taken back.
                own_label, other_label = labels[router.port]
                assert nodes == {own_label, other_label}, nodes
                assert any(name.startswith("llamacpp:") and dict(labels_)["node"] == other_label
                           for name, labels_ in seen), "the other's child's samples"


def test_events_relayed_once(pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    label_b = listing(a)["beta"]["node"]
    label_a = listing(b)["alpha"]["node"]
    unload_all(a, b)
    events_a, events_b = SSEClient(a.url), SSEClient(b.url)
    for events in (events_a, events_b):
        events.start()
        assert events.connected.wait(30)

    def relayed(events: SSEClient, model: str, node: object, value: str) -> int:
        return sum(1 for e in list(events.events) if e.get("model") == model
                   and e.get("node") == node and e.get("event") == "status_change"
                   and (e.get("data") or {}).get("status") == value)

    def wait_relayed(events: SSEClient, model: str, node: object, value: str,
                     count: int) -> None:
        assert wait_until(lambda: relayed(events, model, node, value) >= count, 30), \
            events.events[-5:]

    try:
        with bounded("events", a, b), b.client() as client_b, a.client() as client_a:
            for round_ in range(1, ROUNDS + 1):
                for client, model, events, label in ((client_b, "beta", events_a, label_b),
                                                     (client_a, "alpha", events_b, label_a)):
                    # A change on one router shows on the other's /models/sse, once.
                    assert client.post("/models/load", json={"model": model}).status_code == 200
                    wait_relayed(events, model, label, "loaded", round_)
                    assert client.post("/models/unload",
                                       json={"model": model}).status_code == 200
                    wait_relayed(events, model, label, "unloaded", round_)
        for events, model, label in ((events_a, "beta", label_b), (events_b, "alpha", label_a)):
            assert relayed(events, model, label, "loaded") == ROUNDS, "\n".join(
                json.dumps(e)[:300] for e in events.events if e.get("model") == model)
        # Its own model's events never come back to it through the other router.
        for events, own, other_label in ((events_a, "alpha", label_b),
                                         (events_b, "beta", label_a)):
            assert not [e for e in events.events if e.get("model") == own
                        and e.get("node") == other_label], events.events
    finally:
        for events in (events_a, events_b):
            events.stop.set()


def test_resumable_streams_through_either(pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    request = {"stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with bounded("resumable_streams", a, b):
        for round_ in range(ROUNDS):
            for router, model in ((a, "beta"), (b, "alpha")):
                conv_id = f"loop-{model}-{round_}"
                with router.client() as client:
                    with client.stream("POST", "/v1/chat/completions",
                                       headers={"X-Conversation-Id": conv_id},
                                       json={"model": model, **request}) as streamed:
                        assert streamed.status_code == 200
                        original = streamed.read().decode()
                    assert "[DONE]" in original
                    sessions = client.post("/v1/streams/lookup", json={
                        "conversation_ids": [conv_id, "nobody-has-this"]})
                    assert sessions.status_code == 200, sessions.text
                    assert [s["conversation_id"] for s in sessions.json()] == [conv_id]
                    replay = client.get("/v1/stream", params={"conv_id": conv_id, "from": "0"})
                    assert replay.status_code == 200, replay.text
                    assert replay.text == original  # the bytes the other router's child kept
                    unknown = client.get("/v1/stream", params={"conv_id": "nobody-has-this"})
                    assert unknown.status_code == 404, unknown.text
                    stop = client.delete("/v1/stream", params={"conv_id": conv_id})
                    assert stop.status_code == 204, stop.text
                    gone = client.get("/v1/stream", params={"conv_id": conv_id})
                    assert gone.status_code == 404, gone.text


def test_a_client_set_via_header_gets_a_clear_answer(
        pair: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = pair
    own = httpx.get(a.url + "/props").json()["llama_router"]["instance"]
    other = httpx.get(b.url + "/props").json()["llama_router"]["instance"]
    with a.client() as client:
        for via, words in ((own, "passed through this router"),
                           (other, "nodes it passed through already")):
            for path, body in (("/v1/chat/completions", {"model": "beta", **CHAT}),
                               ("/models/unload", {"model": "beta"})):
                answer = client.post(path, json=body,
                                     headers={"x-llama-router-via": via})
                assert answer.status_code == 409, (path, via, answer.text)
                error = answer.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert words in error["message"] and "x-llama-router-via" in \
                    error["message"], error
        # A via chain naming other routers only: its own model is served as usual.
        answer = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT},
                             headers={"x-llama-router-via": "someone-else"})
        assert answer.status_code == 200, answer.text


def test_an_admin_call_to_a_frozen_peer_is_answered(tmp_path: Path, llama_server: Path,
                                                    tiny_models: dict[str, Path]) -> None:
    with two_routers(tmp_path, llama_server, tiny_models) as (a, b):
        assert wait_until(lambda: "beta" in listing(a), 30)
        with a.client() as client:
            assert client.post("/models/load", json={"model": "beta"}).status_code == 200
            assert wait_until(lambda: listing(a)["beta"]["status"]["value"] == "loaded", 30)
            frozen = [b.proc.pid, *(p.pid for p in b.children())]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                answer = client.post("/models/unload", json={"model": "beta"},
                                     timeout=ANSWER_DEADLINE_S + 10)
                took = time.monotonic() - started
                record("frozen_peer_admin", {"seconds_to_answer": round(took, 2),
                                             "status": answer.status_code})
                assert took < ANSWER_DEADLINE_S, took
                assert answer.status_code in (502, 503), answer.text
                assert set(answer.json()["error"]) == {"code", "message", "type"}
            finally:
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            # Awake: back (it may have carried out the unload it had been sent), and serving.
            assert wait_until(lambda: not listing(a)["beta"]["status"].get("unavailable"), 30)
            answer = client.post("/v1/chat/completions", json={"model": "beta", **CHAT})
            assert answer.status_code == 200, answer.text
