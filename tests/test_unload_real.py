"""An explicit unload of a busy model, on the real llama-server: the requests in flight end at
once with the unload's 503 (not the 502 of a crash), and the child exits promptly instead of
being killed after its stop timeout."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

STOP_TIMEOUT_S = 20  # an unload that waited for it would show


def long_chat(stream: bool) -> dict[str, Any]:
    return {"model": "long", "stream": stream, "max_tokens": 30000,
            "messages": [{"role": "user", "content": "Hello"}]}


def models(router_url: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(router_url + "/models", timeout=10).json()["data"]
    return {m["id"]: m for m in data}


def test_unload_ends_requests_in_flight_with_503_and_stops_at_once(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "p.ini", (
        f"[long]\nmodel = {tiny_models['long']}\nctx-size = 32768\nparallel = 2\n"))
    with start_router(tmp_path, "--presets", str(presets), "--stop-timeout",
                      str(STOP_TIMEOUT_S)) as router:
        plain: dict[str, Any] = {}

        def non_streamed() -> None:
            with httpx.Client(base_url=router.url, timeout=120) as client:
                response = client.post("/v1/chat/completions", json=long_chat(False))
                plain["status"], plain["body"] = response.status_code, response.json()

        with httpx.Client(base_url=router.url, timeout=120) as client, client.stream(
                "POST", "/v1/chat/completions", json=long_chat(True)) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in first
            worker = threading.Thread(target=non_streamed)
            worker.start()
            assert wait_until(lambda: models(router.url)["long"]["status"].get("in_flight") == 2,
                              30), models(router.url)
            started = time.monotonic()
            unload = httpx.post(router.url + "/models/unload", json={"model": "long"},
                                timeout=60)
            took = time.monotonic() - started
            assert unload.status_code == 200, unload.text
            events = [line for line in lines if line.startswith("data: ")]
        worker.join(60)
        assert took < STOP_TIMEOUT_S / 2, f"the unload took {took:.1f} s"
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == 503, last
        assert "was unloaded" in last["error"]["message"], last
        assert plain["status"] == 503, plain
        assert "was unloaded" in plain["body"]["error"]["message"], plain
        assert models(router.url)["long"]["status"]["value"] == "unloaded"
        log = router.log()
        assert "did not stop within" not in log, log[-3000:]
        # And the model loads again for the next request.
        again = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
            **long_chat(False), "max_tokens": 4})
        assert again.status_code == 200, again.text
