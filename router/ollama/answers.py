"""llama-server's answer as Ollama's, pure: an event stream (``text/event-stream``) turned
into NDJSON lines as it arrives (``Answer.feed``: each complete event, once, no buffering past
an unfinished event), a whole JSON body into Ollama's (``Answer.whole``), and an error into
Ollama's ``{"error": "..."}`` (``error_body``).

The last line (``done: true``) carries Ollama's final fields, from the child's ``timings``
(prompt and generated tokens and their milliseconds) and the router's clock (the whole request,
and the model's load when the request waited for one), all in nanoseconds. A tool call that
streams in pieces (OpenAI's deltas) goes out whole, in one line, when the child ends it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

NS = 1_000_000_000
DONE_REASONS = {"tool_calls": "stop", "function_call": "stop"}  # Ollama says stop for these


def now_iso() -> str:
    """The time as Ollama writes ``created_at``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error_body(message: str) -> bytes:
    """Ollama's error body."""
    return json.dumps({"error": message}, ensure_ascii=False).encode()


def error_message(body: bytes) -> str:
    """The message of an error body the router or a child answered (the OpenAI envelope,
    llama-server's, or any text)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:2000] or "error"
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict):
        error = error.get("message", error)
    return error if isinstance(error, str) else json.dumps(error)


def _arguments(text: str) -> Any:
    """A tool call's arguments as Ollama sends them: the object its JSON string holds."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"arguments": text}  # not JSON: kept, under a name
    return value if isinstance(value, dict) else {"value": value}


def ollama_calls(calls: Any) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments a JSON string) as Ollama's (arguments an object)."""
    out = []
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.append({"id": call.get("id") or f"call_{index}", "function": {
                "index": index, "name": function.get("name") or "",
                "arguments": _arguments(function.get("arguments") or "")}})
    return out


class Answer:
    """One Ollama answer made from llama-server's. ``kind``: the Ollama endpoint (``chat``,
    ``generate``, ``embed``, ``embeddings``); ``model``: the name the client gave;
    ``started``: ``perf_counter`` when the request arrived; ``load_s``: asked at the end,
    the seconds this request waited for its model's load (0 when it was serving)."""

    __slots__ = ("_calls", "_done", "_reason", "_rest", "_timings", "kind", "load_s", "model",
                 "started")

    def __init__(self, kind: str, model: str, started: float,
                 load_s: Callable[[], float]) -> None:
        self.kind = kind
        self.model = model
        self.started = started
        self.load_s = load_s
        self._rest = b""
        self._calls: dict[int, dict[str, str]] = {}
        self._reason = "stop"
        self._timings: dict[str, Any] = {}
        self._done = False

    # -- streaming ---------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        """The NDJSON lines for what this piece of the event stream completes."""
        data = self._rest + chunk if self._rest else chunk
        lines = []
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            line = self._event(data[start:end])
            if line:
                lines.append(line)
            start = end + 2
        self._rest = data[start:]
        return b"".join(lines)

    def end(self) -> bytes:
        """The last line, once (the stream ended without its ``[DONE]``, or with it)."""
        rest, self._rest = self._rest, b""
        out = self._event(rest) if rest.strip() else b""
        return out + (b"" if self._done else self._final())

    def _event(self, event: bytes) -> bytes:
        for line in event.splitlines():
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return b"" if self._done else self._final()
                return self._chunk(payload)
            if line.startswith(b"error:"):
                return error_body(error_message(line[6:].strip())) + b"\n"
        return b""

    def _chunk(self, payload: bytes) -> bytes:
        try:
            chunk = json.loads(payload)
        except ValueError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk:
            self._done = True
            return error_body(error_message(payload)) + b"\n"
        if isinstance(chunk.get("timings"), dict):
            self._timings = chunk["timings"]
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        if choice.get("finish_reason"):
            self._reason = choice["finish_reason"]
        delta = choice.get("delta") or {}
        text = choice.get("text") if "text" in choice else delta.get("content")
        thinking = delta.get("reasoning_content")
        for call in delta.get("tool_calls") or ():
            self._add_call(call)
        out = b""
        if text or thinking or "role" in delta:  # the first event too, as soon as it comes
            out = self._line(text or "", thinking or "")
        if choice.get("finish_reason") and self._calls:
            out += self._line("", "", [self._calls[i] for i in sorted(self._calls)])
            self._calls.clear()
        return out

    def _add_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._calls))
        call = self._calls.setdefault(index if isinstance(index, int) else 0,
                                      {"id": "", "name": "", "arguments": ""})
        function = delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["name"] += function.get("name") or ""
        call["arguments"] += function.get("arguments") or ""

    def _line(self, text: str, thinking: str,
              calls: list[dict[str, str]] | None = None) -> bytes:
        line: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = ollama_calls([
                    {"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls])
            line["message"] = message
        else:
            line["response"] = text
            if thinking:
                line["thinking"] = thinking
        line["done"] = False
        return json.dumps(line, ensure_ascii=False).encode() + b"\n"

    def _final(self) -> bytes:
        self._done = True
        line: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.kind == "chat":
            line["message"] = {"role": "assistant", "content": ""}
        else:
            line["response"] = ""
        line.update(done=True, **self.stats(self._reason, self._timings))
        return json.dumps(line, ensure_ascii=False).encode() + b"\n"

    # -- whole -------------------------------------------------------------------------------

    def stats(self, reason: str, timings: dict[str, Any]) -> dict[str, Any]:
        """Ollama's final fields, from the child's ``timings`` and the router's clock."""
        def ms(name: str) -> int:
            value = timings.get(name)
            return int(value * 1_000_000) if isinstance(value, (int, float)) and value > 0 \
                else 0

        def count(name: str) -> int:
            value = timings.get(name)
            return value if isinstance(value, int) and value > 0 else 0

        return {"done_reason": DONE_REASONS.get(reason, reason),
                "total_duration": int((time.perf_counter() - self.started) * NS),
                "load_duration": int(self.load_s() * NS),
                "prompt_eval_count": count("prompt_n") + count("cache_n"),
                "prompt_eval_duration": ms("prompt_ms"),
                "eval_count": count("predicted_n"), "eval_duration": ms("predicted_ms")}

    def whole(self, body: bytes) -> bytes:
        """Ollama's JSON for llama-server's whole JSON answer."""
        answer = json.loads(body)
        if self.kind in ("embed", "embeddings"):
            return json.dumps(self._embeddings(answer)).encode()
        choice = (answer.get("choices") or [{}])[0]
        timings = answer.get("timings") if isinstance(answer.get("timings"), dict) else {}
        usage = answer.get("usage") or {}
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.kind == "chat":
            message = choice.get("message") or {}
            reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("reasoning_content"):
                reply["thinking"] = message["reasoning_content"]
            if message.get("tool_calls"):
                reply["tool_calls"] = ollama_calls(message["tool_calls"])
            out["message"] = reply
        else:
            message = choice.get("message") or {}
            out["response"] = choice.get("text") if "text" in choice \
                else message.get("content") or ""
            if message.get("reasoning_content"):
                out["thinking"] = message["reasoning_content"]
        out["done"] = True
        out.update(self.stats(choice.get("finish_reason") or "stop", timings or {
            "prompt_n": usage.get("prompt_tokens"), "predicted_n":
            usage.get("completion_tokens")}))
        return json.dumps(out, ensure_ascii=False).encode()

    def _embeddings(self, answer: dict[str, Any]) -> dict[str, Any]:
        data = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
        vectors = [d.get("embedding") for d in data]
        if self.kind == "embeddings":
            return {"embedding": vectors[0] if vectors else []}
        prompt = (answer.get("usage") or {}).get("prompt_tokens", 0)
        return {"model": self.model, "embeddings": vectors,
                "total_duration": int((time.perf_counter() - self.started) * NS),
                "load_duration": int(self.load_s() * NS), "prompt_eval_count": prompt}
