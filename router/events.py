"""In-process event bus: every state change is published once to every subscriber.

Each subscriber has a bounded queue; a subscriber that falls behind loses its oldest events
(and is told how many with a ``events_dropped`` event), so a slow reader never slows the
router down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

SUBSCRIBER_QUEUE_SIZE = 256
# The event of a model dropped from the router (the lifecycle's ``Forgotten``): the one signal
# on which every part drops what it keeps of that model (``EventBus.on_removed``).
MODEL_REMOVED = "model_remove"
# The event of a configuration applied by a reload (``edge.reload``), with its diff.
MODELS_RELOADED = "models_reload"

Event = dict[str, Any]


class Subscription:
    """One subscriber's queue; ``accept`` (when given) decides which events it is offered at
    all, so the events it may not see never take its room nor count as dropped."""

    def __init__(self, maxsize: int, accept: Callable[[Event], bool] | None = None) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        self.dropped = 0
        self.accept = accept

    def offer(self, event: Event) -> None:
        if self.accept is not None and not self.accept(event):
            return
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(event)

    async def get(self) -> Event:
        """The next event; a notice of how many were dropped comes before the survivors."""
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            return {"model": "*", "event": "events_dropped", "data": {"count": dropped}}
        return await self.queue.get()


class EventBus:
    def __init__(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> None:
        self._subscribers: set[Subscription] = set()
        self._maxsize = maxsize
        # Called synchronously with every event (metrics); must be quick and never raise.
        self.listeners: list[Callable[[Event], None]] = []

    def on_removed(self, forget: Callable[[str], None]) -> None:
        """Call ``forget(model_id)`` whenever one of this router's models is removed
        (``MODEL_REMOVED``; a peer's, relayed with its ``node``, is the peer's own): every
        table kept per model registers its own, so that a removed model leaves nothing."""

        def listener(event: Event) -> None:
            if event.get("event") == MODEL_REMOVED and "node" not in event:
                forget(event["model"])

        self.listeners.append(listener)

    def on_reloaded(self, reloaded: Callable[[], None]) -> None:
        """Call ``reloaded()`` whenever a new configuration was applied (``MODELS_RELOADED``):
        a table kept per name that is no model (a virtual model's) drops what it removed."""

        def listener(event: Event) -> None:
            if event.get("event") == MODELS_RELOADED and "node" not in event:
                reloaded()

        self.listeners.append(listener)

    def publish(self, model: str, event: str, data: dict[str, Any] | None = None) -> None:
        payload: Event = {"model": model, "event": event}
        if data is not None:
            payload["data"] = data
        self.publish_payload(payload)

    def publish_payload(self, payload: Event) -> None:
        """Publish an event already shaped (a peer's, relayed with its ``node``)."""
        for listener in self.listeners:
            listener(payload)
        for subscriber in self._subscribers:
            subscriber.offer(payload)

    @asynccontextmanager
    async def subscribe(self, accept: Callable[[Event], bool] | None = None
                        ) -> AsyncIterator[Subscription]:
        """A subscription to every event published from now on (that ``accept`` takes)."""
        subscription = Subscription(self._maxsize, accept)
        self._subscribers.add(subscription)
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)
