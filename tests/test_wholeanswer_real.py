"""A batch request's answer, asked of the real llama-server as a stream and assembled whole
(``llama.unstreamed``), against the same request unstreamed, field by field.

One router, SmolLM2 (it ends its answers itself, so ``finish_reason`` is ``stop`` as well as
``length``), one slot. The same body goes as an interactive key's (never taken back: relayed
untouched, llama-server's unstreamed answer as it wrote it) and as a batch key's (assembled),
``temperature`` 0, a fixed seed and ``cache_prompt`` off, so that the two runs compute the same
thing. Left out of the comparison, each because it differs between any two runs of one
request: ``id`` (random per request; so are a tool call's and a response's output items'),
``created``/``created_at``/``completed_at`` (the clock, in seconds), and the measured values of
``timings`` (``*_ms`` and ``*_per_second``; its token counts are compared). The child was asked
for a stream: its slot's last task says so (``GET /slots``).

Then what can go wrong while an answer is assembled: a batch request taken back in the middle
of its answer still gets it whole, later; the child's error before its first byte reaches the
client as the same status and body; a client that leaves frees the slot at once; a child that
dies mid-stream gives the 502 envelope, never a cut JSON body.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

TIMEOUT = 120.0
KEYS = ("sk-gateway-0123456789 name=gw\n"
        "sk-alice-0123456789 name=alice priority=interactive role=infer\n"
        "sk-etl-0123456789 name=etl priority=batch role=infer\n")
GW, ALICE, ETL = "sk-gateway-0123456789", "sk-alice-0123456789", "sk-etl-0123456789"
FIXED = {"temperature": 0, "seed": 42, "cache_prompt": False}
MEASURED = ("_ms", "_per_second", "per_token_ms")
CHAT = [{"role": "user", "content": "Say hello in three words."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

# SmolLM2 calls no tool by itself, and llama-server takes no grammar with tools: the tool-call
# deltas are covered by tests/test_wholeanswer.py (as llama.cpp's tests accumulate them).
THINK = 'root ::= "<think>\\nFirst, a thought.\\n</think>\\n\\nHello there."'
TEMPLATE = Path(__file__).parent / "templates" / "qwen3.jinja"  # llama.cpp's models/templates

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat, ends itself", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 64}),
    ("chat, length", "/chat/completions", {"messages": CHAT, "max_tokens": 5}),
    ("chat, stop word", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 64, "stop": ["o"]}),
    ("chat, reasoning", "/v1/chat/completions",  # Qwen3's template: <think> parsed out
     {"model": "q", "messages": CHAT, "max_tokens": 48, "grammar": THINK}),
    ("chat, tools offered", "/v1/chat/completions",
     {"model": "q", "messages": [{"role": "user", "content": "Weather in Paris?"}],
      "tools": TOOLS, "max_tokens": 24}),
    ("completions", "/v1/completions", {"prompt": "The capital of France is",
                                        "max_tokens": 12}),
    ("completions, stop", "/v1/completions", {"prompt": "One, two, three,", "max_tokens": 24,
                                              "stop": [","]}),
    ("completion", "/completion", {"prompt": "Once upon a time", "n_predict": 16}),
    ("completion, stop", "/completions", {"prompt": "Once upon a time", "n_predict": 32,
                                          "stop": ["the"]}),
    ("completion, tokens", "/completion", {"prompt": [1, 2, 3, 4], "n_predict": 8}),
    ("responses", "/v1/responses", {"input": "Say hello in three words.",
                                    "max_output_tokens": 24}),
]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def comparable(value: Any, key: str = "") -> Any:
    """``value`` without what differs between two runs (see the module docstring)."""
    if isinstance(value, dict):
        return {k: comparable(v, k) for k, v in value.items()
                if k not in ("id", "created", "created_at", "completed_at")
                and not (key == "timings" and k.endswith(MEASURED))}
    if isinstance(value, list):
        return [comparable(v, key) for v in value]
    return value


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, smollm2: Path, llama_server: Path
           ) -> Any:
    tmp = tmp_path_factory.mktemp("whole")
    keys = tmp / "keys"
    keys.write_text(KEYS)
    presets = write_presets(tmp / "m.ini", f"[m]\nmodel = {smollm2}\nctx-size = 2048\n"
                            f"parallel = 1\n[q]\nmodel = {smollm2}\nctx-size = 2048\n"
                            f"parallel = 1\nchat-template-file = {TEMPLATE}\n")
    with start_router(tmp, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys)) as running:
        yield running


def post(router: RouterProcess, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=router.url, timeout=TIMEOUT) as client:
        return client.post(path, headers=auth(key), json={"model": "m", **FIXED, **body})


def last_task_streamed(router: RouterProcess, model: str) -> bool:
    with router.client() as client:
        slots = client.get(f"/slots?model={model}", headers=auth(GW)).json()
    return bool(slots[0]["params"]["stream"])


@pytest.mark.real
@pytest.mark.parametrize(("path", "body"), [(p, b) for _, p, b in CASES],
                         ids=[name for name, _, _ in CASES])
def test_the_assembled_answer_is_the_unstreamed_one(router: RouterProcess, path: str,
                                                     body: dict[str, Any]) -> None:
    model = body.get("model", "m")
    plain = post(router, ALICE, path, body)
    assert not last_task_streamed(router, model)
    whole = post(router, ETL, path, body)
    assert last_task_streamed(router, model)  # asked as a stream, answered whole
    assert (whole.status_code, plain.status_code) == (200, 200), whole.text
    assert whole.headers["content-type"] == plain.headers["content-type"]
    assert comparable(whole.json()) == comparable(plain.json())
    answer = whole.json()
    if path.endswith("chat/completions"):
        assert answer["usage"]["completion_tokens"] > 0 and "timings" in answer
    if "grammar" in body:
        message = answer["choices"][0]["message"]
        assert message["reasoning_content"].strip() == "First, a thought."
        assert message["content"] == "Hello there."


@pytest.mark.real
def test_an_answer_that_ends_itself_and_one_cut_by_its_limit(router: RouterProcess) -> None:
    """The cases cover both ends of a chat answer (a hang guard against a model that never
    stops: then the comparison above proves less)."""
    ends = post(router, ETL, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 64})
    cut = post(router, ETL, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})
    assert ends.json()["choices"][0]["finish_reason"] == "stop"
    assert cut.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.real
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}),
    ("/completion", {"prompt": "x", "grammar": "root ::= nonsense"}),
    ("/v1/chat/completions", {"model": "q", "messages": CHAT, "tools": TOOLS,
                              "grammar": THINK}),
    ("/v1/completions", {"prompt": "word " * 3000}),
], ids=["context exceeded", "bad grammar", "grammar with tools",
        "completions context exceeded"])
def test_a_childs_error_is_the_same_error(router: RouterProcess, path: str,
                                          body: dict[str, Any]) -> None:
    plain = post(router, ALICE, path, body)
    whole = post(router, ETL, path, body)
    assert plain.status_code >= 400
    assert whole.status_code == plain.status_code
    assert whole.json() == plain.json()


@pytest.mark.real
def test_taken_back_mid_answer_it_comes_whole_later(router: RouterProcess) -> None:
    """A long batch answer is under way (its child streams to the router) when an interactive
    request comes: the batch request is taken back, the interactive one answered, and the batch
    client gets one whole answer, as long as it asked for."""
    with ThreadPoolExecutor(2) as pool:
        long_job = pool.submit(post, router, ETL, "/v1/chat/completions",
                               {"messages": CHAT, "max_tokens": 400, "ignore_eos": True})
        time.sleep(1.5)  # into its answer (SmolLM2: ~100 tokens/s on a quiet machine)
        began = time.perf_counter()
        quick = post(router, ALICE, "/v1/chat/completions", {"messages": CHAT,
                                                              "max_tokens": 4})
        quick_s = time.perf_counter() - began
        answer = long_job.result(TIMEOUT)
    assert quick.status_code == 200 and answer.status_code == 200, answer.text
    whole = answer.json()
    assert whole["usage"]["completion_tokens"] == 400
    assert whole["choices"][0]["finish_reason"] == "length"
    assert quick_s < 30  # a hang guard; the floor's figure is the bench's (fairness phase)
    log = router.log()
    assert "event=preempted" in log


@pytest.mark.real
def test_a_client_that_leaves_mid_assembly_frees_the_slot(router: RouterProcess) -> None:
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=router.url,
                                                         timeout=1.0) as client:
        client.post("/v1/chat/completions", headers=auth(ETL), json={
            "model": "m", "messages": CHAT, "max_tokens": 4000, "ignore_eos": True})
    began = time.perf_counter()
    quick = post(router, ETL, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert quick.status_code == 200
    assert time.perf_counter() - began < 30  # not behind 4000 tokens (a hang guard)


@pytest.mark.real
def test_a_child_that_dies_mid_assembly_gives_the_envelope(
        tmp_path: Path, smollm2: Path, llama_server: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {smollm2}\nctx-size = 2048\n"
                            "parallel = 1\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys)) as router, ThreadPoolExecutor(1) as pool:
        job = pool.submit(post, router, ETL, "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 4000, "ignore_eos": True})
        assert wait_until(lambda: _in_flight(router) == 1, TIMEOUT)
        time.sleep(0.5)
        child, = router.children()[-1:]
        os.kill(child.pid, signal.SIGKILL)
        answer = job.result(TIMEOUT)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == 502 and "llama-server" in error["message"]


def _in_flight(router: RouterProcess) -> int:
    with router.client() as client:
        data = client.get("/models", headers=auth(GW)).json()["data"]
    return int(next(m for m in data if m["id"] == "m")["status"].get("in_flight", 0))
