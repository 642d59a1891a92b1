"""File descriptors (router.host.fdlimit): the soft limit raised, client connections capped."""

from __future__ import annotations

import resource

import pytest

from router.host import fdlimit
from router.host.fdlimit import FDS_PER_MODEL, RESERVED_FDS, connection_cap, raise_soft_limit


def test_the_cap_leaves_room_for_the_router_and_its_children() -> None:
    assert connection_cap(1024, 4) == (1024 - RESERVED_FDS - 4 * FDS_PER_MODEL) // 2
    assert connection_cap(256, 4) == 48
    assert connection_cap(1024, 0) == connection_cap(1024, 8)  # no model limit: counted as 8
    assert connection_cap(100, 50) == 8  # never below a few connections


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit",
                        lambda which, value: limits.__setitem__("now", value))
    assert raise_soft_limit() == 4096 and limits["now"] == (4096, 4096)
    limits["now"] = (1024, resource.RLIM_INFINITY)
    assert raise_soft_limit() == fdlimit.MOST_FDS


def test_a_limit_that_cannot_be_raised_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(which: int, value: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert raise_soft_limit() == 256
