"""One parse of each request: the API-key check and the router read the same request context,
so they agree on the model and the role whatever the spelling of the query and path.

In process (the real app, middleware, routes and proxy; no child is ever started: the
supervisor's ``acquire`` and the reloader are replaced by recorders), and a property test
over spellings: percent-encoding of any character in upper or lower case hex, repeated
parameters, ``+``, ``;``, empty values and names without ``=``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
from hostile import exchange, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from support import start_router, wait_until

from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.core.view import ModelView
from router.edge.state import State
from router.errors import Unavailable
from router.http.paths import CHILD_GET_PATHS, LISTING_PATHS, is_local
from router.http.requests import RequestContext
from router.llama.flags import FlagTable
from router.server import Prepared, build_app

ADMIN_KEY, INFER_KEY = "sk-admin-5d1e", "sk-infer-93ac"  # infer: models=alpha role=infer
MODELS = ("alpha", "beta")
UI_FILES = ("/", "/index.html", "/app.js")
PATHS = (*UI_FILES, "/health", "/models", "/v1/models", "/props", "/metrics", "/slots",
         "/tokenize", "/v1/chat/completions", "/logs")


@dataclass
class Recorded:
    """What the router acted on: the models it asked for, the reloads it did."""

    acquired: list[str] = field(default_factory=list)
    reloads: int = 0


@pytest.fixture
async def router(tmp_path: Path, help_table: FlagTable, request: pytest.FixtureRequest
                 ) -> AsyncIterator[tuple[Starlette, Recorded]]:
    """The app over alpha and beta; ``request.param``: more settings (a default model)."""
    text = "version = 1\n"
    for name in MODELS:
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
        text += f"[{name}]\nmodel = {tmp_path / name}.gguf\n"
    presets = tmp_path / "models.ini"
    presets.write_text(text)
    webui = tmp_path / "webui"
    webui.mkdir()
    (webui / "index.html").write_text("<html>the web UI</html>")
    (webui / "app.js").write_text("// the web UI")
    key_file = tmp_path / "keys"
    key_file.write_text(f"{INFER_KEY} models=alpha role=infer\n")
    config = Settings(presets=[presets], llama_server=tmp_path / "never-started",
                      api_key=[ADMIN_KEY], api_key_file=key_file, models_autoload=False,
                      webui_path=webui, **getattr(request, "param", {}))
    catalogue = build_catalogue([presets], [], help_table, [])
    prepared = Prepared(config, tmp_path / "never-started", help_table, [], catalogue,
                        config.all_api_keys(), "test", webui=webui)
    app = build_app(prepared)
    recorded = Recorded()
    async with app.router.lifespan_context(app):
        state: State = app.state.router

        async def acquire(model: ModelView, **kw: Any) -> Any:
            recorded.acquired.append(model.id)
            raise Unavailable("recorded, not served")

        async def reload(source: str, **kw: Any) -> dict[str, Any]:
            recorded.reloads += 1
            return {"success": True}

        state.models.acquire = acquire  # type: ignore[method-assign]
        state.reloader.reload = reload  # type: ignore[method-assign]
        yield app, recorded


# ------------------------------------------------------------------------- spellings

def spelled(text: str, draw: st.DrawFn, safe: str = "") -> str:
    """``text`` with any of its characters percent-encoded, in upper or lower case hex."""
    out = []
    for char in text:
        if char not in safe and draw(st.integers(0, 2)) == 0:
            code = "".join(f"%{b:02X}" for b in char.encode())
            out.append(code.lower() if draw(st.booleans()) else code)
        else:
            out.append(char)
    return "".join(out)


NAMES = ("model", "reload", "autoload", "lines", "mode", "models", "x")
VALUES = (*MODELS, "", "1", "0", "true", "al pha", "alpha+", "gamma")


@st.composite
def queries(draw: st.DrawFn) -> str:
    pairs = []
    for _ in range(draw(st.integers(0, 5))):
        name = spelled(draw(st.sampled_from(NAMES)), draw)
        value = spelled(draw(st.sampled_from(VALUES)), draw).replace(" ", "+")
        form = draw(st.integers(0, 5))
        pairs.append(name if form == 0 else f"{name}=" if form == 1 else f"{name}={value}")
    separators = [draw(st.sampled_from(["&", "&", ";", "&&"])) for _ in pairs]
    query = "".join(sep + pair for sep, pair in zip(separators, pairs, strict=True))
    return query[1:] if query[:1] == "&" else query


@st.composite
def paths(draw: st.DrawFn) -> str:
    return spelled(draw(st.sampled_from(PATHS)), draw, safe="/")


def decoded(query: str) -> dict[str, str]:
    """The query as the router must read it: form-urlencoded, the last value of a name."""
    return dict(parse_qsl(query, keep_blank_values=True))


# ------------------------------------------------------------------------- the property

async def ask(app: Starlette, method: str, path: str, query: str, key: str | None
              ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = httpx.URL("http://router" + path + ("?" + query if query else ""))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.request(method, url, headers=headers)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=paths(), query=queries(), method=st.sampled_from(["GET", "HEAD"]))
async def test_the_key_check_and_the_router_agree_on_model_and_role(
        router: tuple[Starlette, Recorded], path: str, query: str, method: str) -> None:
    app, recorded = router
    params = decoded(query)
    model = params.get("model") or None
    plain_path = httpx.URL("http://router" + path).path  # the decoded path
    ui_file = plain_path in UI_FILES
    reload = plain_path in LISTING_PATHS and bool(params.get("reload"))

    # No key: only the health checks and the web UI's files without a model; the router
    # never asks for a model or reloads for such a request.
    recorded.acquired.clear()
    recorded.reloads = 0
    answer = await ask(app, method, path, query, None)
    public = plain_path == "/health" or (ui_file and model is None)
    assert answer.status_code == (200 if public else 401), (path, query, answer.text)
    assert recorded.acquired == [] and recorded.reloads == 0, (path, query)

    # role=infer limited to alpha: a reload is refused, whatever its spelling; a model the
    # router asks for is the one the key check allowed.
    answer = await ask(app, method, path, query, INFER_KEY)
    assert recorded.reloads == 0, (path, query)
    if reload:
        assert answer.status_code == 403, (path, query, answer.text)
    assert set(recorded.acquired) <= {"alpha"}, (path, query, recorded.acquired)

    # Full access: the router acts on the model and the reload the query names.
    recorded.acquired.clear()
    answer = await ask(app, method, path, query, ADMIN_KEY)
    assert recorded.reloads == (1 if reload else 0), (path, query, answer.text)
    proxied = not is_local(plain_path, params)  # type: ignore[arg-type]
    expected = [model] if proxied and model in MODELS else []
    assert recorded.acquired == expected, (path, query, answer.text)


DEFAULTS = [{"default_model": "beta"},
            {"default_model": "beta", "unknown_model_to_default": True}]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=paths(), query=queries(), method=st.sampled_from(["GET", "HEAD", "POST"]))
@pytest.mark.parametrize("router", DEFAULTS, indirect=True, ids=["default", "unknown-too"])
async def test_a_default_model_is_taken_only_where_no_model_is_named(
        router: tuple[Starlette, Recorded], path: str, query: str, method: str) -> None:
    """With a default model (beta): a proxied request that names no model (however its
    query spells an empty or absent one) goes to beta, except GET and HEAD on paths that are
    not a child's own GET endpoints (the web UI's files, unknown paths: never a model);
    /props, /metrics and the listings stay the router's. A key limited to alpha never
    reaches beta through the default. Unknown names go to beta only when asked to."""
    app, recorded = router
    unknown_too = app.state.router.default.unknown_to_default
    params = decoded(query)
    model = params.get("model") or None
    plain_path = httpx.URL("http://router" + path).path
    proxied = not is_local(plain_path, params)  # type: ignore[arg-type]

    recorded.acquired.clear()
    answer = await ask(app, method, path, query, ADMIN_KEY)
    if not proxied:
        expected = []
    elif model is None:
        reaches = method == "POST" or plain_path in CHILD_GET_PATHS
        expected = ["beta"] if reaches else []
    elif model in MODELS:
        expected = [model]
    else:
        expected = ["beta"] if unknown_too else []
    assert recorded.acquired == expected, (method, path, query, answer.text)
    if proxied and not expected and model is None and method == "POST":
        pytest.fail("a POST without a model must reach the default")

    recorded.acquired.clear()
    answer = await ask(app, method, path, query, INFER_KEY)
    assert set(recorded.acquired) <= {"alpha"}, (method, path, query, recorded.acquired)
    if proxied and model is None and recorded.acquired == [] and answer.status_code == 404:
        assert "beta" not in answer.text  # the default's name is not told to this key


@pytest.mark.parametrize(("target", "model"), [
    ("/?%6dodel=alpha", "alpha"), ("/index.html?mod%65l=beta", "beta"),
    ("/?model=a&model=beta", "beta"), ("/?model=beta&model=", None), ("/?model", None),
    ("/?x=1;model=beta", None),  # ";" does not separate parameters
    ("/?mo%64el=al+pha", "al pha"), ("/props?MODEL=alpha", None),
])
def test_one_decoding_of_the_model(target: str, model: str | None) -> None:
    path, _, query = target.partition("?")
    request = RequestContext({"method": "GET", "path": path, "query_string": query.encode(),
                              "headers": []})
    assert request.model == model


def test_the_context_reads_each_header_once_and_hides_the_key() -> None:
    request = RequestContext({"method": "POST", "path": "/v1/chat/completions",
                              "query_string": b"", "headers": [
                                  (b"authorization", b"Bearer sk-secret"),
                                  (b"authorization", b"Bearer other"),
                                  (b"x-llama-router-via", b"a,b"),
                                  (b"x-conversation-id", b"conv-1")]})
    assert request.credential() == b"sk-secret"
    assert request.via == ("a", "b") and request.conv_id == "conv-1"
    assert "sk-secret" not in repr(request)
    assert not request.local and request.model is None


async def test_a_body_model_wins_over_the_query_and_is_read_once() -> None:
    body = b'{"model": "beta"}'
    request = RequestContext({"method": "POST", "path": "/tokenize",
                              "query_string": b"model=alpha", "headers": [
                                  (b"content-type", b"application/json")]})
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop()

    assert await request.read(receive, 100) == body  # type: ignore[arg-type]
    assert request.model == "beta" and request.parsed == {"model": "beta"}
    with contextlib.suppress(IndexError):  # a second read does not touch the stream
        assert await request.read(receive, 100) == body  # type: ignore[arg-type]


# ------------------------------------------------------------------------- real router

@pytest.mark.real
def test_a_spelled_model_or_reload_needs_its_key_on_a_real_router(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """The two holes a hostile review found, against a keyed router with real children:
    ``GET /?%6dodel=NAME`` (or ``HEAD /index.html?mod%65l=NAME``) without a key loaded NAME,
    evicting the loaded model; ``GET /models?%72eload=1`` with an infer-only key re-read the
    configuration."""
    presets = tmp_path / "models.ini"
    presets.write_text("version = 1\n[*]\nctx-size = 1024\n"
                       f"[alpha]\nmodel = {tiny_models['alpha']}\nload-on-startup = true\n"
                       f"[beta]\nmodel = {tiny_models['beta']}\n")
    webui = tmp_path / "webui"
    webui.mkdir()
    (webui / "index.html").write_text("<html>the web UI</html>")
    key_file = tmp_path / "keys"
    key_file.write_text(f"{INFER_KEY} role=infer\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--models-max", "1", "--api-key", ADMIN_KEY, "--api-key-file",
                      str(key_file), "--webui-path", str(webui)) as router:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

        def status(model: str) -> object:
            with router.client(headers=admin) as client:
                found = {m["id"]: m for m in client.get("/models").json()["data"]}
            return found[model]["status"]["value"]  # type: ignore[index]

        assert wait_until(lambda: status("alpha") == "loaded", 60)
        children = {p.pid for p in router.children()}
        for method, target in [("GET", "/?%6dodel=beta"), ("HEAD", "/index.html?mod%65l=beta"),
                               ("GET", "/?model=beta"),
                               ("GET", "/index.html?%6D%6F%64%65%6C=beta")]:
            answer = exchange(router.port, request(method, target), head_only=[method == "HEAD"])
            assert answer.answers and answer.answers[0].status == 401, (method, target)
        public = exchange(router.port, request("GET", "/?model="))  # no model: the UI's page
        assert public.answers[0].status == 200 and b"the web UI" in public.answers[0].body
        assert status("alpha") == "loaded" and status("beta") == "unloaded"
        assert {p.pid for p in router.children()} == children  # nothing started or stopped

        infer = {"Authorization": f"Bearer {INFER_KEY}"}
        for target in ("/models?%72eload=1", "/v1/models?reload=%31", "/models?rel%6Fad=x"):
            answer = exchange(router.port, request("GET", target, headers=infer))
            assert answer.answers[0].status == 403, target
            assert "needs role=admin" in answer.answers[0].json()["error"]["message"]
        assert "configuration reloaded" not in router.log()
        answer = exchange(router.port, request("GET", "/models?%72eload=1", headers=admin))
        assert answer.answers[0].status == 200  # the admin's reload, however spelled
        assert wait_until(lambda: "configuration reloaded (GET /models?reload)" in router.log(),
                          10)
