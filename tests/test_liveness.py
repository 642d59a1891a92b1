"""Liveness of serving children (router.core.liveness): probes in-process, then a frozen real
child."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import httpx
import pytest
from support import SSEClient, start_router, wait_until, write_presets

from router.children.process import ChildProcess
from router.config.presets import ModelPreset
from router.core.lifecycle import ModelState, Status
from router.core.liveness import Liveness
from router.core.runtime import ModelRuntime
from router.logs import LogRing
from router.serving.load import Replica

real = pytest.mark.real
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
HANG_GUARD_S = 60.0


# ----------------------------------------------------------------------------- probes

class Health:
    """A stand-in child's /health on a free port: answers 200, 503, or never (``frozen``)."""

    def __init__(self) -> None:
        self.status = 200
        self.frozen = False
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        if self.frozen:
            return  # never answers; closed at the end
        writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Length: 2\r\n"
                     "Connection: close\r\n\r\n{}".encode())
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


def serving_model(port: int, client: httpx.AsyncClient) -> tuple[ModelRuntime, ChildProcess]:
    preset = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}))
    runtime = ModelRuntime(preset, LogRing(10), state=ModelState(Status.LOADED))
    child = ChildProcess("m", ["llama-server"], port, runtime.logs, client)
    runtime.state = replace(runtime.state, replicas=tuple([Replica(child)]))
    return runtime, child


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


def prober(client: httpx.AsyncClient, killed: list[str], paused: set[ChildProcess] | None = None,
           misses: int = 2) -> Liveness:
    return Liveness(interval=0.01, timeout=0.2, misses=misses,
                    is_paused=lambda child: child in (paused or set()),
                    on_unresponsive=lambda runtime, child, why: killed.append(why))


async def test_a_child_that_answers_is_left_alone(client: httpx.AsyncClient) -> None:
    health, killed = Health(), []
    async with health as port:
        runtime, child = serving_model(port, client)
        liveness = prober(client, killed)
        for _ in range(5):
            await liveness.probe_round([runtime])
    assert killed == [] and liveness.missed(child) == 0


async def test_misses_in_a_row_kill_and_an_answer_resets_the_count(
        client: httpx.AsyncClient) -> None:
    health, killed = Health(), []
    async with health as port:
        runtime, child = serving_model(port, client)
        liveness = prober(client, killed, misses=3)
        health.frozen = True
        await liveness.probe_round([runtime])
        await liveness.probe_round([runtime])
        assert liveness.missed(child) == 2 and killed == []
        health.frozen = False
        await liveness.probe_round([runtime])
        assert liveness.missed(child) == 0
        health.status = 503  # answering, but not healthy: a miss too
        for _ in range(3):
            await liveness.probe_round([runtime])
    assert len(killed) == 1
    assert killed[0] == ("llama-server stopped answering: 3 health checks in a row failed "
                         "(last: /health answered 503); killed it")


async def test_a_refused_connection_is_a_miss(client: httpx.AsyncClient) -> None:
    health, killed = Health(), []
    async with health as port:
        pass  # closed: nothing listens on the port any more
    runtime, _ = serving_model(port, client)
    liveness = prober(client, killed, misses=1)
    await liveness.probe_round([runtime])
    assert len(killed) == 1
    assert (f"could not reach the model's llama-server on port {port}: ConnectionRefusedError("
            in killed[0])


async def test_a_child_paused_for_its_cpu_turn_is_not_counted(
        client: httpx.AsyncClient) -> None:
    health, killed = Health(), []
    async with health as port:
        runtime, child = serving_model(port, client)
        health.frozen = True
        liveness = prober(client, killed, paused={child}, misses=1)
        await liveness.probe_round([runtime])
    assert killed == [] and liveness.missed(child) == 0


async def test_only_serving_models_are_probed(client: httpx.AsyncClient) -> None:
    health, killed = Health(), []
    async with health as port:
        health.frozen = True
        runtime, child = serving_model(port, client)
        runtime.state = ModelState(Status.STOPPING)
        liveness = prober(client, killed, misses=1)
        await liveness.probe_round([runtime])
    assert killed == [] and liveness.missed(child) == 0


async def test_interval_zero_probes_nothing(client: httpx.AsyncClient) -> None:
    liveness = Liveness(interval=0, timeout=1, misses=1, is_paused=lambda c: False,
                        on_unresponsive=lambda *a: None)
    await asyncio.wait_for(liveness.run(lambda: []), HANG_GUARD_S)  # returns at once


# ----------------------------------------------------------------------------- real children

FAST_PROBES = ("--liveness-interval", "0.2", "--liveness-timeout", "1", "--liveness-misses", "2")


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> Path:
    return write_presets(tmp_path / "live.ini",
                         f"[*]\nctx-size = 32768\nparallel = 1\n"
                         f"[long]\nmodel = {tiny_models['long']}\n")


def stream_lines(url: str, body: dict[str, object], lines: list[str],
                 started: threading.Event) -> None:
    with httpx.Client(timeout=HANG_GUARD_S) as client, \
            client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        lines.append(f"status {response.status_code}")
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()


@real
def test_a_frozen_child_is_killed_its_requests_fail_and_it_restarts(
        tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), *FAST_PROBES) as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "long", **CHAT}).status_code == 200
        frozen = router.models()["long"]["status"]["pid"]
        sse = SSEClient(router.url)
        sse.start()
        assert sse.connected.wait(10)
        lines: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=stream_lines, args=(router.url, {
            "model": "long", "stream": True, "max_tokens": 30000,
            "messages": [{"role": "user", "content": "Hi"}]}, lines, started))
        stream.start()
        assert started.wait(HANG_GUARD_S)
        os.kill(frozen, signal.SIGSTOP)  # mid-stream: the child answers nothing any more
        stream.join(HANG_GUARD_S)
        assert not stream.is_alive(), "the stream to a frozen child never ended"
        assert lines[0] == "status 200"
        last = json.loads(lines[-1].removeprefix("data: "))
        assert "error" in last, lines[-3:]  # the stream ends with an error event
        # The model is unloaded, failed, with the reason; the next request starts a new child.
        assert wait_until(lambda: router.models()["long"]["status"]["value"] == "unloaded",
                          HANG_GUARD_S)
        status = router.models()["long"]["status"]
        assert status["failed"] is True
        assert "stopped answering: 2 health checks in a row failed" in status["message"]
        response = client.post("/v1/chat/completions", json={"model": "long", **CHAT})
        assert response.status_code == 200, response.text
        assert router.models()["long"]["status"]["pid"] != frozen
        metrics = client.get("/metrics").text
        assert 'llamarouter_child_unresponsive_total{model="long"} 1.0' in metrics
        assert wait_until(lambda: any(e.get("event") == "unresponsive" for e in sse.events),
                          HANG_GUARD_S)
        sse.stop.set()
        assert "event=unresponsive" in router.log()


@real
def test_a_frozen_child_fails_a_plain_request_with_the_envelope(
        tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), *FAST_PROBES) as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "long", **CHAT}).status_code == 200
        os.kill(int(router.models()["long"]["status"]["pid"]), signal.SIGSTOP)
        response = client.post("/v1/chat/completions", json={"model": "long", **CHAT})
        # Sent to the frozen child, the request fails once the child is killed; a later
        # one is served by a new child.
        assert response.status_code == 502, response.text
        assert response.json()["error"]["type"]
        response = client.post("/v1/chat/completions", json={"model": "long", **CHAT})
        assert response.status_code == 200, response.text


@real
def test_a_long_generation_is_slow_not_dead(tmp_path: Path, presets: Path) -> None:
    # Fast probes, and a generation many times longer than a probe's timeout: the child
    # answers /health on its own thread all along, so nothing is killed.
    with start_router(tmp_path, "--presets", str(presets), *FAST_PROBES,
                      "--", "--threads", "1") as router, \
            httpx.Client(base_url=router.url, timeout=HANG_GUARD_S * 5) as client:
        response = client.post("/v1/chat/completions", json={
            "model": "long", "max_tokens": 4000, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4000  # seconds: many probes
        assert "health_missed" not in router.log()
        assert "event=unresponsive" not in router.log()
        assert router.models()["long"]["status"]["value"] == "loaded"
