"""The main phase (``--phases main``): the three targets on tiny generated models, for the
serving path alone. Latency of a chat, a stream's first token (new connection and
keep-alive) and ``/tokenize``, interleaved; ``/tokenize`` throughput; cold start and swap
with the router's own CPU; idle and loaded RSS; ``GET /models`` with many presets; each
target's start against the Python floor (``benchmarks.floorstart``). Then its table's rows
and its targets, for the runner (``benchmarks.bench``) to report."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from router.children.process import free_port
from router.llama.tinymodel import write_tiny_model

from .harness.columns import COLUMNS, DIRECT, LLAMACPP, ROUTER, ROUTERS
from .harness.errors import BenchError
from .harness.loadgen import LoadTool, choose_load_tool, run_load
from .harness.processes import ROOT, Managed, process_cpu_s, wait_healthy
from .harness.profiling import py_spy, summarize_profile
from .harness.stats import MB, no_gc, percentile, rotate, summary_ms
from .harness.table import Row
from .harness.targets import Bench, Endpoint, router_models, unload_all, write_presets
from .harness.timing import (
    attempt,
    chat_body,
    ollama_chat_body,
    timed_first_token,
    timed_request,
    tokenize_body,
)

MODELS = ("bench-a", "bench-b", "bench-c")  # a: warm latency; b: cold start; c: swap
LATENCY_METRICS = ("chat", "ttft", "ttft_ka", "tokenize", "models")
GOALS = {
    "tokenize_added_p50": "added p50 /tokenize latency over direct below llama.cpp router's",
    "tokenize_throughput": "/tokenize throughput at least 1.5x llama.cpp router's",
    "ttft_added_p50": "added streaming TTFT p50 at most 1 ms",
    "ollama_ttft_added": "Ollama's /api/chat first token p50 within 0.5 ms of the OpenAI path's",
    "ttft_vs_llamacpp": "added streaming TTFT p50 below llama.cpp router's, new connection "
                        "per request",
    "ttft_ka_vs_llamacpp": "added streaming TTFT p50 below llama.cpp router's, keep-alive "
                           "client",
    "cold_start_added": "cold start p50 at most 30 ms above the child's own spawn -> healthy",
    "idle_rss": "idle router RSS at most 80 MB",
    "models_500_p50": "GET /models with 500 presets under 20 ms (p50)",
}


@dataclass
class MainPhase:
    """The main phase's targets (one of each kind on three models, and one router of each
    kind with ``--presets`` sections for the listing) and what was measured of them."""

    bench: Bench
    eps: dict[str, Endpoint] = field(default_factory=dict)
    list_eps: dict[str, Endpoint] = field(default_factory=dict)
    startup_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    floor: Managed | None = None  # benchmarks.floorstart, from its start to the idle RSS

    # ------------------------------------------------------------ start

    def write_models_and_presets(self) -> dict[str, Path]:
        """The three tiny models; the preset files of each router, by name."""
        bench = self.bench
        model_dir = bench.workdir / "models"
        for seed, name in enumerate(MODELS, start=1):
            bench.models[name] = write_tiny_model(model_dir / f"{name}.gguf", seed=seed,
                                                  name=name)
        chat = {name: bench.models[name] for name in MODELS}
        many = {f"list-{i:03d}": bench.models[MODELS[0]] for i in range(bench.cfg.presets)}
        # llama-router always passes --metrics to its children; llama.cpp needs it in [*].
        # Every child, direct or behind either router, computes alike: as llama-router runs a
        # model alone (CHILD_CPU and its environment), so the rows measure the serving path.
        lc_cpu = bench.lc_cpu_keys()
        return {
            "llamacpp": write_presets(bench.workdir / "llamacpp.ini", chat,
                                      ["metrics = true", *lc_cpu]),
            "router": write_presets(bench.workdir / "llama-router.ini", chat, []),
            "llamacpp_many": write_presets(bench.workdir / "llamacpp-many.ini", many,
                                           ["metrics = true", *lc_cpu]),
            "router_many": write_presets(bench.workdir / "llama-router-many.ini", many, []),
        }

    def setup(self) -> None:
        bench = self.bench
        presets = self.write_models_and_presets()
        starts: list[tuple[str, bool, Callable[[], tuple[Managed, str]]]] = [
            (DIRECT, False, lambda: bench.start_direct(MODELS[0], "direct")),
            (LLAMACPP, False, lambda: bench.start_llamacpp(presets["llamacpp"],
                                                           "llamacpp-router")),
            (ROUTER, False, lambda: bench.start_router(presets["router"], "llama-router")),
            (LLAMACPP, True, lambda: bench.start_llamacpp(presets["llamacpp_many"],
                                                          "llamacpp-router-many")),
            (ROUTER, True, lambda: bench.start_router(presets["router_many"],
                                                      "llama-router-many")),
        ]
        for column, many_presets, start in starts:
            item, url = start()
            healthy = wait_healthy(item, url)
            key = "many_presets" if many_presets else "main"
            self.startup_ms.setdefault(key, {})[column] = healthy * 1000.0
            (self.list_eps if many_presets else self.eps)[column] = Endpoint(column, url, item)
        self.list_eps[DIRECT] = self.eps[DIRECT]
        port = free_port()
        self.floor = bench.procs.start("python-floor", [sys.executable, "-m",
                                                        "benchmarks.floorstart", str(port)],
                                       cwd=ROOT)
        self.startup_ms["python_floor"] = {
            ROUTER: wait_healthy(self.floor, f"http://127.0.0.1:{port}") * 1000.0}
        for column in ROUTERS:
            count = len(router_models(self.list_eps[column]))
            if count != bench.cfg.presets:
                raise BenchError(f"{column} lists {count} models, expected {bench.cfg.presets}")

    def warm_up(self) -> None:
        model = MODELS[0]
        chat, stream, tok = (chat_body(model, stream=False), chat_body(model, stream=True),
                             tokenize_body(model))
        for ep in self.eps.values():
            self.bench.quiet()  # its child starts on a machine the other targets left alone
            tally = ep.tally("warmup")
            for _ in range(5):
                attempt(partial(timed_request, ep.client, "POST", "/v1/chat/completions", chat),
                        tally)
                attempt(partial(timed_first_token, ep.client, stream), tally)
                attempt(partial(timed_first_token, ep.stream_client, stream, keep_alive=True),
                        tally)
            for _ in range(20):
                attempt(partial(timed_request, ep.client, "POST", "/tokenize", tok), tally)
        for column, ep in self.list_eps.items():
            path = "/v1/models" if column == DIRECT else "/models"
            for _ in range(3):
                attempt(partial(timed_request, ep.client, "GET", path, None),
                        ep.tally("warmup"))
        time.sleep(1.0)

    # ------------------------------------------------------------ measurements

    def measure_memory_idle(self) -> None:
        idle: dict[str, float] = {}
        for column, ep in self.eps.items():
            readings = []
            for _ in range(5):
                readings.append(ep.rss())
                time.sleep(0.1)
            idle[column] = percentile(readings, 50) / MB
        self.results["rss_idle_mb"] = idle
        if self.floor is not None:
            self.results["rss_idle_python_floor_mb"] = \
                psutil.Process(self.floor.proc.pid).memory_info().rss / MB
            self.bench.procs.stop(self.floor)
        self.results["rss_idle_many_presets_mb"] = {
            c: self.list_eps[c].rss() / MB for c in ROUTERS}

    def measure_latency(self) -> None:
        model = MODELS[0]
        chat, stream, tok = (chat_body(model, stream=False), chat_body(model, stream=True),
                             tokenize_body(model))
        metrics: dict[str, Callable[[str], float]] = {
            "chat": lambda c: timed_request(self.eps[c].client, "POST", "/v1/chat/completions",
                                            chat),
            "ttft": lambda c: timed_first_token(self.eps[c].client, stream),
            "ttft_ka": lambda c: timed_first_token(self.eps[c].stream_client, stream,
                                                   keep_alive=True),
            "tokenize": lambda c: timed_request(self.eps[c].client, "POST", "/tokenize", tok),
            "models": lambda c: timed_request(self.list_eps[c].client, "GET",
                                              "/v1/models" if c == DIRECT else "/models", None),
        }
        samples: dict[str, dict[str, list[float]]] = {m: {c: [] for c in COLUMNS}
                                                      for m in metrics}
        for rnd in range(self.bench.cfg.rounds):
            order = rotate(COLUMNS, rnd)
            with no_gc():
                for name, measure in metrics.items():
                    for _ in range(self.bench.cfg.samples):
                        for column in order:
                            tally = self._ep(name, column).tally(name)
                            samples[name][column].append(attempt(partial(measure, column),
                                                                 tally))
        self.results["latency_ms"] = {name: {c: summary_ms(v) for c, v in per.items()}
                                      for name, per in samples.items()}

    def measure_ollama(self) -> None:
        """llama-router's streamed first token through Ollama's ``/api/chat`` against its
        own OpenAI path, interleaved on one keep-alive client (no other target has it)."""
        model = MODELS[0]
        paths = {"openai": ("/v1/chat/completions", chat_body(model, stream=True)),
                 "ollama": ("/api/chat", ollama_chat_body(model))}
        ep = self.eps[ROUTER]
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for rnd in range(self.bench.cfg.rounds):
            with no_gc():
                for _ in range(self.bench.cfg.samples):
                    for name in rotate(list(paths), rnd):
                        url, body = paths[name]
                        samples[name].append(attempt(partial(
                            timed_first_token, ep.stream_client, body, url, keep_alive=True),
                            ep.tally("ttft_ollama")))
        self.results["ollama_ttft_ms"] = {n: summary_ms(v) for n, v in samples.items()}

    def _ep(self, metric: str, column: str) -> Endpoint:
        return (self.list_eps if metric == "models" else self.eps)[column]

    def measure_throughput(self) -> None:
        cfg = self.bench.cfg
        tool = choose_load_tool(cfg.loadgen, self.bench.workdir, MODELS[0])
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in COLUMNS}
        for rnd in range(cfg.throughput_rounds):
            for column in rotate(COLUMNS, rnd):
                runs[column].append(run_load(tool, self.eps[column], MODELS[0], cfg,
                                             watch_rss=column != DIRECT))
                time.sleep(0.5)
        self.results["throughput"] = {
            "tool": tool.name, "connections": cfg.connections,
            "duration_s": cfg.duration, "runs": runs,
            "rps": {c: percentile([r["rps"] for r in runs[c]], 50) for c in COLUMNS},
            "p50_ms": {c: percentile([r["p50_ms"] for r in runs[c]], 50) for c in COLUMNS},
            "p99_ms": {c: percentile([r["p99_ms"] for r in runs[c]], 50) for c in COLUMNS},
            "generator_cores": {c: percentile([r["generator_cores"] for r in runs[c]], 50)
                                for c in COLUMNS},
            "target_cores": {c: percentile([r["target_cores"] for r in runs[c]], 50)
                             for c in COLUMNS},
            "errors": {c: sum(r["errors"] for r in runs[c]) for c in COLUMNS},
        }
        self.results["rss_load_mb"] = {c: max(r["peak_rss_mb"] for r in runs[c])
                                       for c in ROUTERS}
        self.results["rss_load_mb"][DIRECT] = self.eps[DIRECT].rss() / MB
        if cfg.profile:
            self.results["profile"] = self.profile_router(tool)

    def profile_router(self, tool: LoadTool) -> dict[str, Any]:
        """py-spy the llama-router process under the same /tokenize load (not counted)."""
        spy = py_spy()
        if spy is None:
            return {"error": "py-spy not installed (pip install py-spy)"}
        ep = self.eps[ROUTER]
        raw = self.bench.workdir / "profile.txt"
        argv = [spy, "record", "--pid", str(ep.item.proc.pid), "--rate", "250",
                "--duration", f"{max(1, round(self.bench.cfg.duration))}", "--format", "raw",
                "--nonblocking", "--output", str(raw)]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as spy_p:
            time.sleep(0.3)
            load = run_load(tool, ep, MODELS[0], self.bench.cfg, watch_rss=False)
            _, err = spy_p.communicate(timeout=60)
        if spy_p.returncode != 0 or not raw.exists():
            return {"error": f"py-spy failed: {err.decode()[-300:]}"}
        return {"rps_while_profiled": load["rps"], **summarize_profile(raw.read_text())}

    def cold_and_swap(self, ep: Endpoint) -> tuple[float, float, float, float]:
        """One cold start and one swap through a router: (cold start, its router CPU, swap,
        its router CPU), in seconds."""
        cold_model, swap_model = MODELS[1], MODELS[2]
        pid = ep.item.proc.pid
        unload_all(ep)
        time.sleep(0.2)
        used = process_cpu_s(pid)
        cold = attempt(partial(timed_first_token, ep.client, chat_body(cold_model, stream=True)),
                       ep.tally("cold"))
        cold_cpu = process_cpu_s(pid) - used
        self.bench.procs.note_descendants()
        # A non-streaming request first, as in normal use: it may leave an idle keep-alive
        # connection to the child that is about to be evicted.
        attempt(partial(timed_request, ep.client, "POST", "/tokenize",
                        tokenize_body(cold_model)), ep.tally("swap"))
        time.sleep(0.2)
        used = process_cpu_s(pid)
        swap = attempt(partial(timed_first_token, ep.client, chat_body(swap_model, stream=True)),
                       ep.tally("swap"))
        swap_cpu = process_cpu_s(pid) - used
        self.bench.procs.note_descendants()
        return cold, cold_cpu, swap, swap_cpu

    def measure_cold(self) -> None:
        kinds = ("cold", "cold_cpu", "swap", "swap_cpu")
        routed: dict[str, dict[str, list[float]]] = {k: {c: [] for c in ROUTERS} for k in kinds}
        healthy: list[float] = []
        direct_first: list[float] = []
        for rnd in range(self.bench.cfg.cold_rounds):
            for column in rotate(COLUMNS, rnd):
                if column == DIRECT:
                    to_healthy, to_first = self.bench.direct_cold_start(MODELS[1], "baseline",
                                                                        60.0)
                    healthy.append(to_healthy)
                    direct_first.append(to_first)
                    continue
                for kind, value in zip(kinds, self.cold_and_swap(self.eps[column]),
                                       strict=True):
                    routed[kind][column].append(value)
        self.results["cold_ms"] = {
            "child_healthy": summary_ms(healthy), "child_first_token": summary_ms(direct_first),
            "cold": {c: summary_ms(v) for c, v in routed["cold"].items()},
            "swap": {c: summary_ms(v) for c, v in routed["swap"].items()},
            # the router process's own CPU (its children's excluded) from the request to its
            # first token: what it spends on a load, beside the child's own work
            "cold_cpu": {c: summary_ms(v) for c, v in routed["cold_cpu"].items()},
            "swap_cpu": {c: summary_ms(v) for c, v in routed["swap_cpu"].items()},
        }

    # ------------------------------------------------------------ the phase

    def run(self) -> dict[str, Any]:
        self.setup()
        self.warm_up()
        self.measure_memory_idle()
        self.measure_latency()
        self.measure_ollama()
        self.measure_throughput()
        self.measure_cold()
        self.results["startup_ms"] = self.startup_ms
        self.results["retries"] = {  # direct serves both lists: count it once
            c: {"main": self.eps[c].failures,
                "many_presets": self.list_eps[c].failures if c != DIRECT else {}}
            for c in COLUMNS}
        return self.results

    def close(self) -> None:
        for ep in [*self.eps.values(), *self.list_eps.values()]:
            ep.close()

    def stop_targets(self) -> None:
        """Stop the main phase's servers: the phases after it start their own."""
        self.close()
        for ep in [*self.eps.values(), *self.list_eps.values()]:
            self.bench.procs.stop(ep.item)


# --------------------------------------------------------------------------- its report

def build_rows(res: dict[str, Any], presets: int) -> list[Row]:
    lat = res["latency_ms"]
    rows: list[Row] = []
    for name, label in (("chat", "chat max_tokens=1"), ("ttft", "stream first token"),
                        ("ttft_ka", "stream first token, keep-alive client"),
                        ("tokenize", "POST /tokenize")):
        for stat in ("p50", "p99"):
            rows.append(Row(f"{name}_{stat}_ms", f"{label} {stat}", "ms", "latency",
                            {c: lat[name][c][stat] for c in COLUMNS}))
    tput = res["throughput"]
    conns = tput["connections"]
    rows.append(Row("tokenize_rps", f"/tokenize throughput, {conns} conns", "req/s", "rate",
                    tput["rps"]))
    rows.append(Row("tokenize_load_p99_ms", "/tokenize p99 under that load", "ms", "latency",
                    tput["p99_ms"]))
    rows.append(Row("target_cores", "server CPU under load (cores)", "cores", "info",
                    tput["target_cores"]))
    rows.append(Row("generator_cores", f"{tput['tool']} CPU (cores)", "cores", "info",
                    tput["generator_cores"]))
    cold = res["cold_ms"]
    healthy = cold["child_healthy"]["p50"]
    first = cold["child_first_token"]["p50"]
    rows.append(Row("cold_vs_healthy_ms", "cold start p50 [direct: spawn->/health 200]", "ms",
                    "latency", {DIRECT: healthy,
                                **{c: cold["cold"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("cold_vs_first_token_ms", "cold start p50 [direct: spawn->1st token]",
                    "ms", "latency",
                    {DIRECT: first, **{c: cold["cold"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("swap_ms", "swap (max 1) p50 [direct: spawn->1st token]", "ms",
                    "latency", {DIRECT: first, **{c: cold["swap"][c]["p50"] for c in ROUTERS}}))
    for key, what in (("cold_cpu", "cold start"), ("swap_cpu", "swap")):
        rows.append(Row(f"{key}_ms", f"router CPU per {what} p50 [direct: none]", "ms", "info",
                        {DIRECT: 0.0, **{c: cold[key][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("rss_idle_mb", "RSS idle, MB [direct: llama-server]", "MB", "info",
                    res["rss_idle_mb"]))
    rows.append(Row("rss_load_mb", "RSS under load (peak), MB", "MB", "info",
                    res["rss_load_mb"]))
    for stat in ("p50", "p99"):
        rows.append(Row(f"models_{stat}_ms", f"GET /models, {presets} presets {stat} "
                        "[direct: 1 model]", "ms", "latency",
                        {c: lat["models"][c][stat] for c in COLUMNS}))
    rows.append(Row("startup_ms", "start -> /health 200 (3 presets)", "ms", "latency",
                    res["startup_ms"]["main"]))
    total = sum(lat[m][DIRECT]["n"] for m in LATENCY_METRICS)
    rows.append(Row("tokenize_load_errors", "throughput errors (non-2xx, socket errors)",
                    "count", "info", tput["errors"]))
    for kind, label in (("dropped", "keep-alive conn closed under client"),
                        ("http_502", "HTTP 502 from the router")):
        counts = {c: float(sum(per.get(kind, 0)
                               for part in res["retries"][c].values()
                               for phase, per in part.items() if phase in LATENCY_METRICS))
                  for c in COLUMNS}
        rows.append(Row(f"retries_{kind}", f"retried: {label}, of {total} samples", "count",
                        "info", counts))
    return rows


def evaluate(res: dict[str, Any], rows: list[Row]) -> dict[str, dict[str, Any]]:
    by = {r.key: r.values for r in rows}
    tok = by["tokenize_p50_ms"]
    lr_added, lc_added = tok[ROUTER] - tok[DIRECT], tok[LLAMACPP] - tok[DIRECT]
    rps = by["tokenize_rps"]
    ttft = by["ttft_p50_ms"]
    cold = by["cold_vs_healthy_ms"]
    ollama, openai = (res["ollama_ttft_ms"][n]["p50"] for n in ("ollama", "openai"))

    def ahead(metric: str) -> tuple[bool, str]:
        p50, p99 = by[f"{metric}_p50_ms"], by[f"{metric}_p99_ms"]
        lr, lc = p50[ROUTER] - p50[DIRECT], p50[LLAMACPP] - p50[DIRECT]
        return lr < lc, (f"llama-router {lr:+.3f} ms vs llama.cpp router {lc:+.3f} ms "
                         f"(p99 {p99[ROUTER]:.2f} vs {p99[LLAMACPP]:.2f} ms, direct "
                         f"{p99[DIRECT]:.2f} ms)")

    checks: dict[str, tuple[bool, str]] = {
        "tokenize_added_p50": (lr_added < lc_added,
                               f"llama-router +{lr_added:.3f} ms vs llama.cpp router "
                               f"+{lc_added:.3f} ms"),
        "tokenize_throughput": (rps[ROUTER] >= 1.5 * rps[LLAMACPP],
                                f"{rps[ROUTER]:.0f} vs {rps[LLAMACPP]:.0f} req/s = "
                                f"{rps[ROUTER] / rps[LLAMACPP]:.2f}x"),
        "ttft_added_p50": (ttft[ROUTER] - ttft[DIRECT] <= 1.0,
                           f"{ttft[ROUTER] - ttft[DIRECT]:+.3f} ms"),
        "ttft_vs_llamacpp": ahead("ttft"),
        "ttft_ka_vs_llamacpp": ahead("ttft_ka"),
        "ollama_ttft_added": (ollama - openai <= 0.5, f"{ollama - openai:+.3f} ms "
                              f"({ollama:.2f} vs {openai:.2f} ms, keep-alive client)"),
        "cold_start_added": (cold[ROUTER] - cold[DIRECT] <= 30.0,
                             f"{cold[ROUTER]:.1f} ms vs child healthy {cold[DIRECT]:.1f} ms "
                             f"= +{cold[ROUTER] - cold[DIRECT]:.1f} ms"),
        "idle_rss": (by["rss_idle_mb"][ROUTER] <= 80.0, f"{by['rss_idle_mb'][ROUTER]:.1f} MB"),
        "models_500_p50": (by["models_p50_ms"][ROUTER] < 20.0,
                           f"{by['models_p50_ms'][ROUTER]:.2f} ms "
                           f"(p99 {by['models_p99_ms'][ROUTER]:.2f} ms)"),
    }
    return {k: {"goal": GOALS[k], "met": ok, "measured": text}
            for k, (ok, text) in checks.items()}


def python_floor(res: dict[str, Any]) -> str:
    """The line comparing llama-router's start and idle memory with the Python floor."""
    start, rss = res["startup_ms"], res["rss_idle_mb"]
    floor_ms = start["python_floor"][ROUTER]
    floor_mb = res["rss_idle_python_floor_mb"]
    own_ms, own_mb = start["main"][ROUTER], rss[ROUTER]
    return (f"Python floor (benchmarks.floorstart: pydantic-settings, httpx, starlette and "
            f"uvicorn serving /health alone): start -> /health 200 {floor_ms:.0f} ms, idle RSS "
            f"{floor_mb:.1f} MB; llama-router {own_ms:.0f} ms ({own_ms - floor_ms:+.0f} ms), "
            f"{own_mb:.1f} MB ({own_mb - floor_mb:+.1f} MB)")
