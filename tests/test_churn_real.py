"""Eviction and reload churn against real llama-server children, with every ``os.close`` of
the router checked (``fdcheck``): 1,000 presets, room for 2 models, a few clients chatting to
random models while the preset file is rewritten and reloaded every 0.7 s.

What it guards: a router that closed a child's pipe descriptors twice (uvloop closes a pipe
transport's descriptor, then the Python file object it was made from; pipes left open after
their output ended were closed so by the garbage collector, in any thread, while the loop
ran) closed other owners' descriptors whose numbers had been reused: requests got no HTTP
answer at all, loads failed with ``could not start llama-server: [Errno 17] File exists``,
and the router died of libuv's abort. Now every request gets an HTTP answer, no load fails
so, the router lives, and nothing is closed twice, underneath its loop, or left to the
garbage collector (which ``fdcheck``'s launcher runs in a thread of its own every 0.5 s, as
the router's log writer or worker threads may: before the fix every run failed on that, and
some also on a ``/proc`` read whose descriptor was closed underneath it, a load that failed
with ``EBADF``, or the router gone).

Seeded and bounded for a shared 2-core machine: about 15 s of churn, well under 2 minutes in
all; figures under ``build/reliability/churn.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fdcheck import VIOLATION, launcher
from support import start_router
from test_hostile import record

pytestmark = pytest.mark.real

SEED = 20260601
PRESETS = 1000
CLIENTS = 5
RELOADS = 20
RELOAD_GAP_S = 0.7
REQUEST_GUARD_S = 60.0  # one request, only to catch a hang
CHAT = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
# What the router's log must never say: a descriptor's number reused underneath an owner.
BROKEN = ("File exists", "Bad file descriptor", VIOLATION)


def preset_text(models: list[Path], changed: set[int], count: int = PRESETS,
                width: int = 4) -> str:
    """``count`` models (``m`` and ``width`` digits) over the tiny ones; those in ``changed``
    with another context size (a changed preset: a reload retires the model, or cancels its
    load under way)."""
    lines = ["[*]", "ctx-size = 512", "parallel = 1"]
    for i in range(count):
        lines += [f"[m{i:0{width}d}]", f"model = {models[i % len(models)]}"]
        if i in changed:
            lines.append("ctx-size = 256")
    return "\n".join(lines) + "\n"


def save_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def chat(client: httpx.AsyncClient, model: str) -> str:
    """The status of the answer, or what came instead of one."""
    try:
        response = await client.post("/v1/chat/completions", json={"model": model, **CHAT})
    except httpx.HTTPError as exc:
        return f"no answer: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} without an envelope: {response.text[:200]!r}"
        if "File exists" in message or "Bad file descriptor" in message:
            return f"{response.status_code}: {message}"
    return str(response.status_code)


async def chat_once(url: str, model: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_GUARD_S) as client:
        return await chat(client, model)


async def churn(url: str, presets: Path, models: list[Path]) -> dict[str, Any]:
    rng = random.Random(SEED)
    outcomes: list[str] = []
    stop = asyncio.Event()

    async def client_loop(seed: int) -> None:
        pick = random.Random(seed)
        limits = httpx.Limits(max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_GUARD_S,
                                     limits=limits) as client:
            while not stop.is_set():
                outcomes.append(await chat(client, f"m{pick.randrange(PRESETS):04d}"))

    clients = [asyncio.create_task(client_loop(rng.randrange(1 << 30)))
               for _ in range(CLIENTS)]
    reloads: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_GUARD_S) as admin:
        for i in range(RELOADS):
            await asyncio.sleep(RELOAD_GAP_S)
            changed = set(rng.sample(range(PRESETS), PRESETS // 2))
            save_atomically(presets, preset_text(models, changed))
            if i % 2:  # the API too, racing the file watcher
                reloads.append((await admin.post("/models/reload")).status_code)
    stop.set()
    async with asyncio.timeout(REQUEST_GUARD_S + 10):
        await asyncio.gather(*clients)
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"requests": len(outcomes), "outcomes": counts, "api_reloads": reloads}


def test_eviction_and_reload_churn_answers_every_request_and_closes_nothing_twice(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    models = [tiny_models[name] for name in ("alpha", "beta", "gamma")]
    presets = tmp_path / "churn.ini"
    presets.write_text(preset_text(models, set()))
    started = time.monotonic()
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "2",
                      launcher=launcher()) as router:
        figures = asyncio.run(churn(router.url, presets, models))
        after = asyncio.run(chat_once(router.url, "m0000"))  # still serving after it all
        figures["exit_code"] = router.proc.poll()  # None: it lives
        log = router.log()
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["loads"] = log.count("event=spawned")
    record("churn", figures)
    summary = json.dumps(figures, indent=1)
    assert figures["exit_code"] is None, f"the router died: {summary}\n{log[-3000:]}"
    assert after == "200", after
    broken = [line for line in log.splitlines() if any(b in line for b in BROKEN)]
    assert broken == [], "\n".join(broken[:20])
    strange = {o: n for o, n in figures["outcomes"].items() if o not in ("200", "503", "429")}
    assert strange == {}, summary
    assert figures["outcomes"].get("200", 0) > 0 and figures["loads"] > 10, summary
    assert set(figures["api_reloads"]) == {200}, summary
