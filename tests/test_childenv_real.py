"""Children's environment with the real llama-server (``router.children.childenv``): a router on a
Vertex AI prediction container (``AIP_MODE=PREDICTION``, ``AIP_HTTP_PORT`` = the router's own
port) still serves from its children, and options set in the router's environment
(``LLAMA_ARG_*``) do not reach them: presets decide; a preset's own ``env`` does, and a
secret-looking value of it is never shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import free_port, start_router, write_presets

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def test_a_router_on_a_prediction_container_serves_from_its_children(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    port = free_port("127.0.0.1")
    presets = write_presets(tmp_path / "env.ini", f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 1024\n")
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port), "AIP_HEALTH_ROUTE": "/ok",
           "AIP_PREDICT_ROUTE": "/predict", "LLAMA_ARG_CTX_SIZE": "256",
           "LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_SERVER_CHILD_MODE": "download",
           "CUDA_VISIBLE_DEVICES": "", "GGML_SCHED_MAX_COPIES": "1"}
    with start_router(tmp_path, "--presets", str(presets), port=port, env=env) as router, \
            router.client() as client:
        for model in ("alpha", "beta"):
            reply = client.post("/v1/chat/completions", json={"model": model, **CHAT})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
        # The preset's context and llama-server's default; never the router's LLAMA_ARG_*.
        contexts = {model: client.get("/props", params={"model": model}).json()
                    ["default_generation_settings"]["n_ctx"] for model in ("alpha", "beta")}
        assert contexts["beta"] == 1024 and contexts["alpha"] not in (256, 1024), contexts
        children = [p for p in router.children() if "llama-server" in p.name()]
        assert len(children) == 2
        for child in children:
            environ = child.environ()
            assert not [name for name in environ if name.startswith(("AIP_", "LLAMA_ARG_"))]
            assert environ["LLAMA_SERVER_ROUTER_PORT"] == str(port)
            assert "LLAMA_SERVER_CHILD_MODE" not in environ
            assert environ["CUDA_VISIBLE_DEVICES"] == "" and environ["GGML_SCHED_MAX_COPIES"] == "1"
        log = router.log()
    assert ("not passed to llama-server children: AIP_HEALTH_ROUTE, AIP_HTTP_PORT, AIP_MODE, "
            "AIP_PREDICT_ROUTE, LLAMA_ARG_CTX_SIZE, LLAMA_ARG_EMBEDDINGS, "
            "LLAMA_SERVER_CHILD_MODE") in log


def test_a_presets_env_reaches_its_child_and_a_secret_is_never_shown(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """A preset's ``env`` entries are in its child's environment (``/proc/<pid>/environ``),
    over the router's own; ``/models`` shows them, a secret-looking one as ``***``, and its
    value is in no answer and no log line."""
    presets = write_presets(tmp_path / "env.ini", f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                            "env = LLAMA_ROUTER_TEST_MARK=hello, MY_SERVICE_TOKEN=s3cret-value, "
                            "CUDA_VISIBLE_DEVICES=\n")
    with start_router(tmp_path, "--presets", str(presets), "--log-level", "debug",
                      env={"CUDA_VISIBLE_DEVICES": "0"}) as router, \
            router.client() as client:
        reply = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
        assert reply.status_code == 200, reply.text
        listing = client.get("/models")
        status = next(m for m in listing.json()["data"] if m["id"] == "alpha")["status"]
        assert status["env"] == {"LLAMA_ROUTER_TEST_MARK": "hello", "MY_SERVICE_TOKEN": "***",
                                 "CUDA_VISIBLE_DEVICES": ""}
        environ = proc_environ(status["pid"])
        assert environ["LLAMA_ROUTER_TEST_MARK"] == "hello"
        assert environ["MY_SERVICE_TOKEN"] == "s3cret-value"
        assert environ["CUDA_VISIBLE_DEVICES"] == ""  # the preset's, not the router's
        assert "s3cret-value" not in listing.text
        assert "s3cret-value" not in client.get("/props").text
        log = router.log()
    assert "s3cret-value" not in log


def proc_environ(pid: int) -> dict[str, str]:
    """A process's environment as ``/proc/<pid>/environ`` holds it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)
