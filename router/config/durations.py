"""A request's ``keep_alive`` read as a duration (configuration-level: the edge applies it,
``edge.keepalive``; Ollama's translation reads it, ``ollama.translate``): one reader of it.

Ollama's durations are Go's (``time.ParseDuration``): one or more number-unit pairs (``ns``,
``us``, ``ms``, ``s``, ``m``, ``h``), a sign first; a bare number (JSON or in a string) is
seconds. Negative: no idle TTL (``math.inf``); ``0``: unload once idle.
"""

from __future__ import annotations

import math
import re

from ..errors import BadRequest

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
    unload once idle); None for ``null``. BadRequest for a value that is no duration (an
    array or object of a large body, read as ``jsonscan.COMPOUND``, is no duration either)."""
    if value is None:
        return None
    if isinstance(value, bool):
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
