"""Benchmark phase: concurrent multi-turn conversations on a model with two replicas.

``N`` conversations run at once, each for several turns: a long system prompt of its own
(~1,500 tokens of SmolLM2-135M-Instruct), then a user question, the streamed reply appended,
the next question, and so on. Users do not type in step: conversation ``i`` starts ``i`` x
``START_GAP_S`` after the first, and each waits a "reading and typing" time between
``THINK_S`` before its next turn (drawn from a seeded generator: the same schedule for every
target). A follow-up turn repeats the whole conversation so far; a
llama-server that still holds the conversation's prefix in a slot (or its ``--cache-ram``)
only processes the new tokens, one that does not processes all ~1,500 again.

Targets, each started once and run in turn (rotating when ``--multiturn-reps`` > 1):

* ``prefix``: llama-router, ``replicas = 2``, ``replica-routing = prefix`` (a conversation's
  follow-ups go to the replica that served its prefix);
* ``least_busy``: the same with ``replica-routing = least-busy``;
* ``llamacpp_router``: llama.cpp's router, one child with all the cores.

Every child has a slot per conversation (``parallel = N``, 2,048 tokens each), so no
conversation evicts another; only where a follow-up lands decides whether its prefix is cached.
Measured: time to the first content token of every turn, and from each reply's ``timings``
how many prompt tokens the child took from its cache. Target: follow-up TTFT p50 with prefix
routing at most half of least-busy's.

The saturated configuration (``Settings.saturated``, ``--multiturn-saturated``): 8
conversations of ~1,000-token system prompts on two replicas of one slot each (``parallel =
1``), in lock-step: each turn, every conversation's next message arrives at once, in an order
shuffled each turn (``ARRIVAL_GAP_S`` apart, the same orders for every target), and the next turn
starts when all are answered. A replica then holds four conversations, one in its slot and the
rest in its prompt cache (``cache-ram = 512`` MiB: the router's default, one KV cache's worth,
~46 MiB here, keeps about two of these prompts, so most follow-ups would find nothing to reuse
whatever the routing), and a follow-up whose replica is busy either waits there or has its
whole conversation computed again on the other: what ``replica-routing = prefix`` weighs. Its
targets: ``prefix``, ``least_busy`` and, with ``--multiturn-baseline SRC``, ``baseline``: prefix
routing as the llama-router in source tree SRC does it (before/after in one run). Target:
follow-up TTFT p50 and p95 with prefix routing below least-busy's and the baseline's.

The ``replica-routing`` preset key is llama-router's; a router that does not accept it yet
(it exits naming the key) gets the least-busy run without the key (its only policy then) and
the prefix run is reported as not run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from router.llama.smollm2 import INSTALL_HINT, find_smollm2

from .harness.errors import BenchError
from .harness.processes import Managed, wait_healthy
from .harness.stats import percentile, rotate
from .harness.targets import write_presets
from .harness.timing import chat_events

if TYPE_CHECKING:
    from .harness.targets import Bench

PREFIX, LEAST_BUSY, LLAMACPP_ONE = "prefix", "least_busy", "llamacpp_router"
BASELINE = "baseline"
TARGETS = (PREFIX, BASELINE, LEAST_BUSY, LLAMACPP_ONE)
LABELS = {PREFIX: "llama-router, replica-routing = prefix",
          BASELINE: "llama-router (baseline source), replica-routing = prefix",
          LEAST_BUSY: "llama-router, replica-routing = least-busy",
          LLAMACPP_ONE: "llama.cpp router, one child"}
ROUTING_KEY = "replica-routing"
MODEL = "chat"
SLOT_CTX = 2048
START_GAP_S = 0.5
ARRIVAL_GAP_S = 0.01  # between a turn's requests in the saturated configuration
THINK_S = (0.3, 2.5)
# A kept-alive connection idle this long is not reused: under every server's own keep-alive
# timeout (llama-server's and uvicorn's 5 s, httpx's default expiry too). With equal
# timeouts a request sent on a connection the server closes at that moment gets no answer
# (httpx.ReadError; seen on a heavily loaded machine): a race of the client, not a target's.
KEEPALIVE_S = 2.0
QUESTIONS = ("In one sentence, what are these notes about?",
             "Which word appears most often in them?",
             "Give me one more detail from the notes.",
             "Summarize our conversation so far.",
             "What would you ask me next?",
             "Thank you. Anything else?")
_WORD_TEXT = ("the of and to in is was for on are with as be at by this have from or one had not "
         "but what all were when we there can an your which their said if do will each about "
         "how up out them then she many some so these would other into has more her two like "
         "him see time could no make than first been its who now people my made over did down "
         "only way find use may water long little very after words called just where most "
         "know river stone garden window market letter winter summer morning evening")
WORDS = tuple(_WORD_TEXT.split(" "))


@dataclass
class Settings:
    conversations: int = 4
    turns: int = 3
    reps: int = 1
    system_words: int = 1340  # ~1,500 tokens of SmolLM2's tokenizer
    max_tokens: int = 24  # per reply
    pace: float = 1.0  # scales the start gaps and think times (quick runs: 0.1)
    parallel: int | None = None  # slots per child; None: one per conversation
    together: bool = False  # lock-step turns, shuffled (the saturated configuration)
    baseline_src: Path | None = None  # a llama-router source tree for the ``baseline`` target
    cache_ram_mib: int | None = None  # each child's --cache-ram; None: the router's default

    @classmethod
    def quick(cls) -> Settings:
        return cls(conversations=2, turns=2, reps=1, system_words=80, max_tokens=4,
                   pace=0.1)

    @classmethod
    def saturated(cls, reps: int = 1, baseline_src: Path | None = None) -> Settings:
        """8 conversations of ~1,000 tokens, 3 turns, on two replicas of one slot each."""
        return cls(conversations=8, turns=3, reps=reps, system_words=890, parallel=1,
                   together=True, baseline_src=baseline_src, cache_ram_mib=512)


def system_prompt(tag: str, words: int) -> str:
    """A long system prompt of its own for each conversation (its start differs)."""
    rnd = random.Random(tag)
    picked = [rnd.choice(WORDS) for _ in range(words)]
    sentences = [" ".join(picked[i:i + 12]).capitalize() + "." for i in range(0, words, 12)]
    return (f"Conversation {tag}. You are a careful assistant. Answer briefly, using the "
            f"notes below.\nNotes:\n" + " ".join(sentences))


@dataclass
class Turn:
    ttft_ms: float
    text: str
    prompt_n: int
    cache_n: int


async def stream_turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                      max_tokens: int) -> Turn:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    began = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    timings: dict[str, Any] = {}
    async with chat_events(client, url, body, url) as events:
        async for event in events:
            if isinstance(event.get("timings"), dict):
                timings = event["timings"]
            choices = event.get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                if first is None:
                    first = time.perf_counter() - began
                parts.append(content)
    if first is None:  # an empty reply: its first token is its end
        first = time.perf_counter() - began
    return Turn(first * 1000.0, "".join(parts), int(timings.get("prompt_n", -1)),
                int(timings.get("cache_n", -1)))


async def conversation(url: str, tag: str, index: int, s: Settings) -> list[Turn]:
    messages = [{"role": "system", "content": system_prompt(tag, s.system_words)}]
    turns = []
    think = random.Random(index)  # the same pauses for every target
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(timeout=600.0, trust_env=False, limits=limits) as client:
        await asyncio.sleep(START_GAP_S * index * s.pace)
        for turn in range(s.turns):
            if turn:  # reading the reply, typing the next question
                await asyncio.sleep(think.uniform(*THINK_S) * s.pace)
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            result = await stream_turn(client, url, messages, s.max_tokens)
            turns.append(result)
            messages.append({"role": "assistant", "content": result.text})
    return turns


async def together(url: str, tag: str, s: Settings) -> list[list[Turn]]:
    """Lock-step turns: each turn every conversation's next message at once, in a shuffled
    order (the same orders for every target)."""
    chats = [[{"role": "system", "content": system_prompt(f"{tag}-{i}", s.system_words)}]
             for i in range(s.conversations)]
    turns: list[list[Turn]] = [[] for _ in chats]
    shuffle = random.Random(0)
    limits = httpx.Limits(max_connections=s.conversations, keepalive_expiry=KEEPALIVE_S)

    async def one(client: httpx.AsyncClient, index: int, delay: float, turn: int) -> None:
        await asyncio.sleep(delay)
        chats[index].append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        result = await stream_turn(client, url, chats[index], s.max_tokens)
        turns[index].append(result)
        chats[index].append({"role": "assistant", "content": result.text})

    async with httpx.AsyncClient(timeout=600.0, trust_env=False, limits=limits) as client:
        for turn in range(s.turns):
            order = list(range(s.conversations))
            shuffle.shuffle(order)
            await asyncio.gather(*(one(client, index, rank * ARRIVAL_GAP_S, turn)
                                   for rank, index in enumerate(order)))
    return turns


async def workload(url: str, tag: str, s: Settings) -> list[list[Turn]]:
    if s.together:
        return await together(url, tag, s)
    return list(await asyncio.gather(*(conversation(url, f"{tag}-{i}", i, s)
                                       for i in range(s.conversations))))


class MultiTurnBench:
    def __init__(self, bench: Bench, settings: Settings) -> None:
        self.bench = bench
        self.s = settings
        self.urls: dict[str, str] = {}
        self.items: list[Managed] = []
        self.notes: dict[str, str] = {}

    def _presets(self, name: str, extra: list[str]) -> Any:
        smol = find_smollm2()
        assert smol is not None
        n = self.s.parallel or self.s.conversations
        if self.s.cache_ram_mib is not None:
            extra = [*extra, f"cache-ram = {self.s.cache_ram_mib}"]
        return write_presets(self.bench.workdir / f"multiturn-{name}.ini", {MODEL: smol},
                             extra, parallel=n, ctx_size=n * SLOT_CTX)

    def _start_router(self, name: str, routing: str | None,
                      src: Path | None = None) -> str | None:
        """Start llama-router with ``replica-routing = routing``; None if it refuses the key."""
        extra = ["replicas = 2", *([f"{ROUTING_KEY} = {routing}"] if routing else [])]
        item, url = self.bench.start_router(self._presets(name, extra), f"multiturn-{name}",
                                            src=src)
        self.items.append(item)
        try:
            wait_healthy(item, url)
        except BenchError as exc:
            if routing and ROUTING_KEY in str(exc):
                return None
            raise
        return url

    def setup(self) -> None:
        prefix = self._start_router(PREFIX, "prefix")
        if prefix is None:
            self.notes[PREFIX] = (f"not run: this llama-router does not accept the preset key "
                                  f"{ROUTING_KEY}")
        else:
            self.urls[PREFIX] = prefix
        busy = self._start_router(LEAST_BUSY, "least-busy" if prefix is not None else None)
        if prefix is None:
            self.notes[LEAST_BUSY] = (f"run without {ROUTING_KEY}: least-busy is this "
                                      f"llama-router's only policy")
        assert busy is not None
        self.urls[LEAST_BUSY] = busy
        if self.s.baseline_src is not None:
            baseline = self._start_router(BASELINE, "prefix", self.s.baseline_src)
            if baseline is None:
                self.notes[BASELINE] = f"not run: that llama-router refuses {ROUTING_KEY}"
            else:
                self.urls[BASELINE] = baseline
        if not self.s.together:  # llama.cpp's router: in the first configuration only
            lc = self._presets(LLAMACPP_ONE, ["metrics = true", *self.bench.lc_cpu_keys()])
            item, url = self.bench.start_llamacpp(lc, "multiturn-llamacpp")
            self.items.append(item)
            wait_healthy(item, url)
            self.urls[LLAMACPP_ONE] = url
        for target, url in self.urls.items():  # load the model (every replica) and warm up
            warm = Settings(conversations=4, turns=1, system_words=8, max_tokens=2, pace=0)
            asyncio.run(workload(url, f"warmup-{target}", warm))

    def run(self) -> dict[str, Any]:
        try:
            self.setup()
            s = self.s
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in self.urls}
            for rep in range(s.reps):
                for target in rotate([t for t in TARGETS if t in self.urls], rep):
                    began = time.perf_counter()
                    convs = asyncio.run(workload(self.urls[target], f"{target}-{rep}", s))
                    runs[target].append({
                        "wall_s": round(time.perf_counter() - began, 2),
                        "turns": [[vars(t) for t in conv] for conv in convs]})
            settings = {**vars(s), "baseline_src": str(s.baseline_src or "") or None}
            return {"settings": settings, "notes": self.notes,
                    "targets": {t: summarize(runs[t], s) for t in runs}}
        finally:
            for item in self.items:
                self.bench.procs.stop(item)


def summarize(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    first: list[float] = []
    follow: list[float] = []
    hits = 0
    for run in runs:
        for conv in run["turns"]:
            first.append(conv[0]["ttft_ms"])
            for turn in conv[1:]:
                follow.append(turn["ttft_ms"])
                # The prefix was cached when the child processed less than the system prompt.
                hits += 0 <= turn["prompt_n"] < s.system_words // 2
    return {"runs": runs, "wall_s": [r["wall_s"] for r in runs],
            "first_turn_ms": {"p50": percentile(first, 50), "p99": percentile(first, 99)},
            "follow_up_ms": {"n": len(follow), "p50": percentile(follow, 50),
                             "p95": percentile(follow, 95), "p99": percentile(follow, 99)},
            "follow_ups_cached": hits}


def evaluate(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    targets = res["targets"]
    if res["settings"].get("together"):
        return evaluate_saturated(targets)
    goal = "follow-up turn TTFT p50 with replica-routing = prefix <= 0.5x least-busy's"
    if PREFIX not in targets:
        return {"multiturn_prefix": {"goal": goal, "met": None,
                                     "measured": res["notes"].get(PREFIX, "not run")}}
    p, b = targets[PREFIX]["follow_up_ms"]["p50"], targets[LEAST_BUSY]["follow_up_ms"]["p50"]
    lc = targets.get(LLAMACPP_ONE, {}).get("follow_up_ms", {}).get("p50")
    return {"multiturn_prefix": {
        "goal": goal, "met": p <= 0.5 * b,
        "measured": f"{p:.0f} ms vs {b:.0f} ms = {p / b:.2f}x (llama.cpp router, one child: "
                    f"{lc:.0f} ms)" if lc is not None else f"{p:.0f} ms vs {b:.0f} ms"}}


def evaluate_saturated(targets: dict[str, Any]) -> dict[str, dict[str, Any]]:
    goal = ("follow-up turn TTFT p50 and p95 with replica-routing = prefix below least-busy's "
            "and the baseline's (saturated)")
    if PREFIX not in targets:
        return {"multiturn_saturated": {"goal": goal, "met": None, "measured": "not run"}}
    mine = targets[PREFIX]["follow_up_ms"]
    met = True
    measured = []
    for other in (LEAST_BUSY, BASELINE):
        if other in targets:
            theirs = targets[other]["follow_up_ms"]
            met = met and mine["p50"] < theirs["p50"] and mine["p95"] < theirs["p95"]
            measured.append(f"{other}: p50 {theirs['p50']:.0f}, p95 {theirs['p95']:.0f} ms")
    return {"multiturn_saturated": {
        "goal": goal, "met": met,
        "measured": f"prefix: p50 {mine['p50']:.0f}, p95 {mine['p95']:.0f} ms; "
                    + "; ".join(measured)}}


def render(res: dict[str, Any]) -> str:
    lines = ["| target | first turn TTFT p50 (ms) | follow-up TTFT p50 (ms) | follow-up p95 (ms) "
             "| follow-up p99 (ms) | follow-ups with the prefix cached | wall per run (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for target in TARGETS:
        row = res["targets"].get(target)
        if row is None:
            if target in res["notes"]:
                lines.append(f"| {LABELS[target]} | {res['notes'][target]} | | | | | |")
            continue
        f = row["follow_up_ms"]
        label = LABELS[target] + (" (without the key)" if target in res["notes"] else "")
        lines.append(f"| {label} | {row['first_turn_ms']['p50']:.0f} | {f['p50']:.0f} | "
                     f"{f['p95']:.0f} | {f['p99']:.0f} | {row['follow_ups_cached']} of "
                     f"{f['n']} | {', '.join(f'{w:g}' for w in row['wall_s'])} |")
    return "\n".join(lines)


def run_phase(bench: Bench, settings: Settings) -> dict[str, Any]:
    if find_smollm2() is None:
        return {"skipped": f"SmolLM2 is not installed: {INSTALL_HINT}", "targets": {}}
    results = MultiTurnBench(bench, settings).run()
    return {"results": results, "targets": evaluate(results), "table": render(results)}
