"""Ollama's API translated, in process: requests into llama-server's (options, format, think,
tools, images, system, raw, keep_alive, the load and unload idioms, every hostile value
refused with a 400 naming it), answers back (a stream's events into NDJSON lines, split
anywhere; tool-call deltas into one whole call; the final fields; errors), and the GGUF
details."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from router.errors import BadRequest
from router.ollama import details, translate
from router.ollama.answers import Answer, error_message

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> translate.Ask:
    return translate.chat({"model": "m", "messages": MSG, **fields}, 2048)


def test_options_map_to_llama_server_fields() -> None:
    ask = chat(options={"temperature": 0.5, "top_p": 0.9, "top_k": 40, "num_predict": 12,
                        "stop": ["\n"], "seed": 7, "repeat_penalty": 1.1, "num_ctx": 2048,
                        "num_gpu": 99, "unknown": "x"}, stream=False)
    assert ask.path == translate.CHAT and not ask.stream
    body = ask.body
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["top_k"] == 40
    assert body["max_tokens"] == 12 and body["stop"] == ["\n"] and body["seed"] == 7
    assert body["repeat_penalty"] == 1.1
    assert "num_ctx" not in body and "num_gpu" not in body and "unknown" not in body
    assert "max_tokens" not in chat(options={"num_predict": -1}).body


@pytest.mark.parametrize("options", [
    {"temperature": "hot"}, {"temperature": math.nan}, {"temperature": math.inf},
    {"temperature": True}, {"top_p": 2}, {"top_k": 1.5}, {"top_k": -1},
    {"seed": 2**40}, {"seed": 1e300}, {"num_predict": 2**31}, {"stop": [1]},
    {"stop": ["x"] * 100}, {"num_ctx": 4096}, {"num_ctx": 0}, {"num_ctx": "big"}])
def test_hostile_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as refused:
        chat(options=options)
    assert next(iter(options)) in refused.value.message


def test_num_ctx_over_the_context_names_it() -> None:
    with pytest.raises(BadRequest, match="num_ctx 4096 exceeds the model's context of 2048"):
        chat(options={"num_ctx": 4096})
    assert chat(options={"num_ctx": 1024}).body  # within: accepted, not sent


@pytest.mark.parametrize("body", [
    {"messages": MSG}, {"model": 5, "messages": MSG}, {"model": "m", "messages": "hi"},
    {"model": "m", "messages": [{"role": "god", "content": "x"}]},
    {"model": "m", "messages": [{"role": "user", "content": 5}]},
    {"model": "m", "messages": MSG, "stream": "yes"},
    {"model": "m", "messages": MSG, "format": "xml"},
    {"model": "m", "messages": MSG, "think": "very"},
    {"model": "m", "messages": MSG, "tools": "all"},
    {"model": "m", "messages": MSG, "options": [1]},
    {"model": "m", "messages": MSG, "keep_alive": [1]},
    {"model": "m", "messages": [{"role": "user", "content": "x", "images": [5]}]},
    {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"f": 1}]}]}])
def test_hostile_bodies_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        translate.chat(body)


def test_format_think_tools_images_keep_alive() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format="json").body["response_format"] == {"type": "json_object"}
    assert chat(format=schema).body["response_format"]["json_schema"]["schema"] == schema
    assert chat(think=False).body["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat(think="high").body["reasoning_effort"] == "high"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat(tools=tools).body["tools"] == tools
    assert chat(keep_alive="5m").body["keep_alive"] == "5m"
    ask = translate.chat({"model": "m", "messages": [
        {"role": "user", "content": "what is it?", "images": ["aGk="]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_name": "f"}]})
    user, assistant, tool = ask.body["messages"]
    assert user["content"][0] == {"type": "image_url",
                                  "image_url": {"url": "data:image/png;base64,aGk="}}
    assert user["content"][1] == {"type": "text", "text": "what is it?"}
    call = assistant["tool_calls"][0]
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"x": 1}
    assert tool == {"role": "tool", "content": "42", "name": "f"}


def test_generate_system_raw_and_idioms() -> None:
    ask = translate.generate({"model": "m", "prompt": "p", "system": "s"})
    assert ask.path == translate.CHAT and ask.body["messages"] == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    raw = translate.generate({"model": "m", "prompt": "p", "raw": True, "stream": False})
    assert raw.path == translate.COMPLETIONS and raw.body["prompt"] == "p" and not raw.stream
    assert translate.generate({"model": "m"}).idiom == "load"
    for zero in (0, 0.0, "0", "0s", "0m"):
        assert translate.generate({"model": "m", "keep_alive": zero}).idiom == "unload"
        assert translate.chat({"model": "m", "messages": [], "keep_alive": zero}).idiom \
            == "unload"
    assert translate.generate({"model": "m", "keep_alive": "5m"}).idiom == "load"
    with pytest.raises(BadRequest, match="suffix"):
        translate.generate({"model": "m", "prompt": "p", "suffix": "q"})


def test_embed_and_latest() -> None:
    assert translate.embed({"model": "e", "input": "x"}).body["input"] == ["x"]
    assert translate.embed({"model": "e", "prompt": "x"}, legacy=True).body["input"] == "x"
    with pytest.raises(BadRequest):
        translate.embed({"model": "e", "input": [1]})
    assert translate.without_latest("m:latest", lambda n: False) == "m"
    assert translate.without_latest("m:latest", lambda n: n == "m:latest") == "m:latest"


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) \
        + b"data: [DONE]\n\n"


def delta(**fields: Any) -> dict[str, Any]:
    finish = fields.pop("finish", None)
    return {"choices": [{"delta": fields, "finish_reason": finish}]}


@pytest.mark.parametrize("cut", [1, 7, 40, 1000])
def test_a_stream_becomes_ndjson_split_anywhere(cut: int) -> None:
    stream = sse(delta(role="assistant"), delta(content="Hel"), delta(content="lo"),
                 {**delta(finish="stop"), "timings": {"prompt_n": 5, "cache_n": 2,
                                                      "prompt_ms": 1.5, "predicted_n": 2,
                                                      "predicted_ms": 3.0}})
    answer = Answer("chat", "m:latest", 0.0, lambda: 0.25)
    out = b"".join(answer.feed(stream[i:i + cut]) for i in range(0, len(stream), cut))
    out += answer.end()
    lines = [json.loads(line) for line in out.splitlines()]
    # The first event's line (the role alone) goes out as soon as it comes: the client's first
    # byte is as early as on the OpenAI path.
    assert [line["message"]["content"] for line in lines] == ["", "Hel", "lo", ""]
    assert [line["done"] for line in lines] == [False, False, False, True]
    last = lines[-1]
    assert last["model"] == "m:latest" and last["done_reason"] == "stop"
    assert last["prompt_eval_count"] == 7 and last["eval_count"] == 2
    assert last["prompt_eval_duration"] == 1_500_000 and last["eval_duration"] == 3_000_000
    assert last["load_duration"] == 250_000_000 and last["total_duration"] > 0


def test_tool_call_deltas_go_out_whole() -> None:
    answer = Answer("chat", "m", 0.0, lambda: 0.0)
    out = answer.feed(sse(
        delta(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "get_",
                                                                "arguments": '{"ci'}}]),
        delta(tool_calls=[{"index": 0, "function": {"name": "weather",
                                                    "arguments": 'ty": "Paris"}'}}]),
        delta(finish="tool_calls")))
    lines = [json.loads(line) for line in out.splitlines()]
    calls = lines[0]["message"]["tool_calls"]
    assert calls == [{"id": "c1", "function": {"index": 0, "name": "get_weather",
                                               "arguments": {"city": "Paris"}}}]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_whole_answers_and_errors() -> None:
    body = json.dumps({"choices": [{"finish_reason": "length", "message": {
        "content": "hi", "reasoning_content": "hmm", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "timings": {"prompt_n": 3, "predicted_n": 1}}).encode()
    whole = json.loads(Answer("chat", "m", 0.0, lambda: 0.0).whole(body))
    assert whole["message"]["content"] == "hi" and whole["message"]["thinking"] == "hmm"
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == {}
    assert whole["done_reason"] == "length" and whole["eval_count"] == 1
    generated = json.loads(Answer("generate", "m", 0.0, lambda: 0.0).whole(
        json.dumps({"choices": [{"text": "abc", "finish_reason": "stop"}]}).encode()))
    assert generated["response"] == "abc"
    embedded = json.loads(Answer("embed", "e", 0.0, lambda: 0.0).whole(json.dumps(
        {"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
         "usage": {"prompt_tokens": 4}}).encode()))
    assert embedded["embeddings"] == [[1.0], [2.0]] and embedded["prompt_eval_count"] == 4
    assert error_message(b'{"error": {"code": 404, "message": "gone"}}') == "gone"
    assert error_message(b"plain") == "plain"
    streamed = Answer("chat", "m", 0.0, lambda: 0.0).feed(
        b'data: {"error": {"code": 500, "message": "boom"}}\n\n')
    assert json.loads(streamed) == {"error": "boom"}


def test_details_from_the_gguf_header(tmp_path: Path) -> None:
    from router.llama.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path / "t.gguf", seed=1, name="t")
    found = details.facts(str(path))
    assert found.details["family"] == "llama" and found.details["format"] == "gguf"
    assert found.size == path.stat().st_size and len(found.digest) == 64
    assert found.model_info["general.architecture"] == "llama"
    assert details.context_of({"ctx-size": "512"}, found) == 512
    assert details.context_of({}, found) == found.context_length
    assert details.facts(None) is details.NO_FACTS
    assert details.facts(str(tmp_path / "missing.gguf")) is details.NO_FACTS
    assert "embedding" in details.capabilities({"embeddings": "true"}, "")
