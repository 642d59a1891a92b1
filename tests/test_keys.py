"""Scoped API keys: the key file's syntax and its errors, the path and model checks through the
real middleware, proxy and routes (in process, against a fake llama-server), and a scoped key
against the real llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from support import fake_binary, serve_in_uvicorn, start_router, write_presets

from router.config.keyfile import (
    ADMIN,
    FULL,
    INFER,
    METRICS,
    ApiKey,
    KeyScope,
    _allows,
    parse_file,
    parse_line,
    policy_of,
)
from router.config.settings import ApiKeysInvalid, ConfigurationError, Settings
from router.edge.app import create_app
from router.edge.keys import ApiKeyMiddleware, Keys, KeysChanged, needed_role
from router.edge.middleware import RequestMetricsMiddleware
from router.edge.routes import EventStream
from router.edge.state import State
from router.http import sse
from router.http.requests import RequestContext
from router.server import build_app, prepare

SECRET = "sk-Very-Secret-0123456789"  # must never show in an error message


# --------------------------------------------------------------------------- parsing

@pytest.mark.parametrize(("line", "roles", "models"), [
    (f"{SECRET}", {ADMIN}, None),
    (f"  {SECRET}   # a comment", {ADMIN}, None),
    (f"{SECRET} models=chat-*,coder role=infer", {INFER}, ("chat-*", "coder")),
    (f"{SECRET}\trole=infer\tmodels=coder  # tabs, any order", {INFER}, ("coder",)),
    (f"{SECRET} role=metrics", {METRICS}, None),
    (f"{SECRET} role=infer,metrics models=owner/repo:*", {INFER, METRICS}, ("owner/repo:*",)),
    (f"{SECRET} models=chat-*", {ADMIN}, ("chat-*",)),
    (f"{SECRET} role=admin", {ADMIN}, None),
    ("abc== role=infer", {INFER}, None),  # base64 padding: still the key
])
def test_good_lines(line: str, roles: set[str], models: tuple[str, ...] | None) -> None:
    key = parse_line(line)
    assert key is not None
    assert str(key) == line.split()[0]
    assert key.scope.roles == roles and key.scope.models == models
    assert SECRET not in repr(key) and "<hidden>" in repr(key)


@pytest.mark.parametrize("line", ["", "   ", "# only a comment", "  # indented comment",
                                  "#", "\t#tab-indented", "#sk-commented-out role=infer"])
def test_blank_and_comment_lines(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("line", [f"{SECRET} #comment", f"{SECRET}\t# tab", f"{SECRET} #",
                                  f"{SECRET} role=infer #role=admin", f"{SECRET} ## #"])
def test_a_hash_after_whitespace_starts_a_comment(line: str) -> None:
    key = parse_line(line)
    assert key is not None and str(key) == SECRET
    assert key.scope.roles == ({INFER} if "role=infer" in line else {ADMIN})


@pytest.mark.parametrize(("line", "word"), [
    (f"{SECRET}#comment", 1), ("sk-Part#Of-A-Key role=infer", 1),
    (f"{SECRET} role=infer#admin", 2), (f"{SECRET} models=chat-*#,coder", 2),
    (f"  {SECRET}# indented", 1),
])
def test_a_hash_inside_a_word_is_refused_not_cut(line: str, word: int) -> None:
    """A '#' inside a key was a silent cut (the key in force was its first part): refused."""
    with pytest.raises(ValueError) as caught:
        parse_line(line)
    message = str(caught.value)
    assert f"'#' inside word {word}" in message
    for secret in (SECRET, "sk-Part", "Of-A-Key"):
        assert secret not in message


def test_a_hash_inside_a_key_stops_the_start_naming_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        settings_with(tmp_path, f"# keys\nfirst-key\n{SECRET}#team-a\n").all_api_keys()
    message = str(caught.value)
    assert f"\n  {tmp_path / 'api-keys'}:3: '#' inside" in message
    assert SECRET not in message and "team-a" not in message


@pytest.mark.parametrize(("line", "problem"), [
    (f"{SECRET} model=chat", "unknown field 'model' (known: models, role, name, priority, "
                              "max-concurrent, tokens-per-minute)"),
    (f"{SECRET} roles=infer", "unknown field 'roles'"),
    (f"{SECRET} Part-Of-A-Key==", "unknown field of word 2"),
    (f"{SECRET} second-half-of-the-key", "word 2 is not a name=value field"),
    (f"{SECRET} models=", "models= needs a comma list"),
    (f"{SECRET} models=a,,b", "without empty entries"),
    (f"{SECRET} models=a, b", "word 3 is not a name=value field"),
    (f"{SECRET} role=root", "unknown role 'root'"),
    (f"{SECRET} role=", "role= has an unknown role"),
    (f"{SECRET} role=infer,", "role= has an unknown role"),
    (f"{SECRET} role=admin,infer", "role=admin already includes every role"),
    (f"{SECRET} role=infer role=metrics", "role= given twice"),
    ("models=chat role=infer", "starts with the field models= where the key belongs"),
    ("role=infer", "starts with the field role="),
])
def test_bad_lines_say_what_is_wrong_and_never_show_the_key(line: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_line(line)
    message = str(caught.value)
    assert problem in message
    for secret in (SECRET, "Part-Of-A-Key", "second-half-of-the-key"):
        assert secret not in message


def test_a_file_names_the_line_of_its_first_problem() -> None:
    text = f"# keys\n{SECRET}\n\nother-key  models=a  colour=blue\n"
    with pytest.raises(ValueError, match=r"^line 4: unknown field 'colour'"):
        parse_file(text)


def test_a_key_twice_with_different_scopes_is_refused_the_same_scope_is_not() -> None:
    assert len(parse_file(f"{SECRET} role=infer\n{SECRET}  role=infer\n")) == 2
    with pytest.raises(ValueError) as caught:
        parse_file(f"{SECRET} role=infer\nx\n{SECRET} role=infer models=a\n")
    assert str(caught.value).startswith("line 3: the key of line 1 again, with another scope")
    assert SECRET not in str(caught.value)


def settings_with(tmp_path: Path, text: str, **kw: Any) -> Settings:
    key_file = tmp_path / "api-keys"
    key_file.write_text(text)
    return Settings(api_key_file=key_file, **kw)


def test_settings_give_file_keys_with_their_scope_and_flag_keys_full_access(
        tmp_path: Path) -> None:
    keys = settings_with(tmp_path, f"{SECRET} models=chat-* role=infer\nplain-key\n",
                         api_key=["flag-key"]).all_api_keys()
    assert keys == ["flag-key", SECRET, "plain-key"]
    assert all(isinstance(key, ApiKey) for key in keys)
    assert keys[0].scope.full and SECRET not in repr(keys)  # type: ignore[attr-defined]
    assert isinstance(keys[1], ApiKey) and keys[1].scope == KeyScope(frozenset({INFER}),
                                                                     ("chat-*",))
    assert isinstance(keys[2], ApiKey) and keys[2].scope.full
    # The same key on the command line and unscoped in the file: both full access, fine.
    assert settings_with(tmp_path, "flag-key\n", api_key=["flag-key"]).all_api_keys()


@pytest.mark.parametrize(("text", "problem"), [
    (f"# first\n{SECRET} role=boss\n", ":2: role= has an unknown role 'boss'"),
    (f"{SECRET} models=a\n{SECRET} models=b\n", ":2: the key of line 1 again"),
    ("# only comments\n", ": gives no API key"),
])
def test_settings_errors_name_the_file_and_line_not_the_key(tmp_path: Path, text: str,
                                                            problem: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        settings_with(tmp_path, text).all_api_keys()
    message = str(caught.value)
    assert f"{tmp_path / 'api-keys'}{problem}" in message
    assert SECRET not in message


def test_every_bad_line_of_a_key_file_is_named(tmp_path: Path) -> None:
    text = (f"{SECRET}-1 role=boss\n{SECRET}-2 role=infer\n# fine\n{SECRET}-3 colour=red\n"
            f"{SECRET}-2 role=metrics\n")
    with pytest.raises(ApiKeysInvalid) as caught:
        settings_with(tmp_path, text).all_api_keys()
    where = tmp_path / "api-keys"
    assert [p.split(": ", 1)[0] for p in caught.value.problems] == \
        [f"{where}:1", f"{where}:4", f"{where}:5"]
    assert "the key of line 2 again" in caught.value.problems[2]
    assert SECRET not in str(caught.value)
    with pytest.raises(ValueError, match=r"^line 1: role= .* \(and 2 more\)$"):
        parse_file(text)


def test_each_key_without_a_name_is_a_team_of_its_own_named_after_its_line() -> None:
    keys = parse_file("sk-a role=infer\n# a comment\n\nsk-b role=infer\nsk-c\n"
                      "sk-d models=x role=infer\n")
    assert [k.policy.name for k in keys] == ["key-1", "key-4", "key-5", "key-6"]
    again = parse_file("sk-a role=infer\nsk-b role=infer\nsk-a role=infer\n")
    assert [k.policy.name for k in again] == ["key-1", "key-2", "key-1"]  # its first line's


def test_the_name_admin_is_taken_only_by_keys_given_with_api_key(tmp_path: Path) -> None:
    keys = settings_with(tmp_path, "sk-a name=admin role=infer\n").all_api_keys()
    assert [policy_of(k).name for k in keys] == ["admin"]
    with pytest.raises(ApiKeysInvalid) as caught:
        settings_with(tmp_path, "# ops\nsk-a name=admin role=infer\n",
                      api_key=["flag-key"]).all_api_keys()
    assert caught.value.problems == [
        f"{tmp_path / 'api-keys'}:2: name=admin is the name of the keys given with --api-key: "
        "choose another"]
    with pytest.raises(ValueError, match="name=admin"):  # a caller that does not say
        parse_file("sk-a name=admin\n")


def test_a_flag_key_cannot_also_be_a_scoped_file_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        settings_with(tmp_path, f"{SECRET} role=infer\n", api_key=[SECRET]).all_api_keys()
    assert "also given by --api-key" in str(caught.value) and SECRET not in str(caught.value)


@pytest.mark.process
def test_serve_refuses_a_bad_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{SECRET} models=chat-*  role=infer\n{SECRET}-2 rol=infer\n")
    result = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--port", "0",
                             "--api-key-file", str(key_file)],
                            capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 2
    assert f"{key_file}:2: unknown field 'rol'" in result.stderr
    assert SECRET not in result.stderr + result.stdout


# --------------------------------------------------------------------------- matching

def test_model_patterns() -> None:
    scope = KeyScope(frozenset({INFER}), ("chat-*", "coder", "a.b", "owner/*:Q4*"))
    for allowed in ("chat-", "chat-a", "chat-x/y:z", "coder", "a.b", "owner/repo:Q4_K_M"):
        assert scope.allows(allowed), allowed
    for refused in ("xchat-a", "coder2", "Coder", "axb", "owner/repo:Q8_0", ""):
        assert not scope.allows(refused), refused
    # A model is in scope when its id or one of its aliases matches.
    assert scope.allows("team-model", ("tm", "chat-team"))
    assert not scope.allows("team-model", ("tm",))
    assert FULL.allows("anything") and FULL.full


def test_matching_is_cached_per_scope_and_model() -> None:
    scope = KeyScope(frozenset({INFER}), ("cached-*",))
    scope.allows("cached-model")
    hits = _allows.cache_info().hits
    for _ in range(3):
        assert scope.allows("cached-model")
    assert _allows.cache_info().hits == hits + 3
    other = KeyScope(frozenset({INFER, METRICS}), ("cached-*",))
    misses = _allows.cache_info().misses
    assert other.allows("cached-model")
    assert _allows.cache_info().misses == misses + 1


def test_scopes_are_immutable() -> None:
    scope = KeyScope(frozenset({INFER}), ("a",))
    with pytest.raises(AttributeError):
        scope.models = None  # type: ignore[misc]


@pytest.mark.parametrize(("method", "target", "role"), [
    ("POST", "/v1/chat/completions", INFER),
    ("POST", "/v1/embeddings", INFER),
    ("GET", "/props", INFER),
    ("GET", "/props?model=a", INFER),
    ("POST", "/props?model=a", ADMIN),
    ("GET", "/models", INFER),
    ("GET", "/v1/models", INFER),
    ("HEAD", "/v1/models", INFER),
    ("GET", "/models?reload=1", ADMIN),
    ("GET", "/models?reload=", INFER),
    ("GET", "/models/sse", INFER),
    ("GET", "/metrics", METRICS),
    ("GET", "/metrics?model=a", METRICS),
    ("POST", "/models/load", ADMIN),
    ("POST", "/models/unload", ADMIN),
    ("POST", "/models/reload", ADMIN),
    ("POST", "/models", ADMIN),
    ("DELETE", "/models", ADMIN),
    ("GET", "/logs", ADMIN),
    ("GET", "/logs/stream", ADMIN),
    ("GET", "/activity", ADMIN),
    ("GET", "/activity/totals", ADMIN),
    ("GET", "/slots?model=a", ADMIN),
    ("POST", "/slots/0?action=erase", ADMIN),
    ("GET", "/lora-adapters?model=a", INFER),
    ("POST", "/lora-adapters", ADMIN),
    ("GET", "/v1/stream?conv_id=c", INFER),
    ("DELETE", "/v1/stream?conv_id=c", INFER),
    ("POST", "/v1/streams/lookup", INFER),
])
def test_needed_roles(method: str, target: str, role: str) -> None:
    path, _, query = target.partition("?")
    assert needed_role(RequestContext({"method": method, "path": path, "headers": [],
                                       "query_string": query.encode()})) == role


# --------------------------------------------------------------------------- in process

KEYS = {  # name in the tables below -> (key, scope line)
    "admin": ("admin-key", None),  # --api-key: full access
    "infer": ("infer-key", "models=chat-*,coder role=infer"),
    "all": ("infer-all-key", "role=infer"),
    "metrics": ("metrics-key", "role=metrics"),
    "both": ("both-key", "models=coder role=infer,metrics"),
    "some": ("admin-some-key", "models=chat-*"),  # admin, limited to some models
}
MODELS = {  # id -> aliases
    "chat-a": "ca", "chat-b": "", "coder": "code", "secret": "hidden",
    "assistant": "chat-helper",  # in chat-*'s scope by its alias
}
NOT_LOADED = 400  # a request that passed every key check reaches the model: not loaded
DENIED = 403
NOT_FOUND = 404


def presets_text(directory: Path) -> str:
    text = "version = 1\n"
    for model, aliases in MODELS.items():
        (directory / f"{model}.gguf").write_bytes(b"GGUF")
        text += f"[{model}]\nmodel = {directory / model}.gguf\n"
        if aliases:
            text += f"alias = {aliases}\n"
    return text


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[Starlette]:
    presets = write_presets(tmp_path / "models.ini", presets_text(tmp_path))
    key_file = tmp_path / "api-keys"
    key_file.write_text("".join(f"{key} {line}\n" for key, line in KEYS.values() if line))
    settings = Settings(presets=[presets], llama_server=fake_binary(tmp_path),
                        api_key=[KEYS["admin"][0]], api_key_file=key_file, webui=False,
                        models_autoload=False)
    application = build_app(prepare(settings))
    async with application.router.lifespan_context(application):
        yield application


async def call(app: Starlette, method: str, target: str, who: str | None = None,
               headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[who][0]}"} if who else headers or {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.request(method, target, headers=headers, **kw)


def chat(model: str) -> tuple[str, str, dict[str, Any]]:
    return "POST", "/v1/chat/completions", {"json": {"model": model, "messages": []}}


async def chat_as(app: Starlette, who: str, model: str) -> httpx.Response:
    method, target, kw = chat(model)
    return await call(app, method, target, who, **kw)


# Each request and, per key, the status it gets: 403 from the key's scope, anything else
# means it got past the key checks (NOT_LOADED: it reached the model, which autoload off
# keeps from loading). Keys: admin, infer (chat-*,coder), all (infer, every model), metrics,
# both (infer+metrics, coder), some (admin, chat-*).
ANY: dict[str, Any] = {}
MATRIX: list[tuple[tuple[str, str, dict[str, Any]], dict[str, int]]] = [
    (chat("chat-a"), dict(admin=400, infer=400, all=400, metrics=403, both=404, some=400)),
    (chat("ca"), dict(admin=400, infer=400, all=400, metrics=403, both=404, some=400)),
    (chat("coder"), dict(admin=400, infer=400, all=400, metrics=403, both=400, some=404)),
    (chat("code"), dict(admin=400, infer=400, all=400, metrics=403, both=400, some=404)),
    (chat("secret"), dict(admin=400, infer=404, all=400, metrics=403, both=404, some=404)),
    (chat("hidden"), dict(admin=400, infer=404, all=400, metrics=403, both=404, some=404)),
    (chat("assistant"), dict(admin=400, infer=400, all=400, metrics=403, both=404, some=400)),
    (chat("no-such-model"), dict(admin=404, infer=404, all=404, metrics=403, both=404,
                                 some=404)),
    (("POST", "/v1/embeddings?model=secret", ANY),
     dict(admin=400, infer=404, all=400, metrics=403, both=404, some=404)),
    (("GET", "/props", ANY), dict(admin=200, infer=200, all=200, metrics=403, both=200,
                                  some=200)),
    (("GET", "/props?model=secret", ANY),
     dict(admin=400, infer=404, all=400, metrics=403, both=404, some=404)),
    (("POST", "/props?model=chat-a", {"json": {}}),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("GET", "/v1/models", ANY), dict(admin=200, infer=200, all=200, metrics=403, both=200,
                                      some=200)),
    (("GET", "/models", ANY), dict(admin=200, infer=200, all=200, metrics=403, both=200,
                                   some=200)),
    (("GET", "/models?reload=1", ANY),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=200)),
    (("GET", "/metrics", ANY), dict(admin=200, infer=403, all=403, metrics=200, both=200,
                                    some=200)),
    (("GET", "/metrics?model=coder", ANY),
     dict(admin=400, infer=403, all=403, metrics=400, both=400, some=404)),
    (("GET", "/metrics?model=chat-a", ANY),
     dict(admin=400, infer=403, all=403, metrics=400, both=404, some=400)),
    (("POST", "/models/unload", {"json": {"model": "chat-a"}}),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("POST", "/models/unload", {"json": {"model": "secret"}}),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=404)),
    (("POST", "/models/load", {"json": {"model": "secret"}}),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=404)),
    (("POST", "/models/load", {"json": {"model": "no-such-model"}}),
     dict(admin=404, infer=403, all=403, metrics=403, both=403, some=404)),
    (("POST", "/models/reload", ANY),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=200)),
    (("POST", "/models", {"json": {"model": "owner/repo:Q4_K_M"}}),
     dict(infer=403, all=403, metrics=403, both=403)),  # admins would ask the Hub
    (("DELETE", "/models?model=secret", ANY),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=404)),
    (("DELETE", "/models?model=chat-b", ANY),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("GET", "/logs", ANY), dict(admin=200, infer=403, all=403, metrics=403, both=403,
                                 some=403)),
    (("GET", "/logs?model=secret", ANY),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=404)),
    (("GET", "/logs?model=chat-b", ANY),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=200)),
    (("GET", "/activity", ANY), dict(admin=200, infer=403, all=403, metrics=403, both=403,
                                     some=200)),
    (("GET", "/activity/totals", ANY),
     dict(admin=200, infer=403, all=403, metrics=403, both=403, some=200)),
    (("GET", "/slots?model=chat-a", ANY),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("POST", "/slots/0?action=erase&model=chat-a", {"json": {}}),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("GET", "/lora-adapters?model=chat-a", ANY),
     dict(admin=400, infer=400, all=400, metrics=403, both=404, some=400)),
    (("POST", "/lora-adapters?model=chat-a", {"json": []}),
     dict(admin=400, infer=403, all=403, metrics=403, both=403, some=400)),
    (("GET", "/v1/stream?conv_id=nobody", ANY),
     dict(admin=404, infer=404, all=404, metrics=403, both=404, some=404)),
    (("POST", "/v1/streams/lookup", {"json": {"conversation_ids": ["nobody"]}}),
     dict(admin=200, infer=200, all=200, metrics=403, both=200, some=200)),
    (("GET", "/health", ANY), dict(admin=200, infer=200, all=200, metrics=200, both=200,
                                   some=200)),
]


@pytest.mark.fake
@pytest.mark.parametrize(("request_", "expected"), MATRIX,
                         ids=[f"{r[0]} {r[1]} {json.dumps(r[2])}" for r, _ in MATRIX])
async def test_the_auth_matrix(app: Starlette, request_: tuple[str, str, dict[str, Any]],
                               expected: dict[str, int]) -> None:
    method, target, kw = request_
    for who, status in expected.items():
        response = await call(app, method, target, who, **kw)
        assert response.status_code == status, (who, response.text)
        if status == DENIED:
            error = response.json()["error"]
            assert error == {"code": 403, "type": "permission_error",
                             "message": error["message"]}, who
            assert "key" in error["message"] and KEYS[who][0] not in error["message"]
        if status == NOT_FOUND:  # out of scope or nobody's: the same answer
            assert response.json()["error"]["type"] == "not_found_error", who
            assert "not found" in response.json()["error"]["message"], who
    public = target == "/health"
    assert (await call(app, method, target, **kw)).status_code == (200 if public else 401)
    wrong = await call(app, method, target, headers={"X-Api-Key": "wrong"}, **kw)
    assert wrong.status_code == (200 if public else 401)


def listed(response: httpx.Response) -> set[str]:
    assert response.status_code == 200, response.text
    return {m["id"] for m in response.json()["data"]}


@pytest.mark.fake
async def test_listings_show_a_scoped_key_only_its_models(app: Starlette) -> None:
    everything = set(MODELS)
    in_chat_scope = {"chat-a", "chat-b", "assistant"}
    for who, models in [("admin", everything), ("all", everything),
                        ("infer", in_chat_scope | {"coder"}), ("both", {"coder"}),
                        ("some", in_chat_scope)]:
        for path in ("/v1/models", "/models"):
            assert listed(await call(app, "GET", path, who)) == models, (who, path)


@pytest.mark.fake
async def test_close_matches_name_only_models_in_scope(app: Starlette) -> None:
    admin = (await chat_as(app, "admin", "secrt")).json()
    assert "did you mean 'secret'" in admin["error"]["message"]
    scoped = await chat_as(app, "infer", "secrt")
    assert scoped.status_code == 404
    assert scoped.json()["error"]["message"] == "model 'secrt' not found"
    near = (await chat_as(app, "infer", "chat-aa")).json()
    assert "did you mean 'chat-a'" in near["error"]["message"]


@pytest.mark.fake
async def test_an_infer_key_cannot_load_or_unload_even_its_own_model(app: Starlette) -> None:
    for path in ("/models/load", "/models/unload"):
        response = await call(app, "POST", path, "infer", json={"model": "chat-a"})
        assert response.status_code == 403
        assert "needs role=admin" in response.json()["error"]["message"]
    state: State = app.state.router
    assert state.models.view("chat-a").status.value == "unloaded"


@pytest.mark.fake
async def test_the_event_stream_shows_a_scoped_key_only_its_models(app: Starlette) -> None:
    state: State = app.state.router
    events: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":  # subscribed: these come after the snapshot
            state.events.publish("secret", "model_status", {"status": {"value": "loading"}})
            state.events.publish("chat-b", "marker")
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
    stream = EventStream(state, KeyScope(frozenset({INFER}), ("chat-*",)))
    await stream(scope, receive, send)  # type: ignore[arg-type]
    assert {e["model"] for e in events} == {"chat-a", "chat-b", "assistant"}
    assert events[-1]["event"] == "marker"


@pytest.mark.fake
async def test_no_key_shows_in_answers_or_logs(app: Starlette,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for who in KEYS:
        await chat_as(app, who, "chat-a")
        await call(app, "POST", "/models/unload", who, json={"model": "secret"})
    texts = [(await call(app, "GET", path, "admin")).text
             for path in ("/props", "/models", "/metrics", "/logs?lines=1000", "/activity")]
    texts += [caplog.text]
    for key, _ in KEYS.values():
        for text in texts:
            assert key not in text


def test_the_middleware_refuses_one_key_with_two_scopes() -> None:
    @contextlib.asynccontextmanager
    async def no_lifespan(app: Starlette) -> AsyncIterator[None]:
        yield

    same = [ApiKey("k", KeyScope(frozenset({INFER}))), ApiKey("k", FULL)]
    application = create_app(no_lifespan, same)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice with different scopes"):
        application.build_middleware_stack()


# --------------------------------------------------------------------------- keys swapped

HANG_GUARD_S = 30.0  # generous: every wait below ends at once when the router is right
KEY_A, KEY_B = "sk-a-removed-0123456789", "sk-b-kept-0123456789"


class Held:
    """A stand-in for what runs behind the key check: the response each path gives, held
    open until ``release`` is set. ``/sse``: an event stream, one event sent; ``/body``: a
    plain body, one chunk sent; ``/wait``: nothing answered yet (a request that waits for its
    model)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if path != "/wait":
            kind = b"text/event-stream" if path == "/sse" else b"text/plain"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", kind)]})
            await send({"type": "http.response.body", "body": b"data: 1\n\n",
                        "more_body": True})
        await self.release.wait()
        if path != "/wait":
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})


async def poll(predicate: Any) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not predicate():  # noqa: ASYNC110 (a count, no event to await)
            await asyncio.sleep(0.01)


async def read_all(client: httpx.AsyncClient, path: str, key: str) -> tuple[int, bytes]:
    async with client.stream("GET", path, headers={"Authorization": f"Bearer {key}"}) as r:
        body = b""
        async for chunk in r.aiter_raw():
            body += chunk
        return r.status_code, body


async def test_a_removed_keys_requests_end_and_the_other_keys_go_on() -> None:
    """Swapping the keys ends every request of a key removed, wherever it is: a 503 envelope
    for one not answered yet, a last error event for an event stream, a cut body otherwise;
    the requests of a key kept go on, and the removed key is refused from then on."""
    held = Held()
    keys = Keys([ApiKey(KEY_A, KeyScope(frozenset({INFER}))), ApiKey(KEY_B)])
    app = RequestMetricsMiddleware(ApiKeyMiddleware(held, keys), None)
    async with serve_in_uvicorn(app, HANG_GUARD_S, lifespan="off") as url, \
            httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        a_sse, a_body, a_wait, b_sse = (
            asyncio.ensure_future(read_all(client, path, key)) for path, key in
            (("/sse", KEY_A), ("/body", KEY_A), ("/wait", KEY_A), ("/sse", KEY_B)))
        await poll(lambda: keys.in_flight() == 4)
        changed = keys.swap([ApiKey(KEY_B, KeyScope(frozenset({INFER})))])
        assert changed == KeysChanged(added=0, removed=1, changed=1, ended=3)
        status, body = await a_sse
        assert status == 200 and body.startswith(b"data: 1\n\n")
        ended = json.loads(body.split(b"data: ")[-1])
        assert ended["error"]["code"] == 503 and "API key" in ended["error"]["message"]
        status, body = await a_wait
        assert status == 503 and json.loads(body)["error"]["type"] == "unavailable_error"
        assert "removed from the router's key file" in json.loads(body)["error"]["message"]
        with pytest.raises(httpx.RemoteProtocolError):
            await a_body  # cut: the client sees a body that never completed
        assert (await read_all(client, "/wait", KEY_A))[0] == 401  # refused from now on
        assert not b_sse.done()
        held.release.set()
        assert await b_sse == (200, b"data: 1\n\ndata: [DONE]\n\n")  # untouched
        assert keys.in_flight() == 0
        assert keys.current.scopes[0] is not None  # B's new scope for its next requests


async def test_a_key_removal_ends_an_event_stream_of_the_routers_own(
        tmp_path: Path) -> None:
    """``/models/sse`` of a removed key ends too (with its last error event), and leaves no
    task of its own behind."""
    keys = Keys([KEY_A])
    closing = asyncio.Event()
    pending: asyncio.Queue[str] = asyncio.Queue()

    async def events(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await sse.respond(scope, receive, send, pending.get, closing)

    app = RequestMetricsMiddleware(ApiKeyMiddleware(events, keys), None)
    async with serve_in_uvicorn(app, HANG_GUARD_S, lifespan="off") as url, \
            httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        before = len(asyncio.all_tasks())
        stream = asyncio.ensure_future(read_all(client, "/models/sse", KEY_A))
        await poll(lambda: keys.in_flight() == 1)
        pending.put_nowait('{"event": "first"}')
        assert keys.swap([KEY_B]).ended == 1
        status, body = await stream
        assert status == 200 and body.endswith(b"\n\n") and b'"code": 503' in body
        await poll(lambda: len(asyncio.all_tasks()) <= before)


# --------------------------------------------------------------------------- real server

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.mark.real
def test_a_scoped_key_against_the_real_llama_server(tmp_path: Path, llama_server: Path,
                                                    tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini", "version = 1\n[*]\nctx-size = 1024\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\n")
    admin, scoped = "admin-key-7f3a91", "scoped-key-c2d8e4"
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"# team A: chat with alpha only\n{scoped}  models=alpha  role=infer\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key", admin, "--api-key-file", str(key_file)) as router, \
            router.client() as client:
        as_scoped = {"Authorization": f"Bearer {scoped}"}
        as_admin = {"Authorization": f"Bearer {admin}"}
        answer = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT},
                             headers=as_scoped)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        refused = client.post("/v1/chat/completions", json={"model": "beta", **CHAT},
                              headers=as_scoped)
        nobody = client.post("/v1/chat/completions", json={"model": "gamma", **CHAT},
                             headers=as_scoped)
        assert (refused.status_code, nobody.status_code) == (404, 404)
        assert refused.json()["error"] == {**nobody.json()["error"],
                                           "message": "model 'beta' not found"}
        assert [m["id"] for m in client.get("/v1/models", headers=as_scoped).json()["data"]] \
            == ["alpha"]
        assert {m["id"] for m in client.get("/v1/models", headers=as_admin).json()["data"]} \
            == {"alpha", "beta"}
        unload = client.post("/models/unload", json={"model": "alpha"}, headers=as_scoped)
        assert unload.status_code == 403
        assert unload.json()["error"]["type"] == "permission_error"
        assert client.get("/metrics", headers=as_scoped).status_code == 403
        # Neither key anywhere: the router's answers, its log, the child's argv and environ.
        seen = [client.get(path, headers=as_admin).text for path in
                ("/props", "/models", "/metrics", "/logs?lines=1000",
                 "/logs?model=alpha&lines=1000")]
        child = next(p for p in router.children() if "llama-server" in p.name())
        seen += [" ".join(child.cmdline()), " ".join(child.environ().values()), router.log()]
        for key in (admin, scoped):
            assert not any(key in text for text in seen), key
        # The scoped key's refusal left the model loaded; the admin key may unload it.
        models = client.get("/models", headers=as_admin).json()["data"]
        assert next(m for m in models if m["id"] == "alpha")["status"]["value"] == "loaded"
        assert client.post("/models/unload", json={"model": "alpha"},
                           headers=as_admin).status_code == 200
