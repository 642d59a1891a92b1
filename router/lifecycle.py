"""A model's lifecycle as an explicit transition table.

Every status change of a model is an ``Event``; ``transition(status, event)`` is the only way
to a new status, and an event that cannot happen in the current status raises
``InvalidTransition`` (a bug in the router, never a client error), so no code path can put
a model into a status its neighbours do not expect. The table:

=============== ===================== ================================================
from            event                 to
=============== ===================== ================================================
unloaded        DOWNLOAD              downloading (an hf-repo model not in the cache)
downloading     DOWNLOADED            unloaded (the file is there; the load goes on)
downloading     DOWNLOAD_FAILED       unloaded (also when cancelled)
unloaded        ADMITTED              loading (the planner made room: spawn)
loading         READY                 loaded (every replica healthy)
loading         LOAD_FAILED           unloaded (exit, timeout, or cancelled)
loaded          STOP                  stopping (unload, eviction, idle TTL, reconfig,
                                      shutdown; the children are asked to exit)
stopping        STOPPED               unloaded (every child has exited)
loaded          LAST_REPLICA_EXITED   unloaded (a crash took its last child)
=============== ===================== ================================================

Drains (a loaded model taking no new requests until it stops) and replica replacement
after a crash keep the model ``loaded``; they are fields of the model, not statuses.
"""

from __future__ import annotations

from enum import StrEnum

from .scheduler import Status


class Event(StrEnum):
    DOWNLOAD = "download"
    DOWNLOADED = "downloaded"
    DOWNLOAD_FAILED = "download_failed"
    ADMITTED = "admitted"
    READY = "ready"
    LOAD_FAILED = "load_failed"
    STOP = "stop"
    STOPPED = "stopped"
    LAST_REPLICA_EXITED = "last_replica_exited"


TRANSITIONS: dict[tuple[Status, Event], Status] = {
    (Status.UNLOADED, Event.DOWNLOAD): Status.DOWNLOADING,
    (Status.DOWNLOADING, Event.DOWNLOADED): Status.UNLOADED,
    (Status.DOWNLOADING, Event.DOWNLOAD_FAILED): Status.UNLOADED,
    (Status.UNLOADED, Event.ADMITTED): Status.LOADING,
    (Status.LOADING, Event.READY): Status.LOADED,
    (Status.LOADING, Event.LOAD_FAILED): Status.UNLOADED,
    (Status.LOADED, Event.STOP): Status.STOPPING,
    (Status.STOPPING, Event.STOPPED): Status.UNLOADED,
    (Status.LOADED, Event.LAST_REPLICA_EXITED): Status.UNLOADED,
}


class InvalidTransition(RuntimeError):
    """An event that cannot happen in the model's current status: a bug in the router."""

    def __init__(self, model: str, status: Status, event: Event) -> None:
        super().__init__(f"model '{model}': {event.value} cannot happen while {status.value}")
        self.status = status
        self.event = event


def transition(model: str, status: Status, event: Event) -> Status:
    """The status after ``event``; raises InvalidTransition if it cannot happen now."""
    try:
        return TRANSITIONS[(status, event)]
    except KeyError:
        raise InvalidTransition(model, status, event) from None
