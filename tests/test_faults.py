"""Faults a real llama-server cannot show on demand, through the real router and supervisor.

The child is tests/fake_llama_server.py behind a wrapper script that adds its fault knobs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from support import alive, fake_binary, start_router, wait_until, write_presets

pytestmark = pytest.mark.fake

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def presets(tmp_path: Path, extra: str = "") -> Path:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return write_presets(tmp_path / "fake.ini", f"[m]\nmodel = {model}\n{extra}")


def serve(tmp_path: Path, *knobs: str, extra: str = "", args: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    binary = fake_binary(tmp_path, *knobs)
    return start_router(tmp_path, "--llama-server", str(binary), "--presets",
                        str(presets(tmp_path, extra)), *args)


def test_child_that_never_becomes_healthy_fails_after_the_load_timeout(tmp_path: Path) -> None:
    with serve(tmp_path, "--fail-health", extra="load-timeout = 1\n") as router, \
            router.client() as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json={"model": "m", **CHAT})
        elapsed = time.monotonic() - started
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "unavailable_error"
        assert "did not become healthy within 1 s" in error["message"]
        assert 1.0 <= elapsed < 10.0
        status = router.models()["m"]["status"]
        assert status["value"] == "unloaded" and status["failed"] is True
        assert not [p for p in router.children() if alive(p.pid)]


def child_info(router) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The one fake child's ``/fake/info``."""
    [child] = [p for p in router.children() if "--port" in p.cmdline()]
    argv = child.cmdline()
    port = argv[argv.index("--port") + 1]
    info: dict[str, object] = httpx.get(f"http://127.0.0.1:{port}/fake/info", timeout=10).json()
    return info


def test_a_child_in_child_mode_is_not_polled_while_it_loads(tmp_path: Path) -> None:
    # Its ready line says when it serves; a /health poll every 20 ms would take CPU time
    # from the load (about 50 polls in this one's second of loading).
    with serve(tmp_path, "--startup-delay", "1", args=("--liveness-interval", "0")) as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions", json={"model": "m", **CHAT}).status_code == 200
        assert child_info(router)["health_requests"] <= 1  # type: ignore[operator]


def test_a_child_without_child_mode_is_ready_when_health_answers(tmp_path: Path) -> None:
    # A llama-server that writes no state lines (a build without child mode): /health decides.
    fake = fake_binary(tmp_path, "--startup-delay", "0.5")
    plain = tmp_path / "plain-llama-server"
    plain.write_text(f"#!/bin/sh\nunset LLAMA_SERVER_ROUTER_PORT\nexec '{fake}' \"$@\"\n")
    plain.chmod(0o755)
    with start_router(tmp_path, "--llama-server", str(plain), "--presets",
                      str(presets(tmp_path)), "--liveness-interval", "0") as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions", json={"model": "m", **CHAT}).status_code == 200
        info = child_info(router)
        assert "LLAMA_SERVER_ROUTER_PORT" not in info["env_keys"]  # type: ignore[operator]
        assert info["health_requests"] >= 1  # type: ignore[operator]
        assert router.models()["m"]["status"]["value"] == "loaded"


def test_child_that_exits_while_loading_reports_code_and_last_line(tmp_path: Path) -> None:
    with serve(tmp_path, "--exit-on-start", "7") as router, router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "m", **CHAT})
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "exited with code 7" in message
        assert "last log line: main: exiting due to model loading error" in message
        status = router.models()["m"]["status"]
        assert status["exit_code"] == 7
        assert any("failed to load model" in line for line in status["last_lines"])


def test_stop_escalates_to_sigkill_after_the_stop_timeout(tmp_path: Path) -> None:
    with serve(tmp_path, "--ignore-sigterm", extra="stop-timeout = 0.5\n") as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "m", **CHAT}).status_code == 200
        pid = router.models()["m"]["status"]["pid"]
        started = time.monotonic()
        assert client.post("/models/unload", json={"model": "m"}).status_code == 200
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5.0
        assert not alive(pid)
        assert "did not stop within 0.5 s; killing" in router.log()
        assert router.models()["m"]["status"]["value"] == "unloaded"


def test_crash_mid_request_is_a_502_and_the_next_request_restarts(tmp_path: Path) -> None:
    with serve(tmp_path, "--crash-on-request") as router, router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "m", **CHAT})
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "server_error"
        assert wait_until(lambda: router.models()["m"]["status"].get("failed") is True, 5)
        status = router.models()["m"]["status"]
        assert status["exit_code"] == 3 and status["value"] == "unloaded"
        # The router is still up and the next request starts a fresh child.
        assert client.get("/health").status_code == 200
        client.post("/v1/chat/completions", json={"model": "m", **CHAT})
        assert router.log().count("event=spawned model=m") == 2


def test_crash_of_an_idle_child_is_noticed(tmp_path: Path) -> None:
    with serve(tmp_path, "--crash-after", "1") as router, router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "m", **CHAT}).status_code == 200
        assert wait_until(lambda: router.models()["m"]["status"].get("failed") is True, 10)
        assert "exited unexpectedly with code 3" in router.models()["m"]["status"]["message"]


def test_wait_budget_header_gives_503_with_retry_after(tmp_path: Path) -> None:
    with serve(tmp_path, "--startup-delay", "5") as router, router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "m", **CHAT},
                               headers={"X-Wait-Budget": "0.5"})
        assert response.status_code == 503
        # Answered within the budget, not when the model was ready (it loads for 5 s).
        assert router.models()["m"]["status"]["value"] == "loading"
        assert "Retry-After" in response.headers
        assert "wait budget of 0.5 s" in response.json()["error"]["message"]


def test_unload_while_loading_kills_the_child(tmp_path: Path) -> None:
    with serve(tmp_path, "--startup-delay", "30") as router, router.client() as client:
        assert client.post("/models/load", json={"model": "m"}).status_code == 200
        assert wait_until(lambda: router.models()["m"]["status"].get("pid") is not None, 10)
        pid = router.models()["m"]["status"]["pid"]
        assert client.post("/models/unload", json={"model": "m"}).status_code == 200
        assert router.models()["m"]["status"]["value"] == "unloaded"
        assert wait_until(lambda: not alive(pid), 5)


def test_a_request_waiting_for_a_load_that_is_unloaded_gets_the_envelope(
        tmp_path: Path) -> None:
    with serve(tmp_path, "--startup-delay", "30") as router, router.client() as client:
        answers: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answers.append(client.post(
            "/v1/chat/completions", json={"model": "m", **CHAT})))
        waiter.start()
        assert wait_until(lambda: router.models()["m"]["status"].get("pid") is not None, 10)
        assert client.post("/models/unload", json={"model": "m"}).status_code == 200
        waiter.join(30)
        [answer] = answers
        assert answer.status_code == 503
        assert answer.json()["error"] == {
            "code": 503, "type": "unavailable_error",
            "message": "model 'm' was unloaded while this request waited for it"}
        assert "Traceback" not in router.log()


def test_queue_limit_answers_429(tmp_path: Path) -> None:
    with serve(tmp_path, "--startup-delay", "3", args=("--max-queue", "1")) as router, \
            router.client() as client:
        assert client.post("/models/load", json={"model": "m"}).status_code == 200
        first: list[int] = []
        waiter = threading.Thread(target=lambda: first.append(client.post(
            "/v1/chat/completions", json={"model": "m", **CHAT}).status_code))
        waiter.start()
        assert wait_until(lambda: router.models()["m"]["status"]["waiting"] == 1, 5)
        refused = client.post("/v1/chat/completions", json={"model": "m", **CHAT})
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "Retry-After" in refused.headers
        waiter.join(30)
        assert first == [200]


def test_a_waiter_that_disconnects_leaves_the_queue_and_its_load_is_cancelled(
        tmp_path: Path) -> None:
    # "busy" streams slowly and holds the only slot; "m" must wait for it.
    model = tmp_path / "busy.gguf"
    model.write_bytes(b"GGUF")
    extra = f"[busy]\nmodel = {model}\n"
    with serve(tmp_path, "--token-delay", "0.05", extra="",
               args=("--models-max", "1", "--fairness", "60",
                     "--presets", str(write_presets(tmp_path / "busy.ini", extra)))) as router, \
            router.client() as client:
        body = {"model": "busy", "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "x"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            chunks = stream.iter_raw()
            next(chunks)
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/chat/completions", json={"model": "m", **CHAT}, timeout=1.0)
            assert wait_until(lambda: router.models()["m"]["status"]["waiting"] == 0, 5)
            assert wait_until(lambda: "queue_position" not in router.models()["m"]["status"],
                              5)
            assert "load cancelled: no request waits for it" in router.log()
            assert router.models()["busy"]["status"]["value"] == "loaded"
        assert "event=spawned model=m" not in router.log()
