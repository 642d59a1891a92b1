"""Ollama's API on the router's port, with the official ``ollama`` client against real
llama-server children (SmolLM2 for chat, tiny random-weight models for the rest): list, show,
ps, chat streamed and not, generate, JSON-schema output, tool calls passed down, embeddings,
the load and ``keep_alive: 0`` unload idioms, errors and key scopes in Ollama's shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

ADMIN = "k-admin"
INFER_KEY = "k-chat"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, llama_server: Path, smollm2: Path,
           tiny_models: dict[str, Path]) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("ollama")
    presets = write_presets(tmp / "p.ini", (
        f"[smol]\nmodel = {smollm2}\nctx-size = 2048\nparallel = 1\nalias = smollm2\n\n"
        f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n\n"
        f"[embed]\nmodel = {tiny_models['embed']}\nembeddings = true\npooling = mean\n"))
    keys = tmp / "keys"
    keys.write_text(f"{ADMIN}\n{INFER_KEY} models=smol,smollm2,embed role=infer\n")
    with start_router(tmp, "--presets", str(presets), "--api-key-file", str(keys)) as found:
        yield found


CLIENTS: list[ollama.Client] = []


def client(router: RouterProcess, key: str = ADMIN) -> ollama.Client:
    made = ollama.Client(host=router.url, headers={"Authorization": f"Bearer {key}"},
                         timeout=120)
    CLIENTS.append(made)
    return made


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while CLIENTS:
        CLIENTS.pop().close()


def test_version_list_show(router: RouterProcess) -> None:
    api = client(router)
    names = {m.model for m in api.list().models}
    assert {"smol", "alpha", "embed"} <= names
    smol = next(m for m in api.list().models if m.model == "smol")
    assert smol.details is not None and smol.details.family == "llama"
    assert smol.details.format == "gguf" and smol.details.quantization_level
    assert smol.size and smol.size > 1_000_000
    shown = api.show("smollm2:latest")  # an alias, with the tag clients add
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert "completion" in (shown.capabilities or [])
    with httpx.Client(base_url=router.url) as raw:
        answer = raw.get("/api/version", headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 200 and answer.json()["version"]


def test_chat_streamed_and_whole(router: RouterProcess) -> None:
    api = client(router, INFER_KEY)
    messages = [{"role": "user", "content": "Say hello."}]
    whole = api.chat("smol", messages=messages, options={"num_predict": 8, "seed": 1,
                                                          "temperature": 0})
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and 0 < whole.eval_count <= 8
    assert whole.prompt_eval_count and whole.prompt_eval_count > 3
    assert whole.eval_duration and whole.total_duration and whole.total_duration >= \
        whole.eval_duration
    parts = list(api.chat("smol", messages=messages, stream=True,
                          options={"num_predict": 8, "seed": 1, "temperature": 0}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert not any(p.done for p in parts[:-1])
    text = "".join(p.message.content or "" for p in parts)
    assert text == whole.message.content  # the same greedy answer, streamed
    assert parts[-1].eval_count == whole.eval_count
    # Recorded as the Ollama request it was, with the tokens the child generated (its tail).
    with httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}) as raw:
        records = raw.get("/activity").json()["requests"]
        metrics = raw.get("/metrics").text
    chats = [r for r in records if r["endpoint"] == "/api/chat" and r["model"] == "smol"]
    assert len(chats) >= 2 and all(r["status"] == 200 for r in chats[:2])
    assert {r["tokens"] for r in chats[:2]} == {whole.eval_count}
    assert all(r["ttft_s"] is not None for r in chats[:2])
    # The GenAI histograms count it as the chat it was (``gen_ai.operation.name``).
    assert any(line.startswith("gen_ai_server_request_duration_seconds_count{")
               and 'gen_ai_operation_name="chat"' in line and 'model="smol"' in line
               for line in metrics.splitlines()), metrics[-3000:]


def test_generate_and_raw(router: RouterProcess) -> None:
    api = client(router)
    answer = api.generate("smol", prompt="The sky is", system="Be brief.",
                          options={"num_predict": 5})
    assert answer.done and answer.response and answer.eval_count
    raw = api.generate("alpha", prompt="abc", raw=True, options={"num_predict": 4})
    assert raw.done and raw.eval_count == 4 and raw.done_reason == "length"
    streamed = list(api.generate("alpha", prompt="abc", raw=True, stream=True,
                                 options={"num_predict": 4}))
    assert streamed[-1].done and streamed[-1].eval_count == 4


def test_json_schema_output_parses(router: RouterProcess) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    answer = client(router).chat("smol", messages=[
        {"role": "user", "content": "Give a person as JSON."}], format=schema,
        options={"num_predict": 64, "temperature": 0})
    value = json.loads(answer.message.content or "")
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_tools_are_passed_down(router: RouterProcess) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    answer = client(router).chat("smol", messages=messages, tools=tools,
                                 options={"num_predict": 16})
    assert answer.done  # the child took tools and an earlier tool call without complaint
    for call in answer.message.tool_calls or ():
        assert isinstance(call.function.arguments, dict)


def test_embeddings(router: RouterProcess) -> None:
    api = client(router, INFER_KEY)
    both = api.embed("embed", input=["hello", "world"])
    assert len(both.embeddings) == 2 and len(both.embeddings[0]) > 8
    assert both.prompt_eval_count
    one = api.embeddings("embed", prompt="hello")
    assert len(one.embedding) == len(both.embeddings[0])


def test_ps_and_the_unload_idiom(router: RouterProcess) -> None:
    api = client(router)
    loaded = api.generate("alpha", keep_alive="1h")  # no prompt: load it, for an hour
    assert loaded.done and loaded.done_reason == "load"
    running = {m.model: m for m in api.ps().models}
    assert "alpha" in running and running["alpha"].expires_at is not None
    left = running["alpha"].expires_at.timestamp() - time.time()  # type: ignore[union-attr]
    assert 3500 < left <= 3600, left
    api.chat("alpha", messages=[{"role": "user", "content": "hi"}], keep_alive=-1,
             options={"num_predict": 2})
    forever = {m.model: m for m in api.ps().models}["alpha"].expires_at
    assert forever is not None and forever.year == 2318  # no idle TTL, as Ollama shows it
    assert running["alpha"].size and running["alpha"].size > 0
    with pytest.raises(ollama.ResponseError) as refused:  # an infer key may not unload
        client(router, INFER_KEY).generate("smol", keep_alive=0)
    assert refused.value.status_code == 403 and "admin" in refused.value.error
    gone = api.generate("alpha", keep_alive=0)
    assert gone.done_reason == "unload"
    assert wait_until(lambda: "alpha" not in {m.model for m in api.ps().models}, 30)


def test_errors_in_ollamas_shape(router: RouterProcess) -> None:
    api = client(router)
    with pytest.raises(ollama.ResponseError) as missing:
        api.chat("nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    with pytest.raises(ollama.ResponseError) as too_big:
        api.chat("smol", messages=[{"role": "user", "content": "hi"}],
                 options={"num_ctx": 100_000})
    assert too_big.value.status_code == 400 and "num_ctx" in too_big.value.error
    infer = client(router, INFER_KEY)
    with pytest.raises(ollama.ResponseError) as scoped:  # not the key's: not found
        infer.chat("alpha", messages=[{"role": "user", "content": "hi"}])
    assert scoped.value.status_code == 404
    assert "alpha" not in {m.model for m in infer.list().models}
    with pytest.raises(ollama.ResponseError) as pull:
        infer.pull("owner/repo")
    assert pull.value.status_code == 403
    with pytest.raises(ollama.ResponseError) as unknown_key:
        client(router, "wrong").list()
    assert unknown_key.value.status_code == 401 and isinstance(unknown_key.value.error, str)
    with httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}) as raw:
        for body, status in [
                (b"{not json", 400), (b"[1]", 400),
                (b'{"model": "smol", "messages": "hi"}', 400),
                (b'{"model": "smol", "messages": [{"role": "user", "content": "x"}], '
                 b'"options": {"temperature": "hot"}}', 400),
                (b'{"model": "smol", "messages": [{"role": "user", "content": "x"}], '
                 b'"options": {"temperature": NaN}}', 400),
                (b'{"model": "smol", "messages": [{"role": "user", "content": "x"}], '
                 b'"options": {"seed": 1e300}}', 400),
                (b'{"model": 5}', 400)]:
            answer = raw.post("/api/chat", content=body)
            assert answer.status_code == status, (body, answer.text)
            assert isinstance(answer.json()["error"], str), answer.text
        for name in ["../../etc/passwd", "owner/..", "/abs/path", "a/b/c", "owner/.hidden"]:
            answer = raw.post("/api/pull", json={"model": name})
            assert answer.status_code == 400, (name, answer.text)
        answer = raw.post("/api/pull", json={"model": "smol"})  # here already: success
        assert answer.json() == {"status": "success"}
        answer = raw.request("DELETE", "/api/delete", json={"model": "smol"})
        assert answer.status_code == 400 and "preset" in answer.json()["error"]
