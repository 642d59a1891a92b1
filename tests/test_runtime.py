"""How many slots, HTTP threads and proxied connections a child gets from its preset."""

from __future__ import annotations

import pytest

from router.config.presets import DEFAULT_SLOTS, slots_of
from router.core.runtime import (
    MIN_HTTP_THREADS,
    RESERVED_HTTP_THREADS,
    http_threads,
)


@pytest.mark.parametrize(("args", "expected"), [
    ({}, DEFAULT_SLOTS), ({"parallel": "-1"}, DEFAULT_SLOTS), ({"parallel": "2"}, 2),
    ({"parallel": "x"}, DEFAULT_SLOTS)])
def test_slots(args: dict[str, str], expected: int) -> None:
    assert slots_of(args) == expected


def test_http_threads_default_leaves_room_for_every_slot() -> None:
    assert http_threads({}) == MIN_HTTP_THREADS
    assert http_threads({"parallel": "64"}) == 68  # llama-server's own rule: slots + 4
    assert http_threads({"parallel": "64"}) - RESERVED_HTTP_THREADS > 64


def test_http_threads_from_the_preset() -> None:
    assert http_threads({"threads-http": "3", "parallel": "64"}) == 3
    assert http_threads({"threads-http": "-1"}) == MIN_HTTP_THREADS
