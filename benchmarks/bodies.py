"""Benchmark phase: the largest request bodies the router takes, in their worst shapes, while
another client keeps asking ``/health`` (issue 44: one request can neither stall the router
nor take gigabytes).

For each shape a llama-router of this tree (or ``--router-src``) is started on a tiny model,
warmed with one chat, then sent the body on a raw socket while a probe asks ``/health`` every
10 ms on a kept-alive connection. Measured: the answer's status and time, ``/health``'s
slowest and median answers meanwhile (what every other client waits at worst), and the
router's peak resident memory over its warm start (``VmHWM``), against the body's size.

* ``text``: a chat whose extra field is one 90 MiB string (under llama-server's own 100 MB
  payload bound: the child answers it);
* ``nests``: 256 MiB of arrays 200 deep with its model at the end (scanned, forwarded; the
  child refuses it past its payload bound);
* ``values``: 256 MiB of ``{},`` (the router refuses it: too many values to read).

Goals: ``/health`` never waits 100 ms; the router's peak growth at most twice the body.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from router.llama.tinymodel import write_tiny_model

from .harness.processes import wait_healthy
from .harness.targets import write_presets

if TYPE_CHECKING:
    from .harness.targets import Bench

MiB = 1 << 20
STALL_GOAL_MS = 100.0
GROWTH_GOAL = 2.0  # times the body


def shapes(quick: bool) -> dict[str, bytes]:
    scale = 16 if quick else 1
    chat = b'"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'
    text = b'{"model": "tiny", ' + chat + b', "x": "' + b"word " * (90 * MiB // scale // 5) \
        + b'"}'
    nest = b"[" * 200 + b"]" * 200 + b","
    nests = b"{" + chat + b', "x": [' + nest * (9_000 // scale) + b"0]"
    nests += b" " * (256 * MiB // scale - len(nests) - 20) + b', "model": "tiny"}'
    values = b'{"model": "tiny", "x": [' + b"{}," * (256 * MiB // scale // 3 - 20) + b"{}]}"
    return {"text": text, "nests": nests, "values": values}


def post(port: int, body: bytes) -> int:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(head)
        view = memoryview(body)
        try:
            for start in range(0, len(body), MiB):
                sock.sendall(view[start:start + MiB])
        except OSError:
            pass  # answered before the whole body went
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(bench: Bench, name: str, body: bytes, model: Path) -> dict[str, Any]:
    presets = write_presets(bench.workdir / f"bodies-{name}.ini", {"tiny": model}, [])
    item, url = bench.start_router(presets, f"bodies-{name}", extra_args=())
    try:
        wait_healthy(item, url)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            client.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
        before = peak_rss(item.proc.pid)
        waits: list[float] = []
        stop = threading.Event()
        probing = threading.Event()  # the probe's first answer came (its connection is up)

        def probe() -> None:
            with httpx.Client(base_url=url, timeout=60, trust_env=False) as health:
                while not stop.is_set():
                    started = time.perf_counter()
                    health.get("/health")
                    waits.append((time.perf_counter() - started) * 1000)
                    probing.set()
                    time.sleep(0.01)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        probing.wait(60)
        started = time.perf_counter()
        status = post(int(url.rsplit(":", 1)[1]), body)
        took = time.perf_counter() - started
        probed = len(waits)
        while len(waits) == probed and prober.is_alive():  # one answer after the body's too
            time.sleep(0.01)
        stop.set()
        prober.join(60)
        growth = peak_rss(item.proc.pid) - before
    finally:
        bench.procs.stop(item)
    return {"bytes": len(body), "status": status, "answer_s": round(took, 3),
            "health_max_ms": round(max(waits, default=0.0), 2), "health_p50_ms":
            round(statistics.median(waits or [0.0]), 2), "probes": len(waits),
            "growth_bytes": growth, "growth_x": round(growth / len(body), 2)}


def run_phase(bench: Bench, quick: bool = False) -> dict[str, Any]:
    model = write_tiny_model(bench.workdir / "bodies" / "tiny.gguf", seed=5, name="tiny")
    results = {name: measure(bench, name, body, model) for name, body in shapes(quick).items()}
    stall = max(r["health_max_ms"] for r in results.values())
    growth = max(r["growth_x"] for r in results.values())
    targets = {
        "bodies_stall": {"goal": f"/health waits under {STALL_GOAL_MS:g} ms while the largest "
                                 "bodies go through",
                         "met": stall < STALL_GOAL_MS, "measured": f"at most {stall:.1f} ms"},
        "bodies_memory": {"goal": f"the router's peak memory grows by at most {GROWTH_GOAL:g}x "
                                  "the body",
                          "met": growth <= GROWTH_GOAL, "measured": f"at most {growth:.2f}x"},
    }
    lines = ["| shape | body (MiB) | status | answer (s) | /health max (ms) | /health p50 (ms) "
             "| peak growth (MiB, x body) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['bytes'] / MiB:.0f} | {r['status']} | {r['answer_s']} "
                     f"| {r['health_max_ms']} | {r['health_p50_ms']} "
                     f"| {r['growth_bytes'] / MiB:.0f} ({r['growth_x']}x) |")
    return {"results": results, "targets": targets, "table": "\n".join(lines)}
