"""A streamed answer assembled into the unstreamed one (``llama.unstreamed``), and its event
stream split (``http.wholeanswer.Events``): the shapes llama-server b11434 writes, one piece at
a time or cut anywhere, tool calls and reasoning, which requests are assembled, and memory
linear in the answer. The real llama-server's answers, field by field:
``tests/test_wholeanswer_real.py``."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from router.errors import UpstreamError
from router.http.wholeanswer import Events
from router.llama.unstreamed import (
    ChatAssembly,
    ChildFailed,
    ResponsesAssembly,
    TextAssembly,
    assembly,
    wholeable,
)


def sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def feed_all(body: bytes, cut: int) -> tuple[list[Any], bool]:
    events = Events()
    found: list[Any] = []
    for i in range(0, len(body), cut):
        if events.done:  # the relay reads no further
            break
        found += events.feed(body[i:i + cut])
    return found, events.done


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 64, 10_000])
def test_events_cut_anywhere(cut: int) -> None:
    body = b": ping\n\n" + sse({"a": 1}, {"b": "x\n\ny"}) + b"event: e\ndata: {\"c\": 3}\n\n"
    found, done = feed_all(body, cut)
    assert found[:2] == [{"a": 1}, {"b": "x\n\ny"}]
    assert done
    found, done = feed_all(body.replace(b"data: [DONE]\n\n", b""), cut)
    assert found == [{"a": 1}, {"b": "x\n\ny"}, {"c": 3}] and not done


def test_an_event_that_is_not_json_is_the_childs_failure() -> None:
    with pytest.raises(UpstreamError):
        Events().feed(b"data: {broken\n\n")


def test_events_of_a_long_answer_take_linear_time() -> None:
    """A long answer, fed in small pieces: the buffer holds one event at most, so the time
    grows with the answer, never with its square (a hang guard, not a measurement)."""
    piece = sse({"content": "word " * 4, "stop": False}, done=False)
    small, large = 2_000, 20_000

    def run(n: int) -> float:
        events, began = Events(), time.perf_counter()
        body = piece * n
        for i in range(0, len(body), 5):
            events.feed(body[i:i + 5])
        return time.perf_counter() - began

    run(small)
    assert run(large) < 40 * max(run(small), 1e-3)


def test_chat_deltas_make_the_message() -> None:
    chunk = {"created": 1, "id": "chatcmpl-x", "model": "m", "system_fingerprint": "b1",
             "object": "chat.completion.chunk"}
    stream = [
        {**chunk, "choices": [{"finish_reason": None, "index": 0,
                               "delta": {"role": "assistant", "content": None}}]},
        {**chunk, "choices": [{"finish_reason": None, "index": 0,
                               "delta": {"reasoning_content": "think"}}]},
        {**chunk, "choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hi"}}]},
        {**chunk, "choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "get", "arguments": "{\"a\""}}]}}]},
        {**chunk, "choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}}]},
        {**chunk, "choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}]},
        {**chunk, "choices": [], "usage": {"completion_tokens": 5}, "timings": {"x": 1}},
    ]
    whole = ChatAssembly()
    for event in stream:
        whole.event(event)
    assert whole.whole() == {
        "choices": [{"finish_reason": "tool_calls", "index": 0, "message": {
            "role": "assistant", "content": "Hi", "reasoning_content": "think",
            "tool_calls": [{"type": "function", "function": {"name": "get",
                                                             "arguments": "{\"a\": 1}"},
                            "id": "c1"}]}}],
        "created": 1, "model": "m", "system_fingerprint": "b1", "object": "chat.completion",
        "usage": {"completion_tokens": 5}, "id": "chatcmpl-x", "timings": {"x": 1}}


def test_a_stream_cut_before_its_last_event_is_no_answer() -> None:
    for made in (ChatAssembly(), TextAssembly("text"), TextAssembly("content"),
                 ResponsesAssembly()):
        made.event({"choices": [{"delta": {"content": "x"}, "finish_reason": None}],
                    "content": "x", "stop": False})
        assert made.whole() is None


def test_native_completion_says_it_was_not_streamed() -> None:
    made = TextAssembly("content")
    for text in ("a", "b"):
        made.event({"content": text, "stop": False, "tokens": [1]})
    made.event({"content": "", "stop": True, "tokens": [],
                "generation_settings": {"stream": True, "n_predict": 2}})
    assert made.whole() == {"content": "ab", "stop": True, "tokens": [],
                            "generation_settings": {"stream": False, "n_predict": 2}}


def test_responses_completed_in_the_unstreamed_shape() -> None:
    made = ResponsesAssembly()
    made.event({"type": "response.output_text.delta", "delta": "x"})
    made.event({"type": "response.completed", "response": {
        "id": "resp_1", "object": "response", "created_at": 7, "status": "completed",
        "model": "m", "usage": {"input_tokens": 1},
        "output": [{"id": "rs_1", "summary": [], "type": "reasoning", "content": [],
                    "encrypted_content": ""},
                   {"type": "message", "status": "completed", "id": "msg_1", "content": [],
                    "role": "assistant"}]}})
    whole = made.whole()
    assert whole is not None
    assert whole["completed_at"] == whole["created_at"] == 7
    assert whole["output"][0]["status"] == "completed"
    assert list(whole["output"][1]) == ["content", "id", "role", "status", "type"]


def test_the_childs_error_event_is_its_unstreamed_error() -> None:
    failed = ChildFailed({"code": 400, "message": "bad", "type": "invalid_request_error"})
    assert failed.status == 400
    assert json.loads(failed.body()) == {"error": {"code": 400, "message": "bad",
                                                   "type": "invalid_request_error"}}
    assert ChildFailed("odd").status == 500


@pytest.mark.parametrize(("path", "fields", "parsed", "expected"), [
    ("/v1/chat/completions", {"messages": []}, True, True),
    ("/chat/completions", {}, True, True),
    ("/v1/completions", {"prompt": "x"}, True, True),
    ("/completion", {"prompt": [1, 2, 3]}, True, True),
    ("/completions", {"prompt": "x", "n_probs": 0}, True, True),
    ("/v1/responses", {"input": "x"}, True, True),
    ("/v1/chat/completions", {}, False, False),  # scanned, not parsed: not read far enough
    ("/v1/messages", {}, True, False),
    ("/infill", {}, True, False),
    ("/v1/embeddings", {}, True, False),
    ("/v1/chat/completions", {"logprobs": True}, True, False),
    ("/v1/completions", {"logprobs": 2}, True, False),
    ("/completion", {"n_probs": 3}, True, False),
    ("/v1/chat/completions", {"n": 2}, True, False),
    ("/v1/chat/completions", {"n": 1}, True, True),
    ("/completion", {"prompt": ["a", "b"]}, True, False),
    ("/completion", {"return_tokens": True}, True, False),
    ("/completion", {"n_indent": 2}, True, False),
    ("/v1/completions", {"verbose": True}, True, False),
])
def test_which_requests_are_assembled(path: str, fields: dict[str, Any], parsed: bool,
                                      expected: bool) -> None:
    assert wholeable(path, fields, parsed) is expected


def test_an_assembly_per_path() -> None:
    assert isinstance(assembly("/v1/chat/completions"), ChatAssembly)
    assert isinstance(assembly("/v1/responses"), ResponsesAssembly)
    assert isinstance(assembly("/completion"), TextAssembly)
    assert isinstance(assembly("/v1/completions"), TextAssembly)
