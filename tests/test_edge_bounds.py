"""The HTTP/1.1 edge of a real router process, attacked as a client without a key would:
request heads that never end (an endless target, an endless header value, endless short
headers) leave its memory bounded and get the envelope; a protocol upgrade carrying a body is
refused at once and does not disturb the shutdown. Figures: build/reliability/edge_*.json."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from support import fake_binary, start_router, wait_until, write_presets

from router.http import http11

pytestmark = pytest.mark.process

FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"
OFFERED = 32 << 20  # bytes of head each hostile connection tries to send
GUARD_S = 60.0

ENDLESS = {  # what the head starts with, and what it goes on with for ever
    "target": (b"GET /", b"a" * 65536, 414),
    "header_value": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: ", b"v" * 65536, 431),
    "short_headers": (b"GET /health HTTP/1.1\r\n", b"X-A: b\r\n" * 8192, 431),
}


def flood(port: int, start: bytes, filler: bytes, answers: list[bytes]) -> None:
    """Send a head that never ends until the router stops taking it; keep its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sent = 0
        try:
            sock.sendall(start)
            while sent < OFFERED:
                sock.sendall(filler)
                sent += len(filler)
        except OSError:  # refused: the router closed its side
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass
        answers.append(received)


@pytest.fixture
def router_args(tmp_path: Path) -> list[str]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "p.ini", f"[m]\nmodel = {model}\n")
    return ["--llama-server", str(fake_binary(tmp_path)), "--presets", str(presets)]


CLIENT_POOL_EXPIRY_S = 5.0  # httpx's and the OpenAI SDK's idle expiry, uvicorn's default too


def test_a_keep_alive_connection_outlives_the_clients_pool_expiry(
        tmp_path: Path, router_args: list[str]) -> None:
    """A client's pooled connection, idle as long as its pool keeps it, still takes the next
    request: the router does not close it first (with uvicorn's default of 5 s the two
    expiries race, and a request sent as the router closes is lost: "server disconnected").
    The idle time is what is tested here, not a wait for an event."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with start_router(tmp_path, *router_args) as router, \
            socket.create_connection(("127.0.0.1", router.port), timeout=GUARD_S) as sock:
        for _ in range(2):
            sock.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, f"the router closed the idle connection: {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            time.sleep(CLIENT_POOL_EXPIRY_S + 1.0)


def test_endless_request_heads_leave_the_router_bounded(tmp_path: Path,
                                                        router_args: list[str]) -> None:
    with start_router(tmp_path, *router_args) as router:
        process = psutil.Process(router.proc.pid)
        before = process.memory_info().rss
        answers: dict[str, list[bytes]] = {kind: [] for kind in ENDLESS}
        threads = [threading.Thread(target=flood, args=(router.port, start, filler,
                                                        answers[kind]))
                   for kind, (start, filler, _) in ENDLESS.items() for _ in range(4)]
        for thread in threads:
            thread.start()
        peak = before
        with httpx.Client(base_url=router.url, timeout=10) as client:
            while any(t.is_alive() for t in threads):
                assert client.get("/health").status_code == 200
                peak = max(peak, process.memory_info().rss)
                time.sleep(0.02)
            metrics = client.get("/metrics").text
        for thread in threads:
            thread.join(GUARD_S)
        peak = max(peak, process.memory_info().rss)
        FIGURES.mkdir(parents=True, exist_ok=True)
        (FIGURES / "edge_endless_heads.json").write_text(json.dumps({
            "connections": len(threads), "bytes_offered_each": OFFERED,
            "rss_before_mib": round(before / 2**20, 1),
            "rss_peak_mib": round(peak / 2**20, 1)}, indent=2) + "\n")
        for kind, (_, _, status) in ENDLESS.items():
            assert len(answers[kind]) == 4
            for raw in answers[kind]:
                head, _, body = raw.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 %d " % status), (kind, raw[:200])
                assert json.loads(body)["error"]["code"] == status
        # 12 connections, 32 MiB offered each: +114 MiB after 12 MiB when heads were unbounded.
        assert peak - before < 32 << 20, (before, peak)
        refused = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("llamarouter_edge_refusals_total{")}
        assert refused["target_too_long"] == 4
        assert refused["head_too_large"] == 4
        assert refused["too_many_headers"] == 4
        assert set(refused) == set(http11.REFUSAL_REASONS)
        assert "Traceback" not in router.log()


def test_an_upgrade_with_a_body_is_refused_at_once_and_shutdown_stays_clean(
        tmp_path: Path, router_args: list[str]) -> None:
    """A websocket handshake announcing a body it never sends: was held past the head and
    body deadlines, and with one open SIGTERM crashed the shutdown (exit 1, 13 tracebacks)."""
    with start_router(tmp_path, *router_args, "--body-timeout", "3") as router:
        handshake = (b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nContent-Length: 1000\r\n"
                     b"\r\n")
        held = socket.create_connection(("127.0.0.1", router.port), timeout=GUARD_S)
        try:
            started = time.monotonic()
            held.sendall(handshake)
            answer = held.recv(65536)
            assert time.monotonic() - started < 5.0
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), answer
            assert "does not switch protocols" in json.loads(body)["error"]["message"]
            router.proc.send_signal(signal.SIGTERM)
            assert router.proc.wait(GUARD_S) == 0
        finally:
            held.close()
        assert wait_until(lambda: router.proc.poll() is not None, GUARD_S)
        assert "Traceback" not in router.log(), router.log()


@pytest.mark.real
def test_a_head_at_the_bounds_reaches_a_real_llama_server_and_one_past_them_does_not(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """The edge's bounds are tighter than llama-server's (cpp-httplib's 8,192 bytes a line and
    100 headers): the largest head the router takes, with what the router adds on the hop,
    is served by the real child, never refused with its bare 400; one byte or header more is
    the router's own envelope."""
    presets = write_presets(tmp_path / "p.ini", f"[m]\nmodel = {tiny_models['alpha']}\n")
    with start_router(tmp_path, "--presets", str(presets)) as router:
        target = "/v1/chat/completions?" + "p" * (http11.MAX_TARGET_BYTES
                                                  - len("/v1/chat/completions?"))
        long_value = "v" * (http11.MAX_HEADER_BYTES - len("x-long"))
        headers = {"X-Long": long_value, "Content-Type": "application/json"}
        # httpx adds host, accept, accept-encoding, connection, user-agent, content-length.
        headers |= {f"X-{i}": str(i) for i in range(http11.MAX_HEADERS - len(headers) - 6)}
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=router.url, timeout=60) as client:
            answer = client.post(target, json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"
            over = client.post(target, json=body, headers={**headers, "X-One-More": "1"})
            assert over.status_code == 431
            assert over.json()["error"]["code"] == 431
            longer = client.post(target + "p", json=body)
            assert longer.status_code == 414 and longer.json()["error"]["code"] == 414


def test_idle_connections_without_a_key_cannot_keep_a_keyed_client_out(tmp_path: Path) -> None:
    """At the connection cap (8, from a small descriptor limit), every connection kept alive
    on the public /health without a key: a client with a key still gets in (an idle keyless
    one is closed for it), and so do the next two, each kept open."""
    with start_router(tmp_path, "--api-key", "sk-ration-1", "--no-webui",
                      open_files=150) as router:
        assert "up to 8 client connections" in router.log(), router.log()
        idle = []
        for _ in range(7):  # the cap, with the one the check below keeps
            sock = socket.create_connection(("127.0.0.1", router.port), timeout=GUARD_S)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            idle.append(sock)
        keyed = [httpx.Client(base_url=router.url, timeout=GUARD_S,
                              headers={"Authorization": "Bearer sk-ration-1"})
                 for _ in range(3)]
        with httpx.Client(base_url=router.url, timeout=GUARD_S) as keyless:
            assert keyless.get("/health").status_code == 200  # the eighth, kept alive
            for client in keyed:  # each one more, each kept open
                answer = client.get("/models")
                assert answer.status_code == 200, answer.text
            for client in keyed:  # kept: they carried a key
                assert client.get("/models").status_code == 200
        for client in keyed:
            client.close()
        for sock in idle:
            sock.close()
        # one idle connection without a key was closed for each keyed one (which ones: the
        # idle the longest, the test's or the start-up probes' the router has not yet seen
        # end)
        assert router.log().count("closing one idle without a key") >= 3, router.log()
