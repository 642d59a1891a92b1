"""A key limited to some models, or without the admin role, sees only its scope: the event
stream (no router-wide events, no other model's), ``/props`` (no configuration errors, no peer
addresses), ``/metrics``, ``/logs`` and ``/activity``; and a model outside its scope answers
exactly as a name nobody uses, everywhere. In process against a fake llama-server, then
through a router subprocess with keys and the real llama-server. Also: the event stream's
snapshot carries every model, however many."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from support import SSEClient, fake_binary, start_router, wait_until, write_presets

from router.config.keyfile import FULL, INFER, KeyScope
from router.config.settings import Settings
from router.edge.routes import EventStream
from router.edge.state import State
from router.observe.metrics import only_models
from router.server import build_app, prepare

KEYS = {  # name -> (key, scope in the key file; "" for --api-key)
    "admin": ("sk-admin-0a1b2c", ""),
    "some": ("sk-some-3d4e5f", "models=chat-*"),  # admin of chat-* only
    "infer": ("sk-infer-6a7b8c", "role=infer"),  # every model, inference only
    "chat": ("sk-chat-9d0e1f", "role=infer models=chat-*"),
    "metrics": ("sk-metrics-2a3b4c", "role=metrics models=chat-*"),
}
MODELS = ("chat-a", "chat-b", "coder", "secret")


def presets_text(directory: Path, models: tuple[str, ...] = MODELS) -> str:
    (directory / "m.gguf").write_bytes(b"GGUF")
    return "version = 1\n" + "".join(f"[{m}]\nmodel = {directory / 'm.gguf'}\n"
                                     for m in models)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[Starlette]:
    presets = write_presets(tmp_path / "models.ini", presets_text(tmp_path))
    key_file = tmp_path / "api-keys"
    key_file.write_text("".join(f"{key} {scope}\n" for key, scope in KEYS.values() if scope))
    settings = Settings(presets=[presets], llama_server=fake_binary(tmp_path),
                        api_key=[KEYS["admin"][0]], api_key_file=key_file, webui=False,
                        models_autoload=False)
    application = build_app(prepare(settings))
    async with application.router.lifespan_context(application):
        yield application


async def call(app: Starlette, method: str, target: str, who: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.request(method, target, **kw,
                                    headers={"Authorization": f"Bearer {KEYS[who][0]}"})


# --------------------------------------------------------------------------- names

PROBES = [  # (who, method, target or JSON body for a model) naming a model
    ("chat", "POST", "/v1/chat/completions"),
    ("chat", "GET", "/props?model={}"),
    ("chat", "POST", "/v1/embeddings?model={}"),
    ("some", "POST", "/models/load"),
    ("some", "POST", "/models/unload"),
    ("some", "DELETE", "/models?model={}"),
    ("some", "GET", "/logs?model={}"),
    ("some", "GET", "/logs/stream?model={}"),
    ("some", "GET", "/metrics?model={}"),
    ("metrics", "GET", "/metrics?model={}"),
]


@pytest.mark.fake
@pytest.mark.parametrize(("who", "method", "target"), PROBES)
async def test_a_model_out_of_scope_answers_as_a_name_nobody_uses(
        app: Starlette, who: str, method: str, target: str) -> None:
    async def ask(name: str) -> httpx.Response:
        if "{}" in target:
            return await call(app, method, target.format(name), who)
        return await call(app, method, target, who, json={"model": name, "messages": []})

    answers = {name: await ask(name) for name in ("secret", "secreu", "coder", "codex")}
    for name, answer in answers.items():
        assert answer.status_code == 404, (name, answer.text)
        assert answer.json() == {"error": {"code": 404, "type": "not_found_error",
                                           "message": f"model '{name}' not found"}}
    # The close matches come from the key's own models: a near miss of one of them says so.
    near = await ask("chat-aa")
    assert "did you mean 'chat-a'" in near.json()["error"]["message"]


# --------------------------------------------------------------------------- views

@pytest.mark.fake
async def test_props_shows_config_errors_and_peers_only_to_full_access(
        app: Starlette, tmp_path: Path) -> None:
    (tmp_path / "models.ini").write_text("version = 1\n[broken]\nno-such-flag = 1\n")
    assert (await call(app, "POST", "/models/reload", "admin")).status_code == 400
    admin = (await call(app, "GET", "/props", "admin")).json()
    assert admin["config_error"] and str(tmp_path) in json.dumps(admin["config_error"])
    for who in ("some", "infer", "chat"):
        props = await call(app, "GET", "/props", who)
        assert props.status_code == 200
        assert props.json()["config_error"] is None, who
        assert str(tmp_path) not in props.text, who


async def events_seen(state: State, key_scope: KeyScope | None,
                      publish: list[tuple[str, str, dict[str, Any]]], marker: str = "chat-a"
                      ) -> list[dict[str, Any]]:
    """What ``/models/sse`` sends a key: its snapshot, then the events ``publish`` (published
    once it is subscribed), up to a final marker every key sees."""
    events: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":  # subscribed: these follow the snapshot
            for model, event, data in publish:
                state.events.publish(model, event, data)
            state.events.publish(marker, "marker")
        for block in message.get("body", b"").decode().split("\n\n"):
            if block.startswith("data: "):
                events.append(json.loads(block[6:]))
                if events[-1]["event"] == "marker":
                    done.set()

    async def receive() -> dict[str, Any]:
        await done.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/models/sse", "headers": [],
             "query_string": b""}
    async with asyncio.timeout(30):
        await EventStream(state, key_scope)(scope, receive, send)  # type: ignore[arg-type]
    return events


@pytest.mark.fake
async def test_router_wide_events_reach_only_full_access(app: Starlette) -> None:
    state: State = app.state.router
    publish = [("*", "models_reload_failed", {"errors": ["/etc/secret/models.ini:3: bad"]}),
               ("*", "peer_up", {"url": "http://10.0.0.7:8080"}),
               ("secret", "model_status", {"status": "loading"}),
               ("chat-b", "model_status", {"status": "loading"})]
    full = await events_seen(state, None, publish)
    assert [e["event"] for e in full if e["model"] == "*"] == ["models_reload_failed",
                                                               "peer_up"]
    assert {e["model"] for e in full} == {*MODELS, "*"}
    for key_scope, models in [(KeyScope(frozenset({INFER})), set(MODELS)),
                              (KeyScope(frozenset({INFER}), ("chat-*",)), {"chat-a", "chat-b"}),
                              (KeyScope(FULL.roles, ("chat-*",)), {"chat-a", "chat-b"})]:
        seen = await events_seen(state, key_scope, publish)
        assert {e["model"] for e in seen} == models, key_scope
        assert "10.0.0.7" not in json.dumps(seen) and "/etc/secret" not in json.dumps(seen)
        assert seen[-1]["event"] == "marker"


@pytest.mark.fake
async def test_the_snapshot_carries_every_model_however_many(tmp_path: Path) -> None:
    """It was cut at the subscriber queue's 256 events."""
    names = tuple(f"model-{i:04d}" for i in range(1000))
    presets = write_presets(tmp_path / "many.ini", presets_text(tmp_path, names))
    settings = Settings(presets=[presets], llama_server=fake_binary(tmp_path), webui=False)
    application = build_app(prepare(settings))
    async with application.router.lifespan_context(application):
        state: State = application.state.router
        seen = await events_seen(state, None, [], "model-0999")
        chat = await events_seen(state, KeyScope(frozenset({INFER}), ("model-09*",)), [],
                                 "model-0999")
    assert seen[-1] == chat[-1] == {"model": "model-0999", "event": "marker"}
    snapshot = [e for e in seen if e["event"] == "model_status"]
    assert [e["model"] for e in snapshot] == list(names)  # each once, in order, none dropped
    assert all(e["data"] == {"status": "unloaded"} for e in snapshot)
    assert [e["model"] for e in chat if e["event"] == "model_status"] == list(names[900:])
    assert not any(e["event"] == "events_dropped" for e in seen + chat)


EXPOSITION = b"""# HELP llamarouter_model_status 1 for the model's current status
# TYPE llamarouter_model_status gauge
llamarouter_model_status{model="chat-a",status="loaded"} 1.0
llamarouter_model_status{model="secret",status="loaded"} 1.0
# HELP llamarouter_requests_total Requests answered
# TYPE llamarouter_requests_total counter
llamarouter_requests_total{endpoint="/v1/models",model="",status="200"} 3.0
llamarouter_requests_total{endpoint="/v1/chat/completions",model="secret",status="200"} 2.0
# HELP llamarouter_cpu_turns_total Turns given
# TYPE llamarouter_cpu_turns_total counter
llamarouter_cpu_turns_total 7.0
# HELP llamacpp:n_tokens_max Largest observed n_tokens
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max{model="secret"} 12
llamacpp:n_tokens_max{model="chat-a"} 34
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total{model="secret",node="n2"} 5.0
"""


def test_only_models_keeps_the_series_of_the_keys_models() -> None:
    text = only_models(EXPOSITION, lambda model: model.startswith("chat-")).decode()
    assert "secret" not in text and 'model=""' not in text
    assert 'llamarouter_model_status{model="chat-a",status="loaded"} 1.0' in text
    assert "llamarouter_cpu_turns_total 7.0" in text  # no model label: router-wide
    assert 'llamacpp:n_tokens_max{model="chat-a"} 34.0' in text
    assert "# TYPE llamacpp:n_tokens_max counter" in text
    assert "llamacpp:prompt_tokens_total" not in text  # nothing left of it
    assert "llamarouter_requests_total" not in text


@pytest.mark.fake
async def test_metrics_of_a_scoped_metrics_key_cover_its_models(app: Starlette) -> None:
    everything = (await call(app, "GET", "/metrics", "admin")).text
    assert 'model="secret"' in everything and 'model="coder"' in everything
    scoped = await call(app, "GET", "/metrics", "metrics")
    assert scoped.status_code == 200
    assert 'llamarouter_model_status{model="chat-a",status="unloaded"} 1.0' in scoped.text
    for other in ('model="secret"', 'model="coder"', 'model=""'):
        assert other not in scoped.text


@pytest.mark.fake
async def test_logs_and_activity_of_a_scoped_key(app: Starlette) -> None:
    activity = app.state.activity
    now = time.time()
    for model in ("chat-a", "secret", "chat-b", ""):
        activity.add(model=model, method="POST", path="/v1/chat/completions", status=200,
                     started=now, total_s=0.1)
    listed = (await call(app, "GET", "/activity", "some")).json()["requests"]
    assert [r["model"] for r in listed] == ["chat-b", "chat-a"]
    assert (await call(app, "GET", "/activity?limit=1", "some")).json()["requests"][0][
        "model"] == "chat-b"
    assert (await call(app, "GET", "/activity?model=secret", "some")).json()["requests"] == []
    totals = (await call(app, "GET", "/activity/totals", "some")).json()["models"]
    assert set(totals) == {"chat-a", "chat-b"}
    everything = (await call(app, "GET", "/activity", "admin")).json()["requests"]
    assert [r["model"] for r in everything][:4] == ["", "chat-b", "secret", "chat-a"]
    # The router's own log covers every model: not for a key limited to some.
    for path in ("/logs", "/logs/stream"):
        refused = await call(app, "GET", path, "some")
        assert refused.status_code == 403 and "?model=" in refused.json()["error"]["message"]
    assert (await call(app, "GET", "/logs?model=chat-a", "some")).status_code == 200


# --------------------------------------------------------------------------- real router

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.real
def test_scoped_keys_through_a_router_with_real_children(tmp_path: Path, llama_server: Path,
                                                         tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini",
                            f"version = 1\n[*]\nctx-size = 512\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\n")
    admin, infer, scraper = "sk-admin-71c0", "sk-infer-alpha-52aa", "sk-scrape-alpha-9e"
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{infer}  models=alpha  role=infer\n"
                        f"{scraper}  models=alpha  role=metrics\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(llama_server), "--api-key", admin,
                      "--api-key-file", str(key_file)) as router, \
            router.client() as client:
        as_admin = {"Authorization": f"Bearer {admin}"}
        as_infer = {"Authorization": f"Bearer {infer}"}
        watchers = {who: SSEClient(router.url, {"Authorization": f"Bearer {key}"})
                    for who, key in (("admin", admin), ("infer", infer))}
        for watcher in watchers.values():
            watcher.start()
            assert watcher.connected.wait(30)
        for model in ("alpha", "beta"):
            assert client.post("/v1/chat/completions", json={"model": model, **CHAT},
                               headers=as_admin).status_code == 200
        # A rejected edit of the configuration: its errors name the file.
        presets.write_text("version = 1\n[broken]\nno-such-flag = 1\n")
        assert client.post("/models/reload", headers=as_admin).status_code == 400
        assert wait_until(lambda: any(e["event"] == "models_reload_failed"
                                      for e in watchers["admin"].events), 30)
        # Anything published after that reaches the scoped watcher too, after it: then it has
        # had its chance to see the reload event.
        assert client.post("/models/unload", json={"model": "alpha"},
                           headers=as_admin).status_code == 200
        assert wait_until(lambda: any(e["model"] == "alpha" and e["data"].get("status")
                                      == "unloaded" for e in watchers["infer"].events
                                      if isinstance(e.get("data"), dict)), 30)
        for watcher in watchers.values():
            watcher.stop.set()
        seen = watchers["infer"].events
        assert {e["model"] for e in seen} == {"alpha"}, seen
        assert str(tmp_path) not in json.dumps(seen)
        assert {e["model"] for e in watchers["admin"].events} >= {"*", "alpha", "beta"}

        assert str(tmp_path) in client.get("/props", headers=as_admin).text
        props = client.get("/props", headers=as_infer)
        assert props.status_code == 200 and props.json()["config_error"] is None
        assert str(tmp_path) not in props.text

        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {scraper}"})
        assert metrics.status_code == 200
        assert 'model="alpha"' in metrics.text and 'model="beta"' not in metrics.text
        assert 'llamacpp:' in client.get("/metrics", headers=as_admin).text
        beta_series = [line for line in client.get("/metrics", headers=as_admin).text
                       .splitlines() if 'model="beta"' in line and line.startswith("llamacpp:")]
        assert beta_series  # the admin sees the real child's series the scraper does not

        out, nobody = (client.post("/v1/chat/completions", json={"model": name, **CHAT},
                                   headers=as_infer) for name in ("beta", "gamma"))
        assert (out.status_code, nobody.status_code) == (404, 404)
        assert out.json()["error"]["message"] == "model 'beta' not found"
        assert nobody.json()["error"]["message"] == "model 'gamma' not found"
