"""Prefix-cache-aware routing against the real llama-server: two replicas of the tiny ``long``
model, one slot each. llama-server reports in ``timings.cache_n`` how many prompt tokens it
reused from its cache, which only the replica that served the previous turn has.

To make the two routings disagree, the first turn is sent while replica 0 is busy with a long
stream, so it lands on replica 1; with both idle again, least-busy picks replica 0 for the
follow-up, prefix routing replica 1.

When the replica holding a conversation is busy, prefix routing weighs the expected wait there
against computing the whole prompt on the other (``router.serving.pace``, from the timings of the
child's earlier replies): a stream that asks for 14,000 tokens exactly (``ignore_eos``) is a long
wait, so the follow-up goes elsewhere; one that does not say is expected to be as short as the
replies so far, so the follow-up waits for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

# A long stream: at about 16k tokens/s it still runs when the test acts, and its client reads
# only its first bytes, so the router holds its replica until the test lets it go.
HOLD_TOKENS = 14000


def presets(tmp_path: Path, model: Path, routing: str) -> Path:
    return write_presets(tmp_path / "affinity.ini",
                         f"[alpha]\nmodel = {model}\nctx-size = 16384\nparallel = 1\n"
                         f"replicas = 2\nreplica-routing = {routing}\n")


def conversation(topic: str) -> list[dict[str, Any]]:
    """A first turn with a long system prompt (about 1,000 tokens of the tiny model)."""
    return [{"role": "system", "content": f"You are an expert on {topic}. " * 40},
            {"role": "user", "content": f"Tell me about {topic}."}]


def ask(client: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = client.post("/v1/chat/completions",
                           json={"model": "alpha", "messages": messages, "max_tokens": 8})
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def follow_up(messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    return [*messages, reply["choices"][0]["message"],
            {"role": "user", "content": "And then?"}]


def ask_alone(router: RouterProcess, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with router.client() as client:
        return ask(client, messages)


def replica_loads(router: RouterProcess) -> list[int]:
    return [r["in_flight"] for r in router.models()["alpha"]["status"]["replicas"]]  # type: ignore[index]


def in_flight(router: RouterProcess) -> int:
    return int(router.models()["alpha"]["status"]["in_flight"])  # type: ignore[index]


@contextlib.contextmanager
def holding(router: RouterProcess, messages: list[dict[str, Any]],
            declared: bool = True) -> Iterator[None]:
    """A long stream of ``messages`` in flight (its first bytes read) until the block ends;
    then its client goes away, and the router has let its replica go. ``declared``: it asks
    for exactly ``HOLD_TOKENS`` (``ignore_eos``); else only for at most that many (the tiny
    model never ends a reply early, so it runs as long)."""
    body = {"model": "alpha", "messages": messages, "max_tokens": HOLD_TOKENS,
            "ignore_eos": declared, "stream": True}
    with router.client() as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_raw()  # kept: a dropped iterator would close the stream
        next(chunks)
        yield
    assert wait_until(lambda: in_flight(router) == 0, timeout=30.0)


def decisions(router: RouterProcess) -> dict[str, float]:
    with router.client() as client:
        text = client.get("/metrics").text
    prefix = "llamarouter_replica_routing_total{"
    found = {}
    for line in text.splitlines():
        if line.startswith(prefix) and 'model="alpha"' in line:
            labels, value = line[len(prefix):].split("} ")
            decision = dict(p.split("=") for p in labels.split(","))["decision"].strip('"')
            found[decision] = float(value)
    return found


def pids(router: RouterProcess) -> list[int]:
    return [r["pid"] for r in router.models()["alpha"]["status"]["replicas"]]  # type: ignore[index]


def test_a_follow_up_turn_goes_to_the_replica_that_has_its_prefix_unless_least_busy(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    path = presets(tmp_path, tiny_models["long"], "prefix")
    with start_router(tmp_path, "--presets", str(path)) as router, \
            router.client() as client:
        first = conversation("rivers")
        with holding(router, conversation("mountains")):  # replica 0 (both idle: the first)
            reply = ask(client, first)  # replica 0 is full: replica 1
            assert in_flight(router) == 1  # the stream still held replica 0 meanwhile
        assert decisions(router) == {"miss": 2}
        prompt_tokens = reply["usage"]["prompt_tokens"]
        assert prompt_tokens > 500
        # Both idle: least-busy would pick replica 0; the prefix is on replica 1.
        second = ask(client, follow_up(first, reply))
        assert second["timings"]["cache_n"] >= prompt_tokens, second["timings"]
        assert decisions(router) == {"miss": 2, "prefix_hit": 1}

        # The same, routed by load alone: a reload changes it in place, children kept.
        before = pids(router)
        write_presets(path, path.read_text().replace("= prefix", "= least-busy"))
        result = client.post("/models/reload").json()
        assert result["success"] is True and result["changed"] == [], result
        assert pids(router) == before
        first = conversation("lakes")
        with holding(router, conversation("valleys")):
            reply = ask(client, first)  # replica 1
            assert in_flight(router) == 1
        second = ask(client, follow_up(first, reply))  # replica 0: nothing to reuse
        assert second["timings"]["cache_n"] < reply["usage"]["prompt_tokens"] // 2, \
            second["timings"]
        assert decisions(router) == {"miss": 2, "prefix_hit": 1}  # not routed by prefix
        assert all("pace" not in r for r in router.models()["alpha"]["status"]["replicas"])  # type: ignore[index]


def test_a_saturated_replica_is_bypassed_and_the_bypass_remembered(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    path = presets(tmp_path, tiny_models["long"], "prefix")
    with start_router(tmp_path, "--presets", str(path)) as router, \
            router.client() as client:
        first = conversation("forests")
        reply = ask(client, first)  # both idle: replica 0
        second_turn = follow_up(first, reply)
        # The same conversation streams on replica 0 (its prefix is there) and fills its slot.
        with holding(router, first):
            second = ask(client, second_turn)  # replica 0 is full, replica 1 free: replica 1
            assert in_flight(router) == 1
        assert decisions(router) == {"miss": 1, "prefix_hit": 1, "override": 1}
        assert second["timings"]["cache_n"] < reply["usage"]["prompt_tokens"] // 2, \
            second["timings"]
        # Replica 1 now holds the longer prefix (the override recorded it): turn 3 goes there.
        third = ask(client, follow_up(second_turn, second))
        assert third["timings"]["cache_n"] >= second["usage"]["prompt_tokens"], third["timings"]
        assert decisions(router) == {"miss": 1, "prefix_hit": 2, "override": 1}


def test_a_follow_up_waits_for_its_busy_replica_when_that_costs_less_than_its_prompt_elsewhere(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    path = presets(tmp_path, tiny_models["long"], "prefix")
    with start_router(tmp_path, "--presets", str(path)) as router, \
            router.client() as client:
        first = conversation("meadows")
        reply = ask(client, first)  # both idle: replica 0, whose timings teach its pace
        second_turn = follow_up(first, reply)
        learned, untaught = (r["pace"] for r in router.models()["alpha"]["status"]["replicas"])  # type: ignore[index]
        assert learned["prompt_ms_per_kchar"] > 0 and learned["token_ms"] > 0, learned
        assert learned["reply_tokens"] == 8 and learned["reuse"] == 1.0, learned
        assert untaught["prompt_ms_per_kchar"] is None and untaught["backlog_s"] == 0, untaught
        # Replica 0 streams the same conversation again, without saying for how long: the
        # router expects a reply as long as the last one (8 tokens), and a wait for it shorter
        # than computing the conversation's ~1,000 tokens on replica 1. (llama-server does not
        # generate past what its client has read, so the follow-up runs once the stream ends.)
        with ThreadPoolExecutor(1) as pool:
            with holding(router, first, declared=False):
                pending = pool.submit(ask_alone, router, second_turn)
                # routed (to replica 0, queued behind the stream) while the stream runs
                assert wait_until(lambda: pending.done() or replica_loads(router) == [2, 0],
                                  timeout=30.0), replica_loads(router)
            second = pending.result(timeout=60.0)
        assert decisions(router) == {"miss": 1, "prefix_hit": 2}
        assert second["timings"]["cache_n"] >= reply["usage"]["prompt_tokens"], \
            second["timings"]
