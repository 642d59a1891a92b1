"""Running as a service: the systemd notify protocol and graceful shutdown, for real."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import alive, wait_until, write_presets

from router.children.process import free_port

pytestmark = pytest.mark.real


@contextlib.contextmanager
def serving(tmp_path: Path, presets: Path, env: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``llama-router serve`` as a service manager runs it: its own process, our signals."""
    port = free_port()
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--presets",
                                 str(presets), "--port", str(port)],
                                env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_notify_ready_watchdog_stopping(tmp_path: Path, tiny_models: dict[str, Path],
                                        llama_server: Path) -> None:
    presets = write_presets(tmp_path / "svc.ini", f"[boot]\nmodel = {tiny_models['alpha']}\n"
                            "load-on-startup = true\n"
                            f"[other]\nmodel = {tiny_models['beta']}\n")
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(30)
    env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"}
    with serving(tmp_path, presets, env) as (proc, url), contextlib.closing(sock):
        messages: list[str] = []
        while not any("READY=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        # READY only once the startup model answers.
        status = httpx.get(f"{url}/models").json()["data"]
        boot = next(m for m in status if m["id"] == "boot")
        assert boot["status"]["value"] == "loaded"
        assert "STATUS=serving" in messages[-1]
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "boot", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 200
        watchdog = 0
        while watchdog < 2:
            if "WATCHDOG=1" in sock.recv(4096).decode():
                watchdog += 1
        proc.send_signal(signal.SIGTERM)
        while True:
            message = sock.recv(4096).decode()
            if "STOPPING=1" in message:
                break
        assert proc.wait(30) == 0


def test_sigterm_lets_a_stream_finish(tmp_path: Path, tiny_models: dict[str, Path],
                                      llama_server: Path) -> None:
    presets = write_presets(tmp_path / "svc.ini", f"[a]\nmodel = {tiny_models['alpha']}\n"
                            "ctx-size = 4096\nparallel = 1\n")
    with serving(tmp_path, presets) as (proc, url):
        assert wait_until(lambda: _healthy(url), 30)
        body = {"model": "a", "stream": True, "max_tokens": 2000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            chunks = response.iter_raw()
            received = next(chunks)
            child = httpx.get(url + "/models").json()["data"][0]["status"]["pid"]
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            for chunk in chunks:
                received += chunk
        assert received.rstrip().endswith(b"data: [DONE]")
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 30
        assert wait_until(lambda: not alive(child), 5)


def test_second_signal_exits_at_once(tmp_path: Path, tiny_models: dict[str, Path],
                                     llama_server: Path) -> None:
    presets = write_presets(tmp_path / "svc.ini", f"[a]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 8192\nparallel = 1\n")
    with serving(tmp_path, presets) as (proc, url):
        assert wait_until(lambda: _healthy(url), 30)
        body = {"model": "a", "stream": True, "max_tokens": 8000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            next(response.iter_raw())
            child = httpx.get(url + "/models").json()["data"][0]["status"]["pid"]
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: not _healthy(url), 5)  # no longer accepting
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
            assert time.monotonic() - started < 5
        assert wait_until(lambda: not alive(child), 5)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
