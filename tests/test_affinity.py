"""Prefix-cache-aware routing among replicas: prefix keys, the per-replica table, the choice
(pure, enumerated exhaustively), and its wiring: presets, reconfiguration, leases, metrics,
and the hot path's key extraction. The real llama-server's side: tests/test_affinity_real.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from router.children.process import ChildProcess
from router.config.presets import ModelPreset, PresetsInvalid, load_preset_file
from router.config.reconfig import diff
from router.config.sources import Catalogue
from router.core.cpugate import CpuGate
from router.core.runtime import ModelRuntime
from router.edge import forward
from router.edge.metering import Meter
from router.edge.virtual import Virtuals
from router.errors import ModelNotLoaded
from router.http.shutdown import Shutdown
from router.llama.flags import FlagTable
from router.logs import LogRing
from router.observe.metrics import RouterMetrics
from router.serving.affinity import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    MAX_KEYS,
    MISS,
    NO_PREFIX,
    OVERRIDE,
    PREFIX_HIT,
    Prefix,
    PrefixTable,
    chat_keys,
    choose,
    least_busy,
    request_keys,
    request_prefix,
    text_keys,
    token_keys,
)
from router.serving.leases import Leases
from router.serving.load import Replica
from router.teams.usage import Usage

SYSTEM = {"role": "system", "content": "You are terse."}


def turn(n: int) -> list[dict[str, Any]]:
    """The messages of turn ``n`` of one conversation (turn 1: system + first question)."""
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(1, n + 1):
        if i > 1:
            messages.append({"role": "assistant", "content": f"answer {i - 1}"})
        messages.append({"role": "user", "content": f"question {i}"})
    return messages


# -- prefix keys ------------------------------------------------------------------------------


def test_a_follow_up_turn_shares_the_keys_of_the_turn_before() -> None:
    first, second, third = (request_keys({"messages": turn(n)}) for n in (1, 2, 3))
    assert len(first) == 2 and len(second) == 4 and len(third) == 6
    assert second[:2] == first and third[:4] == second
    assert len(set(third)) == 6  # each key stands for a different prefix


def test_a_key_covers_everything_before_it() -> None:
    base = chat_keys(turn(3))
    edited = turn(3)
    edited[2] = {"role": "assistant", "content": "another answer"}
    keys = chat_keys(edited)
    assert keys[:2] == base[:2]
    assert all(a != b for a, b in zip(keys[2:], base[2:], strict=True))


def test_role_and_content_both_count() -> None:
    user = chat_keys([{"role": "user", "content": "hi"}])
    assert chat_keys([{"role": "system", "content": "hi"}]) != user
    assert chat_keys([{"role": "user", "content": "hi!"}]) != user
    assert chat_keys([{"role": "user", "content": "hi", "name": "x"}]) == user  # role+content


def test_content_as_parts_is_keyed_by_its_json() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "a"}}]
    keys = chat_keys([{"role": "user", "content": parts}])
    reordered = [{"text": "look", "type": "text"}, {"image_url": {"url": "a"}, "type": "image_url"}]
    assert chat_keys([{"role": "user", "content": reordered}]) == keys  # the same JSON value
    other = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "b"}}]
    assert chat_keys([{"role": "user", "content": other}]) != keys
    assert len(keys) == 1


def test_tool_calls_and_odd_messages_are_keyed_without_failing() -> None:
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}
    other = {**call, "tool_calls": [{"id": "2", "function": {"name": "g", "arguments": "{}"}}]}
    assert chat_keys([SYSTEM, call]) != chat_keys([SYSTEM, other])
    odd: list[Any] = ["text", 3, None, {"role": ["x"], "content": "c"}, {"content": {"a": 1}}]
    keys = chat_keys([SYSTEM, *odd])
    assert len(keys) == 6 and keys[0] == chat_keys([SYSTEM])[0]
    assert chat_keys([SYSTEM, *odd]) == keys  # deterministic


def test_text_prompts_are_keyed_by_blocks() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * BLOCK_CHARS + 10))
    keys = text_keys(text)
    assert len(keys) == 4  # three whole blocks and the rest
    longer = text_keys(text[:3 * BLOCK_CHARS] + "something else entirely")
    assert longer[:3] == keys[:3] and longer[3] != keys[3]
    assert text_keys(text[:100]) == text_keys(text[:100])
    assert len(text_keys(text[:100])) == 1 and text_keys("") == ()
    assert request_keys({"prompt": text}) == keys


def test_token_prompts_are_keyed_by_blocks() -> None:
    tokens = list(range(2 * BLOCK_TOKENS + 1))
    keys = request_keys({"prompt": tokens})
    assert len(keys) == 3 and keys == token_keys(tokens)
    assert token_keys([*tokens[:2 * BLOCK_TOKENS], 7])[:2] == keys[:2]
    mixed: list[Any] = [1, {"multimodal_data": ["x"]}, [2, 3]]
    assert len(request_keys({"prompt": mixed})) == 1  # unhashable parts: by their JSON


def test_requests_without_a_prompt_have_no_keys() -> None:
    for body in ({"input": "embed me"}, {"content": "tokenize me"}, {"messages": "no list"},
                 {"prompt": []}, {"prompt": 3}, {}):
        assert request_keys(body) == ()


def test_a_chat_and_a_prompt_never_share_keys() -> None:
    chat = request_keys({"messages": [{"role": "user", "content": "x"}]})
    text, tokens = request_keys({"prompt": "x"}), request_keys({"prompt": [120]})
    assert len({*chat, *text, *tokens}) == 3


def test_huge_prompts_are_keyed_up_to_a_bound() -> None:
    assert len(text_keys("x" * (BLOCK_CHARS * MAX_KEYS + 5000))) == MAX_KEYS
    assert len(chat_keys([SYSTEM] * (MAX_KEYS + 10))) == MAX_KEYS
    assert len(token_keys([1] * (BLOCK_TOKENS * MAX_KEYS + 1))) == MAX_KEYS


# -- the table --------------------------------------------------------------------------------


def test_the_table_finds_the_longest_prefix_it_holds() -> None:
    table = PrefixTable()
    first, second = chat_keys(turn(1)), chat_keys(turn(3))
    assert table.longest(first) == 0
    table.record(first)
    assert table.longest(first) == 2 and table.longest(second) == 2
    table.record(second)
    assert table.longest(second) == 6 and len(table) == 6  # shared keys are stored once
    assert table.longest(()) == 0


def test_the_table_forgets_the_least_recently_seen_keys() -> None:
    table = PrefixTable(capacity=4)
    table.record((1, 2, 3))
    table.record((4,))
    table.record((1,))  # seen again: now the most recent
    table.record((5, 6))
    assert [k for k in (1, 2, 3, 4, 5, 6) if k in table] == [1, 4, 5, 6]
    assert len(table) == 4
    # a later key still matches when earlier ones are gone
    assert table.longest((9, 8, 7, 4)) == 4 and table.longest((2, 3)) == 0


# -- the choice -------------------------------------------------------------------------------

KEYS = (101, 102, 103)


def tables_for(matches: Sequence[int]) -> list[PrefixTable]:
    """A table per replica holding the first ``matches[i]`` of ``KEYS``."""
    tables = []
    for match in matches:
        table = PrefixTable()
        table.record(KEYS[:match])
        tables.append(table)
    return tables


def expected(loads: Sequence[tuple[int, int]], matches: Sequence[int]) -> tuple[int, str]:
    """The rule, spelled out independently of ``choose``."""
    def most_free(indexes: Sequence[int]) -> int:
        return min(indexes, key=lambda i: (-(loads[i][1] - loads[i][0]), i))

    everyone = list(range(len(loads)))
    if max(matches) == 0:
        return most_free(everyone), MISS
    holder = most_free([i for i in everyone if matches[i] == max(matches)])
    free = [i for i in everyone if loads[i][0] < loads[i][1]]
    if loads[holder][0] >= loads[holder][1] and free:
        return most_free(free), OVERRIDE
    return holder, PREFIX_HIT


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_the_choice_over_every_small_state(replicas: int) -> None:
    checked = 0
    for slots in itertools.product((1, 2), repeat=replicas):
        for in_flight in itertools.product(range(4), repeat=replicas):
            loads = list(zip(in_flight, slots, strict=True))
            for matches in itertools.product(range(len(KEYS) + 1), repeat=replicas):
                got = choose(loads, tables_for(matches), KEYS)
                assert got == expected(loads, matches), (loads, matches)
                index, decision = got
                if decision == OVERRIDE:  # never onto a saturated replica
                    assert loads[index][0] < loads[index][1]
                    assert matches[index] < max(matches) or loads[index][0] < loads[index][1]
                checked += 1
    assert checked == 2 ** replicas * 4 ** replicas * 4 ** replicas


def test_the_choice_by_example() -> None:
    idle, half, full = (0, 2), (1, 2), (2, 2)
    # the follow-up goes where its conversation is, though the other replica is idler
    assert choose([idle, half], tables_for([0, 2]), KEYS) == (1, PREFIX_HIT)
    # the longer prefix wins over a shorter one
    assert choose([idle, idle], tables_for([1, 3]), KEYS) == (1, PREFIX_HIT)
    # equal prefixes: the least busy of the holders, then the first
    assert choose([half, idle, idle], tables_for([2, 2, 0]), KEYS) == (1, PREFIX_HIT)
    assert choose([idle, idle], tables_for([2, 2]), KEYS) == (0, PREFIX_HIT)
    # saturated holder, another free: the least busy of the free ones
    assert choose([half, full, idle], tables_for([0, 3, 0]), KEYS) == (2, OVERRIDE)
    # every replica saturated: stay with the cache
    assert choose([full, full], tables_for([0, 1]), KEYS) == (1, PREFIX_HIT)
    # nothing known: the least busy, as without prefix routing
    assert choose([half, idle], tables_for([0, 0]), KEYS) == (1, MISS)
    assert choose([idle, idle], tables_for([0, 0]), ()) == (0, MISS)
    assert least_busy([half, idle, idle]) == 1 and least_busy([half, idle], [0]) == 0


# -- wiring: runtime, leases, metrics ---------------------------------------------------------


def runtime_with(replicas: int, parallel: int = 1, routing: str = "prefix") -> ModelRuntime:
    preset = ModelPreset(id="hot", args=MappingProxyType({"parallel": str(parallel)}),
                         replicas=replicas, replica_routing=routing)
    runtime = ModelRuntime(preset, LogRing(10))
    children = tuple(Replica(object.__new__(ChildProcess)) for _ in range(replicas))
    runtime.state = replace(runtime.state, replicas=children)
    return runtime


def leases() -> Leases:
    return Leases(gate=CpuGate(list), idle=lambda r: None,
                  on_replica_done=lambda r: None)


def test_leases_route_by_keys_record_them_and_report_the_decision() -> None:
    runtime = runtime_with(2)
    taken = leases()
    decisions: list[tuple[str, str]] = []
    taken.on_routed = lambda model, decision: decisions.append((model, decision))
    first, second = (request_prefix({"messages": turn(n)}) for n in (1, 2))
    busy = taken.take(runtime)  # least busy, unrecorded: replica 0
    one = taken.take(runtime, prefix=first)  # replica 0 is full: replica 1
    assert (busy.replica, one.replica) == tuple(runtime.replicas)
    assert decisions == [("hot", MISS)]
    assert runtime.replicas[1].prefixes.longest(second.keys) == 2
    busy.release()
    one.release()
    follow_up = taken.take(runtime, prefix=second)  # both idle: least busy would say 0
    assert follow_up.replica is runtime.replicas[1]
    assert decisions[-1] == ("hot", PREFIX_HIT)
    again = taken.take(runtime, prefix=second)  # replica 1 is full now, 0 is free
    assert again.replica is runtime.replicas[0]
    assert decisions[-1] == ("hot", OVERRIDE)
    assert runtime.replicas[0].prefixes.longest(second.keys) == 4  # the override remembers too
    assert (runtime.in_flight, [r.in_flight for r in runtime.replicas]) == (2, [1, 1])


def test_an_explicit_replica_or_no_keys_bypass_the_table() -> None:
    runtime = runtime_with(2)
    taken = leases()
    taken.on_routed = lambda model, decision: pytest.fail("no routing decision expected")
    lease = taken.take(runtime, runtime.replicas[1], prefix=Prefix((1, 2), (3, 6)))
    assert lease.replica is runtime.replicas[1] and len(runtime.replicas[1].prefixes) == 0
    assert taken.take(runtime).replica is runtime.replicas[0]


def test_routing_decisions_are_counted_per_model_and_decision() -> None:
    metrics = RouterMetrics()
    for decision in (PREFIX_HIT, PREFIX_HIT, MISS):
        metrics.observe_routing("hot", decision)
    text = generate_latest(metrics.registry).decode()
    assert 'llamarouter_replica_routing_total{decision="prefix_hit",model="hot"} 2.0' in text
    assert 'llamarouter_replica_routing_total{decision="miss",model="hot"} 1.0' in text
    assert 'decision="override"' not in text
    routed: list[Any] = []
    sup = SimpleNamespace(events=SimpleNamespace(listeners=[]), on_routed=routed.append,
                          views=list, cpu_turns=0, children_paused=0, cpu_other_work=None,
                          warm=None)
    metrics.attach(sup)  # type: ignore[arg-type]
    assert routed == [metrics.observe_routing]
    generate_latest(metrics.registry)  # the live gauges read the supervisor's views


# -- presets and reconfiguration --------------------------------------------------------------


def test_replica_routing_is_a_preset_option(tmp_path: Path, help_table: FlagTable) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    path = tmp_path / "p.ini"
    path.write_text(f"[*]\nreplica-routing = least-busy\n[a]\nmodel = {model}\nreplicas = 2\n"
                    f"[b]\nmodel = {model}\nreplicas = 2\nreplica-routing = Prefix\n"
                    f"[c]\nmodel = {model}\n[d]\nmodel = {model}\nreplicas = 3\n"
                    "__PRESET_REPLICA_ROUTING = prefix\n")
    loaded = load_preset_file(path, help_table)
    presets = {s.name: loaded.merged(s) for s in loaded.models}
    assert {k: p.replica_routing for k, p in presets.items()} == {
        "a": "least-busy", "b": "prefix", "c": "least-busy", "d": "prefix"}
    assert [k for k, p in presets.items() if p.prefix_routing] == ["b", "d"]
    assert "replica-routing" not in presets["b"].args  # never reaches llama-server
    assert ModelPreset(id="x", args={}, replicas=2).prefix_routing  # the default
    assert not ModelPreset(id="x", args={}).prefix_routing  # one replica: nothing to choose


def test_a_bad_replica_routing_names_its_line(tmp_path: Path, help_table: FlagTable) -> None:
    path = tmp_path / "p.ini"
    path.write_text("[a]\nhf-repo = o/r\nreplica-routing = round-robin\n")
    with pytest.raises(PresetsInvalid) as caught:
        load_preset_file(path, help_table)
    assert str(caught.value) == (f"{path}:3: [a] replica-routing: bad replica routing "
                                 "'round-robin': use prefix or least-busy")


def test_changing_the_routing_updates_in_place_without_a_restart() -> None:
    old = ModelPreset(id="a", args={"model": "/m"}, replicas=2)
    new = ModelPreset(id="a", args={"model": "/m"}, replicas=2, replica_routing="least-busy")
    change = diff({"a": old}, {"a": new})
    assert (change.restart, change.update) == ([], ["a"])


# -- the hot path: keys only for models routed by prefix --------------------------------------


class KeySupervisor:
    """What ``forward.proxy`` asks of a supervisor; records the prefix it is given."""

    settings = SimpleNamespace(max_body_bytes=1 << 20, models_autoload=True, state_dir=None)
    catalogue = Catalogue({})  # no profiles, no virtual models

    def __init__(self, preset: ModelPreset) -> None:
        self.preset = preset
        self.keys: list[Prefix | None] = []

    def find(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(id=model, preset=self.preset, serving=True)

    def keeps_conversations(self, model: SimpleNamespace) -> bool:
        return False

    def lease_now(self, model: SimpleNamespace, prefix: Prefix | None = None,
                  turn: object = None) -> None:
        self.keys.append(prefix)
        raise ModelNotLoaded(model.id)


async def keys_passed(preset: ModelPreset, body: dict[str, Any]) -> Prefix | None:
    sup = KeySupervisor(preset)
    app = SimpleNamespace(state=SimpleNamespace(
        router=SimpleNamespace(models=sup, default=None, shutdown=Shutdown(30.0),
                               peers=None, meter=Meter(Usage()), virtuals=Virtuals()),
        webui=None))
    raw = json.dumps({"model": preset.id, **body}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "app": app,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await forward.proxy(scope, receive, send)
    assert sent[0]["status"] == 400  # the fake's refusal, after a lease was asked for
    assert len(sup.keys) == 1
    return sup.keys[0]


async def test_the_hot_path_passes_keys_only_for_models_routed_by_prefix() -> None:
    chat = {"messages": turn(2)}
    routed = ModelPreset(id="hot", args={}, replicas=2)
    assert await keys_passed(routed, chat) == request_prefix(chat)
    assert (await keys_passed(routed, chat) or NO_PREFIX).keys == chat_keys(turn(2))
    assert await keys_passed(routed, {"prompt": "abc"}) == Prefix(text_keys("abc"), (3,), whole=0)
    assert await keys_passed(routed, {"input": "embed"}) is None  # no prompt: least busy
    least = ModelPreset(id="hot", args={}, replicas=2, replica_routing="least-busy")
    assert await keys_passed(least, chat) is None
    assert await keys_passed(ModelPreset(id="one", args={}), chat) is None


def test_a_responses_input_is_its_prompt() -> None:
    """OpenAI's Responses API: ``input`` is the prompt (a text, or items read as a chat's
    messages); elsewhere (embeddings) it is no prompt to key."""
    items = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert request_prefix({"input": items}, responses=True).keys == chat_keys(items)
    text = "x" * 1200
    assert request_prefix({"input": text}, responses=True).keys == text_keys(text)
    assert request_prefix({"input": text}).keys == ()
