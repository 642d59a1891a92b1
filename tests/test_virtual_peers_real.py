"""A virtual model whose targets are on two routers on one machine: a node (127.0.0.2) holds
``beta``; a gateway (127.0.0.1) holds ``alpha`` and fronts the node with ``--peer``. Its
virtual model ``assistant`` (``targets = beta, alpha``, ``choose = fallback``) is answered by
the node's ``beta`` while the node is up, and by the gateway's own ``alpha`` once the node is
gone, with no request lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

NODE = "127.0.0.2"
ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
PEER_OPTIONS = ("--liveness-interval", "0.5", "--liveness-misses", "2",
                "--liveness-timeout", "5")


def test_a_virtual_model_falls_back_from_a_peers_target_to_its_own(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    node_presets = write_presets(tmp_path / "node.ini",
                                 f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 256\n")
    gateway_presets = write_presets(tmp_path / "gateway.ini", (
        f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 256\n"
        "[assistant]\ntargets = beta, alpha\nchoose = fallback\n"))
    with start_router(tmp_path, "--presets", str(node_presets), "--node-name", "node-b",
                      host=NODE) as node, \
            start_router(tmp_path, "--presets", str(gateway_presets), "--peer", node.url,
                         *PEER_OPTIONS) as gateway, gateway.client() as client:
        assert wait_until(lambda: "beta" in gateway.models(), 30)
        answer = client.post("/v1/chat/completions", json={"model": "assistant", **ASK})
        assert answer.status_code == 200, answer.text
        listed = gateway.models()
        assert listed["assistant"]["last_target"] == "beta"
        assert listed["alpha"]["status"]["value"] == "unloaded"  # the node answered
        assert node.models()["beta"]["status"]["value"] == "loaded"

        node.proc.terminate()
        node.proc.wait(30)
        # The node is gone: the virtual model's next target, the gateway's own model.
        for _ in range(3):
            answer = client.post("/v1/chat/completions",
                                 json={"model": "assistant", **ASK})
            assert answer.status_code == 200, answer.text
        listed = gateway.models()
        assert listed["assistant"]["last_target"] == "alpha"
        assert listed["alpha"]["status"]["value"] == "loaded"
