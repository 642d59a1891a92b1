"""Choosing a replica by expected cost (``router.serving.pace``): the child's timings read from a
response's end, the running estimates, the backlog of expected work, the choice, and a
simulation of the saturated case with made-up timings (two one-slot replicas, eight
conversations arriving together): by cost, the follow-up turns start sooner than by the rule
of load alone and than least-busy. The real llama-server's side: tests/test_affinity_real.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from router import clock
from router.children.process import ChildProcess
from router.config.presets import ModelPreset
from router.core.cpugate import CpuGate
from router.core.runtime import ModelRuntime
from router.http.tail import ResponseTail, Timings, parse_timings
from router.logs import LogRing
from router.serving.affinity import MISS, OVERRIDE, PREFIX_HIT, Prefix, request_prefix
from router.serving.leases import Leases
from router.serving.load import Replica
from router.serving.pace import (
    MIN_PROMPT_TOKENS,
    OVERRUN_SHARE,
    Backlog,
    Option,
    Pace,
    by_cost,
)

# -- timings from a response's end ------------------------------------------------------------

LAST_EVENT = (b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
              b'"usage":{"completion_tokens":24,"prompt_tokens":1100},'
              b'"timings":{"cache_n":1000,"prompt_n":100,"prompt_ms":825.0,'
              b'"prompt_per_token_ms":8.25,"predicted_n":24,"predicted_ms":800.0,'
              b'"predicted_per_second":30.0}}\n\ndata: [DONE]\n\n')


def test_timings_are_read_from_a_streams_last_event_or_a_body() -> None:
    assert parse_timings(LAST_EVENT) == Timings(100, 825.0, 1000, 24, 800.0)
    body = json.dumps({"choices": [{"message": {"content": "x"}}],
                       "timings": {"prompt_n": 7, "prompt_ms": 1.5e1, "predicted_n": 2}})
    assert parse_timings(body.encode()) == Timings(7, 15.0, 0, 2, 0.0)
    assert parse_timings(b'data: {"timings":{"prompt_n":1}}\n\n' + LAST_EVENT).prompt_n == 100


@pytest.mark.parametrize("tail", [
    b"", b'data: {"choices":[]}\n\n', b'"timings":{"prompt_n":', b'"timings": 3',
    b'"timings":{"prompt_n":"many","prompt_ms":NaN}', b'"timings":{"prompt_n":1{}}',
    b"\xff\xfe" * 3000, b'"timings":{' + b" " * 100_000])
def test_odd_tails_give_nothing_or_zeros(tail: bytes) -> None:
    found = parse_timings(tail)
    assert found is None or found == Timings()


# -- running estimates ------------------------------------------------------------------------


def test_the_prompt_speed_counts_only_the_characters_the_child_computed() -> None:
    pace = Pace()
    pace.learn(Timings(prompt_n=250, prompt_ms=1000.0, cache_n=750), chars=4000)
    assert pace.prompt_s_per_char == pytest.approx(1.0 / 1000)  # 1 s for a quarter of 4000
    pace.learn(Timings(prompt_n=1000, prompt_ms=2000.0), chars=4000)  # 0.5 ms per char
    assert pace.prompt_s_per_char == pytest.approx(0.001 + 0.3 * (0.0005 - 0.001))
    before = pace.prompt_s_per_char
    pace.learn(Timings(prompt_n=MIN_PROMPT_TOKENS - 1, prompt_ms=900.0, cache_n=900), 4000)
    assert pace.prompt_s_per_char == before  # a short computation: fixed costs, not speed


def test_a_reply_is_expected_as_long_as_usual_within_its_bound() -> None:
    pace = Pace()
    assert pace.reply_s(Prefix((1,), (10,))) == 0.0  # nothing known yet
    pace.learn(Timings(predicted_n=20, predicted_ms=400.0), chars=10)
    assert (pace.token_s, pace.reply_tokens) == (pytest.approx(0.02), 20)
    assert pace.reply_s(Prefix((1,), (10,))) == pytest.approx(0.4)
    assert pace.reply_s(Prefix((1,), (10,), max_tokens=5)) == pytest.approx(0.1)
    assert pace.reply_s(Prefix((1,), (10,), max_tokens=1000)) == pytest.approx(0.4)
    # ignore_eos: it runs to max_tokens, however short replies usually are
    assert pace.reply_s(Prefix((1,), (10,), 1000, to_the_end=True)) == pytest.approx(20.0)


def test_the_reply_bound_comes_from_the_request() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert request_prefix(chat).max_tokens is None
    assert request_prefix({**chat, "max_tokens": 8, "ignore_eos": True})[2:4] == (8, True)
    assert request_prefix({**chat, "max_completion_tokens": 9})[2:4] == (9, False)
    assert request_prefix({"prompt": "abc", "n_predict": 7, "ignore_eos": 1})[2:4] == (7, False)
    for odd in (-1, True, "8", 2.5, None):
        assert request_prefix({**chat, "max_tokens": odd, "ignore_eos": True})[2:4] == \
            (None, False)
    assert request_prefix(chat).sizes == (len("user") + len("hi"),)


# -- the backlog ------------------------------------------------------------------------------


def test_the_backlog_serves_in_order_and_counts_what_is_left() -> None:
    backlog = Backlog()
    first = backlog.add(4.0, 100, 0, now=0.0, slots=1)
    second = backlog.add(3.0, 100, 0, now=0.0, slots=1)
    assert (first.started, second.started) == (0.0, None)
    assert backlog.remaining(1.0) == pytest.approx(3.0 + 3.0)
    assert backlog.wait(1.0, in_flight=2, slots=1) == pytest.approx(6.0)
    assert backlog.wait(1.0, in_flight=0, slots=1) == 0.0  # a free slot: no wait
    # The first overran (9 s of an expected 4): not over until it ends, a quarter of it left.
    assert backlog.remaining(9.0) == pytest.approx(OVERRUN_SHARE * 4.0 + 3.0)
    backlog.remove(first, now=9.0, slots=1)
    assert second.started == 9.0 and backlog.remaining(10.0) == pytest.approx(2.0)
    backlog.remove(second, now=10.0, slots=1)
    assert backlog.tickets == [] and backlog.remaining(11.0) == 0.0


def test_a_backlog_with_several_slots_starts_as_many_and_shares_the_wait() -> None:
    backlog = Backlog()
    tickets = [backlog.add(2.0, 1, 0, now=0.0, slots=2) for _ in range(3)]
    assert [t.started for t in tickets] == [0.0, 0.0, None]
    assert backlog.wait(0.0, in_flight=3, slots=2) == pytest.approx(6.0 / 2)
    backlog.remove(tickets[1], now=1.0, slots=2)
    assert tickets[2].started == 1.0


# -- the choice -------------------------------------------------------------------------------

# A conversation of 4 messages: 4,000 characters of system prompt, then 3 short ones.
PROMPT = Prefix((11, 12, 13, 14), (4000, 4040, 4100, 4140), max_tokens=24)
FAST = Pace(prompt_s_per_char=0.002, token_s=0.03, reply_tokens=24)  # 8 s for the system


def option(match: int, in_flight: int = 0, wait_s: float = 0.0, pace: Pace = FAST,
           slots: int = 1) -> Option:
    return Option(match, in_flight, slots, wait_s, pace)


def test_a_short_queue_on_the_cached_replica_beats_computing_the_prompt_elsewhere() -> None:
    choice = by_cost([option(3, in_flight=1, wait_s=2.0), option(0)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (0, PREFIX_HIT)
    assert choice.first_token_s == pytest.approx(2.0 + 40 * 0.002)
    assert choice.work_s == pytest.approx(40 * 0.002 + 24 * 0.03)


def test_a_long_queue_on_the_cached_replica_sends_the_request_elsewhere() -> None:
    choice = by_cost([option(3, in_flight=3, wait_s=9.0), option(0)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (1, OVERRIDE)
    assert choice.first_token_s == pytest.approx(4140 * 0.002)
    # a shorter prefix elsewhere (the system prompt): only its last 140 characters to compute
    choice = by_cost([option(3, in_flight=1, wait_s=0.1), option(1)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (0, PREFIX_HIT)
    choice = by_cost([option(3, in_flight=1, wait_s=0.5), option(1)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (1, OVERRIDE)
    assert choice.first_token_s == pytest.approx(140 * 0.002)


def test_without_a_prefix_the_soonest_free_replica_wins() -> None:
    choice = by_cost([option(0, in_flight=1, wait_s=3.0), option(0, in_flight=1, wait_s=1.0)],
                     PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (1, MISS)
    # ties: the longest prefix, then the most free slots, then the first
    tie = by_cost([option(0, in_flight=1, slots=2), option(0, slots=2)], PROMPT)
    assert tie is not None and tie.index == 1
    first = by_cost([option(0), option(0)], PROMPT)
    assert first is not None and first.index == 0


def test_a_replica_that_has_shown_nothing_is_taken_as_fast_as_its_siblings() -> None:
    assert by_cost([option(3, pace=Pace()), option(0, pace=Pace())], PROMPT) is None
    choice = by_cost([option(3, in_flight=1, wait_s=2.0), option(0, pace=Pace())], PROMPT)
    assert choice is not None and choice.index == 0  # 4,140 chars at FAST's speed: 8.3 s
    assert choice.work_s == pytest.approx(40 * 0.002 + 24 * 0.03)
    unknown = by_cost([option(0, pace=Pace()), option(0, in_flight=1, wait_s=1.0)], PROMPT)
    assert unknown is not None and unknown.index == 0
    assert unknown.work_s == pytest.approx(4140 * 0.002 + 24 * 0.03)  # a sibling's reply pace


# -- the saturated case, simulated with made-up timings ---------------------------------------

CHARS_PER_TOKEN = 4
def two_one_slot_replicas() -> tuple[ModelRuntime, Leases]:
    """A model with two one-slot replicas (no processes behind them) and its leases."""
    preset = ModelPreset(id="hot", args=MappingProxyType({"parallel": "1"}), replicas=2)
    runtime = ModelRuntime(preset, LogRing(10))
    runtime.state = replace(runtime.state, replicas=tuple(
        Replica(object.__new__(ChildProcess)) for _ in range(2)))
    return runtime, Leases(gate=CpuGate(list), idle=lambda r: None,
                           on_replica_done=lambda r: None)


PROMPT_S = 0.008  # per prompt token computed (~125 tokens/s: SmolLM2 on one core)
TOKEN_S = 0.035  # per generated token
REPLY_TOKENS = 24
SYSTEM_WORDS = 800


def conversation(index: int) -> list[dict[str, Any]]:
    rnd = random.Random(index)
    notes = " ".join(rnd.choice(("river", "stone", "garden", "window")) for _ in range(
        SYSTEM_WORDS))
    return [{"role": "system", "content": f"Conversation {index}. {notes}"}]


def timings_event(timings: Timings) -> bytes:
    return b"data: " + json.dumps({"choices": [], "timings": {
        "cache_n": timings.cache_n, "prompt_n": timings.prompt_n,
        "prompt_ms": timings.prompt_ms, "predicted_n": timings.predicted_n,
        "predicted_ms": timings.predicted_ms}}).encode() + b"\n\ndata: [DONE]\n\n"


async def simulate(policy: str, monkeypatch: pytest.MonkeyPatch, conversations: int = 8,
                   turns: int = 3, seed: int = 0, room: int = 8) -> tuple[list[float], int]:
    """Run ``conversations`` for ``turns`` on two one-slot replicas, each turn's requests
    arriving together in a shuffled order; each replica is a FIFO server that keeps the last
    ``room`` prompts it computed (llama-server's slot, ``--cache-ram``). ``policy``: ``cost`` (the
    replicas learn from the timings), ``rule`` (they never do: ``affinity.choose``), or
    ``least-busy``. Returns the follow-up turns' times to first token and how many of them
    found their conversation cached."""
    now = 0.0
    monkeypatch.setattr(clock, "now", lambda: now)
    runtime, leases = two_one_slot_replicas()
    free_at = [0.0, 0.0]
    cached: list[dict[int, int]] = [{}, {}]  # per replica: conversation -> tokens it holds
    messages = [conversation(i) for i in range(conversations)]
    shuffle = random.Random(seed)
    follow_ups: list[float] = []
    reused = 0

    for turn in range(turns):
        arrived = now
        order = list(range(conversations))
        shuffle.shuffle(order)
        ends = []
        for conv in order:
            messages[conv].append({"role": "user", "content": f"Question {turn}?"})
            prefix = request_prefix({"messages": messages[conv], "max_tokens": REPLY_TOKENS})
            lease = leases.take(runtime, prefix=None if policy == "least-busy" else prefix)
            index = runtime.replicas.index(lease.replica)
            tokens = prefix.chars // CHARS_PER_TOKEN
            hit = min(cached[index].get(conv, 0), tokens)
            start = max(free_at[index], arrived)
            first_token = start + (tokens - hit) * PROMPT_S
            free_at[index] = first_token + REPLY_TOKENS * TOKEN_S
            cached[index].pop(conv, None)
            cached[index][conv] = tokens
            while len(cached[index]) > room:  # the least recently computed goes first
                del cached[index][next(iter(cached[index]))]
            if turn:
                follow_ups.append(first_token - arrived)
                reused += hit >= tokens // 2
            ends.append((free_at[index], lease, Timings(
                tokens - hit, (tokens - hit) * PROMPT_S * 1000, hit, REPLY_TOKENS,
                REPLY_TOKENS * TOKEN_S * 1000)))
            messages[conv].append({"role": "assistant", "content": f"Answer {turn}."})
        for end, lease, timings in sorted(ends, key=lambda e: e[0]):
            now = end
            if policy == "cost":
                lease.learn(ResponseTail(b"", timings_event(timings)))
            lease.release()
    return follow_ups, reused


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def test_saturated_follow_ups_start_sooner_by_cost(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Ten shuffles: by cost, never later than by the rule of load (which overrides the cache
    whenever the first two arrivals of a turn share a replica), and sooner in all; always
    sooner than least-busy; every follow-up reuses its conversation."""
    pooled: dict[str, list[float]] = {"cost": [], "rule": [], "least-busy": []}
    for seed in range(10):
        results = {policy: await simulate(policy, monkeypatch, seed=seed) for policy in pooled}
        cost, rule, busy = (results[k][0] for k in pooled)
        summary = {k: (round(p(v[0], 50), 2), round(p(v[0], 95), 2), v[1])
                   for k, v in results.items()}
        assert len(cost) == 16 and results["cost"][1] == 16, summary
        assert p(cost, 50) <= p(rule, 50) and p(cost, 95) <= p(rule, 95), summary
        assert p(cost, 50) < p(busy, 50) and p(cost, 95) < p(busy, 95), summary
        for policy, (times, _) in results.items():
            pooled[policy] += times
    for other in ("rule", "least-busy"):
        assert p(pooled["cost"], 50) < p(pooled[other], 50)
        assert p(pooled["cost"], 95) < p(pooled[other], 95)


def test_only_a_request_routed_by_prefix_holds_a_ticket_and_teaches_its_replica() -> None:
    runtime, leases = two_one_slot_replicas()

    plain = leases.take(runtime)
    explicit = leases.take(runtime, runtime.replicas[1], PROMPT)
    assert plain.ticket is None and explicit.ticket is None
    for lease in (plain, explicit):
        lease.learn(ResponseTail(b"", LAST_EVENT))
        lease.release()
    assert [r.pace for r in runtime.replicas] == [Pace(), Pace()]
    routed = leases.take(runtime, prefix=PROMPT)
    assert routed.ticket is not None and routed.replica.backlog.tickets == [routed.ticket]
    # a stream's last two chunks: its last event, then [DONE]
    head, done = LAST_EVENT.split(b"\n\n", 1)
    routed.learn(ResponseTail(head + b"\n\n", done))
    routed.release()
    routed.release()  # exactly once
    routed.learn(ResponseTail(b"", LAST_EVENT))  # after the release: nothing more
    assert routed.replica.backlog.tickets == [] and runtime.in_flight == 0
    assert routed.replica.pace.prompt_s_per_char == pytest.approx(0.825 / (4140 * 100 / 1100))
    assert runtime.replicas[1].pace == Pace()


async def test_a_replica_whose_cache_keeps_too_little_is_soon_not_trusted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica keeps only the prompt in its slot (no room in RAM): its table promises
    prefixes its cache no longer has. By cost, the replicas learn that from ``cache_n`` and the
    follow-ups start no later than with least-busy, and sooner than by the rule at p95."""
    pooled: dict[str, list[float]] = {"cost": [], "rule": [], "least-busy": []}
    for seed in range(10):
        for policy, times in pooled.items():
            times += (await simulate(policy, monkeypatch, seed=seed, room=1))[0]
    cost, rule, busy = pooled.values()
    assert p(cost, 50) <= 1.05 * min(p(rule, 50), p(busy, 50)), pooled
    assert p(cost, 95) <= 1.05 * p(busy, 95) and p(cost, 95) < p(rule, 95), pooled


def test_reuse_is_learned_from_what_the_cache_had() -> None:
    pace = Pace()
    pace.learn(Timings(prompt_n=1000, prompt_ms=100.0, cache_n=10), chars=4040,
               expected_cached=4000)  # the table promised 4,000 characters: 40 were there
    assert pace.reuse == pytest.approx(0.7 + 0.3 * (4040 * 10 / 1010 / 4000))
    pace.learn(Timings(prompt_n=10, prompt_ms=1.0, cache_n=1000), chars=4040,
               expected_cached=4000)
    assert pace.reuse > 0.7
    before = pace.reuse
    pace.learn(Timings(prompt_n=1000, prompt_ms=100.0), chars=4000)  # nothing promised
    assert pace.reuse == before


def test_costs_too_close_to_tell_apart_go_to_the_longest_prefix() -> None:
    """A follow-up whose whole conversation one replica holds, and most of it another that
    has learned a faster prompt speed: the few characters' difference is noise in the speeds,
    and the longest prefix wins; a clear difference still decides."""
    fast = Pace(prompt_s_per_char=0.00001, token_s=0.01)  # 100 characters: 1 ms
    slow = Pace(prompt_s_per_char=0.0002, token_s=0.01)  # 40 characters: 8 ms
    choice = by_cost([option(2, pace=fast), option(3, pace=slow)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (1, PREFIX_HIT)
    choice = by_cost([option(2, pace=fast), option(3, wait_s=1.0, pace=slow)], PROMPT)
    assert choice is not None and (choice.index, choice.decision) == (0, OVERRIDE)
