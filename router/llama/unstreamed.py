"""llama-server's streamed answer made into the one whole answer it would have sent unstreamed.

A request that may be taken back (``edge/metering``: a lower class, not streamed by its
client) is asked of the child as a stream, whatever its client asked: llama-server looks at a
streamed request's connection at every token, at an unstreamed one's about once a second, so a
take-back stops the child within a token. Its client, which asked for no stream, gets the
answer assembled here from the events, equal field by field to the one llama-server builds
unstreamed (b11434, ``tools/server/server-task.cpp``), except the values that differ between
any two runs (ids, times, ``timings``):

* chat completions (``/v1/chat/completions``, ``/chat/completions``): the message from the
  deltas, accumulated as llama.cpp's own tests accumulate them against the final parse
  (``tests/test-chat.cpp``: content and reasoning appended, a tool call's id and name replaced,
  its arguments appended); ``finish_reason`` from the last choice; ``usage`` and ``timings``
  from the last event (asked for with ``stream_options.include_usage``);
* completions (``/v1/completions``): the last event is the whole answer but its text, which
  the events before it carry;
* llama.cpp's completion (``/completion``, ``/completions``): the same, with its ``content``;
  its ``generation_settings.stream`` says false again;
* responses (``/v1/responses``, ``/responses``): the ``response.completed`` event's response,
  with the two fields only the unstreamed one has (``completed_at``, a reasoning item's
  ``status``).

Not here (the request stays unstreamed, taken back within a second as before): Anthropic
messages (``/v1/messages``: a first token that is not a whole UTF-8 character leaves its
stream without ``message_start``, so its usage cannot be rebuilt for sure), ``/infill`` (no
model of the tests has its tokens, so no test proves it), and any request whose streamed events
carry what the unstreamed answer gives otherwise or not at all (``wholeable``): token
probabilities, several choices or prompts, raw token ids, ``n_indent`` (which cuts text it
already streamed), ``verbose``. A body the router did not parse (multipart, or scanned when
large) is not read far enough to tell, and stays unstreamed too.

Known difference: a generation cut by its token limit in the middle of a UTF-8 character ends
unstreamed with a replacement character (llama-server sends the broken bytes, its JSON writer
replaces them); streamed, those bytes are never sent.

Pure: no I/O. The relay (``http/wholeanswer``) feeds the events and sends the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
OAI_COMPLETION_PATHS = frozenset({"/v1/completions"})
NATIVE_PATHS = frozenset({"/completion", "/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
WHOLE_PATHS = CHAT_PATHS | OAI_COMPLETION_PATHS | NATIVE_PATHS | RESPONSES_PATHS
# Fields whose streamed events differ from the unstreamed answer (see the module docstring):
# present with any value but these, the request is not assembled.
_UNSAFE = ("n_probs", "logprobs", "top_logprobs", "return_tokens", "n_indent", "verbose")
_OFF = (None, False, 0)
# The fields the child gets on top of the client's, as JSON (the last key wins there).
STREAM = b"true"
INCLUDE_USAGE = b'{"include_usage":true}'


class ChildFailed(Exception):
    """The stream ended with llama-server's error event: unstreamed, the same error would have
    been the answer, with its ``code`` as the status."""

    def __init__(self, error: Any) -> None:
        super().__init__(str(error))
        self.error = error
        code = error.get("code") if isinstance(error, dict) else None
        self.status = code if type(code) is int and 400 <= code <= 599 else 500

    def body(self) -> bytes:
        return dumps({"error": self.error})


def wholeable(path: str, fields: Mapping[str, Any], parsed: bool) -> bool:
    """Whether a request to ``path`` with these top-level ``fields`` (its one reading;
    ``parsed``: the whole body was parsed, not scanned) may be asked of the child as a stream
    and its answer assembled here, equal to the unstreamed one."""
    if not parsed or path not in WHOLE_PATHS:
        return False
    if any(fields.get(name) not in _OFF for name in _UNSAFE):
        return False
    for name in ("n", "n_cmpl"):
        if fields.get(name) not in (None, 1):
            return False
    prompt = fields.get("prompt")
    return not isinstance(prompt, list) or all(type(token) is int for token in prompt)


def assembly(path: str) -> Assembly:
    """A new assembly for an answer of ``path`` (one of ``WHOLE_PATHS``)."""
    if path in CHAT_PATHS:
        return ChatAssembly()
    if path in OAI_COMPLETION_PATHS:
        return TextAssembly("text")
    if path in NATIVE_PATHS:
        return TextAssembly("content")
    return ResponsesAssembly()


def dumps(answer: Any) -> bytes:
    """JSON as llama-server writes it: compact, UTF-8 as is."""
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()


class Assembly:
    """One answer being assembled: ``event`` takes each event's data (a JSON text), ``whole``
    gives the answer once the stream has ended. Memory: what the answer holds, its pieces
    joined once at the end."""

    def event(self, data: Any) -> None:
        raise NotImplementedError

    def whole(self) -> dict[str, Any] | None:
        """The whole answer, or None when the stream ended before its last event."""
        raise NotImplementedError


class TextAssembly(Assembly):
    """``/v1/completions`` (``field``: ``text``, in its one choice) and llama.cpp's own
    ``/completion`` (``content``): the last event is the unstreamed answer, its text empty."""

    def __init__(self, field: str) -> None:
        self._field = field
        self._pieces: list[str] = []
        self._last: dict[str, Any] | None = None

    def event(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        holder = data
        if self._field == "text":
            choices = data.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                return
            holder = choices[0]
            ended = holder.get("finish_reason") is not None
        else:
            ended = data.get("stop") is True
        piece = holder.get(self._field)
        if isinstance(piece, str) and piece:
            self._pieces.append(piece)
        if ended:
            self._last = data

    def whole(self) -> dict[str, Any] | None:
        last = self._last
        if last is None:
            return None
        text = "".join(self._pieces)
        if self._field == "text":
            last["choices"][0]["text"] = text
        else:
            last["content"] = text
            settings = last.get("generation_settings")
            if isinstance(settings, dict) and "stream" in settings:
                settings["stream"] = False  # the child was asked for a stream, the client not
        return last


class ChatAssembly(Assembly):
    """A chat completion: the message from its deltas (see the module docstring)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict[str, Any]] = []  # id, name, argument pieces
        self._choice: dict[str, Any] | None = None  # the last choice: finish_reason, index
        self._last: dict[str, Any] | None = None  # the last event (usage, timings)

    def event(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        choices = data.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    self._choose(choice)
        self._last = data

    def _choose(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._delta(delta)
        if choice.get("finish_reason") is not None:
            self._choice = choice

    def _delta(self, delta: dict[str, Any]) -> None:
        content = delta.get("content")
        if isinstance(content, str):
            self._content.append(content)
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str):
            self._reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict) or type(call.get("index")) is not int:
                continue
            while len(self._calls) <= call["index"]:
                self._calls.append({"id": "", "name": "", "arguments": []})
            held = self._calls[call["index"]]
            if call.get("id"):
                held["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                held["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                held["arguments"].append(function["arguments"])

    def whole(self) -> dict[str, Any] | None:
        last, choice = self._last, self._choice
        if last is None or choice is None:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        reasoning = "".join(self._reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self._calls:
            message["tool_calls"] = [_tool_call(call) for call in self._calls]
        answer: dict[str, Any] = {
            "choices": [{"finish_reason": choice["finish_reason"],
                         "index": choice.get("index", 0), "message": message}],
            "created": last.get("created"), "model": last.get("model"),
            "system_fingerprint": last.get("system_fingerprint"),
            "object": "chat.completion"}
        for name in ("usage", "id", "timings"):
            if name in last:
                answer[name] = last[name]
        return answer


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as the unstreamed message writes it (``common_chat_msg::
    to_json_oaicompat``): its id only when it has one."""
    made: dict[str, Any] = {"type": "function", "function": {
        "name": call["name"], "arguments": "".join(call["arguments"])}}
    if call["id"]:
        made["id"] = call["id"]
    return made


class ResponsesAssembly(Assembly):
    """A response of the Responses API: the ``response.completed`` event's response, in the
    unstreamed one's shape (``to_json_oaicompat_resp``)."""

    def __init__(self) -> None:
        self._response: dict[str, Any] | None = None

    def event(self, data: Any) -> None:
        if isinstance(data, dict) and data.get("type") == "response.completed" \
                and isinstance(data.get("response"), dict):
            self._response = data["response"]

    def whole(self) -> dict[str, Any] | None:
        got = self._response
        if got is None:
            return None
        output = [_output_item(item) for item in got.get("output") or ()]
        created = got.get("created_at")
        return {"completed_at": created, "created_at": created, "id": got.get("id"),
                "model": got.get("model"), "object": "response", "output": output,
                "status": got.get("status", "completed"), "usage": got.get("usage")}


_ITEM_ORDER = {"message": ("content", "id", "role", "status", "type"),
               "reasoning": ("id", "summary", "type", "content", "encrypted_content", "status")}


def _output_item(item: Any) -> Any:
    """An output item as the unstreamed response writes it: a reasoning item has its
    ``status``, the keys in its order."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type")
    if kind == "reasoning":
        item = {**item, "status": "completed"}
    order = _ITEM_ORDER.get(kind) if isinstance(kind, str) else None
    if order is None or set(item) != set(order):
        return item
    return {name: item[name] for name in order}
