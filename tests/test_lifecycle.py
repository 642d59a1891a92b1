"""The model lifecycle's transition table (router.lifecycle): every status x event pair."""

from __future__ import annotations

import itertools

import pytest

from router.lifecycle import TRANSITIONS, Event, InvalidTransition, transition
from router.scheduler import Status

U, D, L, OK, S = (Status.UNLOADED, Status.DOWNLOADING, Status.LOADING, Status.LOADED,
                  Status.STOPPING)
EXPECTED = {
    (U, Event.DOWNLOAD): D,
    (D, Event.DOWNLOADED): U,
    (D, Event.DOWNLOAD_FAILED): U,
    (U, Event.ADMITTED): L,
    (L, Event.READY): OK,
    (L, Event.LOAD_FAILED): U,
    (OK, Event.STOP): S,
    (S, Event.STOPPED): U,
    (OK, Event.LAST_REPLICA_EXITED): U,
}


@pytest.mark.parametrize(("status", "event"), list(itertools.product(Status, Event)),
                         ids=lambda v: v.value)
def test_every_status_and_event(status: Status, event: Event) -> None:
    if (status, event) in EXPECTED:
        assert transition("m", status, event) is EXPECTED[(status, event)]
    else:
        with pytest.raises(InvalidTransition) as raised:
            transition("m", status, event)
        assert str(raised.value) == f"model 'm': {event.value} cannot happen while {status.value}"


def test_the_table_is_exactly_the_documented_one() -> None:
    assert TRANSITIONS == EXPECTED


def reachable_from(start: Status) -> set[Status]:
    """Every status some sequence of events leads to from ``start`` (itself included)."""
    seen, stack = {start}, [start]
    while stack:
        here = stack.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is here and dst not in seen:
                seen.add(dst)
                stack.append(dst)
    return seen


def test_every_status_is_reachable_and_can_end_unloaded() -> None:
    assert reachable_from(U) == set(Status)
    for status in Status:  # no status is a dead end: each leads back to unloaded
        assert U in reachable_from(status)
