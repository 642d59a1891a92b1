"""The default model: requests that name no model (llama-server's own clients) go to it.

In process: the decision (``defaults.DefaultModel``), and JSON and multipart bodies without a
model through the real app with a recording supervisor. Real: llama-server's native endpoints
without a model through the router answer as the child itself answers them, the openai SDK
with ``model=""``, the implicit default of a one-model router ending when a second model
appears, ``--default-model`` with ``--unknown-model-to-default`` and a scoped key, and a
default model that does not exist refused at start and at reload.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from support import start_router, wait_until, write_presets

from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.core.view import ModelView
from router.edge.defaults import ONLY_MODEL, SETTING, DefaultModel, NoDefaultModel, check
from router.edge.route import decide, take
from router.edge.state import State
from router.errors import Unavailable
from router.http.requests import RequestContext
from router.llama.flags import FlagTable
from router.server import Prepared, build_app

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


# ------------------------------------------------------------------------- in process

async def _app(tmp_path: Path, table: FlagTable, models: tuple[str, ...], **settings: Any
               ) -> tuple[Starlette, list[str]]:
    text = "version = 1\n"
    for name in models:
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
        text += f"[{name}]\nmodel = {tmp_path / name}.gguf\n"
    presets = tmp_path / "models.ini"
    presets.write_text(text)
    config = Settings(presets=[presets], llama_server=tmp_path / "never-started",
                      models_autoload=False, webui=False, **settings)
    catalogue = build_catalogue([presets], [], table, [])
    prepared = Prepared(config, tmp_path / "never-started", table, [], catalogue, [], "test")
    return build_app(prepared), []


@pytest.fixture
async def app(tmp_path: Path, help_table: FlagTable, request: pytest.FixtureRequest
              ) -> AsyncIterator[tuple[Starlette, list[str]]]:
    """The app over ``request.param``'s models and settings; ``acquired``: the models the
    router asked its supervisor for (never served)."""
    models, settings = request.param
    app, acquired = await _app(tmp_path, help_table, models, **settings)
    async with app.router.lifespan_context(app):
        state: State = app.state.router

        async def acquire(model: ModelView, **kw: Any) -> Any:
            acquired.append(model.id)
            raise Unavailable("recorded, not served")

        state.models.acquire = acquire  # type: ignore[method-assign]
        yield app, acquired


async def _send(app: Starlette, method: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.request(method, path, **kw)


MULTIPART = {"files": {"file": ("a.wav", b"RIFF....", "audio/wav")},
             "data": {"response_format": "json"}}


@pytest.mark.parametrize("app", [(("alpha", "beta"), {"default_model": "beta"})],
                         indirect=True)
async def test_requests_without_a_model_go_to_the_default(app: tuple[Starlette, list[str]]
                                                          ) -> None:
    router, acquired = app
    for method, path, kw in [
            ("POST", "/completion", {"json": {"prompt": "Hi"}}),
            ("POST", "/v1/chat/completions", {"json": {"model": "", **CHAT}}),
            ("POST", "/tokenize", {"content": b""}),  # an empty body names no model
            ("POST", "/v1/audio/transcriptions", MULTIPART),  # multipart without the field
            ("GET", "/slots", {}), ("GET", "/slots", {"params": {"model": ""}}),
            ("GET", "/lora-adapters", {}), ("HEAD", "/slots", {})]:
        acquired.clear()
        answer = await _send(router, method, path, **kw)
        assert acquired == ["beta"], (method, path, answer.text)
        assert answer.status_code == 503  # the recorder's answer, from beta's acquire
    for method, path in [("GET", "/"), ("GET", "/nothing-here"), ("GET", "/completion"),
                         ("HEAD", "/index.html"), ("GET", "/props"), ("GET", "/metrics"),
                         ("GET", "/v1/models"), ("GET", "/health")]:
        acquired.clear()
        answer = await _send(router, method, path)
        assert acquired == [], (method, path)
        assert answer.status_code in (200, 404), (method, path, answer.status_code)
    # Named models are not touched; unknown names stay a 404 (the option is off).
    acquired.clear()
    answer = await _send(router, "POST", "/completion", json={"model": "alpha"})
    assert acquired == ["alpha"]
    answer = await _send(router, "POST", "/completion", json={"model": "gpt-3.5-turbo"})
    assert answer.status_code == 404 and acquired == ["alpha"]
    props = (await _send(router, "GET", "/props")).json()
    assert props["role"] == "router"
    assert props["llama_router"]["default_model"] == "beta"
    assert props["llama_router"]["default_model_from"] == SETTING
    listed = (await _send(router, "GET", "/v1/models")).json()["data"]
    assert [m["id"] for m in listed if m.get("default")] == ["beta"]


@pytest.mark.parametrize("app", [(("alpha", "beta"), {})], indirect=True)
async def test_without_a_default_several_models_keep_the_400_naming_the_option(
        app: tuple[Starlette, list[str]]) -> None:
    router, acquired = app
    for method, path, kw in [("POST", "/completion", {"json": {"prompt": "Hi"}}),
                             ("POST", "/v1/audio/transcriptions", MULTIPART),
                             ("GET", "/slots", {})]:
        answer = await _send(router, method, path, **kw)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "model name is missing" in error["message"]
        assert "--default-model" in error["message"] and "2 models" in error["message"]
    assert acquired == []
    props = (await _send(router, "GET", "/props")).json()["llama_router"]
    assert props["default_model"] is None and props["default_model_from"] is None
    listed = (await _send(router, "GET", "/v1/models")).json()["data"]
    assert not any("default" in m for m in listed)


@pytest.mark.parametrize("app", [(("only",), {"unknown_model_to_default": True})],
                         indirect=True)
async def test_one_model_is_the_default_without_the_setting(app: tuple[Starlette, list[str]]
                                                            ) -> None:
    router, acquired = app
    await _send(router, "POST", "/infill", json={"input_prefix": "def f("})
    await _send(router, "POST", "/embeddings", json={"model": "text-embedding-3-small"})
    assert acquired == ["only", "only"]
    props = (await _send(router, "GET", "/props")).json()["llama_router"]
    assert (props["default_model"], props["default_model_from"]) == ("only", ONLY_MODEL)


@pytest.mark.parametrize("app", [(("alpha", "beta"), {"default_model": "beta",
                                                      "unknown_model_to_default": True})],
                         indirect=True)
async def test_the_route_is_decided_without_writing_and_taken_once(
        app: tuple[Starlette, list[str]]) -> None:
    """``route.decide`` is pure: it reads the request, the published models and the default,
    and writes nothing; ``route.take`` then names the default model and the model's id in the
    request. Its ``local`` is the handle the lease is taken by (no name resolved again)."""
    router, _ = app
    state: State = router.state.router
    raw = b'{"model": "gpt-4o"}'
    request = RequestContext({"method": "POST", "path": "/v1/chat/completions",
                              "raw_path": b"/v1/chat/completions", "query_string": b"",
                              "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", b"%d" % len(raw))]})
    request.model = "gpt-4o"
    before = (request.model, request.named, request.defaulted, request.model_id)
    route = decide(state.models, state.peers, state.default, request, "gpt-4o")
    assert (request.model, request.named, request.defaulted, request.model_id) == before
    assert (route.model_id, route.defaulted_to, route.holders) == ("beta", "beta", ())
    assert route.local is not None and route.local.id == "beta"
    taken = take(state, request, route, None)
    assert (request.model, request.named, request.defaulted, request.model_id) == \
        ("beta", "gpt-4o", True, "beta")
    assert taken.local is route.local and taken.conversation is None


def test_the_decision(help_table: FlagTable, tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    presets = tmp_path / "m.ini"
    presets.write_text(f"version = 1\n[a]\nmodel = {tmp_path / 'a.gguf'}\nalias = first\n")
    catalogue = build_catalogue([presets], [], help_table, [])
    assert check(None, catalogue) is None
    assert check("first", catalogue) is None  # an alias names it too
    problem = check("nope", catalogue)
    assert problem == "--default-model 'nope' is not a model of this configuration " \
                      "(its models: a)"
    assert "2 models" in NoDefaultModel(2).message
    assert DefaultModel("").name is None  # LLAMA_ROUTER_DEFAULT_MODEL= is unset
    assert Settings(default_model="").default_model is None


# ------------------------------------------------------------------------- real children

NATIVE = [  # llama-server's own endpoints as its clients call them: no model anywhere
    ("POST", "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0}),
    ("POST", "/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    ("POST", "/v1/chat/completions", {**CHAT, "temperature": 0}),
    ("POST", "/tokenize", {"content": "hello world"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2}),
    ("POST", "/embedding", {"content": "hello"}),
    ("POST", "/rerank", {"query": "a", "documents": ["b"]}),
    ("GET", "/slots", None),
    ("GET", "/v1/props", None),
]
DETERMINISTIC = ("/tokenize", "/detokenize", "/apply-template")


@pytest.mark.real
def test_llama_server_clients_work_unchanged_through_a_one_model_router(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """A router with one model is a llama-server to its clients: each native endpoint,
    without a model, answers what the child answers directly (status, and the body where it
    is deterministic). Then a second model appears: the implicit default ends, visibly."""
    presets = write_presets(tmp_path / "models.ini", "version = 1\n[*]\nctx-size = 1024\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(llama_server)) as router, router.client() as client:
        for method, path, body in NATIVE:
            routed = client.request(method, path, json=body)
            port = router.models()["alpha"]["status"]["port"]  # type: ignore[index]
            direct = httpx.request(method, f"http://127.0.0.1:{port}{path}", json=body,
                                   timeout=60)
            assert routed.status_code == direct.status_code, (path, routed.text, direct.text)
            if path in DETERMINISTIC:
                assert routed.json() == direct.json(), path
        assert client.post("/completion", json={"prompt": "Hi", "n_predict": 3}
                           ).json()["content"]
        openai = pytest.importorskip("openai")
        sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
        reply = sdk.chat.completions.create(model="", messages=[{"role": "user",
                                                                 "content": "Hi"}],
                                            max_tokens=3)
        assert reply.choices[0].message.content
        assert client.get("/props").json()["role"] == "router"  # still the router's own
        assert client.get("/props").json()["llama_router"]["default_model"] == "alpha"
        assert client.get("/nothing-here").status_code == 404  # never a model

        # A second model: requests without a model now get the 400 that names the option.
        presets.write_text(presets.read_text() + f"[beta]\nmodel = {tiny_models['beta']}\n")
        assert client.post("/models/reload").json()["success"]
        answer = client.post("/completion", json={"prompt": "Hi", "n_predict": 3})
        assert answer.status_code == 400
        assert "--default-model" in answer.json()["error"]["message"]
        props = client.get("/props").json()["llama_router"]
        assert props["default_model"] is None
        assert not any(m.get("default") for m in client.get("/v1/models").json()["data"])
        assert wait_until(lambda: "no longer the default model" in router.log(), 10)


@pytest.mark.real
def test_a_default_model_with_unknown_names_and_a_scoped_key(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini", "version = 1\n[*]\nctx-size = 1024\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\nalias = b\n")
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha models=alpha role=infer\nsk-admin\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--default-model", "b", "--unknown-model-to-default",
                      "--api-key-file", str(keys)) as router, \
            router.client(headers={"Authorization": "Bearer sk-admin"}) as admin, \
            router.client(headers={"Authorization": "Bearer sk-alpha"}) as scoped:
        answer = admin.post("/tokenize", json={"content": "hello"})
        assert answer.status_code == 200 and answer.json()["tokens"]
        answer = admin.post("/v1/chat/completions", json={"model": "gpt-3.5-turbo", **CHAT})
        assert answer.status_code == 200, answer.text
        status = {m["id"]: m["status"]["value"] for m in admin.get("/models").json()["data"]}
        assert status == {"alpha": "unloaded", "beta": "loaded"}  # both went to beta
        props = admin.get("/props").json()["llama_router"]
        assert (props["default_model"], props["default_model_from"]) == ("beta", "setting")

        # A key that may not use beta: the default is not its, and is never named to it.
        for answer in (scoped.post("/tokenize", json={"content": "hi"}),
                       scoped.post("/completion", json={"model": "gpt-4", "prompt": "x"})):
            assert answer.status_code == 404, answer.text
            assert "beta" not in answer.text and answer.json()["error"]["code"] == 404
        assert scoped.get("/props").json()["llama_router"]["default_model"] is None
        assert scoped.post("/tokenize", json={"model": "alpha", "content": "hi"}
                           ).status_code == 200

        # A reload that would remove the default model is refused; the default stays.
        presets.write_text("version = 1\n[*]\nctx-size = 1024\n"
                           f"[alpha]\nmodel = {tiny_models['alpha']}\n")
        result = admin.post("/models/reload").json()
        assert not result["success"]
        assert "--default-model 'b' is not a model" in result["errors"][0]
        assert admin.post("/tokenize", json={"content": "hello"}).status_code == 200


@pytest.mark.real
@pytest.mark.process
def test_an_unknown_default_model_stops_the_start(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini",
                            f"version = 1\n[alpha]\nmodel = {tiny_models['alpha']}\n")
    done = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--presets",
                           str(presets), "--llama-server", str(llama_server), "--port", "0",
                           "--default-model", "alhpa"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--default-model 'alhpa' is not a model of this configuration (its models: " \
           "alpha)" in done.stderr


@pytest.mark.real
def test_props_answers_the_default_models_own_fields_as_a_single_llama_server(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """``GET /props`` on a router with a default model: the child's own fields (``model_path``,
    ``total_slots``, the generation settings, ``is_sleeping``) under the router's (``role``,
    ``llama_router``), for a key that may use that model; the placeholders of llama.cpp's
    router, and ``is_sleeping`` true, while it is not loaded (nothing is loaded for it)."""
    presets = write_presets(tmp_path / "models.ini", "version = 1\n[*]\nctx-size = 1024\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nparallel = 2\n"
                            "sleep-idle-seconds = 1\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\n")
    keys = tmp_path / "keys"
    keys.write_text("sk-admin\nsk-beta models=beta role=infer\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--default-model", "alpha", "--api-key-file", str(keys)) as router, \
            router.client(headers={"Authorization": "Bearer sk-admin"}) as admin, \
            router.client(headers={"Authorization": "Bearer sk-beta"}) as scoped:
        cold = admin.get("/props").json()
        assert cold["role"] == "router" and cold["is_sleeping"] is True
        assert cold["model_path"] == "none" and cold["llama_router"]["default_model"] == "alpha"
        assert {m["id"]: m["status"]["value"] for m in admin.get("/models").json()["data"]} \
            == {"alpha": "unloaded", "beta": "unloaded"}  # /props loaded nothing
        assert admin.post("/completion", json={"prompt": "Hi", "n_predict": 2}
                          ).status_code == 200
        port = {m["id"]: m for m in admin.get("/models").json()["data"]}["alpha"]["status"][
            "port"]
        own = httpx.get(f"http://127.0.0.1:{port}/props").json()
        props = admin.get("/props").json()
        assert props["role"] == "router" and props["llama_router"]["default_model"] == "alpha"
        assert props["model_path"] == own["model_path"] == str(tiny_models["alpha"])
        assert props["total_slots"] == own["total_slots"] == 2
        assert props["default_generation_settings"] == own["default_generation_settings"]
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["cors_proxy_enabled"] is False and props["ui_settings"] == {}
        # The child sleeps (--sleep-idle-seconds) and says so; /props does not wake it.
        assert wait_until(lambda: admin.get("/props").json()["is_sleeping"] is True, 20)
        assert admin.get("/props").json()["is_sleeping"] is True
        assert admin.post("/tokenize", json={"content": "hi"}).status_code == 200
        assert admin.get("/props").json()["is_sleeping"] is False
        # A key that may not use alpha learns nothing of it.
        other = scoped.get("/props").json()
        assert other["model_path"] == "none" and "is_sleeping" not in other
        assert other["llama_router"]["default_model"] is None
