"""What llama.cpp's web UI and other clients of its router read, answered in its shapes, on the
real llama-server: ``/models/sse`` events (load progress from the children, ``info`` when
loaded, only llama.cpp's status values), ``/props``, ``/tools``, resumable streams."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import SSEClient, start_router, wait_until, write_presets

from router.children.process import load_progress, progress_rank

LLAMA_CPP_STATUSES = {"unloaded", "loading", "loaded", "sleeping", "downloading", "downloaded"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# --------------------------------------------------------------------------- pure parts

def test_load_progress_takes_both_shapes_of_a_childs_report() -> None:
    first = load_progress(None, {"stages": ["text_model", "mmproj_model"],
                                 "current": "text_model", "value": 0.5})
    assert first == {"stages": ["text_model", "mmproj_model"], "current": "text_model",
                     "value": 0.5}
    # Before the mmproj loads, llama-server sends {"stage": ...}: that stage starts at 0.
    assert load_progress(first, {"stage": "mmproj_model"}) == {
        "stages": ["text_model", "mmproj_model"], "current": "mmproj_model", "value": 0.0}
    assert load_progress(None, {"stages": ["text_model"], "current": "text_model",
                                "value": 7})["value"] == 1.0  # clamped
    assert load_progress(None, {"nothing": 1}) is None
    assert load_progress(None, {"stages": [], "current": "x", "value": "a"}) is None


def test_progress_rank_orders_by_stage_then_value() -> None:
    stages = ["text_model", "mmproj_model"]
    early = {"stages": stages, "current": "text_model", "value": 0.9}
    later = {"stages": stages, "current": "mmproj_model", "value": 0.1}
    assert progress_rank(early) < progress_rank(later)
    assert min([later, early], key=progress_rank) is early


# --------------------------------------------------------------------------- real children

@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "compat.ini",
                         f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n"
                         f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 512\n")


@pytest.mark.real
def test_models_sse_speaks_llama_cpps_events(tmp_path: Path, presets: Path,
                                             llama_server: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        sse = SSEClient(router.url)
        sse.start()
        assert sse.connected.wait(10)
        assert wait_until(lambda: len(sse.events) >= 2, 10)  # the snapshot
        assert client.post("/models/load", json={"model": "alpha"}).status_code == 200
        assert wait_until(lambda: router.models()["alpha"]["status"]["value"] == "loaded", 60)
        assert client.post("/models/unload", json={"model": "alpha"}).status_code == 200
        assert wait_until(lambda: any(
            e["event"] == "status_change" and e["data"]["status"] == "unloaded"
            for e in sse.events if e["model"] == "alpha"), 30)
        sse.stop.set()

    alpha = [e for e in sse.events if e["model"] == "alpha"]
    assert alpha[0] == {"model": "alpha", "event": "model_status",
                        "data": {"status": "unloaded"}}  # the snapshot
    # Then llama.cpp's own sequence: model_status loading, progress, loaded with info
    # (the router's own "queued" may come between: clients ignore what they do not know).
    llama_cpps = [e for e in alpha if e["event"] != "queued"]
    assert llama_cpps[1] == {"model": "alpha", "event": "model_status",
                             "data": {"status": "loading"}}
    assert "progress" in llama_cpps[2]["data"]
    statuses = [e["data"]["status"] for e in sse.events if "status" in e.get("data", {})]
    assert set(statuses) <= LLAMA_CPP_STATUSES, statuses
    changes = [e["data"] for e in alpha if e["event"] == "status_change"]
    progress = [c["progress"] for c in changes if "progress" in c]
    # The child reports its own load progress: first 0.0, last 1.0, never backwards.
    assert progress and progress[0]["value"] == 0.0 and progress[-1]["value"] == 1.0
    assert all(p["stages"] == ["text_model"] and p["current"] == "text_model"
               for p in progress)
    assert [p["value"] for p in progress] == sorted(p["value"] for p in progress)
    assert all(c["status"] == "loading" for c in changes if "progress" in c)
    loaded = next(c for c in changes if c["status"] == "loaded")
    info = loaded["info"]
    assert info["id"] == "alpha" and info["object"] == "model"
    assert info["architecture"]["input_modalities"] == ["text"]
    assert info["meta"]["n_ctx"] == 512 and info["meta"]["n_vocab"] > 0
    # Stopping is the router's own event; the status clients see stays llama.cpp's.
    stopping = next(e for e in alpha if e["event"] == "stopping")
    assert stopping["data"] == {"status": "loaded", "reason": "unloaded"}
    unloaded = changes[-1]
    # As llama.cpp's router: the exit code of the stop, 0 (so its UI shows no failure).
    assert unloaded == {"status": "unloaded", "was_running": True, "exit_code": 0}
    log = router.log()
    # Asked to exit as llama.cpp's router asks, the child exits at once, cleanly.
    assert re.search(r"stopped .*model=alpha .*exit_code=0", log), log
    assert "did not stop within" not in log


@pytest.mark.real
def test_router_props_tools_and_cors_proxy_answer_as_llama_cpps_router(
        tmp_path: Path, presets: Path, llama_server: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        props = client.get("/props").json()
        assert props["role"] == "router"
        assert props["default_generation_settings"] == {"params": None, "n_ctx": 0}
        assert props["ui_settings"] == {} and props["cors_proxy_enabled"] is False
        assert client.get("/props", params={"autoload": "false"}).json()["role"] == "router"
        for method in ("GET", "POST"):
            for path in ("/tools", "/cors-proxy"):
                answer = client.request(method, path, json={})
                assert answer.status_code == 403, (method, path)
                assert answer.json() == {"error": {"message": "this feature is disabled",
                                                   "type": "feature_disabled"}}


@pytest.mark.real
def test_resumable_streams_go_to_the_child_that_has_them(tmp_path: Path, presets: Path,
                                                         llama_server: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        headers = {"X-Conversation-Id": "conv-a"}
        with client.stream("POST", "/v1/chat/completions", headers=headers,
                           json={"model": "alpha", "stream": True, **CHAT}) as streamed:
            original = "".join(streamed.iter_text())
        assert "[DONE]" in original
        # beta serves another conversation: lookups ask each owner for its own ids only.
        client.post("/v1/chat/completions", headers={"X-Conversation-Id": "conv-b"},
                    json={"model": "beta", "stream": True, **CHAT}).read()

        sessions = client.post("/v1/streams/lookup",
                               json={"conversation_ids": ["conv-a", "conv-b", "nope"]}).json()
        assert sorted(s["conversation_id"] for s in sessions) == ["conv-a", "conv-b"]
        assert client.post("/v1/streams/lookup", content=b"{not json").json() == []

        replay = client.get("/v1/stream", params={"conv_id": "conv-a", "from": "0"})
        assert replay.status_code == 200
        assert replay.headers["content-type"].startswith("text/event-stream")
        assert replay.text == original  # the very bytes the child kept

        assert client.get("/v1/stream").status_code == 400
        gone = client.get("/v1/stream", params={"conv_id": "nope"})
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "Stream not found or expired"

        assert client.delete("/v1/stream", params={"conv_id": "conv-a"}).status_code == 204
        assert client.get("/v1/stream", params={"conv_id": "conv-a"}).status_code == 404
        # Unloaded, the owner has no stream to give, and nothing is loaded to look.
        assert client.post("/models/unload", json={"model": "beta"}).status_code == 200
        assert wait_until(lambda: router.models()["beta"]["status"]["value"] == "unloaded", 30)
        assert client.get("/v1/stream", params={"conv_id": "conv-b"}).status_code == 404
        assert router.models()["beta"]["status"]["value"] == "unloaded"

