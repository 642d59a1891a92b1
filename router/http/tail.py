"""What the end of a response body says, read once per request.

The router keeps a response's last two body chunks (``requests.RequestContext.sent``: a
stream's last event, then ``data: [DONE]``), at most ``TAIL_BYTES`` of each, and reads two
things from them, each at most once and only when asked (``ResponseTail``):

* ``timings``: what llama-server reports at the end of every completion (``"timings"``: the
  prompt tokens it computed, ``prompt_n``, in ``prompt_ms``; those it took from its cache,
  ``cache_n``; the tokens it generated, ``predicted_n``, in ``predicted_ms``), which a replica's
  ``pace`` learns from;
* ``tokens``: the number of tokens generated, for the metrics and the activity record:
  llama-server's ``predicted_n`` wins over the usage fields of the OpenAI
  (``completion_tokens``), Anthropic and Responses (``output_tokens``) shapes and of
  ``/completion`` (``tokens_predicted``);
* ``prompt_tokens``: the prompt's tokens as the client was told them (``prompt_tokens``,
  ``input_tokens``, ``tokens_evaluated``), else the timings' ``prompt_n`` and ``cache_n``
  together, for the teams' usage.

Whole bodies are never buffered or parsed. What they say is the upstream's word, clamped:
a token count to ``0..MAX_TOKENS``, a duration to ``0..MAX_MS`` (an upstream that reports more
tokens than SQLite's 64-bit integers hold must not break the teams' usage, nor a number of
5,000 digits a request).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_BYTES = 4096  # of each of the last two body chunks: a stream's last event, then [DONE]
MAX_TOKENS = 2**31 - 1  # a token count read here is at most this (no context holds more)
MAX_MS = float(2**31 - 1)  # a duration read here, in ms (24 days), at most this

_TIMINGS = re.compile(rb'"timings"\s*:\s*\{([^{}]*)\}')
_FIELD = re.compile(rb'"(prompt_n|prompt_ms|cache_n|predicted_n|predicted_ms)"\s*:\s*'
                    rb'(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)')


@dataclass(frozen=True, slots=True)
class Timings:
    prompt_n: int = 0  # prompt tokens computed
    prompt_ms: float = 0.0
    cache_n: int = 0  # prompt tokens taken from the cache
    predicted_n: int = 0  # tokens generated
    predicted_ms: float = 0.0


def parse_timings(tail: bytes) -> Timings | None:
    """The last ``"timings"`` object in ``tail`` (the end of a response body or stream); None
    when there is none. Fields missing or malformed count as 0."""
    found = list(_TIMINGS.finditer(tail))
    if not found:
        return None
    values: dict[str, float] = {}
    for match in _FIELD.finditer(found[-1].group(1)):
        name = match.group(1).decode()
        bound = MAX_MS if name.endswith("_ms") else MAX_TOKENS
        values[name] = min(max(float(match.group(2)), 0.0), bound)  # inf: the bound
    return Timings(int(values.get("prompt_n", 0)), values.get("prompt_ms", 0.0),
                   int(values.get("cache_n", 0)), int(values.get("predicted_n", 0)),
                   values.get("predicted_ms", 0.0))


def _count(digits: bytes) -> int:
    """A token count as the upstream wrote it (decimal digits), at most ``MAX_TOKENS``
    (never parsed past that: ``int`` refuses 4,300 digits and more)."""
    return MAX_TOKENS if len(digits) > 10 else min(int(digits), MAX_TOKENS)


_TOKENS = re.compile(
    rb'"(predicted_n|completion_tokens|output_tokens|tokens_predicted)"\s*:\s*(\d+)')


def generated_tokens(tail: bytes) -> int | None:
    """The number of tokens generated, from the end of a response body (a stream's last events
    or a JSON body's last bytes); None when it says nothing about generated tokens."""
    predicted: int | None = None
    usage: int | None = None
    for match in _TOKENS.finditer(tail[-TAIL_BYTES:]):
        if match.group(1) == b"predicted_n":
            predicted = _count(match.group(2))
        else:
            usage = _count(match.group(2))
    return predicted if predicted is not None else usage


_PROMPT = re.compile(rb'"(prompt_tokens|input_tokens|tokens_evaluated)"\s*:\s*(\d+)')


def prompt_tokens(tail: bytes, timings: Timings | None) -> int | None:
    """The prompt's tokens as the end of a response body tells them; None when it does not."""
    found = None
    for match in _PROMPT.finditer(tail[-TAIL_BYTES:]):
        found = _count(match.group(2))
    if found is None and timings is not None:
        return min(timings.prompt_n + timings.cache_n, MAX_TOKENS)
    return found


class ResponseTail:
    """The end of one response (its last two chunks, ``TAIL_BYTES`` of each), read lazily:
    each of ``timings``, ``tokens`` and ``prompt_tokens`` is parsed at most once, when first
    asked (the teams' usage, the metrics and the server span read the same)."""

    __slots__ = ("_prompt", "_timings", "_tokens", "bytes")

    def __init__(self, before: bytes, last: bytes) -> None:
        self.bytes = before[-TAIL_BYTES:] + last[-TAIL_BYTES:] if last else b""
        self._timings: Timings | object | None = _UNREAD
        self._tokens: int | object | None = _UNREAD
        self._prompt: int | object | None = _UNREAD

    @property
    def timings(self) -> Timings | None:
        if self._timings is _UNREAD:
            self._timings = parse_timings(self.bytes) if self.bytes else None
        return self._timings  # type: ignore[return-value]

    @property
    def prompt_tokens(self) -> int | None:
        if self._prompt is _UNREAD:
            self._prompt = prompt_tokens(self.bytes, self.timings) if self.bytes else None
        return self._prompt  # type: ignore[return-value]

    @property
    def tokens(self) -> int | None:
        if self._tokens is _UNREAD:
            self._tokens = generated_tokens(self.bytes) if self.bytes else None
        return self._tokens  # type: ignore[return-value]


_UNREAD = object()  # not parsed yet
