"""Smoke tests for tests/fake_llama_server.py, run as a child process like llama-server."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

FAKE = Path(__file__).with_name("fake_llama_server.py")
POLL_S = 0.02
DEADLINE_S = 10.0
CHAT = {"model": "whatever", "messages": [{"role": "user", "content": "hi"}]}

pytestmark = pytest.mark.fake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(port: int, *extra: str) -> list[str]:
    # Unknown llama-server flags (some with values, some looking like known short options) must
    # be ignored by the fake.
    return [sys.executable, str(FAKE), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "fake-model", "--metrics", "-m", "/nonexistent/model.gguf",
            "--ctx-size", "2048", "-np", "2", "-ctk", "q8_0", "-cb", "--seed", "-1", "--jinja",
            *extra]


@contextmanager
def spawn(*extra: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen(command(port, *extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # reaps the child and closes the stderr pipe


def wait_healthy(client: httpx.Client, base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"fake exited early with {proc.returncode}"
        try:
            if client.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(POLL_S)
    pytest.fail("fake llama-server did not become healthy")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


def test_chat_non_stream_and_shapes() -> None:
    with spawn() as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        r = client.post(f"{base}/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["model"] == "whatever"
        assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3
        models = client.get(f"{base}/v1/models").json()
        assert models["data"][0]["id"] == "fake-model"
        assert models["data"][0]["meta"]["n_ctx"] == 1024  # -c 2048 split over -np 2
        assert [s["is_processing"] for s in client.get(f"{base}/slots").json()] == [False] * 2
        r = client.get(f"{base}/no/such/path")
        assert r.status_code == 404
        assert r.json() == {"error": {"code": 404, "message": "File Not Found",
                                      "type": "not_found_error"}}
        info = client.get(f"{base}/fake/info").json()
        assert info["pid"] == proc.pid and "-ctk" in info["argv"] and "PATH" in info["env_keys"]


def test_chat_stream_ends_with_done() -> None:
    with spawn() as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        req = {**CHAT, "max_tokens": 4, "stream": True}
        with client.stream("POST", f"{base}/v1/chat/completions", json=req) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "tok0 tok1 tok2 tok3"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_metrics_counters_increase() -> None:
    with spawn() as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        before = client.get(f"{base}/metrics").text
        assert "# TYPE llamacpp:prompt_tokens_total counter" in before
        assert "# HELP llamacpp:requests_processing" in before
        assert client.post(f"{base}/completion", json={"prompt": "abc", "n_predict": 5}).json()[
            "content"] == "tok0 tok1 tok2 tok3 tok4"
        after = client.get(f"{base}/metrics").text
        assert metric(after, "tokens_predicted_total") == metric(before,
                                                                 "tokens_predicted_total") + 5
        assert metric(after, "prompt_tokens_total") == metric(before, "prompt_tokens_total") + 3
        assert metric(after, "requests_processing") == 0


def test_startup_delay_reports_loading_then_ok() -> None:
    with spawn("--startup-delay", "1.0") as (proc, base), httpx.Client(timeout=5) as client:
        deadline = time.monotonic() + DEADLINE_S
        first: httpx.Response | None = None
        while first is None and time.monotonic() < deadline:
            try:
                first = client.get(f"{base}/health")
            except httpx.TransportError:
                time.sleep(POLL_S)
        assert first is not None and first.status_code == 503
        assert first.json() == {"error": {"code": 503, "message": "Loading model",
                                          "type": "unavailable_error"}}
        wait_healthy(client, base, proc)
        assert client.get(f"{base}/health").json() == {"status": "ok"}


def test_exit_on_start_uses_the_code() -> None:
    proc = subprocess.run(command(free_port(), "--exit-on-start", "7"), capture_output=True,
                          timeout=DEADLINE_S, check=False)
    assert proc.returncode == 7
    assert b"failed to load model" in proc.stderr


def test_ignore_sigterm_survives_until_sigkill() -> None:
    with spawn("--ignore-sigterm") as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None
        assert client.get(f"{base}/health").status_code == 200
        proc.kill()
        assert proc.wait(timeout=5) == -signal.SIGKILL


def test_sigterm_exits_cleanly_by_default() -> None:
    with spawn() as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0


def test_crash_on_request_exits_3() -> None:
    with spawn("--crash-on-request") as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        with pytest.raises(httpx.TransportError):
            client.post(f"{base}/v1/chat/completions", json=CHAT)
        assert proc.wait(timeout=5) == 3


def test_crash_after_exits_3() -> None:
    with spawn("--crash-after", "0.5") as (proc, _base):
        assert proc.wait(timeout=5) == 3


def test_stream_disconnect_frees_the_slot() -> None:
    with spawn("--token-delay", "0.05") as (proc, base), httpx.Client(timeout=5) as client:
        wait_healthy(client, base, proc)
        req = {**CHAT, "max_tokens": 10_000, "stream": True}
        with client.stream("POST", f"{base}/v1/chat/completions", json=req) as r:
            seen = 0
            for line in r.iter_lines():
                seen += bool(line)
                if seen == 3:
                    assert client.get(f"{base}/fake/info").json()["in_flight"] == 1
                    break
        deadline = time.monotonic() + DEADLINE_S
        while client.get(f"{base}/fake/info").json()["in_flight"] and \
                time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert client.get(f"{base}/fake/info").json()["in_flight"] == 0
        assert not any(s["is_processing"] for s in client.get(f"{base}/slots").json())


def test_help_and_version() -> None:
    out = subprocess.run([sys.executable, str(FAKE), "--help"], capture_output=True,
                         timeout=DEADLINE_S, check=False)
    assert out.returncode == 0 and b"--ctx-size N" in out.stdout
    assert b"(env: LLAMA_ARG_CTX_SIZE)" in out.stdout
    out = subprocess.run([sys.executable, str(FAKE), "--version"], capture_output=True,
                         timeout=DEADLINE_S, check=False)
    assert out.returncode == 0 and b"version: 11434 (fake)" in out.stderr
