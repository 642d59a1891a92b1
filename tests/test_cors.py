"""The router's one CORS policy (``cors.py``): preflights answered at the edge, inference open
to the origins of ``--cors-origins``, sensitive routes refused to every page of another origin
that is not named there, whatever the content type; the children's CORS headers never
relayed.

In process: the real app, middleware and routes, with the supervisor's ``acquire``, ``load``
and ``unload`` and the reloader replaced by recorders, so a test sees whether anything was
loaded, unloaded or reloaded. Real: the same against a router and a real llama-server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from support import start_router, write_presets

from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.core.view import ModelView
from router.edge.cors import CorsPolicy, cross_origin, same_origin
from router.edge.state import State
from router.errors import Unavailable
from router.http.requests import RequestContext
from router.llama.flags import FlagTable
from router.server import Prepared, build_app

KEY = "sk-cors-7f3a"
HOST = "router.test:8080"  # the Host of every in-process request
OWN = f"http://{HOST}"  # the router's own origin
EVIL = "https://evil.example"
APP = "https://app.example"  # named in --cors-origins where a test says so
PREFLIGHT_CHAT = {"Origin": EVIL, "Access-Control-Request-Method": "POST",
                  "Access-Control-Request-Headers": "authorization,content-type"}


@dataclass
class Recorded:
    """What the router did for the requests: models asked for, loads, unloads, reloads."""

    acquired: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    reloads: int = 0

    @property
    def anything(self) -> bool:
        return bool(self.acquired or self.loaded or self.unloaded or self.reloads)


Client = Callable[..., Any]


@contextlib.asynccontextmanager
async def router_app(tmp_path: Path, help_table: FlagTable, cors: str = "*",
                     keys: list[str] | None = None
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, Recorded]]:
    text = "version = 1\n"
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
        text += f"[{name}]\nmodel = {tmp_path / name}.gguf\n"
    presets = write_presets(tmp_path / "models.ini", text)
    config = Settings(presets=[presets], llama_server=tmp_path / "never-started",
                      api_key=keys or [], webui=False, cors_origins=cors)
    catalogue = build_catalogue([presets], [], help_table, [])
    prepared = Prepared(config, tmp_path / "never-started", help_table, [], catalogue,
                        config.all_api_keys(), "test")
    app: Starlette = build_app(prepared)
    recorded = Recorded()
    async with app.router.lifespan_context(app):
        state: State = app.state.router
        sup = state.models

        async def acquire(model: ModelView, **kw: Any) -> Any:
            recorded.acquired.append(model.id)
            raise Unavailable("recorded, not served")

        async def load(model: ModelView, **kw: Any) -> None:
            recorded.loaded.append(model.id)

        async def unload(model: ModelView, **kw: Any) -> None:
            recorded.unloaded.append(model.id)

        async def reload(source: str, **kw: Any) -> dict[str, Any]:
            recorded.reloads += 1
            return {"success": True}

        sup.acquire = acquire  # type: ignore[method-assign]
        sup.load = load  # type: ignore[method-assign]
        sup.unload = unload  # type: ignore[method-assign]
        state.reloader.reload = reload  # type: ignore[method-assign]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url=f"http://{HOST}") as client:
            yield client, recorded


def refused(response: httpx.Response) -> bool:
    """The 403 envelope of a refused cross-origin request, granting nothing."""
    return (response.status_code == 403
            and response.json()["error"]["type"] == "permission_error"
            and "--cors-origins" in response.json()["error"]["message"]
            and not any(k.lower().startswith("access-control-") for k in response.headers))


def preflight_refused(response: httpx.Response) -> bool:
    """A refused preflight as llama-server answers it: 200, empty, no CORS header at all, so
    the browser sends nothing more (the request itself would get the 403 of ``refused``)."""
    return (response.status_code == 200 and response.content == b""
            and not any(k.lower().startswith("access-control-") for k in response.headers)
            and "vary" not in response.headers)


# ------------------------------------------------------------------------- pure decisions

@pytest.mark.parametrize(("origin", "host", "same"), [
    (b"http://router.test:8080", b"router.test:8080", True),
    (b"https://router.test:8080", b"router.test:8080", True),  # TLS ends in front
    (b"http://router.test", b"router.test:80", True),
    (b"https://router.test", b"Router.Test", True),
    (b"http://[::1]:8080", b"[::1]:8080", True),
    (b"http://router.test:8081", b"router.test:8080", False),  # another port
    (b"http://router.test.evil.example:8080", b"router.test:8080", False),
    (b"HTTP://ROUTER.TEST:8080", b"router.test:8080", False),  # no browser sends it
    (b"http://router.test:8080/", b"router.test:8080", False),
    (b"http://user@router.test:8080", b"router.test:8080", False),
    (b"http://router.test:8080@evil.example", b"router.test:8080", False),
    (b"null", b"router.test:8080", False),
    (b"", b"router.test:8080", False),
    (b"http://router.test:8080", None, False),
    (b"http://router.test:8080", b"", False),
])
def test_same_origin_compares_host_and_port_strictly(origin: bytes, host: bytes | None,
                                                     same: bool) -> None:
    assert same_origin(origin, host) is same


def context_with(*headers: tuple[bytes, bytes]) -> RequestContext:
    return RequestContext({"method": "POST", "path": "/models/load", "query_string": b"",
                           "headers": [(b"host", b"router.test:8080"), *headers]})


@pytest.mark.parametrize(("headers", "cross"), [
    ((), False),
    (((b"sec-fetch-site", b"same-origin"),), False),
    (((b"sec-fetch-site", b"none"),), False),  # typed in the address bar, a bookmark
    (((b"sec-fetch-site", b"same-site"),), True),  # another port of the same host
    (((b"sec-fetch-site", b"cross-site"),), True),
    (((b"origin", OWN.encode()), (b"sec-fetch-site", b"cross-site")), True),  # contradictory
    (((b"origin", OWN.encode()),), False),
    (((b"origin", b"http://router.test:9090"), (b"sec-fetch-site", b"same-site")), True),
    # Header values are compared in any case: a proxy or a client may change it.
    (((b"sec-fetch-site", b"Cross-Site"),), True),
    (((b"sec-fetch-site", b"SAME-SITE"),), True),
    (((b"sec-fetch-site", b"Same-Origin"),), False),
])
def test_a_browser_says_where_a_request_comes_from(headers: tuple[tuple[bytes, bytes], ...],
                                                   cross: bool) -> None:
    assert cross_origin(context_with(*headers)) is cross


@pytest.mark.parametrize(("value", "problem"), [
    ("null", "sandboxed"), ("https://*.example.com", "not an origin"),
    ("https://app.example/path", "not an origin"), ("app.example", "not an origin"),
    ("https://user@app.example", "not an origin"), ("https://app.example:0", "port"),
    ("https://app.example:70000", "port"), ("none,*", "none cannot"), (" , ", "give"),
])
def test_bad_cors_origins_refuse_to_start(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        CorsPolicy.parse(value)
    with pytest.raises(ValueError, match="cors_origins"):
        Settings(cors_origins=value)


def test_origins_are_kept_as_browsers_send_them() -> None:
    policy = CorsPolicy.parse("HTTPS://App.Example:443/, http://localhost:5173,localhost")
    assert policy.origins == {b"https://app.example", b"http://localhost:5173"}
    assert policy.localhost and not policy.any_origin
    assert CorsPolicy.parse("*") == CorsPolicy() == CorsPolicy.parse(Settings().cors_origins)
    assert Settings(cors_origins="").cors_origins == "*"  # an empty env entry is unset
    assert CorsPolicy.parse("none").describe() == "none"


# ------------------------------------------------------------------------------ preflights

async def test_a_preflight_is_answered_at_the_edge_like_llama_server(
        tmp_path: Path, help_table: FlagTable) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        answer = await client.options("/v1/chat/completions?model=alpha", headers=PREFLIGHT_CHAT)
        assert answer.status_code == 200 and answer.content == b""
        assert answer.headers["access-control-allow-origin"] == "*"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert "Authorization" in answer.headers["access-control-allow-headers"]
        # A plain OPTIONS (no browser) is answered the same way, with no origin to grant.
        plain = await client.options("/v1/chat/completions?model=beta")
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        assert not recorded.anything  # nothing resolved, loaded or routed


async def test_a_preflight_on_a_keyed_router_needs_no_key_and_gets_only_cors_headers(
        tmp_path: Path, help_table: FlagTable) -> None:
    async with router_app(tmp_path, help_table, keys=[KEY]) as (client, recorded):
        for target in ("/v1/chat/completions?model=alpha", "/models", "/props", "/metrics",
                       "/v1/models", "/models/sse"):
            answer = await client.options(target, headers={**PREFLIGHT_CHAT,
                                                           "Access-Control-Request-Method": "GET"})
            assert answer.status_code == 200 and answer.content == b"", target
            assert answer.headers["access-control-allow-origin"] == "*"
        # The real request still needs the key; its 401 is readable by the page.
        chat = await client.post("/v1/chat/completions", headers={"Origin": EVIL},
                                 json={"model": "alpha", "messages": []})
        assert chat.status_code == 401 and chat.headers["access-control-allow-origin"] == "*"
        assert not recorded.anything


@pytest.mark.parametrize(("method", "target"), [
    ("POST", "/models/load"), ("POST", "/models/unload"), ("POST", "/models/reload"),
    ("POST", "/models"), ("DELETE", "/models?model=alpha"), ("DELETE", "/v1/stream"),
    ("POST", "/slots?model=alpha&id_slot=0&action=erase"), ("POST", "/props?model=alpha"),
    ("POST", "/lora-adapters?model=alpha"), ("GET", "/logs"), ("GET", "/activity"),
    ("GET", "/models?reload=1"),
])
async def test_a_preflight_for_a_sensitive_route_is_refused(
        tmp_path: Path, help_table: FlagTable, method: str, target: str) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        answer = await client.options(target, headers={
            "Origin": EVIL, "Access-Control-Request-Method": method})
        assert preflight_refused(answer), answer.text
        sent = await client.request(method, target, headers={"Origin": EVIL},
                                    json={"model": "alpha"} if method == "POST" else None)
        assert refused(sent), (target, sent.text)  # if a page sends it anyway
        assert not recorded.anything


async def test_an_origin_named_in_cors_origins_may_use_sensitive_routes(
        tmp_path: Path, help_table: FlagTable) -> None:
    async with router_app(tmp_path, help_table, cors=f"*,{APP}") as (client, recorded):
        answer = await client.options("/models/load", headers={
            "Origin": APP, "Access-Control-Request-Method": "POST"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP
        assert answer.headers["vary"] == "Origin"
        load = await client.post("/models/load", headers={"Origin": APP},
                                 json={"model": "alpha"})
        assert load.status_code == 200, load.text
        assert load.headers["access-control-allow-origin"] == APP
        assert recorded.loaded == ["alpha"]
        other = await client.post("/models/load", headers={"Origin": EVIL},
                                  json={"model": "beta"})
        assert refused(other) and recorded.loaded == ["alpha"]


# ------------------------------------------------------------- forgery of sensitive routes

FORGED_ORIGINS = [
    "null", EVIL, "HTTP://ROUTER.TEST:8080", f"{OWN}/", "http://router.test:8081",
    "http://router.test", "http://user@router.test:8080", "http://router.test:8080.evil.example",
    f"{OWN}, {EVIL}", "http://localhost:8080", "",
]
FORMS: dict[str, dict[str, Any]] = {
    "text/plain": {"content": b'{"model": "alpha", "x": "="}',
                   "headers": {"Content-Type": "text/plain"}},
    "multipart": {"files": {"model": (None, "alpha")}},
    "urlencoded": {"content": b"model=alpha",
                   "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
    "json": {"json": {"model": "alpha"}},
}


@pytest.mark.parametrize("origin", FORGED_ORIGINS)
@pytest.mark.parametrize("form", FORMS)
async def test_forms_from_other_origins_change_nothing(
        tmp_path: Path, help_table: FlagTable, origin: str, form: str) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        for path in ("/models/load", "/models/unload", "/models/reload"):
            kw = dict(FORMS[form])
            kw["headers"] = {**kw.get("headers", {}), "Origin": origin}
            answer = await client.post(path, **kw)
            assert refused(answer), (path, answer.status_code, answer.text)
        assert not recorded.anything


@pytest.mark.parametrize(("site", "allowed"), [
    ("cross-site", False), ("same-site", False), ("same-origin", True), ("none", True),
    ("Cross-Site", False), ("SAME-SITE", False)])
async def test_sec_fetch_site_alone_decides_without_an_origin(
        tmp_path: Path, help_table: FlagTable, site: str, allowed: bool) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        # An <img src> or a link: a GET with no Origin that would re-read the configuration.
        reload = await client.get("/models?reload=1", headers={"Sec-Fetch-Site": site})
        assert (reload.status_code == 200) is allowed and (recorded.reloads == 1) is allowed
        if not allowed:
            assert refused(reload)
        logs = await client.get("/logs", headers={"Sec-Fetch-Site": site})
        assert (logs.status_code == 200) is allowed
        # Inference reads are not refused for want of an Origin (the page cannot read them).
        listing = await client.get("/v1/models", headers={"Sec-Fetch-Site": site})
        assert listing.status_code == 200
        assert "access-control-allow-origin" not in listing.headers


async def test_scripts_and_the_routers_own_pages_keep_working(
        tmp_path: Path, help_table: FlagTable) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        # curl -d: no Origin, no Sec-Fetch-Site, form content type.
        load = await client.post("/models/load", content=b'{"model": "alpha"}',
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert load.status_code == 200, load.text
        # The dashboard and the web UI: same origin, as a browser marks it.
        for origin in (OWN, "https://router.test:8080"):
            unload = await client.post("/models/unload", json={"model": "alpha"},
                                       headers={"Origin": origin, "Sec-Fetch-Site": "same-origin"})
            assert unload.status_code != 403, unload.text
            assert "access-control-allow-origin" not in unload.headers
        assert recorded.loaded == ["alpha"]


# ------------------------------------------------------------------------------ inference

async def test_inference_from_any_origin_is_readable_by_default(
        tmp_path: Path, help_table: FlagTable) -> None:
    async with router_app(tmp_path, help_table) as (client, recorded):
        chat = await client.post("/v1/chat/completions", headers={"Origin": "null"},
                                 content=json.dumps({"model": "alpha", "messages": []}))
        assert chat.status_code == 503  # the recorder's answer
        assert chat.headers["access-control-allow-origin"] == "*"
        assert recorded.acquired == ["alpha"]
        listing = await client.get("/v1/models", headers={"Origin": EVIL})
        assert listing.headers["access-control-allow-origin"] == "*"
        assert "vary" not in listing.headers


@pytest.mark.parametrize(("cors", "origin", "granted"), [
    (APP, APP, APP), (APP, EVIL, None), (APP, f"{APP}/", None), (APP, "https://APP.example", None),
    (APP, "https://app.example:8443", None), (APP, "null", None),
    ("localhost", "http://localhost:5173", "http://localhost:5173"),
    ("localhost", "http://127.0.0.1:3000", "http://127.0.0.1:3000"),
    ("localhost", "http://[::1]:3000", "http://[::1]:3000"),
    ("localhost", "http://localhost.evil.example", None),
    ("localhost", "http://127.0.0.1.evil.example", None),
    ("none", EVIL, None), ("none", "http://localhost:5173", None),
])
async def test_a_narrower_policy_refuses_other_pages_even_for_inference(
        tmp_path: Path, help_table: FlagTable, cors: str, origin: str,
        granted: str | None) -> None:
    async with router_app(tmp_path, help_table, cors=cors) as (client, recorded):
        preflight = await client.options("/v1/chat/completions", headers={
            **PREFLIGHT_CHAT, "Origin": origin})
        chat = await client.post("/v1/chat/completions", headers={
            "Origin": origin, "Content-Type": "text/plain"},
            content=b'{"model": "alpha", "messages": []}')
        if granted is None:
            assert preflight_refused(preflight) and refused(chat)
            assert not recorded.anything
        else:
            assert preflight.status_code == 200
            for answer in (preflight, chat):
                assert answer.headers["access-control-allow-origin"] == granted
                assert answer.headers["vary"] == "Origin"
            assert recorded.acquired == ["alpha"]
        own = await client.get("/v1/models", headers={"Origin": OWN})
        assert own.status_code == 200  # the router's own pages, whatever the policy


@pytest.mark.parametrize("origin", [
    "http://localhost", "http://localhost:8080", "http://127.0.0.1", "http://127.0.0.1:3000",
    "http://[::1]", "http://[::1]:3000", "https://localhost:5173"])
async def test_localhost_pages_are_reflected_in_llama_servers_spelling(
        tmp_path: Path, help_table: FlagTable, origin: str) -> None:
    """``--cors-origins localhost``, as b11434's tests ask it: the origin reflected, the
    header named as llama-server writes it (a client's case-sensitive ``dict`` finds it)."""
    async with router_app(tmp_path, help_table, cors="localhost") as (client, recorded):
        answer = await client.options("/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"})
        assert answer.status_code == 200 and answer.content == b""
        names = {bytes(name): value for name, value in answer.headers.raw}  # as on the wire
        assert names[b"Access-Control-Allow-Origin"] == origin.encode()
        assert names[b"Access-Control-Allow-Methods"] == b"GET, POST, DELETE, OPTIONS"
        assert names[b"Vary"] == b"Origin"
        assert not recorded.anything


# Origins that look local and are not, or that no browser sends for a local page: each is
# refused (its preflight gets no CORS header, its request the 403), however it is spelled.
FORGED_LOCAL = [
    "http://localhost.evil.com", "http://127.0.0.1.nip.io", "http://localhost.", "null",
    "http://LOCALHOST", "HTTP://localhost", "http://LocalHost:3000", "http://127.0.0.1.:80",
    "http://[::1].evil.com", "http://[0:0:0:0:0:0:0:1]", "http://[::ffff:127.0.0.1]",
    "http://127.1", "http://0.0.0.0", "http://localhost:3000/", "http://localhost:3000/x",
    "http://user@localhost", "http://evil.com@localhost", "http://localhost@evil.com",
    "http://localhost:3000, http://evil.com", "http://localhost\t", "localhost",
    "http://evil.com#http://localhost", "file://localhost", "http://notlocalhost",
    "http://web.mydomain.fr", "http://evil.com", "",
]


@pytest.mark.parametrize("origin", FORGED_LOCAL)
async def test_forged_local_origins_are_refused(
        tmp_path: Path, help_table: FlagTable, origin: str) -> None:
    async with router_app(tmp_path, help_table, cors="localhost") as (client, recorded):
        preflight = await client.options("/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"})
        assert preflight_refused(preflight), (origin, preflight.headers)
        chat = await client.post("/v1/chat/completions", headers={
            "Origin": origin, "Content-Type": "text/plain"},
            content=b'{"model": "alpha", "messages": []}')
        assert refused(chat), (origin, chat.status_code, chat.text)
        assert not recorded.anything


# ----------------------------------------------------------------------- real llama-server

@pytest.mark.real
@pytest.mark.process
def test_preflights_and_the_childs_cors_headers_against_llama_server(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "cors.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 256\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 256\n")
    auth = {"Authorization": f"Bearer {KEY}"}
    with start_router(tmp_path, "--presets", str(presets), "--api-key", KEY) as router, \
            router.client() as client:

        def status(model: str) -> Any:
            listing = client.get("/models", headers=auth).json()["data"]
            return {m["id"]: m["status"]["value"] for m in listing}[model]

        # A preflight naming an unloaded model loads nothing, with or without a key.
        answer = client.options("/v1/chat/completions?model=alpha", headers=PREFLIGHT_CHAT)
        assert answer.status_code == 200 and answer.content == b""
        assert answer.headers["access-control-allow-origin"] == "*"
        assert status("alpha") == "unloaded"
        assert not router.children()
        # A chat from another origin: the router's CORS headers, once, never the child's.
        headers = {**auth, "Origin": EVIL}
        chat = client.post("/v1/chat/completions", headers=headers, json={
            "model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.headers.get_list("access-control-allow-origin") == ["*"]
        assert "access-control-allow-credentials" not in chat.headers
        # The same without an Origin: no CORS header at all, though the child sends one.
        plain = client.post("/tokenize", headers=auth,
                            json={"model": "alpha", "content": "hi"})
        assert plain.status_code == 200 and not [
            k for k in plain.headers if k.lower().startswith("access-control-")]
        (child,) = router.children()
        argv = child.cmdline()
        port = argv[argv.index("--port") + 1]
        direct = httpx.post(f"http://127.0.0.1:{port}/tokenize", headers={"Origin": EVIL},
                            json={"content": "hi"})
        assert direct.headers["access-control-allow-origin"] == EVIL  # what is stripped
        # A cross-origin unload is refused before the key check, and alpha keeps serving.
        unload = client.post("/models/unload", headers=headers, json={"model": "alpha"})
        assert refused(unload)
        assert status("alpha") == "loaded"


INFERENCE_ROUTES = ("/v1/chat/completions", "/chat/completions", "/v1/completions",
                    "/completions", "/completion", "/v1/responses", "/responses",
                    "/v1/embeddings", "/embeddings", "/embedding", "/v1/rerank", "/rerank",
                    "/v1/reranking", "/reranking", "/v1/messages", "/v1/messages/count_tokens",
                    "/infill", "/tokenize", "/detokenize", "/apply-template",
                    "/v1/audio/transcriptions", "/audio/transcriptions", "/v1/props",
                    "/lora-adapters")


@pytest.mark.real
def test_every_inference_route_answers_a_preflight_as_llama_server_does(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Over llama-server's inference routes, with and without ``?model=``: the same status
    and methods as the child itself answers; the origin as ``--cors-origins *`` decides
    (``*``, no credentials) and ``Authorization`` allowed besides llama-server's ``*``
    (docs/api.md#browsers-and-cors). No preflight loads a model."""
    presets = write_presets(tmp_path / "cors.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 256\n"
                            "load-on-startup = true\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 256\n")
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        (child,) = router.children()
        argv = child.cmdline()
        port = argv[argv.index("--port") + 1]
        for path in INFERENCE_ROUTES:
            for method in ("POST", "GET"):
                headers = {**PREFLIGHT_CHAT, "Access-Control-Request-Method": method}
                direct = httpx.options(f"http://127.0.0.1:{port}{path}", headers=headers)
                for target in (path, path + "?model=beta"):
                    routed = client.options(target, headers=headers)
                    if method == "POST" and path in ("/v1/props", "/lora-adapters"):
                        assert direct.status_code == 200  # a write that changes the model
                        assert preflight_refused(routed), target  # never cross-site
                        continue
                    assert routed.status_code == direct.status_code == 200, target
                    assert routed.headers["access-control-allow-methods"] == \
                        direct.headers["access-control-allow-methods"], target
                    assert routed.headers["access-control-allow-origin"] == "*"
                    assert "access-control-allow-credentials" not in routed.headers
                    assert routed.headers["access-control-allow-headers"] == "Authorization, *"
        beta = {m["id"]: m for m in client.get("/models").json()["data"]}["beta"]
        assert beta["status"]["value"] == "unloaded"
