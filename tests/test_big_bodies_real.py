"""One request can neither stall the router nor take gigabytes (red-team pass 5): bodies of
up to the largest size the router takes (256 MiB), in their worst shapes, sent to a router
in front of the real llama-server, while another client keeps asking ``/health``.

* a 90 MiB chat request whose prompt is one long string (under llama-server's own 100 MB
  payload bound): answered by the child;
* 256 MiB of arrays 200 deep: scanned (its model found), forwarded, refused by the child's
  payload bound (its 413 passes through);
* 256 MiB of ``{},``: refused by the router (413, too many values) before anything is built.

Asserted: every answer is the one named, ``/health`` keeps answering throughout (a generous
hang bound; the benchmark has the figure), and the router's peak memory grows by a small
multiple of the body (its ``VmHWM``, not a time).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support import start_router, write_presets

pytestmark = pytest.mark.real

GUARD_S = 120.0  # a hang guard, never a measurement
HEALTH_BOUND_S = 5.0  # /health's slowest answer while the bodies go through (was 25 s+)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def post(port: int, body: bytes) -> tuple[int, bytes]:
    """A POST of ``body`` on a raw socket (no client library copies it again)."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
        sock.sendall(head)
        view = memoryview(body)
        try:
            for start in range(0, len(body), 1 << 20):
                sock.sendall(view[start:start + (1 << 20)])
        except OSError:
            pass  # answered (and closed) before the whole body went: the answer says why
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2]


def test_the_largest_bodies_hold_neither_the_router_nor_its_memory(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini", f"""
[alpha]
model = {tiny_models['alpha']}
ctx-size = 512
""")
    with start_router(tmp_path, "--presets", str(presets), "--no-webui") as router:
        with router.client() as client:
            warm = client.post("/v1/chat/completions", json={
                "model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            assert warm.status_code == 200, warm.text
        pid = router.proc.pid
        before = psutil.Process(pid).memory_info().rss
        slowest = [0.0]
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=router.url, timeout=GUARD_S) as health:
                while not stop.is_set():
                    started = time.monotonic()
                    assert health.get("/health").status_code == 200
                    slowest[0] = max(slowest[0], time.monotonic() - started)
                    time.sleep(0.02)

        # made before the poller starts: building them holds this process's GIL
        head = (b'{"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", '
                b'"content": "hi"}], "x": "')
        text = head + b"word " * ((90 << 20) // 5) + b'"}'
        nest = b"[" * 200 + b"]" * 200 + b","
        deep = b'{"model": "alpha", "x": [' + nest * 9_000 + b"0]"
        deep += b" " * ((256 << 20) - len(deep) - 2) + b"}"
        values = b'{"model": "alpha", "x": [' + b"{}," * ((256 << 20) // 3 - 20) + b"{}]}"
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            status, answer = post(router.port, text)
            assert status == 200, answer[:300]
            growth_text = peak_rss(pid) - before
            status, answer = post(router.port, deep)
            assert status == 413, answer[:300]  # the child's payload bound (no body)
            status, answer = post(router.port, values)
            assert status == 413 and b"too many JSON values" in answer, answer[:300]
        finally:
            stop.set()
            poller.join(GUARD_S)
        growth = peak_rss(pid) - before
    print(f"slowest /health {slowest[0]:.3f} s, peak growth {growth_text >> 20} MiB (90 MiB"
          f" body), {growth >> 20} MiB (256 MiB bodies)")
    assert slowest[0] < HEALTH_BOUND_S, slowest[0]
    # the body itself, the copy the child is sent (head and body), the transport's share
    assert growth_text < 4 * (90 << 20), growth_text
    assert growth < 4 * (256 << 20), growth
