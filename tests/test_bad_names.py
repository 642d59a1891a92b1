"""Names no answer can carry, through ``llama-router serve`` with real llama-server children:
a GGUF in ``--models-dir`` whose file name is not UTF-8 (served as ``bad\\xff``, at start and
after a reload), a model name holding a lone surrogate, and JSON nested 100,000 deep: each a
model that serves or a 400 envelope, never a start that stops or a 500.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from support import start_router

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
DEEP = b"[" * 100_000 + b"]" * 100_000


def named(directory: Path, raw: bytes) -> Path:
    """``directory/raw``, for a name given as bytes (not necessarily UTF-8)."""
    return Path(os.fsdecode(os.fsencode(directory) + b"/" + raw))


def chat(client: httpx.Client, model: str) -> str:
    answer = client.post("/v1/chat/completions", json={"model": model, **CHAT})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["message"]["content"])


def assert_400(response: httpx.Response, text: str) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == 400 and text in error["message"], error


def test_a_file_name_that_is_not_utf8_is_served_under_a_safe_id(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    shutil.copy(tiny_models["alpha"], named(root, b"bad\xff.gguf"))
    shutil.copy(tiny_models["beta"], root / "good.gguf")
    with start_router(tmp_path, "--models-dir", str(root)) as router, \
            router.client() as client:
        listed = client.get("/models")
        assert listed.status_code == 200, listed.text
        ids = {m["id"]: m for m in listed.json()["data"]}
        assert set(ids) == {"bad\\xff", "good"}
        assert chat(client, "bad\\xff") and chat(client, "good")
        shown = client.get("/models").json()["data"]
        args = next(m for m in shown if m["id"] == "bad\\xff")["status"]["args"]
        assert args[args.index("--model") + 1].endswith("/bad\\xff.gguf")
        assert client.get("/v1/models").status_code == 200
        assert "not valid UTF-8: served as model 'bad\\xff'" in router.log()

        # A reload that finds another such file adds it, and both serve.
        shutil.copy(tiny_models["gamma"], named(root, b"new\xfe\xfd.gguf"))
        reloaded = client.post("/models/reload")
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["added"] == ["new\\xfe\\xfd"]
        assert chat(client, "new\\xfe\\xfd") and chat(client, "bad\\xff")
        assert "served as model 'new\\xfe\\xfd'" in router.log()


def test_lone_surrogates_and_deep_json_get_a_400(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    shutil.copy(tiny_models["alpha"], root / "alpha.gguf")
    with start_router(tmp_path, "--models-dir", str(root)) as router, \
            router.client(headers={"content-type": "application/json"}) as client:
        for path in ("/models/load", "/models/unload", "/v1/chat/completions",
                     "/v1/embeddings", "/tokenize"):
            for name in (b"\\ud800", b"alpha\\udfff", b"\\udc00\\ud800"):
                body = b'{"model": "' + name + b'", "messages": [], "content": "x"}'
                assert_400(client.post(path, content=body), "not valid Unicode")
        for path in ("/v1/streams/lookup", "/v1/chat/completions", "/models/load"):
            assert_400(client.post(path, content=DEEP), "nested too deeply")
        assert_400(client.post("/v1/streams/lookup",
                               content=b'{"conversation_ids": ' + DEEP + b"}"),
                   "nested too deeply")
        # The router serves on: the real child answers.
        assert chat(client, "alpha")
        assert "Traceback" not in router.log()
