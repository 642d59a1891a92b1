"""An Ollama request as the llama-server request it means, pure: ``translate`` reads the
Ollama body once (its types and values checked, every refusal a ``BadRequest`` naming the
field) and returns an ``Ask``: the llama-server path and JSON body to send down the router's
request path, whether the answer streams, and the load or unload idiom of a request with no
prompt.

What maps to what (Ollama → llama-server):

* ``/api/chat`` ``messages`` (``images``, ``tool_calls``, ``tool_name``) →
  ``/v1/chat/completions`` ``messages`` (image parts, OpenAI tool calls);
* ``/api/generate`` ``prompt``, ``system``, ``images`` → ``/v1/chat/completions``, a system
  and a user message; with ``raw: true`` → ``/v1/completions``, the prompt as given;
* ``/api/embed`` ``input``, ``/api/embeddings`` ``prompt`` → ``/v1/embeddings`` ``input``;
* ``options`` (``OPTIONS``; ``num_predict`` → ``max_tokens``) → the sampling fields;
* ``format``: ``"json"`` or a JSON schema → ``response_format`` ``json_object`` or
  ``json_schema`` (grammar-constrained by the child);
* ``think`` → ``chat_template_kwargs.enable_thinking`` (a level: ``reasoning_effort``);
* ``tools`` → ``tools`` (the same shape); ``keep_alive`` → kept in the body (the request
  path reads it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config.durations import keep_alive_seconds
from ..errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
LATEST = ":latest"  # the tag Ollama clients add to a name that has none
MAX_INT = 2**31 - 1  # an integer option's bound (llama-server reads them as 32-bit)
MAX_SEED = 2**32 - 1  # llama-server's seed is a 32-bit unsigned number (-1: random)
LEVELS = ("low", "medium", "high")  # ``think`` as a level (gpt-oss)


@dataclass(frozen=True, slots=True)
class Ask:
    """What an Ollama request asks: the llama-server ``path`` and ``body``, whether the
    answer ``stream``s (NDJSON), and ``idiom``: ``"load"`` or ``"unload"`` for a chat or
    generate request with no prompt (Ollama's way to load a model, or with ``keep_alive``
    0, to unload it), else None."""

    kind: str
    model: str
    path: str
    body: dict[str, Any]
    stream: bool
    idiom: str | None = None


def _number(name: str, value: Any, low: float, high: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise BadRequest(f"option {name} must be a finite number, not {_shown(value)}")
    if not low <= value <= high:
        raise BadRequest(f"option {name} must be between {low:g} and {high:g}, "
                         f"not {_shown(value)}")
    return float(value)


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if type(value) is float and value.is_integer():
        value = int(value)  # 40.0 is 40, as Go's JSON decoder reads it
    if type(value) is not int:
        raise BadRequest(f"option {name} must be a whole number, not {_shown(value)}")
    if not low <= value <= high:
        raise BadRequest(f"option {name} must be between {low} and {high}, not {value}")
    return value


def _stops(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value) \
            or len(value) > 64:
        raise BadRequest(f"option {name} must be a list of at most 64 strings")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


# Ollama's option → (llama-server's field, how the value is checked). Load-time options
# (num_gpu, num_thread, num_batch, use_mmap, ...) are the preset's business: ignored here.
OPTIONS: Mapping[str, tuple[str, Callable[[str, Any], Any]]] = {
    "temperature": ("temperature", lambda n, v: _number(n, v, 0, 100)),
    "top_p": ("top_p", lambda n, v: _number(n, v, 0, 1)),
    "min_p": ("min_p", lambda n, v: _number(n, v, 0, 1)),
    "typical_p": ("typical_p", lambda n, v: _number(n, v, 0, 1)),
    "top_k": ("top_k", lambda n, v: _integer(n, v, 0, MAX_INT)),
    "repeat_penalty": ("repeat_penalty", lambda n, v: _number(n, v, 0, 100)),
    "repeat_last_n": ("repeat_last_n", lambda n, v: _integer(n, v, -1, MAX_INT)),
    "presence_penalty": ("presence_penalty", lambda n, v: _number(n, v, -100, 100)),
    "frequency_penalty": ("frequency_penalty", lambda n, v: _number(n, v, -100, 100)),
    "seed": ("seed", lambda n, v: _integer(n, v, -1, MAX_SEED)),
    "num_predict": ("max_tokens", lambda n, v: _integer(n, v, -2, MAX_INT)),
    "stop": ("stop", _stops),
    "mirostat": ("mirostat", lambda n, v: _integer(n, v, 0, 2)),
    "mirostat_tau": ("mirostat_tau", lambda n, v: _number(n, v, 0, 100)),
    "mirostat_eta": ("mirostat_eta", lambda n, v: _number(n, v, 0, 100)),
}


def _options(body: Mapping[str, Any], context: int | None) -> dict[str, Any]:
    """The llama-server fields of ``options``; ``num_ctx`` is checked against the model's
    context (``context``: its preset's, None when unknown) and never sent: a child's
    context is fixed when it starts."""
    options = body.get("options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise BadRequest('"options" must be an object')
    fields: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "num_ctx":
            wanted = _integer(name, value, 1, MAX_INT)
            if context is not None and wanted > context:
                raise BadRequest(
                    f"option num_ctx {wanted} exceeds the model's context of {context} "
                    "tokens (its preset's ctx-size): the router does not resize a model's "
                    "context per request; ask for at most that, or raise ctx-size")
            continue
        known = OPTIONS.get(name)
        if known is None:
            continue
        field, check = known
        checked = check(name, value)
        if field == "max_tokens" and checked < 0:
            continue  # -1: until the model stops, -2: until the context fills
        fields[field] = checked
    return fields


def _format(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value,
                                                       "strict": True}}
    raise BadRequest('"format" must be "json" or a JSON schema object')


def _think(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"chat_template_kwargs": {"enable_thinking": value}}
    if value in LEVELS:
        return {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": value},
                "reasoning_effort": value}
    raise BadRequest('"think" must be true, false, "low", "medium" or "high"')


def _images(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, str) and i for i in value):
        raise BadRequest('"images" must be a list of base64-encoded images')
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}
            for image in value]


def _content(text: Any, images: Any, where: str) -> Any:
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise BadRequest(f'"{where}" must be a string')
    parts = _images(images)
    if not parts:
        return text
    return [*parts, *([{"type": "text", "text": text}] if text else [])]


def _tool_calls(value: Any) -> list[dict[str, Any]]:
    """A message's Ollama tool calls (``{"function": {"name", "arguments": {...}}}``) as
    OpenAI's (their arguments a JSON string, each with an id)."""
    if not isinstance(value, list):
        raise BadRequest('"tool_calls" must be a list')
    calls = []
    for index, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest('each of "tool_calls" must be {"function": {"name": ..., '
                             '"arguments": {...}}}')
        arguments = function.get("arguments", {})
        calls.append({"id": call.get("id") or f"call_{index}", "type": "function",
                      "function": {"name": function["name"],
                                   "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    return calls


ROLES = frozenset({"system", "user", "assistant", "tool"})


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise BadRequest('each message must be an object with a "role" of system, user, '
                         "assistant or tool")
    out: dict[str, Any] = {"role": message["role"],
                           "content": _content(message.get("content"), message.get("images"),
                                               "content")}
    if message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"])
    thinking = message.get("thinking")
    if isinstance(thinking, str) and thinking:
        out["reasoning_content"] = thinking
    for name in ("tool_call_id", "tool_name"):
        if isinstance(message.get(name), str):
            out["tool_call_id" if name == "tool_call_id" else "name"] = message[name]
    return out


def _common(body: Mapping[str, Any], context: int | None) -> dict[str, Any]:
    """What chat and generate share: sampling options, format, think, keep_alive."""
    fields = _options(body, context)
    response_format = _format(body.get("format"))
    if response_format is not None:
        fields["response_format"] = response_format
    fields.update(_think(body.get("think")))
    if "keep_alive" in body:
        fields["keep_alive"] = _keep_alive(body["keep_alive"])
    return fields


def _keep_alive(value: Any) -> Any:
    """The value as the client sent it, once read as a duration (``config.durations``: a
    value that is no duration is refused here, in Ollama's shape); the edge applies it."""
    keep_alive_seconds(value)
    return value


def unloads(keep_alive: Any) -> bool:
    """Whether ``keep_alive`` is zero (``0``, ``"0"``, ``"0s"``, ...): unload now."""
    return keep_alive_seconds(keep_alive) == 0


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", True)
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise BadRequest('"stream" must be true or false')
    return stream


def model_of(body: Mapping[str, Any]) -> str:
    """The model an Ollama body names (``model``, or the older ``name``)."""
    model = body.get("model", body.get("name"))
    if not isinstance(model, str) or not model.strip():
        raise BadRequest('"model" is required: a model name (GET /api/tags lists them)')
    return model.strip()


def _tools(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRequest('"tools" must be a list of tool objects')
    return value


def chat(body: Mapping[str, Any], context: int | None = None) -> Ask:
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise BadRequest('"messages" must be a list')
    model, stream = model_of(body), _stream(body)
    fields = _common(body, context)
    if not messages:
        return Ask("chat", model, CHAT, fields, stream, _idiom(fields))
    out = {"model": model, "messages": [_message(m) for m in messages], "stream": stream,
           **fields}
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    return Ask("chat", model, CHAT, out, stream)


def generate(body: Mapping[str, Any], context: int | None = None) -> Ask:
    model, stream = model_of(body), _stream(body)
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw", False)
    for name, value in (("prompt", prompt), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise BadRequest(f'"{name}" must be a string')
    if not isinstance(raw, bool):
        raise BadRequest('"raw" must be true or false')
    for unsupported in ("suffix", "template"):
        if body.get(unsupported):
            raise BadRequest(f'"{unsupported}" is not supported by this server: the model\'s '
                             "own chat template applies (raw: true sends the prompt as it is)")
    fields = _common(body, context)
    if not prompt and not body.get("images"):
        return Ask("generate", model, CHAT, fields, stream, _idiom(fields))
    if raw:
        if body.get("images"):
            raise BadRequest('"images" cannot be sent with "raw": true')
        out = {"model": model, "prompt": prompt, "stream": stream, **fields}
        return Ask("generate", model, COMPLETIONS, out, stream)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": _content(prompt, body.get("images"),
                                                         "prompt")})
    return Ask("generate", model, CHAT,
               {"model": model, "messages": messages, "stream": stream, **fields}, stream)


def _idiom(fields: Mapping[str, Any]) -> str:
    return "unload" if unloads(fields.get("keep_alive")) else "load"


def embed(body: Mapping[str, Any], legacy: bool = False) -> Ask:
    """``/api/embed`` (``input``: a string or a list of them), or with ``legacy`` the older
    ``/api/embeddings`` (``prompt``: one string)."""
    model = model_of(body)
    value = body.get("prompt" if legacy else "input")
    if isinstance(value, str):
        inputs: list[str] = [value]
    elif not legacy and isinstance(value, list) and value and all(
            isinstance(i, str) for i in value):
        inputs = value
    else:
        raise BadRequest('"prompt" must be a string' if legacy else
                         '"input" must be a string or a non-empty list of strings')
    out: dict[str, Any] = {"model": model, "input": inputs[0] if legacy else inputs}
    if "keep_alive" in body:
        out["keep_alive"] = _keep_alive(body["keep_alive"])
    if body.get("truncate") is False:
        out["truncate"] = False
    return Ask("embeddings" if legacy else "embed", model, EMBEDDINGS, out, False)


def without_latest(name: str, known: Callable[[str], bool]) -> str:
    """``name`` without Ollama's ``:latest`` tag when only that makes it unknown."""
    if name.endswith(LATEST) and not known(name):
        return name[:-len(LATEST)]
    return name
