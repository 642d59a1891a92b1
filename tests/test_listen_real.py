"""A router listening on several addresses (``--host 127.0.0.1,::1``, as llama-server takes
it) with real llama-server children: it answers on each, its dashboard and a peer reach it
over IPv6, and an address it cannot bind stops it before any child starts. (Parsing and
binding alone: ``test_listen.py``.)"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support import start_router, wait_until, write_presets
from test_listen import needs_ipv6

pytestmark = pytest.mark.real

CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@needs_ipv6
def test_a_router_on_ipv4_and_ipv6_loopback_serves_on_both(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "listen.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nload-on-startup = true\n")
    with start_router(tmp_path, "--presets", str(presets), host="127.0.0.1,::1") as router:
        port = router.port
        for url in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            with httpx.Client(base_url=url, timeout=60) as client:
                assert client.get("/health").json() == {"status": "ok"}
                reply = client.post("/v1/chat/completions", json=CHAT)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"]
                assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["alpha"]
                page = client.get("/dashboard/")
                assert page.status_code == 200 and "<html" in page.text.lower()
                assert client.get("/dashboard/api.js").status_code == 200
        assert f"listening on http://127.0.0.1:{port}, http://[::1]:{port}" in router.log()
        # Another router fronts this one through its IPv6 address.
        with start_router(tmp_path, "--peer", f"http://[::1]:{port}") as gateway, \
                gateway.client() as client:
            assert wait_until(lambda: "alpha" in gateway.models(), 30), gateway.log()
            reply = client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
        assert len([p for p in router.children() if "llama-server" in p.name()]) == 1


def test_an_address_that_cannot_be_bound_stops_the_router_before_any_child(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "taken.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nload-on-startup = true\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = subprocess.run(
            [sys.executable, "-m", "router.cli", "serve", "--presets", str(presets),
             "--host", "127.0.0.1,127.0.0.2", "--port", str(port)],
            capture_output=True, text=True, timeout=120)
    assert started.returncode == 2, started.stderr[-2000:]
    assert started.stderr.endswith(
        f"llama-router: cannot listen on 127.0.0.2:{port}: Address already in use\n")
    # Refused before the app started: no model loaded, no child spawned.
    assert "Application startup" not in started.stderr
    assert "spawned" not in started.stderr
