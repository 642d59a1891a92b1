"""The hostile tier under load, against real llama-server children: many streams at once over
more models than may be loaded, a long run of requests with flat memory, and many event
subscribers through many swaps. Figures: docs/reliability.md (and build/reliability/).

Bounded for a 2-core machine shared with other work: every wait has a generous guard, and
nothing asserts how fast it went.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support import start_router, write_presets
from test_hostile import record

pytestmark = pytest.mark.real

GUARD_S = 600.0  # a whole phase; only to catch a hang


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> Path:
    text = "[*]\nctx-size = 2048\nparallel = 4\n"
    for name in ("alpha", "beta", "gamma"):
        text += f"[{name}]\nmodel = {tiny_models[name]}\n"
    return write_presets(tmp_path / "load.ini", text)


async def one_stream(client: httpx.AsyncClient, model: str) -> str:
    """'done' for a stream that ended with [DONE]; the status for a clear refusal; anything
    else is a problem, described."""
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello"}]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            data = json.loads(await response.aread())
            ok = response.status_code in (429, 503) and "message" in data.get("error", {})
            return str(response.status_code) if ok else f"bad refusal {response.status_code}"
        last = ""
        async for line in response.aiter_lines():
            if line:
                last = line
        return "done" if last == "data: [DONE]" else f"ended with {last[:80]!r}"


def test_a_thousand_streams_over_three_models_with_room_for_two(
        tmp_path: Path, presets: Path) -> None:
    async def run(url: str) -> dict[str, int]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=GUARD_S) as client:
            outcomes = await asyncio.wait_for(asyncio.gather(
                *(one_stream(client, ("alpha", "beta", "gamma")[i % 3]) for i in range(1000))),
                GUARD_S)
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    with start_router(tmp_path, "--presets", str(presets), "--models-max", "2") as router:
        counts = asyncio.run(run(router.url))
        assert router.proc.poll() is None
    record("thousand_streams", {"streams": 1000, **counts})
    assert set(counts) <= {"done", "429", "503"}, counts
    assert counts.get("done", 0) > 0


def test_ten_thousand_requests_keep_memory_flat(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            httpx.Client(base_url=router.url, timeout=60) as client:
        process = psutil.Process(router.proc.pid)

        def burst(n: int) -> None:
            for i in range(n):
                response = client.post("/tokenize", json={"model": "alpha",
                                                           "content": f"words {i}"})
                assert response.status_code == 200

        burst(1000)  # warm: pools, caches, metric series
        before = process.memory_info().rss
        started = time.monotonic()
        burst(10_000)
        seconds = time.monotonic() - started
        after = process.memory_info().rss
    growth_mib = (after - before) / 2**20
    record("ten_thousand_requests", {"requests": 10_000, "rss_before_mib": round(before / 2**20, 1),
                                     "rss_after_mib": round(after / 2**20, 1),
                                     "growth_mib": round(growth_mib, 2),
                                     "seconds": round(seconds, 1)})
    assert growth_mib < 16, f"RSS grew {growth_mib:.1f} MiB over 10,000 requests"


def test_a_hundred_subscribers_see_every_event_through_thirty_swaps(
        tmp_path: Path, presets: Path) -> None:
    swaps = 30

    async def subscriber(client: httpx.AsyncClient, ready: asyncio.Event,
                         connected: list[int], seen: list[dict[str, Any]],
                         finished: list[int], all_finished: asyncio.Event) -> None:
        async with client.stream("GET", "/models/sse") as response:
            connected.append(1)
            if len(connected) == 100:
                ready.set()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if loaded(seen) == swaps:  # its last swap's "loaded" arrived
                        finished.append(1)
                        if len(finished) == 100:
                            all_finished.set()

    async def run(url: str) -> list[list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
            ready, all_finished = asyncio.Event(), asyncio.Event()
            connected: list[int] = []
            finished: list[int] = []
            seen: list[list[dict[str, Any]]] = [[] for _ in range(100)]
            tasks = [asyncio.create_task(subscriber(client, ready, connected, seen[i],
                                                    finished, all_finished))
                     for i in range(100)]
            await asyncio.wait_for(ready.wait(), 60)
            for i in range(swaps):
                response = await client.post("/v1/chat/completions", timeout=120, json={
                    "model": ("alpha", "beta")[i % 2], "max_tokens": 1,
                    "messages": [{"role": "user", "content": "Hi"}]})
                assert response.status_code == 200, response.text
            # The last swap's events reach everyone: each saw its last "loaded".
            await asyncio.wait_for(all_finished.wait(), 120)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return seen

    def loaded(events: list[dict[str, Any]]) -> int:
        return sum(1 for e in events if e.get("event") == "status_change"
                   and (e.get("data") or {}).get("status") == "loaded")

    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router:
        seen = asyncio.run(run(router.url))
    transitions = [[(e["model"], e["event"], (e.get("data") or {}).get("status"))
                    for e in s if e.get("event") in ("status_change", "model_status", "stopping")]
                   for s in seen]
    record("sse_subscribers", {"subscribers": 100, "swaps": swaps,
                               "events_each": len(transitions[0]),
                               "identical": all(t == transitions[0] for t in transitions)})
    assert all(t == transitions[0] for t in transitions), "subscribers saw different events"
    assert loaded(seen[0]) >= swaps
    assert not any(e.get("event") == "events_dropped" for s in seen for e in s)
