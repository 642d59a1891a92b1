"""The request body's deadline (``--body-timeout``) through ``llama-router serve`` with a real
llama-server child: a body that stops arriving gets a 408 envelope and the model serves on, a
client without a key cannot hold a connection by trickling a body, and a stalled upload does
not hold SIGTERM for the shutdown grace period. (The protocol's cases, with short deadlines,
are in-process in ``test_http11.py``.)
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

KEY = "body-deadline-key"
CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
GUARD_S = 60.0  # a hang guard, never a measurement


def presets(tmp_path: Path, models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "models.ini",
                         f"version = 1\n[alpha]\nmodel = {models['alpha']}\nctx-size = 512\n"
                         "load-on-startup = true\n")


def slow_body(port: int, *, key: str | None, sent: bytes = b'{"model": "alpha", ') -> socket.socket:
    """A connection that sends a chat's head and the start of its body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
                 + sent)
    return sock


def loaded(client: httpx.Client) -> bool:
    return bool(client.get("/models").json()["data"][0]["status"]["value"] == "loaded")


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_stalled_body_gets_a_408_and_the_model_serves_on(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--api-key", KEY, "--body-timeout", "1") as router, \
            router.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert wait_until(lambda: loaded(client), GUARD_S)
        sock = slow_body(router.port, key=KEY)
        started = time.monotonic()
        raw = read_until_closed(sock)
        waited = time.monotonic() - started
        sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw[:300]
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == 408 and "stopped arriving" in error["message"]
        assert 1.0 <= waited < 30.0
        # The same chat, sent whole, is served by the child; the cut one is on record as 408.
        answer = client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        statuses = [r["status"] for r in client.get("/activity").json()["requests"]
                    if r["endpoint"] == "/v1/chat/completions"]
        assert 408 in statuses, statuses


def test_a_client_without_a_key_cannot_hold_a_connection_by_trickling(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Answered 401 at once; then a byte every 0.2 s of a body nobody reads: the connection is
    closed one deadline (1 s) after the answer, not held while the bytes keep coming."""
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--api-key", KEY, "--body-timeout", "1") as router:
        sock = slow_body(router.port, key=None, sent=b"")
        sock.settimeout(0.2)
        head = b""
        deadline = time.monotonic() + GUARD_S
        while b"\r\n\r\n" not in head and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                head += sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 401"), head
        answered = time.monotonic()
        closed = None
        while closed is None and time.monotonic() < deadline:
            try:
                sock.sendall(b"x")
                if sock.recv(65536) == b"":
                    closed = time.monotonic()
            except TimeoutError:
                continue
            except OSError:  # reset: closed too
                closed = time.monotonic()
        sock.close()
        assert closed is not None, "the connection was held while the client trickled"
        assert closed - answered < 10.0


def test_a_stalled_upload_does_not_hold_sigterm_for_the_grace_period(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """A 60 s body deadline and a 60 s grace period: a client that stalled mid-body still lets
    the router exit within seconds of SIGTERM (it gets a 408), with its child stopped."""
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--body-timeout", "60", "--shutdown-grace", "60") as router:
        with router.client() as client:
            assert wait_until(lambda: loaded(client), GUARD_S)
        sock = slow_body(router.port, key=None)
        time.sleep(0.5)  # the router has the head and the first bytes (nothing to await)
        router.children()  # remember the child, for start_router's check
        started = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(GUARD_S) == 0, router.log()
        exited = time.monotonic() - started
        raw = read_until_closed(sock)
        sock.close()
        assert raw.startswith(b"HTTP/1.1 408"), raw[:300]
        assert exited < 15.0, f"SIGTERM took {exited:.1f} s\n{router.log()}"
        print(f"exit {exited:.2f} s after SIGTERM with a stalled upload")
