"""OpenTelemetry against the real llama-server: routers started with the standard ``OTEL_*``
variables export to a real OTLP/HTTP receiver (``otlp_receiver``: the protobuf decoded with
``opentelemetry-proto``), and each trace's tree and attributes are asserted:

* a cold request: its server span (the client's ``traceparent`` its parent), the wait, the
  load under it and the spawn under that, and the exchange with the child (CLIENT); the usage;
  the three histograms over OTLP and on ``/metrics``; no prompt, completion or key anywhere;
* a warm restore: a model evicted by another's load saves its slots (under that load), and its
  next load restores them (under its own);
* a queued request of a batch team: its wait for a slot, with its team and class, no load;
* a request through a gateway to a peer: one trace over both routers, the node's server span
  the child of the gateway's exchange.

Spans are awaited with a bounded wait (``OTEL_BSP_SCHEDULE_DELAY``: 50 ms), never a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from otlp_receiver import Received, Span, serve
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

GUARD_S = 120.0  # a hang guard, never a measurement
# An endless stream (no chat template: no stop string a random model could write by chance).
ENDLESS = {"model": "long", "stream": True, "ignore_eos": True, "n_predict": -1,
           "prompt": "go on"}
KEY = "sk-otel-secret-0123456789"
PROMPT = "Tell me about the purple elephant of Zanzibar. " * 20  # a few hundred tokens
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[tuple[str, Received]]:
    yield from serve()


def otel_env(endpoint: str, service: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": service,
            "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRIC_EXPORT_INTERVAL": "200"}


def awaited(received: Received, found: Callable[[list[Span]], object]) -> list[Span]:
    """Every span received, once ``found`` holds of them (bounded)."""
    assert wait_until(lambda: found(received.snapshot()), GUARD_S), received.snapshot()
    return received.snapshot()


def one(spans: list[Span], name: str, kind: str | None = None, **where: object) -> Span:
    matching = [s for s in spans if s.name == name and kind in (None, s.kind)
                and all(s.attributes.get(k) == v for k, v in where.items())]
    assert len(matching) == 1, (name, where, spans)
    return matching[0]


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]


def nothing_secret(received: Received, *secrets: str) -> None:
    for body in received.raw:
        for secret in secrets:
            assert secret.encode() not in body


def chat(client: httpx.Client, model: str, text: str, **headers: str) -> httpx.Response:
    response = client.post("/v1/chat/completions", headers=headers, timeout=GUARD_S, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 200, response.text
    return response


def test_a_cold_request(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path,
                        receiver: tuple[str, Received]) -> None:
    """Two requests wait for alpha's one load: it waits for room (``--models-max 1``) while
    an endless stream holds the other model, until the test ends that stream."""
    endpoint, received = receiver
    presets = write_presets(tmp_path / "m.ini", f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            "ctx-size = 4096\nparallel = 2\n"
                            f"[long]\nmodel = {tiny_models['long']}\nctx-size = 512\n"
                            "parallel = 1\ncontext-shift = true\n")
    auth = {"Authorization": f"Bearer {KEY}"}
    answers: list[dict[str, Any]] = []

    def ask(**headers: str) -> None:
        with router.client(headers=auth) as own:
            answers.append(chat(own, "alpha", PROMPT, **headers).json())

    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key", KEY, "--models-max", "1",
                      env=otel_env(endpoint, "llama-router-test")) as router, \
            router.client(headers=auth) as client:
        with client.stream("POST", "/completion", json=ENDLESS) as stream:
            chunks = stream.iter_raw()  # (held: a generator dropped closes the stream)
            next(chunks)  # long serves and is busy: alpha's load waits for room
            asking = [threading.Thread(target=ask, kwargs={
                "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}), threading.Thread(target=ask)]
            for thread in asking:
                thread.start()
            assert wait_until(lambda: waiting(client, "alpha") == 2, GUARD_S)
            next(chunks)  # still streaming: alpha's load still waits
        for thread in asking:
            thread.join(GUARD_S)
        spans = awaited(received, lambda got: sum(s.kind == "SERVER" for s in got) == 3)
        metrics = client.get("/metrics").text
        assert wait_until(lambda: any(name == "gen_ai.server.request.duration"
                                      for _, name, _, _ in received.metrics), GUARD_S)
    assert len(answers) == 2
    (server,) = [s for s in spans if s.kind == "SERVER" and s.trace_id == TRACE_ID]
    answer = next(a for a in answers if a["usage"]["prompt_tokens"]
                  == server.attributes["gen_ai.usage.input_tokens"])
    assert server.kind == "SERVER" and server.service == "llama-router-test"
    assert (server.trace_id, server.parent_id) == (TRACE_ID, CLIENT_SPAN)  # the client's
    usage = answer["usage"]
    assert server.attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp",
        "gen_ai.request.model": "alpha", "gen_ai.response.model": "alpha",
        "server.port": router.port, "http.response.status_code": 200,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": answer["timings"]["cache_n"]}
    exchange, wait = sorted(children(spans, server), key=lambda s: s.kind)
    assert (wait.name, wait.kind, exchange.kind) == ("wait alpha", "INTERNAL", "CLIENT")
    assert wait.attributes == {"llama_router.model": "alpha", "llama_router.team": "admin",
                               "llama_router.class": "default",
                               "llama_router.wait.load": True}
    # One load for both: a child of the wait of the request that started it, linked by the
    # other's wait.
    load = one(spans, "load alpha")
    waits = [s for s in spans if s.name == "wait alpha"]
    assert len(waits) == 2 and load.parent_id in {w.span_id for w in waits}
    (linked,) = [w for w in waits if w.span_id != load.parent_id]
    assert linked.links == (load.span_id,)
    (spawn,) = children(spans, load)
    assert spawn.name == "spawn" and spawn.attributes["llama_router.replicas"] == 1
    assert exchange.name == "chat alpha" and exchange.attributes["server.address"] == "127.0.0.1"
    assert exchange.attributes["http.response.status_code"] == 200
    assert not any(s.error for s in spans)
    # The three histograms, over OTLP with the conventions' attributes, and on /metrics.
    (_, _, attributes, bounds), *_ = [
        m for m in received.metrics if m[1] == "gen_ai.server.request.duration"
        and m[2]["gen_ai.request.model"] == "alpha"]
    assert attributes == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp",
                          "gen_ai.request.model": "alpha", "gen_ai.response.model": "alpha",
                          "server.port": router.port}
    assert bounds == (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                      40.96, 81.92)
    assert {name for _, name, _, _ in received.metrics} >= {
        "gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token"}
    assert 'gen_ai_server_request_duration_seconds_count{error_type="",' \
           'gen_ai_operation_name="chat",gen_ai_provider_name="llama.cpp",' \
           'gen_ai_request_model="alpha",gen_ai_response_model="alpha"' in metrics
    nothing_secret(received, KEY, "purple elephant", answer["choices"][0]["message"]["content"]
                   or "\0never")


def test_a_warm_restore(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path,
                        receiver: tuple[str, Received]) -> None:
    endpoint, received = receiver
    presets = write_presets(tmp_path / "m.ini", "[*]\nctx-size = 2048\nparallel = 1\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--models-max", "1", "--state-dir", str(tmp_path / "states"),
                      env=otel_env(endpoint, "warm")) as router, router.client() as client:
        for model in ("alpha", "beta", "alpha"):  # beta evicts alpha, whose slot is saved
            response = client.post("/completion", timeout=GUARD_S, json={
                "model": model, "prompt": PROMPT, "n_predict": 4, "cache_prompt": True})
            assert response.status_code == 200, response.text
        assert response.json()["timings"]["cache_n"] > 0  # restored: from the cache
        spans = awaited(received, lambda got: sum(s.kind == "SERVER" for s in got) == 3)
    first, evicting, again = _in_order(spans)
    assert [s.name for s in (first, evicting, again)] == [
        "text_completion alpha", "text_completion beta", "text_completion alpha"]
    # alpha's save: under beta's load, which evicted it
    save = one(spans, "warm save", **{"llama_router.model": "alpha"})
    assert save.trace_id == evicting.trace_id and save.attributes["llama_router.warm.states"] >= 1
    # alpha's restore: under its own load, after its spawn
    restore = one(spans, "warm restore", **{"llama_router.warm.states": 1})
    assert restore.trace_id == again.trace_id
    assert restore.attributes == {"llama_router.model": "alpha", "llama_router.warm.states": 1}
    (load,) = [s for s in spans if s.span_id == restore.parent_id]
    # (and beta's save: alpha's load evicted it in turn)
    assert load.name == "load alpha" and {
        (s.name, s.attributes["llama_router.model"]) for s in children(spans, load)} == {
        ("spawn", "alpha"), ("warm restore", "alpha"), ("warm save", "beta")}
    assert again.attributes["gen_ai.usage.cache_read.input_tokens"] > 0


def _in_order(spans: list[Span]) -> list[Span]:
    """The server spans in the order their requests were sent (each its own trace)."""
    servers = [s for s in spans if s.kind == "SERVER"]
    return sorted(servers, key=spans.index)


BATCH_KEYS = ("sk-gateway-0123456789 name=gw\n"
              "sk-etl-0123456789 name=etl priority=batch role=infer\n")


def test_a_queued_request_of_a_batch_team(tmp_path: Path, tiny_models: dict[str, Path],
                                          llama_server: Path,
                                          receiver: tuple[str, Received]) -> None:
    endpoint, received = receiver
    keys = tmp_path / "keys"
    keys.write_text(BATCH_KEYS)
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 512\nparallel = 1\ncontext-shift = true\n")
    gw = {"Authorization": "Bearer sk-gateway-0123456789"}
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys), env=otel_env(endpoint, "teams")) as router, \
            router.client() as client:
        answers: list[httpx.Response] = []
        with client.stream("POST", "/completion", json={**ENDLESS, "model": "m"},
                           headers=gw) as stream:
            chunks = stream.iter_raw()  # (held: a generator dropped closes the stream)
            next(chunks)  # it holds the one slot
            batch = threading.Thread(target=lambda: answers.append(chat(
                client, "m", "batch job", Authorization="Bearer sk-etl-0123456789")))
            batch.start()
            assert wait_until(lambda: waiting(client, "m", gw) == 1, GUARD_S)
            next(chunks)  # still streaming: the batch request waits for its slot
        batch.join(GUARD_S)  # the stream closed: the batch request has the slot
        assert answers and answers[0].status_code == 200
        spans = awaited(received, lambda got: sum(s.kind == "SERVER" for s in got) == 2)
    server = [s for s in spans if s.kind == "SERVER"
              and any(c.attributes.get("llama_router.team") == "etl"
                      for c in children(spans, s))]
    assert len(server) == 1
    (wait,) = [s for s in children(spans, server[0]) if s.kind == "INTERNAL"]
    assert wait.attributes == {"llama_router.model": "m", "llama_router.team": "etl",
                               "llama_router.class": "batch", "llama_router.wait.slot": True}
    assert children(spans, wait) == []  # the model served: no load


def waiting(client: httpx.Client, model: str, headers: dict[str, str] | None = None) -> int:
    """Requests waiting for ``model``."""
    data = client.get("/models", headers=headers).json()["data"]
    return int(next(m for m in data if m["id"] == model)["status"].get("waiting", 0))


NODE = "127.0.0.2"


def test_a_request_through_a_gateway_to_a_peer(tmp_path: Path, tiny_models: dict[str, Path],
                                               llama_server: Path,
                                               receiver: tuple[str, Received]) -> None:
    endpoint, received = receiver
    presets = write_presets(tmp_path / "n.ini", f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            "ctx-size = 1024\nparallel = 1\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--node-name", "node-a", host=NODE,
                      env=otel_env(endpoint, "node")) as node, \
            start_router(tmp_path, "--peer", node.url, "--node-name", "gw",
                         "--liveness-interval", "0.5", env=otel_env(endpoint, "gateway")
                         ) as gateway, gateway.client() as client:
        assert wait_until(lambda: "alpha" in gateway.models(), GUARD_S), gateway.log()
        chat(client, "alpha", PROMPT)
        spans = awaited(received, lambda got: {s.service for s in got if s.kind == "SERVER"}
                        >= {"node", "gateway"} and any(s.service == "node" and s.kind == "CLIENT"
                                                       for s in got))
    gw_server = one([s for s in spans if s.service == "gateway"], "chat alpha", "SERVER",
                    **{"llama_router.node": "node-a"})
    assert gw_server.kind == "SERVER" and gw_server.parent_id == ""
    (hop,) = children(spans, gw_server)
    assert hop.kind == "CLIENT" and hop.service == "gateway"
    assert hop.attributes["llama_router.node"] == "node-a"
    assert hop.attributes["server.address"] == NODE
    (node_server,) = children(spans, hop)  # the node continues the gateway's trace
    assert node_server.service == "node" and node_server.kind == "SERVER"
    assert node_server.name == "chat alpha"
    assert {s.trace_id for s in spans} == {gw_server.trace_id}  # one trace on both routers
    node_children = {(s.name, s.kind) for s in children(spans, node_server)}
    assert node_children == {("wait alpha", "INTERNAL"), ("chat alpha", "CLIENT")}
    assert "gen_ai.usage.output_tokens" in gw_server.attributes
