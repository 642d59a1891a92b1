"""Bad input gets a clear 4xx envelope, never a 500: each case once caused a traceback."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support import fake_binary, start_router, write_presets

pytestmark = pytest.mark.fake

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def envelope_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    return str(error["message"])


@pytest.fixture
def router(tmp_path: Path):  # type: ignore[no-untyped-def]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "p.ini", f"[m]\nmodel = {model}\n")
    # No Hub here: a closed port stands for a network that is down.
    with start_router(tmp_path, "--llama-server", str(fake_binary(tmp_path)), "--presets",
                      str(presets), env={"HF_ENDPOINT": "http://127.0.0.1:9"}) as running:
        yield running


def test_bad_input_is_a_client_error_with_the_envelope(router) -> None:  # type: ignore[no-untyped-def]
    with router.client() as client:
        deep = b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        message = envelope_of(client.post("/v1/chat/completions", content=deep,
                                          headers={"content-type": "application/json"}), 400)
        assert "nested too deeply" in message
        for budget in ("nan", "inf", "-1", "0"):
            message = envelope_of(client.post("/v1/chat/completions", json={"model": "m", **CHAT},
                                              headers={"X-Wait-Budget": budget}), 400)
            assert "positive, finite" in message or "number of seconds" in message
        for lines in ("²", "9" * 5000, "-1", "1.5"):
            assert "lines must be" in envelope_of(client.get("/logs", params={"lines": lines}),
                                                  400)
        for name in ("a/b\nc", "a/..", "a/.", "a-/b", "a/b:Q4\r\nX: y"):
            envelope_of(client.post("/models", json={"model": name}), 400)
        # A well-formed name with the Hub out of reach: the Hub's fault, said so.
        message = envelope_of(client.post("/models", json={"model": "owner/repo:Q4_K_M"}), 502)
        assert "cannot reach the Hugging Face Hub" in message
        # Still serving, nothing logged as a crash.
        assert client.post("/v1/chat/completions",
                           json={"model": "m", **CHAT}).status_code == 200
    assert "Traceback" not in router.log()
