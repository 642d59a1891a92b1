"""``keep_alive`` read once (router.edge.keepalive): Ollama's durations, numbers and their
signs; everything else refused with the field named; who may set it."""

from __future__ import annotations

import math

import pytest

from router.config.keyfile import FULL, KeyScope
from router.edge.keepalive import keep_alive_seconds, may_keep_alive
from router.errors import BadRequest
from router.http.jsonscan import COMPOUND


@pytest.mark.parametrize(("value", "seconds"), [
    (300, 300.0), (2.5, 2.5), (0, 0.0), ("0", 0.0), ("0s", 0.0), ("-1", math.inf),
    (-1, math.inf), (-0.5, math.inf), ("-1m", math.inf), ("5m", 300.0), ("1h30m", 5400.0),
    ("90s", 90.0), ("250ms", 0.25), ("1.5h", 5400.0), (" 10m ", 600.0), ("+2s", 2.0),
    ("1h1m1s", 3661.0), (".5s", 0.5), ("300", 300.0), (math.inf, math.inf),
    (1e300, 1e300), (None, None),
])
def test_durations_as_ollama_reads_them(value: object, seconds: float | None) -> None:
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", [
    True, False, "soon", "", "5 minutes", "5M", "m", "1d", "--1s", "1s-", "NaN", "inf",
    math.nan, [1], {"s": 1}, COMPOUND, "1" * 100, "1e3s", "0x10", "٣s",
])
def test_what_is_no_duration_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(BadRequest) as refused:
        keep_alive_seconds(value)
    assert "keep_alive" in refused.value.message
    assert len(refused.value.message) < 300  # a long value is named by its type only


def test_only_keys_that_may_load_and_unload_set_it() -> None:
    assert may_keep_alive(None) and may_keep_alive(FULL)
    assert may_keep_alive(KeyScope(frozenset({"admin"}), ("chat-*",)))
    assert not may_keep_alive(KeyScope(frozenset({"infer"})))
    assert not may_keep_alive(KeyScope(frozenset({"infer", "metrics"})))
