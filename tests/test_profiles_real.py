"""Profiles on the real llama-server: two names, one child. A profile's request policy shows in
the child's own ``generation_settings`` (its default where the client sent none, the client's
value over it, its forced value over the client's), on every body shape; a conversation that
alternates between the two names stays in the one prompt cache; loading a profile loads its
base; a body the policy cannot be applied to is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import SSEClient, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

PRESETS = """\
[chat]
model = {model}
ctx-size = 2048
parallel = 1
params.top_p = 0.5

[chat-code]
profile-of = chat
alias = coder
params.temperature = 0.25
force.top_k = 7
strip = padding
"""


def settings(client: object, model: str, **fields: object) -> dict[str, object]:
    """The child's ``generation_settings`` for one short ``/completion`` to ``model``."""
    response = client.post("/completion", json={  # type: ignore[attr-defined]
        "model": model, "prompt": "Hello", "n_predict": 2, **fields})
    assert response.status_code == 200, response.text
    return response.json()["generation_settings"]  # type: ignore[no-any-return]


def test_two_names_one_child_each_with_its_policy(tmp_path: Path, llama_server: Path,
                                                  smollm2: Path) -> None:
    presets = write_presets(tmp_path / "p.ini", PRESETS.format(model=smollm2))
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        events = SSEClient(router.url)
        events.start()
        assert events.connected.wait(30)
        assert client.post("/models/load", json={"model": "coder"}).json() == {"success": True}
        # The profile's status follows its base's, live on /models/sse (the web UI's selector).
        assert wait_until(lambda: any(e["model"] == "chat-code" and e["data"].get("status")
                                      == "loaded" for e in events.events), 60)
        events.stop.set()
        listed = router.models()
        assert listed["chat"]["status"]["value"] == "loaded"  # the profile loaded its base
        profile = listed["chat-code"]
        assert profile["profile_of"] == "chat" and profile["aliases"] == ["coder"]
        assert profile["policy"] == {"params": {"temperature": 0.25}, "force": {"top_k": 7},
                                     "strip": ["padding"]}
        assert profile["status"] == listed["chat"]["status"]  # its base's
        assert listed["chat"]["policy"] == {"params": {"top_p": 0.5}}
        assert len(router.children()) == 1  # one llama-server for both names

        plain = settings(client, "chat")
        assert plain["top_p"] == pytest.approx(0.5) and plain["top_k"] != 7
        coded = settings(client, "chat-code")
        assert coded["temperature"] == pytest.approx(0.25) and coded["top_k"] == 7
        assert "top_p" in coded and coded["top_p"] != pytest.approx(0.5)  # not the base's
        own = settings(client, "coder", temperature=0.9, top_k=50)
        assert own["temperature"] == pytest.approx(0.9) and own["top_k"] == 7

        # A body past the scan threshold (read by the scanner, not parsed whole): the same.
        large = settings(client, "chat-code", padding="x" * 400_000)
        assert large["temperature"] == pytest.approx(0.25) and large["top_k"] == 7

        # Chat, streamed: answered by the base's child, in its own name (relayed as it is).
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "chat-code", "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["model"] == "chat"

        refused = client.post("/completion", files={"prompt": (None, "Hello")},
                              data={"model": "chat-code"})
        assert refused.status_code == 400
        assert "JSON object body" in refused.json()["error"]["message"]
        assert len(router.children()) == 1


def test_a_conversation_alternating_between_names_stays_warm(
        tmp_path: Path, llama_server: Path, smollm2: Path) -> None:
    presets = write_presets(tmp_path / "p.ini", PRESETS.format(model=smollm2))
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                    {"role": "user", "content": "Name a colour."}]
        previous = 0  # the tokens of the previous turn's prompt: this turn's prefix
        for turn, name in enumerate(["chat", "chat-code", "chat", "chat-code"]):
            answer = client.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 8, "messages": messages})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            timings = body["timings"]
            assert timings["cache_n"] >= 0.9 * previous, (turn, timings)  # the one cache
            previous = timings["cache_n"] + timings["prompt_n"]
            messages += [body["choices"][0]["message"],
                         {"role": "user", "content": f"And another, {turn}?"}]
        assert len(router.children()) == 1


VIRTUALS = """\
[alpha]
model = {alpha}
parallel = 1
[beta]
model = {beta}
parallel = 1
[broken]
model = {broken}
[warm]
targets = alpha, beta
[spill]
targets = alpha, beta
choose = spillover
[safe]
targets = broken, beta
choose = fallback
"""
ASK = {"prompt": "Hello", "n_predict": 2}


def test_virtual_models_choose_warm_spill_over_and_fall_back(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    presets = write_presets(tmp_path / "v.ini", VIRTUALS.format(
        alpha=tiny_models["alpha"], beta=tiny_models["long"], broken=broken))
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        assert client.post("/models/load?wait=1", json={"model": "beta"}).status_code == 200
        # warm: the loaded target, with no load at all.
        assert client.post("/completion", json={"model": "warm", **ASK}).status_code == 200
        listed = router.models()
        assert listed["alpha"]["status"]["value"] == "unloaded"
        assert (listed["warm"]["last_target"], listed["warm"]["last_reason"]) == ("beta",
                                                                                  "warm")
        assert listed["warm"]["targets"] == ["alpha", "beta"]

        # spillover: alpha's one slot busy with a long stream, the next request goes to beta.
        assert client.post("/models/load?wait=1", json={"model": "alpha"}).status_code == 200
        assert client.post("/completion", json={"model": "spill", **ASK}).status_code == 200
        assert router.models()["spill"]["last_target"] == "alpha"  # free: the first
        with client.stream("POST", "/completion", json={
                "model": "alpha", "prompt": "Hello", "n_predict": 4000, "stream": True,
                "ignore_eos": True}) as busy:
            next(busy.iter_lines())  # the slot is computing
            assert client.post("/completion", json={"model": "spill", **ASK}).status_code \
                == 200
            spilled = router.models()["spill"]
            assert (spilled["last_target"], spilled["last_reason"]) == ("beta", "spillover")

        # fallback: the first target fails to load, the request is answered by the next;
        # from then on the failed one is passed over.
        answer = client.post("/completion", json={"model": "safe", **ASK})
        assert answer.status_code == 200, answer.text
        assert router.models()["safe"]["last_target"] == "beta"
        assert client.post("/completion", json={"model": "safe", **ASK}).status_code == 200
        safe = router.models()["safe"]
        assert (safe["last_target"], safe["last_reason"]) == ("beta", "fallback")
        metrics = client.get("/metrics").text
        assert 'llamarouter_virtual_choices_total{model="spill",reason="spillover",' \
               'target="beta"} 1.0' in metrics


FAMILIES = """\
[smol]
model = {smollm2}
ctx-size = 1024
[short]
profile-of = smol
force.max_tokens = 1
force.n_predict = 1
force.max_output_tokens = 1
[embed]
model = {embed}
embeddings = true
pooling = mean
ctx-size = 256
[embed-b64]
profile-of = embed
force.encoding_format = base64
"""


def test_a_policy_holds_on_every_endpoint_family(
        tmp_path: Path, llama_server: Path, smollm2: Path,
        tiny_models: dict[str, Path]) -> None:
    """``force.`` as the child applies it, on chat, completions, ``/completion``,
    ``/v1/responses``, ``/v1/messages`` (each its own length field, one token) and embeddings
    (``encoding_format``); ``/infill`` reaches the child with the policy's body (SmolLM2 has
    no infill tokens: the child's own 501)."""
    presets = write_presets(tmp_path / "f.ini", FAMILIES.format(
        smollm2=smollm2, embed=tiny_models["embed"]))
    hi = [{"role": "user", "content": "hi"}]
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        def one_token(path: str, body: dict[str, object], count: object) -> None:
            for stream in (False, True):
                answer = client.post(path, json={"model": "short", "stream": stream, **body})
                assert answer.status_code == 200, (path, answer.text)
                if not stream:
                    assert count(answer.json()) == 1, (path, answer.text)
                else:
                    assert answer.text.count("data:") >= 1, (path, answer.text)

        one_token("/v1/chat/completions", {"messages": hi, "max_tokens": 50},
                  lambda a: a["usage"]["completion_tokens"])
        one_token("/v1/completions", {"prompt": "hi", "max_tokens": 50},
                  lambda a: a["usage"]["completion_tokens"])
        one_token("/completion", {"prompt": "hi", "n_predict": 50},
                  lambda a: a["tokens_predicted"])
        one_token("/v1/responses", {"input": "hi", "max_output_tokens": 50},
                  lambda a: a["usage"]["output_tokens"])
        one_token("/v1/messages", {"messages": hi, "max_tokens": 50},
                  lambda a: a["usage"]["output_tokens"])
        infill = client.post("/infill", json={"model": "short", "input_prefix": "def f(",
                                              "input_suffix": "):\n"})
        assert infill.status_code == 501 and "Infill" in infill.json()["error"]["message"]

        plain = client.post("/v1/embeddings", json={"model": "embed", "input": "hello"})
        assert plain.status_code == 200 and isinstance(plain.json()["data"][0]["embedding"], list)
        forced = client.post("/v1/embeddings", json={"model": "embed-b64", "input": "hello",
                                                     "encoding_format": "float"})
        assert forced.status_code == 200, forced.text
        assert isinstance(forced.json()["data"][0]["embedding"], str)  # base64, forced
        assert len(router.children()) == 2  # one child per base, whatever the names
