"""Live configuration against the real llama-server: edits apply without dropping a request."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SSEClient, alive, start_router, wait_until

pytestmark = pytest.mark.real


def ini(models: dict[str, Path], long_ctx: int = 8192, with_b: bool = True,
        broken: bool = False) -> str:
    text = f"[a]\nmodel = {models['long']}\nctx-size = {long_ctx}\nparallel = 1\n"
    if with_b:
        text += f"[b]\nmodel = {models['beta']}\nctx-size = 1024\n"
    if broken:
        text += "ctx-sise = 5\n"
    return text


def save_atomically(path: Path, text: str) -> None:
    """What editors do: write a temporary file, then rename it over the original."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def models(tiny_models: dict[str, Path], llama_server: Path) -> dict[str, Path]:
    return tiny_models


class Stream(threading.Thread):
    """A long streamed generation, read to the end in the background."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.started = threading.Event()
        self.body = b""
        self.status = 0

    def run(self) -> None:
        request: dict[str, Any] = {"model": self.model, "stream": True, "max_tokens": 8000,
                                   "ignore_eos": True,
                                   "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", self.url + "/v1/chat/completions", json=request) as r:
            self.status = r.status_code
            for chunk in r.iter_raw():
                self.body += chunk
                self.started.set()

    def finished_cleanly(self) -> bool:
        return self.status == 200 and self.body.rstrip().endswith(b"data: [DONE]")


def test_changed_model_restarts_after_its_stream(tmp_path: Path,
                                                 models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        for name in ("a", "b"):
            assert client.post("/models/load?wait=true", json={"model": name}).status_code == 200
        before = {m: d["status"]["pid"] for m, d in router.models().items()}
        stream = Stream(router.url, "a")
        stream.start()
        assert stream.started.wait(30)
        save_atomically(presets, ini(models, long_ctx=4096))
        stream.join(120)
        assert stream.finished_cleanly(), stream.body[-300:]
        assert wait_until(lambda: router.models()["a"]["status"].get("pid") not in
                          (None, before["a"]) and
                          router.models()["a"]["status"]["value"] == "loaded", 30)
        args = router.models()["a"]["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "4096"
        assert not alive(before["a"])
        assert router.models()["b"]["status"]["pid"] == before["b"]  # unchanged: same child
        assert "event=reloaded" in router.log()


def test_removed_model_finishes_its_stream_then_disappears(tmp_path: Path,
                                                          models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=True))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        stream = Stream(router.url, "a")
        stream.start()
        assert stream.started.wait(30)
        pid = router.models()["a"]["status"]["pid"]
        presets.write_text(f"[b]\nmodel = {models['beta']}\nctx-size = 1024\n")
        # Whichever comes first, the file watcher or this request, applies the removal.
        assert client.post("/models/reload").json()["success"] is True
        # New requests for the removed model are refused at once; the stream goes on to its
        # end (a removal that stopped the child would cut it).
        refused = client.post("/v1/chat/completions", json={
            "model": "a", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 404
        stream.join(120)
        assert stream.finished_cleanly()
        assert wait_until(lambda: "a" not in router.models(), 10)
        assert wait_until(lambda: not alive(pid), 5)


def test_broken_edit_keeps_the_last_good_configuration(tmp_path: Path,
                                                       models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        save_atomically(presets, ini(models, broken=True))
        assert wait_until(lambda: client.get("/props").json()["config_error"], 5)
        error = client.get("/props").json()["config_error"]
        assert any("live.ini:8: [b] ctx-sise: unknown key" in e for e in error), error
        assert "reload rejected" in router.log()
        chat = client.post("/v1/chat/completions", json={
            "model": "b", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 200  # still serving the previous configuration
        api = client.post("/models/reload")
        assert api.status_code == 400 and "ctx-sise" in api.json()["error"]["message"]
        save_atomically(presets, ini(models, long_ctx=2048))
        assert wait_until(lambda: client.get("/props").json()["config_error"] is None, 5)
        args = router.models()["a"]["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "2048"


def test_atomic_save_is_picked_up_within_a_second(tmp_path: Path,
                                                  models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=False))
    with start_router(tmp_path, "--presets", str(presets)) as router:
        assert set(router.models()) == {"a"}
        sse = SSEClient(router.url)
        sse.start()
        assert sse.connected.wait(10)
        save_atomically(presets, ini(models, with_b=True))
        assert wait_until(lambda: "b" in router.models(), 30)  # how soon: see the benchmark
        assert wait_until(lambda: any(e["event"] == "models_reload" for e in sse.events), 5)
        reload_event = next(e for e in sse.events if e["event"] == "models_reload")
        assert reload_event["model"] == "*" and reload_event["data"]["added"] == ["b"]
        sse.stop.set()


def test_sighup_and_get_reload(tmp_path: Path, models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=False))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        router.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "configuration reloaded (SIGHUP)" in router.log(), 5)
        listing = client.get("/models", params={"reload": "1"}).json()
        assert {m["id"] for m in listing["data"]} == {"a"}
        assert "configuration reloaded (GET /models?reload)" in router.log()
        assert router.proc.poll() is None
