"""Every conversation keeps its cache, against the real llama-server (``warm/conversations.py``):
with ``--state-dir``, a model with fewer slots than conversations saves the one a new
conversation displaces, and restores a conversation by its prompt's longest saved prefix when
its next turn comes, after slot churn, a swap and a router restart, so that its next turn comes
from the cache (``timings.cache_n``). A state of another API key is never restored; a model
whose restores do not hit stops keeping conversations and says why; the budget holds; a child
killed during a displacement save loses that state, never the router.

The children run with ``cache-ram = 0``: llama-server's own RAM prompt cache would otherwise
keep the displaced conversations warm inside one child, and hide what the router restores.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

GUARD_S = 120.0  # a hang guard, never a measurement
# Three conversations, each a prompt of a few hundred tokens over whole 512-character blocks.
OPENINGS = {name: (f"Conversation {name}: " + f"the {name} fox jumps over the lazy dog. " * 40)
            for name in ("A", "B", "C")}
MORE = " And then it ran into the forest, far away from the farm. " * 4


def presets(tmp_path: Path, tiny_models: dict[str, Path], extra: str = "") -> Path:
    return write_presets(tmp_path / "models.ini",
                         f"[*]\nctx-size = 4096\nparallel = 1\ncache-ram = 0\n{extra}"
                         f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                         f"[beta]\nmodel = {tiny_models['beta']}\n")


def turn(client: httpx.Client, prompt: str, model: str = "alpha", key: str | None = None
         ) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/completion", json={"model": model, "prompt": prompt,
                                                "n_predict": 4, "temperature": 0,
                                                "cache_prompt": True},
                           headers=headers, timeout=GUARD_S)
    assert response.status_code == 200, response.text
    timings: dict[str, Any] = response.json()["timings"]
    return timings


def states_of(router: RouterProcess, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with router.client(headers=headers) as client:
        data = client.get("/models").json()["data"]
    found: dict[str, Any] = next(m for m in data if m["id"] == "alpha")["status"]["states"]
    return found


def warm(first: dict[str, Any], again: dict[str, Any]) -> bool:
    """The next turn took at least the first turn's prompt from the cache."""
    return again["cache_n"] >= first["prompt_n"] - 8


def router_args(tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path],
                *more: str, extra: str = "") -> list[str]:
    return ["--presets", str(presets(tmp_path, tiny_models, extra)), "--llama-server",
            str(llama_server), "--models-max", "1", "--state-dir", str(tmp_path / "states"),
            *more]


def test_slot_churn_a_swap_and_a_restart_keep_every_conversation_warm(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    args = router_args(tmp_path, llama_server, tiny_models)
    with start_router(tmp_path, *args) as router, router.client() as client:
        first = {name: turn(client, opening) for name, opening in OPENINGS.items()}
        assert all(t["cache_n"] < 64 and t["prompt_n"] > 200 for t in first.values()), first
        # One slot, three conversations: A and B were saved as the next took the slot.
        churned = turn(client, OPENINGS["A"] + MORE)
        assert warm(first["A"], churned), (first["A"], churned)
        states = states_of(router)
        assert states["displaced"] >= 2 and states["on_demand"] == 1 and states["hits"] == 1
        turn(client, OPENINGS["B"], model="beta")  # a swap: alpha's slot saved at its stop
        assert wait_until(lambda: router.models()["alpha"]["status"]["value"] == "unloaded",
                          GUARD_S)
        swapped = {name: turn(client, OPENINGS[name] + MORE) for name in ("B", "C")}
        assert all(warm(first[n], swapped[n]) for n in swapped), (first, swapped)
        metrics = client.get("/metrics").text
    assert 'llamarouter_state_restores_on_demand_total{model="alpha"}' in metrics, metrics
    assert 'llamarouter_state_restore_hits_total{model="alpha"}' in metrics
    # A restart on the same state directory: every conversation comes back warm.
    with start_router(tmp_path, *args) as router, router.client() as client:
        again = {name: turn(client, OPENINGS[name] + MORE + MORE) for name in OPENINGS}
        states = states_of(router)
    assert all(warm(first[n], again[n]) for n in OPENINGS), (first, again)
    assert states["misses"] == 0 and "off" not in states, states


def test_a_conversation_of_another_key_is_never_restored(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    args = router_args(tmp_path, llama_server, tiny_models, "--api-key-file", str(keys))
    with start_router(tmp_path, *args) as router, router.client() as client:
        first = turn(client, OPENINGS["A"], key="sk-alice")
        turn(client, OPENINGS["B"], key="sk-alice")  # A saved, owned by alice
        stolen = turn(client, OPENINGS["A"] + MORE, key="sk-bob")
        assert stolen["cache_n"] < 64, stolen  # bob computes it all: nothing of alice's
        assert states_of(router, "sk-alice")["on_demand"] == 0
        own = turn(client, OPENINGS["A"] + MORE, key="sk-alice")
        assert warm(first, own), (first, own)
        assert states_of(router, "sk-alice")["on_demand"] == 1
        manifests = [p.read_text() for p in (tmp_path / "states").rglob("slot-*.json")]
    assert manifests and not any("sk-alice" in m or "sk-bob" in m for m in manifests)


def test_a_model_whose_restores_do_not_hit_stops_keeping_conversations(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    args = router_args(tmp_path, llama_server, tiny_models)
    openings = {**OPENINGS, "D": OPENINGS["C"].replace("C", "D")}
    with start_router(tmp_path, *args) as router, router.client() as client:
        for opening in openings.values():
            turn(client, opening)  # A, B, C saved as the next took the slot; D at the stop
    # Each of A's, B's and C's states now says it holds the next one's conversation, and D's
    # (restored into the slot as the child starts) none asked for: every restore misses.
    manifests = sorted((tmp_path / "states").rglob("slot-*.json"),
                       key=lambda p: json.loads(p.read_text())["saved_at"])
    documents = [json.loads(p.read_text()) for p in manifests]
    assert len(documents) == 4, documents
    labels = [d["prefix"] for d in documents]
    nobody = {"conversation": {"n": 1, "key": 0, "owner": None}}
    for path, document, other in zip(manifests, documents,
                                     [labels[1], labels[2], labels[0], nobody], strict=True):
        path.write_text(json.dumps({**document, "prefix": other}))
    with start_router(tmp_path, *args) as router, router.client() as client:
        for name in ("A", "B", "C"):  # B and C each displace the one before: saved
            turn(client, openings[name] + MORE)
        states = states_of(router)
        turn(client, openings["D"] + MORE)  # displaces C's, no longer saved
        assert wait_until(lambda: states_of(router)["displaced"] == 2, 60), states_of(router)
        kept = {p.name for p in (tmp_path / "states").rglob("slot-*.json")}
        log = router.log()
    assert states["misses"] == 3 and states["hits"] == 0, states
    assert "do not restore" in states["off"], states
    assert log.count("event=conversations_off") == 1, log
    # nor is anything saved at the stop (D's conversation sat in the slot)
    assert {p.name for p in (tmp_path / "states").rglob("slot-*.json")} <= kept


def test_the_budget_keeps_the_most_recent_conversations(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    probe = tmp_path / "probe"  # a router of its own measures one state's size
    probe.mkdir()
    with start_router(probe, *router_args(probe, llama_server, tiny_models)) as router, \
            router.client() as client:
        turn(client, OPENINGS["A"])
        turn(client, OPENINGS["B"])  # A saved
        size = states_of(router)["bytes"]
    assert size > 0
    args = router_args(tmp_path, llama_server, tiny_models, "--state-budget",
                       str(int(size * 1.5)))
    with start_router(tmp_path, *args) as router, router.client() as client:
        for opening in OPENINGS.values():
            turn(client, opening)  # A saved, then B: A is dropped
        states = states_of(router)
        kept_b = turn(client, OPENINGS["B"] + MORE)
        lost_a = turn(client, OPENINGS["A"] + MORE)
    assert states["count"] == 1 and states["bytes"] <= size * 1.5, states
    assert kept_b["cache_n"] > 200 and lost_a["cache_n"] < 64, (kept_b, lost_a)


def test_a_child_killed_during_a_displacement_save_loses_only_that_state(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    args = router_args(tmp_path, llama_server, tiny_models)
    with start_router(tmp_path, *args) as router, router.client() as client:
        turn(client, OPENINGS["A"])
        (child,) = router.children()
        child.send_signal(signal.SIGSTOP)  # the save of A waits on a frozen child
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(client.post(
            "/completion", json={"model": "alpha", "prompt": OPENINGS["B"], "n_predict": 4},
            timeout=GUARD_S)))
        sender.start()
        assert wait_until(lambda: "event=state_displacing" in router.log(), GUARD_S)
        child.kill()
        sender.join(GUARD_S)
        assert answers, "the request never ended"
        answer = answers[0]
        assert answer.status_code in (200, 502, 503), answer.text
        if answer.status_code != 200:
            assert answer.json()["error"]["message"], answer.text
        after = turn(client, OPENINGS["C"])  # the model serves again
        assert after["prompt_n"] > 200
        assert client.get("/health").status_code == 200


def test_a_flood_of_conversations_on_one_slot_and_a_slot_named_by_the_client(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """Eight conversations at once on one slot: the child queues what finds no free slot and
    the router follows; every request is answered and the model serves on. A request naming
    its own ``id_slot`` keeps it: the router places nothing for it."""
    args = router_args(tmp_path, llama_server, tiny_models)
    prompts = [f"Flood {i}: " + OPENINGS["A"] for i in range(8)]
    with start_router(tmp_path, *args) as router, router.client() as client:
        answers: list[int] = []
        threads = [threading.Thread(target=lambda p=p: answers.append(
            client.post("/completion", json={"model": "alpha", "prompt": p, "n_predict": 4},
                        timeout=GUARD_S).status_code)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(GUARD_S)
        assert answers == [200] * 8, answers
        again = turn(client, prompts[0] + MORE)  # the router's book still holds together
        assert again["prompt_n"] + again["cache_n"] > 200
        before = states_of(router).get("displaced", 0)
        own = client.post("/completion", json={"model": "alpha", "prompt": OPENINGS["B"],
                                               "n_predict": 4, "id_slot": 0}, timeout=GUARD_S)
        assert own.status_code == 200, own.text
        assert states_of(router).get("displaced", 0) == before  # nothing saved for it


def test_one_keys_conversation_never_serves_another_from_a_slot_or_the_ram_cache(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """With API keys, a slot holding one key's conversation is erased before another key's
    request runs there, and the children keep no RAM prompt cache (``--cache-ram 0``): both
    would serve a cached prefix, and its speed would tell the other key what was sent."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    preset_file = write_presets(tmp_path / "models.ini",  # llama-server's own cache-ram
                                f"[*]\nctx-size = 4096\nparallel = 1\n"
                                f"[alpha]\nmodel = {tiny_models['alpha']}\n")
    with start_router(tmp_path, "--presets", str(preset_file), "--llama-server",
                      str(llama_server), "--state-dir", str(tmp_path / "states"),
                      "--api-key-file", str(keys)) as router, router.client() as client:
        turn(client, OPENINGS["A"], key="sk-alice")
        (child,) = router.children()
        argv = child.cmdline()
        in_slot = turn(client, OPENINGS["A"] + MORE, key="sk-bob")  # alice's is in the slot
        turn(client, OPENINGS["B"], key="sk-alice")  # alice's B in the slot, A on disk
        elsewhere = " Then something else happened, somewhere else entirely. " * 4
        from_ram = turn(client, OPENINGS["A"] + elsewhere, key="sk-bob")
        own = turn(client, OPENINGS["A"] + MORE, key="sk-alice")
    assert argv[argv.index("--cache-ram") + 1] == "0", argv
    assert in_slot["cache_n"] < 64 and from_ram["cache_n"] < 64, (in_slot, from_ram)
    assert own["cache_n"] > 200, own  # alice's own, restored from disk


def test_a_request_sent_while_every_slot_is_busy_is_placed_by_the_router_too(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """Bob asks for alice's prefix while alice's request holds the only slot: his request
    waits in the router's queue (not the child's), so the router places it when the slot
    frees and erases alice's conversation first; a child choosing for itself would serve him
    her cached prefix."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    # Context shift and no n_predict: alice's stream never ends by itself (a short one could
    # end, whole in the socket buffers, before bob's request comes).
    args = router_args(tmp_path, llama_server, tiny_models, "--api-key-file", str(keys),
                       extra="context-shift = true\n")
    alice = {"Authorization": "Bearer sk-alice"}
    with start_router(tmp_path, *args) as router, router.client(headers=alice) as client, \
            router.client() as other:
        def waiting() -> object:
            return next(m for m in client.get("/models").json()["data"]
                        if m["id"] == "alpha")["status"]["waiting"]

        body = {"model": "alpha", "prompt": OPENINGS["A"], "ignore_eos": True, "stream": True,
                "cache_prompt": True}
        with client.stream("POST", "/completion", json=body, timeout=GUARD_S) as running:
            lines = running.iter_lines()
            assert any(line.startswith("data: ") for line in lines)  # alice holds the slot
            bob: dict[str, Any] = {}
            asking = threading.Thread(target=lambda: bob.update(
                turn(other, OPENINGS["A"] + MORE, key="sk-bob")))
            asking.start()
            assert wait_until(lambda: waiting() == 1, GUARD_S)  # in the router's queue
        asking.join(GUARD_S)  # alice left: her slot goes to bob
    assert bob and bob["cache_n"] < 64, bob  # nothing of alice's
