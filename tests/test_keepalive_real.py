"""A request's ``keep_alive`` on the real llama-server: the model's idle TTL for its current
load, set by a key that may load and unload models and ignored from another; ``0`` unloads the
model once its requests are done, a pin notwithstanding; a negative one keeps it past the
router's ``--idle-timeout``; a value that is no duration is a 400 on every body shape; a
preset's ``strip = keep_alive`` ignores clients' values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

ADMIN, INFER = "sk-keepalive-admin", "sk-keepalive-infer"


def presets(tiny: dict[str, Path], extra: str = "") -> str:
    return (f"[alpha]\nmodel = {tiny['alpha']}\nctx-size = 256\n\n"
            f"[beta]\nmodel = {tiny['beta']}\nctx-size = 256\npin = true\n\n"
            f"[gamma]\nmodel = {tiny['gamma']}\nctx-size = 256\nstrip = keep_alive\n{extra}")


def complete(client: object, model: str, key: str, keep_alive: object = None,
             **extra: object) -> object:
    body: dict[str, object] = {"model": model, "prompt": "Hi", "n_predict": 2, **extra}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    return client.post("/completion", json=body,  # type: ignore[attr-defined]
                       headers={"Authorization": f"Bearer {key}"})


def status(router: object, model: str) -> str:
    with router.client(headers={"Authorization": f"Bearer {ADMIN}"}) as c:  # type: ignore
        entry = next(m for m in c.get("/models").json()["data"] if m["id"] == model)
    return entry["status"]["value"]  # type: ignore[no-any-return]


def entry(router: object, model: str) -> dict[str, object]:
    with router.client(headers={"Authorization": f"Bearer {ADMIN}"}) as c:  # type: ignore
        return next(m for m in c.get("/models").json()["data"] if m["id"] == model)


def test_keep_alive_sets_unloads_and_is_refused_when_no_duration(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    path = write_presets(tmp_path / "p.ini", presets(tiny_models))
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{ADMIN}\n{INFER} role=infer\n")
    with start_router(tmp_path, "--presets", str(path), "--api-key-file", str(keys),
                      "--idle-timeout", "2") as router, router.client() as client:
        # An admin key: the TTL for this load, shown in the model's entry.
        assert complete(client, "alpha", ADMIN, "1h").status_code == 200
        assert entry(router, "alpha")["keep_alive"] == 3600
        # Negative: no idle TTL; the router's --idle-timeout of 2 s no longer applies.
        assert complete(client, "alpha", ADMIN, -1).status_code == 200
        assert entry(router, "alpha")["keep_alive"] == -1
        # An infer key's value is ignored (Ollama's clients send it with every request).
        assert complete(client, "alpha", INFER, 0).status_code == 200
        assert entry(router, "alpha")["keep_alive"] == -1

        # Not a duration: a 400 envelope naming the field, whatever the key, nothing loaded.
        for bad in ("soon", True, [1], {"s": 1}, "5 minutes", "1e400x"):
            for key in (ADMIN, INFER):
                answer = complete(client, "beta", key, bad)
                assert answer.status_code == 400, answer.text  # type: ignore[attr-defined]
                error = answer.json()["error"]  # type: ignore[attr-defined]
                assert "keep_alive" in error["message"] and error["type"] == \
                    "invalid_request_error"
        raw = client.post("/completion", content=b'{"model": "beta", "prompt": "x", '
                          b'"keep_alive": NaN}', headers={"Authorization": f"Bearer {ADMIN}",
                                                          "Content-Type": "application/json"})
        assert raw.status_code == 400 and "keep_alive" in raw.json()["error"]["message"]
        assert status(router, "beta") == "unloaded"

        # 0: unloaded once the request is done, though beta is pinned (an explicit unload).
        assert complete(client, "beta", ADMIN).status_code == 200
        assert status(router, "beta") == "loaded"
        assert complete(client, "beta", ADMIN, "0s").status_code == 200
        assert wait_until(lambda: status(router, "beta") == "unloaded", 30)
        assert "keep_alive 0" in router.log()
        # A body past the scan threshold (scanned, not parsed): read the same way.
        assert complete(client, "beta", ADMIN, 0, padding="x" * 400_000).status_code == 200
        assert wait_until(lambda: status(router, "beta") == "unloaded", 30)
        # Streamed chat: the same, once the stream has ended.
        with client.stream("POST", "/v1/chat/completions", headers={
                "Authorization": f"Bearer {ADMIN}"}, json={
                "model": "beta", "max_tokens": 2, "stream": True, "keep_alive": 0,
                "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status_code == 200
            body = b"".join(response.iter_bytes())
        assert b"[DONE]" in body
        assert wait_until(lambda: status(router, "beta") == "unloaded", 30)

        # A preset that strips keep_alive ignores the clients' values.
        assert complete(client, "gamma", ADMIN, 0).status_code == 200
        assert status(router, "gamma") == "loaded" and "keep_alive" not in entry(router, "gamma")

        # alpha, kept alive with no TTL, outlived the router's 2 s idle TTL.
        assert status(router, "alpha") == "loaded"
        # A stop ends the request's TTL: loaded again, the router's own applies.
        assert client.post("/models/unload", json={"model": "alpha"},
                           headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert wait_until(lambda: status(router, "alpha") == "unloaded", 30)
        assert complete(client, "alpha", ADMIN).status_code == 200
        assert "keep_alive" not in entry(router, "alpha")
        assert wait_until(lambda: status(router, "alpha") == "unloaded", 30)
        assert json.dumps(entry(router, "alpha")).find(ADMIN) < 0
