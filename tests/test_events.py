"""Unit tests for router.events: the bounded, lossy, per-subscriber event bus."""

from __future__ import annotations

import asyncio

import pytest

from router.events import SUBSCRIBER_QUEUE_SIZE, EventBus, Subscription


async def drain(subscription: Subscription) -> list[dict[str, object]]:
    out = []
    while subscription.dropped or not subscription.queue.empty():
        out.append(await subscription.get())
    return out


async def test_publish_reaches_every_subscriber() -> None:
    bus = EventBus()
    async with bus.subscribe() as first, bus.subscribe() as second:
        bus.publish("m1", "loading")
        bus.publish("m1", "loaded", {"port": 1234})
        expected = [{"model": "m1", "event": "loading"},
                    {"model": "m1", "event": "loaded", "data": {"port": 1234}}]
        assert await drain(first) == expected
        assert await drain(second) == expected


async def test_event_without_data_has_no_data_key() -> None:
    bus = EventBus()
    async with bus.subscribe() as sub:
        bus.publish("*", "reloaded")
        assert await sub.get() == {"model": "*", "event": "reloaded"}


async def test_publish_without_subscribers_is_a_no_op() -> None:
    EventBus().publish("m", "loaded")


async def test_subscriber_only_sees_events_after_subscribing() -> None:
    bus = EventBus()
    bus.publish("m", "before")
    async with bus.subscribe() as sub:
        bus.publish("m", "after")
        assert await drain(sub) == [{"model": "m", "event": "after"}]


async def test_get_waits_for_the_next_event() -> None:
    bus = EventBus()
    async with bus.subscribe() as sub:
        waiter = asyncio.ensure_future(sub.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        bus.publish("m", "loaded")
        assert await asyncio.wait_for(waiter, 1.0) == {"model": "m", "event": "loaded"}


async def test_slow_subscriber_loses_oldest_and_is_told() -> None:
    bus = EventBus(maxsize=3)
    async with bus.subscribe() as slow, bus.subscribe() as fast:
        got_fast = []
        for i in range(8):
            bus.publish("m", "tick", {"i": i})
            got_fast.append(await fast.get())
        assert [e["data"] for e in got_fast] == [{"i": i} for i in range(8)]
        assert slow.dropped == 5
        events = await drain(slow)
    assert events == [
        {"model": "*", "event": "events_dropped", "data": {"count": 5}},
        {"model": "m", "event": "tick", "data": {"i": 5}},
        {"model": "m", "event": "tick", "data": {"i": 6}},
        {"model": "m", "event": "tick", "data": {"i": 7}},
    ]
    assert slow.dropped == 0


async def test_drop_notice_is_given_again_for_later_losses() -> None:
    bus = EventBus(maxsize=1)
    async with bus.subscribe() as sub:
        bus.publish("m", "a")
        bus.publish("m", "b")
        assert await sub.get() == {"model": "*", "event": "events_dropped",
                                   "data": {"count": 1}}
        bus.publish("m", "c")
        bus.publish("m", "d")
        bus.publish("m", "e")
        assert await drain(sub) == [
            {"model": "*", "event": "events_dropped", "data": {"count": 3}},
            {"model": "m", "event": "e"},
        ]


async def test_no_drop_notice_within_capacity() -> None:
    bus = EventBus(maxsize=2)
    async with bus.subscribe() as sub:
        bus.publish("m", "a")
        bus.publish("m", "b")
        assert sub.dropped == 0
        assert [e["event"] for e in await drain(sub)] == ["a", "b"]


async def test_unsubscribed_after_the_context_exits() -> None:
    bus = EventBus()
    async with bus.subscribe() as sub:
        bus.publish("m", "inside")
    bus.publish("m", "outside")
    assert await drain(sub) == [{"model": "m", "event": "inside"}]


async def test_unsubscribed_even_when_the_body_raises() -> None:
    bus = EventBus()
    with pytest.raises(RuntimeError):
        async with bus.subscribe() as sub:
            raise RuntimeError("reader failed")
    bus.publish("m", "after")
    assert sub.queue.empty()
    assert sub.dropped == 0


async def test_default_queue_size() -> None:
    bus = EventBus()
    async with bus.subscribe() as sub:
        for i in range(SUBSCRIBER_QUEUE_SIZE + 4):
            bus.publish("m", "tick", {"i": i})
        assert sub.queue.qsize() == SUBSCRIBER_QUEUE_SIZE
        assert sub.dropped == 4
