"""A chaos soak against real llama-server children: every request gets an answer.

For ``CHAOS_S`` seconds, seeded, a router with room for 2 of 12 models (and one model on a
hostile peer) is driven by what its users and its bad days do at once:

* clients chatting to random models, streamed and not, some leaving mid-request;
* the presets rewritten every ``RELOAD_GAP_S`` (half the models changed: retired, loads under
  way cancelled), and ``POST /models/reload`` racing the file watcher;
* a llama-server child killed with SIGKILL every ``KILL_GAP_S``;
* a peer that answers every relayed request with a response head that never ends;
* raw connections sending an endless request head, or a WebSocket handshake.

It counts every request and fails on one that got no answer (a connection dropped with no
status line, or a stream cut without ``[DONE]`` or an error event), an answer outside the
envelope, a router exit, a descriptor closed twice or underneath the loop (``fdcheck``), or
the router's RSS past its bound. Figures: ``build/reliability/chaos.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fdcheck import VIOLATION, launcher
from support import start_router
from test_churn_real import preset_text as churn_presets
from test_churn_real import save_atomically
from test_hostile import record
from test_peers_hostile import stand_in_thread

pytestmark = pytest.mark.real

SEED = 20261203
MODELS = 12
CLIENTS = 4
CHAOS_S = 30.0
RELOAD_GAP_S = 1.5
KILL_GAP_S = 2.0
ATTACK_GAP_S = 1.0
REQUEST_GUARD_S = 60.0  # one request, only to catch a hang
RSS_BOUND = 128 << 20  # the router's growth over the soak (children not included)
LEFT = "left"  # the client went away on purpose


def preset_text(models: list[Path], changed: set[int]) -> str:
    return churn_presets(models, changed, count=MODELS, width=2)


def judged(response: httpx.Response, body: bytes) -> str:
    """The outcome of an answered request: its status, or why the answer is wrong."""
    status = response.status_code
    if status == 200:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            lines = [ln for ln in body.split(b"\n") if ln.startswith(b"data: ")]
            if not lines or (lines[-1] != b"data: [DONE]" and b'"error"' not in lines[-1]):
                return f"stream cut without [DONE] or an error event: {body[-200:]!r}"
        return "200"
    try:
        error = json.loads(body)["error"]
        assert error["code"] == status and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{status} without an envelope: {body[:200]!r}"
    return str(status)


async def chat(client: httpx.AsyncClient, rng: random.Random, model: str) -> str:
    stream = rng.random() < 0.5
    leave_after = rng.choice([None] * 9 + [0.0, 0.05, 0.3])
    payload = {"model": model, "stream": stream, "max_tokens": rng.randrange(4, 64),
               "messages": [{"role": "user", "content": "Hello"}]}
    left = False
    try:
        async with asyncio.timeout(REQUEST_GUARD_S):
            async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
                if leave_after is not None:  # once the head came: a client leaving mid-body
                    await asyncio.sleep(leave_after)
                    left = True
                    return LEFT  # closing the response drops the connection
                body = await response.aread()
                return judged(response, body)
    except TimeoutError:
        return "no answer: hung past the guard"
    except httpx.HTTPError as exc:
        if left:  # only the leaving itself may fail so
            return LEFT
        return f"no answer: {type(exc).__name__}: {exc}"


async def attack(port: int, rng: random.Random) -> str:
    """An endless request head, or a WebSocket handshake announcing a body: the envelope."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if rng.random() < 0.5:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: ")
            expected = b"HTTP/1.1 431 "
            with contextlib.suppress(ConnectionError):
                for _ in range(32):  # 1 MiB of a header value that never ends
                    writer.write(b"v" * 32768)
                    await writer.drain()
        else:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                         b"Upgrade: websocket\r\nContent-Length: 100\r\n\r\n")
            expected = b"HTTP/1.1 400 "
        async with asyncio.timeout(REQUEST_GUARD_S):
            answer = await reader.read(65536)
        return "refused" if answer.startswith(expected) else f"attack answered {answer[:80]!r}"
    except ConnectionError as exc:
        return f"attack got no answer: {exc!r}"
    finally:
        writer.close()


def kill_a_child(router_pid: int, rng: random.Random) -> bool:
    try:
        children = [p for p in psutil.Process(router_pid).children(recursive=True)
                    if "llama-server" in p.name()]
    except psutil.Error:
        return False
    if not children:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(rng.choice(children).pid, signal.SIGKILL)
    return True


async def soak(url: str, port: int, pid: int, presets: Path,
               models: list[Path]) -> dict[str, Any]:
    rng = random.Random(SEED)
    outcomes: list[str] = []
    deadline = time.monotonic() + CHAOS_S
    process = psutil.Process(pid)
    rss = {"before": process.memory_info().rss, "peak": 0}
    counts = {"reloads": 0, "kills": 0, "attacks": 0}

    async def client_loop(seed: int) -> None:
        pick = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_GUARD_S) as client:
            while time.monotonic() < deadline:
                model = "far" if pick.random() < 0.1 else f"m{pick.randrange(MODELS):02d}"
                outcomes.append(await chat(client, pick, model))

    async def reloads() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_GUARD_S) as admin:
            while time.monotonic() < deadline:
                await asyncio.sleep(RELOAD_GAP_S)
                changed = set(rng.sample(range(MODELS), MODELS // 2))
                save_atomically(presets, preset_text(models, changed))
                if rng.random() < 0.5:  # the API too, racing the file watcher
                    outcomes.append(judged(answer := await admin.post("/models/reload"),
                                           answer.content))
                counts["reloads"] += 1

    async def kills() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(KILL_GAP_S)
            counts["kills"] += kill_a_child(pid, rng)

    async def attacks() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(ATTACK_GAP_S)
            outcomes.append(await attack(port, rng))
            counts["attacks"] += 1

    async def watch_memory() -> None:
        while time.monotonic() < deadline:
            rss["peak"] = max(rss["peak"], process.memory_info().rss)
            await asyncio.sleep(0.1)

    actors = [asyncio.create_task(client_loop(rng.randrange(1 << 30)))
              for _ in range(CLIENTS)]
    actors += [asyncio.create_task(work()) for work in (reloads, kills, attacks, watch_memory)]
    async with asyncio.timeout(CHAOS_S + 2 * REQUEST_GUARD_S):
        await asyncio.gather(*actors)
    tally: dict[str, int] = {}
    for outcome in outcomes:
        tally[outcome] = tally.get(outcome, 0) + 1
    return {"requests": len(outcomes), "outcomes": tally, **counts,
            "rss_before_mib": round(rss["before"] / 2**20, 1),
            "rss_peak_mib": round(rss["peak"] / 2**20, 1)}


def test_chaos_answers_every_request_and_the_router_lives(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    models = [tiny_models[name] for name in ("alpha", "beta", "gamma")]
    presets = tmp_path / "chaos.ini"
    presets.write_text(preset_text(models, set()))
    with stand_in_thread({"far": "loaded"}) as (peer, _):
        peer.endless_head = 4 << 20
        with start_router(tmp_path, "--presets", str(presets), "--models-max", "2",
                          "--peer", peer.url, "--liveness-interval", "0.5",
                          launcher=launcher()) as router:
            figures = asyncio.run(soak(router.url, router.port, router.proc.pid, presets,
                                       models))
            figures["exit_code"] = router.proc.poll()  # None: it lives
            with router.client() as client:  # and serves after it all
                after = client.post("/v1/chat/completions", json={
                    "model": "m00", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hello"}]})
            log = router.log()
    figures["loads"] = log.count("event=spawned")
    record("chaos", figures)
    summary = json.dumps(figures, indent=1)
    assert figures["exit_code"] is None, f"the router died: {summary}\n{log[-3000:]}"
    assert after.status_code == 200, after.text
    violations = [line for line in log.splitlines() if VIOLATION in line]
    assert violations == [], "\n".join(violations[:20])
    wrong = {o: n for o, n in figures["outcomes"].items()
             if o not in ("200", "refused", LEFT) and not o.isdigit()}
    assert wrong == {}, summary
    statuses = {int(o) for o in figures["outcomes"] if o.isdigit()}
    assert statuses <= {200, 409, 429, 502, 503, 504}, summary
    assert figures["outcomes"].get("200", 0) > 0 and figures["kills"] > 0, summary
    assert figures["outcomes"].get("refused", 0) == figures["attacks"], summary
    assert (figures["rss_peak_mib"] - figures["rss_before_mib"]) * 2**20 < RSS_BOUND, summary
