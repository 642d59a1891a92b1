"""What two readers of one request could read two ways is refused or decided once, at the
edge (``requests.RequestContext``, ``requests.parse_json``), as a red-team review asked:

* two ``X-Conversation-Id`` headers (the router checked the first, llama-server keeps the
  last) are a 400 envelope before anything acts on the request;
* the multipart ``model`` field is matched exactly (``MODEL`` is another field), and two
  ``model`` fields are a 400;
* a request the default model took (``--unknown-model-to-default``, or no model) reaches a
  remote upstream naming the default's name, never the name the client gave;
* JSON nested too deeply is a 400 wherever a client's JSON is read (reload options, loads,
  proxied bodies, stream lookups), never a 500;
* a lookup's body that stops arriving ends quietly, as every body read through the context.

In process: the real app, middleware, routes and proxy; local models are never started (the
supervisor's ``acquire`` records), the remote upstream is a recording stand-in on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.core.view import ModelView
from router.edge.state import State
from router.errors import NestedTooDeeply, Unavailable
from router.http import requests
from router.http.requests import MAX_JSON_DEPTH, RequestContext, parse_json
from router.llama.flags import FlagTable
from router.server import Prepared, build_app

ADMIN_KEY, ALPHA_KEY = "sk-admin-77c1", "sk-alpha-41e9"  # alpha: models=alpha role=infer
GUARD_S = 30.0  # a hang guard, never a measurement


def envelope_of(response: httpx.Response, status: int) -> str:
    """The error message of ``response``, asserting it is the envelope with ``status``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str)
    return str(error["message"])


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


# --------------------------------------------------------------------- the app, recording

@pytest.fixture
async def app(tmp_path: Path, help_table: FlagTable
              ) -> AsyncIterator[tuple[Starlette, list[str]]]:
    """The app over alpha and beta (never started); yields it and the models acquired."""
    text = "version = 1\n"
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
        text += f"[{name}]\nmodel = {tmp_path / name}.gguf\n"
    presets = tmp_path / "models.ini"
    presets.write_text(text)
    keys = tmp_path / "keys"
    keys.write_text(f"{ALPHA_KEY} models=alpha role=infer\n")
    config = Settings(presets=[presets], llama_server=tmp_path / "never-started",
                      api_key=[ADMIN_KEY], api_key_file=keys, webui=False)
    catalogue = build_catalogue([presets], [], help_table, [])
    prepared = Prepared(config, tmp_path / "never-started", help_table, [], catalogue,
                        config.all_api_keys(), "test")
    application = build_app(prepared)
    acquired: list[str] = []
    async with application.router.lifespan_context(application):
        state: State = application.state.router

        async def acquire(model: ModelView, **kw: Any) -> Any:
            acquired.append(model.id)
            raise Unavailable("recorded, not served")

        state.models.acquire = acquire  # type: ignore[method-assign]
        yield application, acquired


async def send(app: Starlette, method: str, path: str, key: str = ADMIN_KEY,
               **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **kw.pop("headers", {})}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.request(method, path, headers=headers, **kw)


CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------- X-Conversation-Id, twice

def test_the_context_refuses_a_second_conversation_id() -> None:
    def context_with(*values: bytes) -> RequestContext:
        return RequestContext({"method": "POST", "path": "/v1/chat/completions",
                               "query_string": b"", "headers": [
                                   (b"x-conversation-id", v) for v in values]})

    assert context_with(b"c1").refused is None and context_with(b"c1").conv_id == "c1"
    for values in ((b"c1", b"c2"), (b"c1", b"c1"), (b"", b"c2")):
        request = context_with(*values)
        assert request.refused is not None and request.refused.status == 400
        with pytest.raises(type(request.refused)):
            request.conv_id  # noqa: B018 (a context no edge checked refuses it too)


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions"), ("GET", "/v1/stream?conv_id=c1"),
    ("POST", "/v1/streams/lookup"), ("OPTIONS", "/v1/chat/completions")])
async def test_two_conversation_ids_are_a_400_before_anything_reads_the_request(
        app: tuple[Starlette, list[str]], method: str, path: str) -> None:
    application, acquired = app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                 base_url="http://router") as client:
        response = await client.request(
            method, path, json=CHAT if method == "POST" else None,
            headers=[("Authorization", f"Bearer {ALPHA_KEY}"),
                     ("X-Conversation-Id", "mine"), ("X-Conversation-Id", "someone-elses")])
    assert "X-Conversation-Id" in envelope_of(response, 400)
    assert acquired == []  # no model was asked for
    state: State = application.state.router
    assert len(state.conversations) == 0  # and no conversation claimed


# ------------------------------------------------------------------ multipart "model" field

def multipart(*fields: tuple[str, str]) -> tuple[bytes, str]:
    boundary = "b0undary"
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                    f"{value}\r\n".encode() for name, value in fields)
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def test_a_multipart_model_field_is_matched_exactly(
        app: tuple[Starlette, list[str]]) -> None:
    """``MODEL=alpha`` and ``model=beta``: the key (alpha only) is checked against beta, the
    model a llama.cpp peer would serve; never against alpha."""
    application, acquired = app
    body, content_type = multipart(("MODEL", "alpha"), ("model", "beta"))
    response = await send(application, "POST", "/v1/audio/transcriptions", key=ALPHA_KEY,
                          content=body, headers={"Content-Type": content_type})
    assert "'beta' not found" in envelope_of(response, 404)
    assert acquired == []
    # The upper-case field alone names no model: the request has none.
    body, content_type = multipart(("MODEL", "beta"))
    response = await send(application, "POST", "/v1/audio/transcriptions", content=body,
                          headers={"Content-Type": content_type})
    assert "model name is missing" in envelope_of(response, 400)


async def test_two_multipart_model_fields_are_a_400(app: tuple[Starlette, list[str]]) -> None:
    application, acquired = app
    for fields in ((("model", "alpha"), ("model", "beta")),
                   (("model", "alpha"), ("prompt", "x"), ("model", "alpha"))):
        body, content_type = multipart(*fields)
        response = await send(application, "POST", "/v1/audio/transcriptions", key=ALPHA_KEY,
                              content=body, headers={"Content-Type": content_type})
        assert 'more than one "model" field' in envelope_of(response, 400)
    assert acquired == []


# ------------------------------------------------------------------------- JSON too deep

def test_the_one_json_reader_has_a_depth_limit() -> None:
    assert parse_json(deep(MAX_JSON_DEPTH)) is not None
    wide = b"[" + b",".join([b'{"a": [1, "]]]]"]}'] * 5000) + b"]"  # many brackets, shallow
    assert len(parse_json(wide)) == 5000
    for body in (deep(MAX_JSON_DEPTH + 1), b'{"model": "m", "x": ' + deep(300) + b"}",
                 b'{"a": "[[[", "b": ' + deep(MAX_JSON_DEPTH + 1) + b"}"):
        with pytest.raises(NestedTooDeeply) as info:
            parse_json(body)
        assert info.value.status == 400


def nesting(value: object) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


TRICKY = st.text(st.sampled_from(['[', '{', ']', '}', '\\', '"', 'a', '\n', "é"]), max_size=6)
VALUES = st.recursive(st.none() | st.integers() | TRICKY,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TRICKY, inner, max_size=3), max_leaves=30)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(value=VALUES, limit=st.integers(0, 8), ascii_only=st.booleans())
def test_the_depth_is_measured_exactly_whatever_the_strings_hold(
        value: object, limit: int, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(requests, "MAX_JSON_DEPTH", limit)
        if nesting(value) > limit:
            with pytest.raises(NestedTooDeeply):
                parse_json(body)
        else:
            assert parse_json(body) == value


@pytest.mark.parametrize(("path", "body"), [
    ("/models/reload", deep(1000)),
    ("/models/reload", b'{"allow_empty": ' + deep(1000) + b"}"),
    ("/models/load", b'{"model": "alpha", "x": ' + deep(1000) + b"}"),
    ("/models/unload", deep(5000)),
    ("/v1/streams/lookup", b'{"conversation_ids": ' + deep(1000) + b"}"),
    ("/v1/chat/completions", b'{"model": "alpha", "x": ' + deep(MAX_JSON_DEPTH + 1) + b"}"),
])
async def test_json_nested_too_deeply_is_a_400_everywhere(
        app: tuple[Starlette, list[str]], path: str, body: bytes) -> None:
    application, acquired = app
    response = await send(application, "POST", path, content=body,
                          headers={"Content-Type": "application/json"})
    assert "nested too deeply" in envelope_of(response, 400)
    assert acquired == []


# ------------------------------------------------------------ a lookup's body that stalls

async def test_a_stalled_lookup_body_ends_quietly(
        app: tuple[Starlette, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    """The body stops arriving and the server cuts it (``http11``: the app sees the client
    leave): the lookup ends as every body read does, without a traceback or a 500."""
    application, _ = app
    messages = [{"type": "http.request", "body": b'{"conversation_', "more_body": True},
                {"type": "http.disconnect"}]
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await gone.wait()  # never set: nothing more arrives
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def record(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/streams/lookup",
             "raw_path": b"/v1/streams/lookup", "query_string": b"", "root_path": "",
             "server": ("router", 80), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"router"), (b"authorization", f"Bearer {ADMIN_KEY}".encode()),
                         (b"content-type", b"application/json"),
                         (b"content-length", b"1000")]}
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(GUARD_S):
            await application(scope, receive, record)
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert 500 not in statuses, sent
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records]


# ------------------------------------------------------- the default model on a remote

class Upstream:
    """A stand-in remote upstream: ``/health`` and ``/v1/models`` answer 200; every other
    request is recorded (its target and body) and answered ``{}``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            target = head.split(" ", 2)[1]
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(length)
            answer = b'{"data": [{"id": "upstream-model"}]}'
            if target not in ("/health", "/v1/models"):
                self.requests.append((target, body))
                answer = b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("upstream_model", [None, "served-name"])
async def test_a_request_the_default_took_names_the_default_on_its_remote(
        tmp_path: Path, help_table: FlagTable, upstream_model: str | None) -> None:
    """``--unknown-model-to-default`` with a remote default: a key limited to that default
    names ``secret`` (a model the upstream serves, outside the key's scope): the upstream gets
    the default's name in the body, the multipart field and the query, whatever the client
    named or left out."""
    name = upstream_model or "far"
    upstream = Upstream()
    async with upstream as url:
        (tmp_path / "alpha.gguf").write_bytes(b"GGUF")
        presets = tmp_path / "models.ini"
        presets.write_text(f"version = 1\n[alpha]\nmodel = {tmp_path / 'alpha.gguf'}\n"
                           f"[far]\nupstream = {url}\n"
                           + (f"upstream-model = {upstream_model}\n" if upstream_model else ""))
        keys = tmp_path / "keys"
        keys.write_text("sk-far models=far\n")
        config = Settings(presets=[presets], llama_server=tmp_path / "never-started",
                          api_key_file=keys, webui=False, default_model="far",
                          unknown_model_to_default=True)
        catalogue = build_catalogue([presets], [], help_table, [])
        prepared = Prepared(config, tmp_path / "never-started", help_table, [], catalogue,
                            config.all_api_keys(), "test")
        application = build_app(prepared)
        async with application.router.lifespan_context(application), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                  base_url="http://router", timeout=GUARD_S,
                                  headers={"Authorization": "Bearer sk-far"}) as client:
            answers = [
                await client.post("/v1/chat/completions",
                                  json={"model": "secret", "messages": []}),
                await client.post("/tokenize", json={"content": "x"}),
                await client.get("/v1/props", params={"model": "secret", "x": "1"}),
                await client.get("/slots"),
                await client.post("/v1/audio/transcriptions",
                                  data={"model": "secret", "language": "en"},
                                  files={"file": ("a.wav", b"RIFF", "audio/wav")}),
                await client.post("/v1/audio/transcriptions", data={"language": "en"},
                                  files={"file": ("a.wav", b"RIFF", "audio/wav")}),
            ]
            assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    targets = [httpx.URL(target) for target, _ in upstream.requests]
    assert [t.path for t in targets] == ["/v1/chat/completions", "/tokenize", "/v1/props",
                                         "/slots", *["/v1/audio/transcriptions"] * 2]
    chat_body, tokenize_body, _, _, named_body, unnamed_body = (
        body for _, body in upstream.requests)
    props, slots = targets[2:4]
    assert json.loads(chat_body) == {"model": name, "messages": []}
    assert json.loads(tokenize_body) == {"content": "x", "model": name}
    assert props.params.multi_items() == [("model", name), ("x", "1")]
    assert slots.params.multi_items() == [("model", name)]
    for form in (named_body, unnamed_body):
        assert form.count(b'name="model"') == 1 and b"secret" not in form
        assert b'name="model"\r\n\r\n' + name.encode() + b"\r\n" in form
        assert b'name="language"\r\n\r\nen\r\n' in form and b"RIFF" in form
