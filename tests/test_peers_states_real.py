"""A conversation kept on a node's disk, across nodes: two nodes (llama-routers with
``--state-dir`` and real llama-server children, on 127.0.0.2 and 127.0.0.3) share a model
behind a gateway. A conversation served by one node, whose model is then unloaded there (its
slot saved), takes its next turn on that node again, restored, though by load alone the
other node came first (``placement.by_saved_state``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"
GUARD_S = 120.0  # a hang guard, never a measurement
OPENING = "Conversation K: " + "the kept fox jumps over the lazy dog. " * 40
MORE = " And then it ran into the forest, far away from the farm. " * 4


@contextlib.contextmanager
def node(tmp_path: Path, tiny_models: dict[str, Path], host: str, name: str
         ) -> Iterator[RouterProcess]:
    presets = write_presets(tmp_path / f"{name}.ini",
                            f"[*]\nctx-size = 4096\nparallel = 1\ncache-ram = 0\n"
                            f"[shared]\nmodel = {tiny_models['alpha']}\n")
    with start_router(tmp_path, "--presets", str(presets), "--node-name", name,
                      "--state-dir", str(tmp_path / f"states-{name}"), host=host) as router:
        yield router


def served(router: RouterProcess) -> float:
    """``/completion`` requests ``router`` answered for ``shared`` (its own metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with router.client() as client:
        text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "llamarouter_requests_total" and s.labels.get("model") == "shared"
               and s.labels.get("endpoint") == "/completion")


def shared_status(router: RouterProcess) -> dict[str, Any]:
    found: dict[str, Any] = router.models()["shared"]["status"]
    return found


def turn(client: httpx.Client, prompt: str) -> dict[str, Any]:
    response = client.post("/completion", json={"model": "shared", "prompt": prompt,
                                                "n_predict": 4, "temperature": 0,
                                                "cache_prompt": True}, timeout=GUARD_S)
    assert response.status_code == 200, response.text
    timings: dict[str, Any] = response.json()["timings"]
    return timings


def test_a_conversation_goes_back_to_the_node_that_keeps_it(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with node(tmp_path, tiny_models, NODE_A, "node-a") as a, \
            node(tmp_path, tiny_models, NODE_B, "node-b") as b, \
            start_router(tmp_path, "--peer", a.url, "--peer", b.url,
                         "--node-name", "gw") as gateway, \
            httpx.Client(base_url=gateway.url, timeout=GUARD_S) as client:
        assert wait_until(lambda: "shared" in gateway.models(), GUARD_S), gateway.log()
        load = client.post("/models/load", json={"model": "shared", "node": "node-b"})
        assert load.status_code == 200, load.text
        assert wait_until(lambda: shared_status(b)["value"] == "loaded", GUARD_S)
        first = turn(client, OPENING)  # node-b: the only node where it is loaded
        # A node counts a request once its answer is written: the client may be faster.
        assert wait_until(lambda: served(b) == 1, GUARD_S) and served(a) == 0
        unload = client.post("/models/unload", json={"model": "shared", "node": "node-b"})
        assert unload.status_code == 200, unload.text
        assert wait_until(lambda: shared_status(b)["value"] == "unloaded"
                          and shared_status(b)["states"]["count"] >= 1, GUARD_S), \
            shared_status(b)
        # Loaded nowhere now: by load alone node-a comes first; node-b keeps the conversation.
        second = turn(client, OPENING + MORE)
        assert wait_until(lambda: served(b) == 2, GUARD_S) and served(a) == 0, gateway.log()
        assert second["cache_n"] >= first["prompt_n"] // 2, (first, second)  # restored
        assert shared_status(b)["states"]["restored"] >= 1
        metrics = client.get("/metrics").text
    assert any(line.startswith("llamarouter_replica_routing_total{")
               and 'decision="saved_state"' in line and 'model="shared"' in line
               for line in metrics.splitlines()), metrics
