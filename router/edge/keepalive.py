"""A request's ``keep_alive``: Ollama's field, honoured in every JSON request body.

``keep_alive`` sets the idle TTL of the model that serves the request, from this request until
that model next stops (``Models.keep_alive``; ``/models`` shows it in the model's entry):

* a number of seconds (``300``), or a duration as Ollama writes it (``"5m"``, ``"1h30m"``,
  ``"90s"``, ``"250ms"``, ``"300"``): the TTL;
* a negative one (``-1``, ``"-1m"``): no idle TTL (the model still yields to ``--models-max``
  and the memory budgets, as any other);
* ``0``: unload the model once its requests are done, as ``POST /models/unload`` would (a
  ``pin`` or ``min-resident`` does not hold it);
* ``null`` or no field: the TTL in force stays.

It is honoured only from a key that may load and unload models (``role=admin``; every request
of a router without keys); from another key it is ignored, as Ollama's clients send it with
every request. A value that is no duration (``true``, ``"soon"``, NaN, an array) is refused
with a 400, whatever the key. The field is read from the body as the model's request policy
left it (a preset's ``strip = keep_alive`` ignores clients' values; ``force.keep_alive``
sets one), once, through ``RequestContext.fields``: a large body is read as a small one. It
stays in the body (llama-server ignores it; a peer serving the request applies it there).
"""

from __future__ import annotations

import math
import re

from ..config.keyfile import ADMIN, KeyScope
from ..errors import BadRequest
from ..http.jsonscan import COMPOUND

FIELD = "keep_alive"
# Ollama's durations are Go's (time.ParseDuration): one or more number-unit pairs, a sign
# first; a bare number is seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h))+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_MAX_TEXT = 64


def keep_alive_seconds(value: object) -> float | None:
    """The idle TTL a ``keep_alive`` value asks for, in seconds (``math.inf``: none; 0:
    unload once idle); None for ``null``. BadRequest for a value that is no duration."""
    if value is None:
        return None
    if isinstance(value, bool) or value is COMPOUND:
        raise _invalid(value)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= _MAX_TEXT:
        seconds = _parse_text(value.strip())
    else:
        raise _invalid(value)
    if math.isnan(seconds):
        raise _invalid(value)
    return math.inf if seconds < 0 else seconds


def _parse_text(text: str) -> float:
    if _NUMBER.fullmatch(text):
        return float(text)
    if not _DURATION.fullmatch(text):
        raise _invalid(text)
    sign = -1.0 if text.startswith("-") else 1.0
    return sign * sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))


def _invalid(value: object) -> BadRequest:
    shown = value if isinstance(value, str) and len(value) <= _MAX_TEXT else type(value).__name__
    return BadRequest(f"keep_alive must be a number of seconds or a duration such as \"5m\" "
                      f"(negative: keep loaded; 0: unload after this request), not {shown!r}")


def may_keep_alive(key_scope: KeyScope | None) -> bool:
    """Whether a request of a key with this scope may set a model's TTL: one that may load and
    unload models (None: full access, or a router without keys)."""
    return key_scope is None or ADMIN in key_scope.grants
