"""The hostile tier's faults that no other test file covers, against the real llama-server: a
crash loop, a second router on a taken port, and a router starved of file descriptors.
(Elsewhere: SIGKILL/SIGSTOP of a child mid-stream in test_real_router.py and
test_liveness.py, a never-healthy child in test_faults.py, SIGKILL of the router in
test_real_router.py, garbled and emptied presets in test_reload.py.)
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support import start_router, wait_until, write_presets
from test_hostile import record

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def test_a_model_that_always_crashes_stops_being_restarted(tmp_path: Path,
                                                            llama_server: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))  # a header llama-server cannot load
    presets = write_presets(tmp_path / "crash.ini", f"[broken]\nmodel = {broken}\n")
    with start_router(tmp_path, "--presets", str(presets),
                      env={"LLAMA_ROUTER_CRASH_LOOP_LIMIT": "2"}) as router, \
            router.client() as client:
        answers = [client.post("/v1/chat/completions", json={"model": "broken", **CHAT})
                   for _ in range(3)]
        first, second, third = answers
        assert first.status_code == 503 and "failed to load" in first.json()["error"]["message"]
        assert second.status_code == 503
        # The third is refused without starting anything.
        message = third.json()["error"]["message"]
        assert third.status_code == 503 and "failed 2 times in a row" in message, message
        assert "POST /models/load" in message
        status = router.models()["broken"]["status"]
        assert status["crash_loop"] is True and status["failed"] is True
        assert [p for p in router.children() if "llama-server" in p.name()] == []
        # An explicit load clears the loop (and fails again, counted from one).
        assert client.post("/models/load", json={"model": "broken"}).status_code == 200
        assert wait_until(lambda: router.models()["broken"]["status"].get("failed"), 60)
        assert "crash_loop" not in router.models()["broken"]["status"]


def test_a_second_router_on_a_taken_port_exits_and_the_first_serves_on(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "one.ini", f"[alpha]\nmodel = {tiny_models['alpha']}\n")
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        assert client.post("/v1/chat/completions", json={"model": "alpha", **CHAT}) \
            .status_code == 200
        second = subprocess.run(
            [sys.executable, "-m", "router.cli", "serve", "--presets", str(presets),
             "--port", str(router.port)], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert "already in use" in second.stderr + second.stdout, second.stderr[-2000:]
        assert client.post("/v1/chat/completions", json={"model": "alpha", **CHAT}) \
            .status_code == 200
        assert len([p for p in router.children() if "llama-server" in p.name()]) == 1


def test_out_of_file_descriptors_is_refused_clearly_and_survived(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "fd.ini", "[*]\nctx-size = 1024\nparallel = 4\n" + "".join(
        f"[{name}]\nmodel = {tiny_models[name]}\n" for name in ("alpha", "beta")))

    messages: set[str] = set()  # what the refusals said, for a failure's message

    async def flood(url: str) -> dict[str, int]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            async def one(i: int) -> str:
                try:
                    response = await client.post("/v1/chat/completions", json={
                        "model": ("alpha", "beta")[i % 2], **CHAT})
                except httpx.TransportError as exc:  # refused at accept(): no fd for it
                    return type(exc).__name__
                if response.status_code == 200:
                    return "200"
                error = response.json()["error"]  # any other answer: the envelope
                assert error["code"] == response.status_code and error["message"]
                messages.add(f"{response.status_code}: {error['message'][:160]}")
                return str(response.status_code)
            outcomes = await asyncio.gather(*(one(i) for i in range(400)))
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    with start_router(tmp_path, "--presets", str(presets), open_files=256) as router:
        counts = asyncio.run(flood(router.url))
        assert router.proc.poll() is None
        with router.client() as client:  # and afterwards it serves normally
            for model in ("alpha", "beta"):
                assert client.post("/v1/chat/completions", json={"model": model, **CHAT}) \
                    .status_code == 200
        # The memory estimates, if a header could not be read in the flood, come back.
        assert wait_until(lambda: all(
            (router.models()[m]["status"]["memory"]["estimate"] or 0) > 0  # type: ignore[index]
            for m in ("alpha", "beta")), 60)
        log = router.log()
    record("file_descriptors", {"clients": 400, "ulimit_n": 256, **counts})
    assert counts.get("200", 0) > 0, (counts, sorted(messages), log[-3000:])
    assert not [k for k in counts if k.startswith("5") and k not in ("502", "503")], counts
    assert "not a GGUF file" not in log
    assert "Traceback" not in log
