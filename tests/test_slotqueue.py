"""The slot queue on its own (``serving/slotqueue``), hostile: a flood of requests that leave
while queued frees every place and leaves nothing behind; a turn granted as its client leaves
passes the slot on; the next slot goes by class and fair share."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from router import clock
from router.changes import Changes
from router.serving.load import Served
from router.serving.slotqueue import SlotQueue
from router.teams.fairshare import MAX_PREEMPTIONS, FairQueue, Turn


def model(slots: int = 1, interactive_slots: int = 0) -> Served:
    return cast(Served, SimpleNamespace(
        id="m", slots=slots, replicas=[object()], loaded=True, has_slots=True, serving=True,
        preset=SimpleNamespace(upstream=None, interactive_slots=interactive_slots)))


def test_a_flood_of_requests_that_leave_while_queued_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        slots, runtime = SlotQueue(Changes()), model()
        holder = Turn("a", 1, 10)
        assert slots.start_now(runtime, holder)
        leaving = [asyncio.get_running_loop().create_future() for _ in range(500)]
        waits = [asyncio.ensure_future(slots.wait_turn(
            runtime, Turn(f"flow{n % 50}", n % 3, 10), clock.now() + 60, [gone]))
            for n, gone in enumerate(leaving)]
        await asyncio.sleep(0)
        assert slots.waiting("m") == 500
        for gone in leaving:
            gone.set_result(None)  # every client leaves
        assert not any(await asyncio.gather(*waits))
        queue = slots.queue(runtime)
        assert (queue.waiting, queue.running) == (0, 1)
        assert not slots._granted and len(queue._flows) == 1  # only the holder's flow
        slots.ended(runtime, holder, 0)
        assert slots.running("m") == 0 and "m" not in slots._queues

    asyncio.run(scenario())


def test_a_turn_granted_as_its_client_leaves_passes_the_slot_on() -> None:
    async def scenario() -> None:
        slots, runtime = SlotQueue(Changes()), model()
        holder = Turn("a", 1, 10)
        assert slots.start_now(runtime, holder)
        gone: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        first = asyncio.ensure_future(slots.wait_turn(runtime, Turn("b", 1, 10),
                                                      clock.now() + 60, [gone]))
        second_turn = Turn("c", 1, 10)
        second = asyncio.ensure_future(slots.wait_turn(runtime, second_turn,
                                                       clock.now() + 60, []))
        await asyncio.sleep(0)
        slots.ended(runtime, holder, 0)  # b gets the slot ...
        gone.set_result(None)  # ... as its client leaves, in the same instant
        assert await first is False
        assert await second is True and second_turn.started
        assert slots.running("m") == 1 and slots.waiting("m") == 0

    asyncio.run(scenario())


def test_the_freed_slot_goes_to_the_higher_class_then_the_least_served() -> None:
    async def scenario() -> None:
        slots, runtime = SlotQueue(Changes()), model()
        holder = Turn("etl", 2, 1000)
        assert slots.start_now(runtime, holder)
        batch, interactive = Turn("etl", 2, 10), Turn("alice", 0, 10)
        waits = [asyncio.ensure_future(slots.wait_turn(runtime, t, clock.now() + 60, []))
                 for t in (batch, interactive)]
        await asyncio.sleep(0)
        slots.ended(runtime, holder, 0)
        assert interactive.started and not batch.started  # given at once, in order
        assert slots.start_now(runtime, Turn("x", 0, 1)) is False  # others wait: no jumping
        slots.ended(runtime, interactive, 0)
        assert all(await asyncio.gather(*waits)) and batch.started

    asyncio.run(scenario())


def test_a_wait_ends_at_its_deadline_without_a_slot() -> None:
    async def scenario() -> None:
        slots, runtime = SlotQueue(Changes()), model()
        assert slots.start_now(runtime, Turn("a", 1, 1))
        assert await slots.wait_turn(runtime, Turn("b", 1, 1), clock.now() + 0.01, []) is False
        assert slots.waiting("m") == 0

    asyncio.run(scenario())


def test_a_higher_class_takes_a_slot_back_from_a_request_that_has_not_answered() -> None:
    async def scenario() -> None:
        slots, runtime = SlotQueue(Changes()), model(slots=2)
        taken: list[str] = []

        def running(flow: str, rank: int, preemptible: bool) -> Turn:
            turn = Turn(flow, rank, 10)
            assert slots.start_now(runtime, turn)
            if preemptible:
                turn.preempt = lambda: taken.append(flow) is None
            return turn

        default = running("team", 1, True)
        batch = running("etl", 2, True)
        waiting = asyncio.ensure_future(slots.wait_turn(runtime, Turn("alice", 0, 1),
                                                        clock.now() + 60, []))
        await asyncio.sleep(0)
        assert taken == ["etl"] and batch.preemptions == 1  # the lowest class
        slots.ended(runtime, batch, -batch.cost)  # it gives its slot back ...
        assert await waiting  # ... to the interactive request
        again = asyncio.ensure_future(slots.wait_turn(runtime, batch, clock.now() + 60, []))
        await asyncio.sleep(0)
        assert not again.done() and default.preemptions == 0  # batch takes none back
        slots.ended(runtime, default, 0)
        assert await again

    asyncio.run(scenario())


def test_no_request_is_taken_back_more_than_the_bound_nor_by_its_own_class() -> None:
    queue = FairQueue()
    batch = Turn("etl", 2, 10, preempt=lambda: True)
    queue.start(batch)
    assert queue.victim(Turn("etl2", 2, 1)) is None  # the same class never
    assert queue.victim(Turn("a", 1, 1)) is batch
    batch.preemptions = MAX_PREEMPTIONS
    assert queue.victim(Turn("a", 0, 1)) is None
    streamed = Turn("s", 2, 10)  # no preempt: its answer has begun, or is streamed
    queue.start(streamed)
    assert queue.victim(Turn("a", 0, 1)) is None


def test_a_slot_kept_for_the_interactive_class_is_never_taken_by_another() -> None:
    """``interactive-slots = 1`` of two: batch and default requests take one slot at most and
    queue for it; an interactive one takes the kept slot at once, and the next interactive
    one, with both slots busy, waits (and takes no slot back from an answering request)."""
    async def run() -> None:
        slots = SlotQueue(Changes())
        runtime = model(slots=2, interactive_slots=1)
        first = Turn("etl", 2, 10.0)
        assert slots.start_now(runtime, first)
        second = Turn("etl", 2, 10.0)
        assert not slots.start_now(runtime, second)  # the free slot is kept
        waiting = asyncio.ensure_future(
            slots.wait_turn(runtime, second, clock.now() + 60.0, []))
        await asyncio.sleep(0)
        assert slots.running("m") == 1 and slots.waiting("m") == 1
        alice = Turn("alice", 0, 10.0)
        assert not slots.start_now(runtime, alice)  # someone waits: through the queue
        assert await slots.wait_turn(runtime, alice, clock.now() + 60.0, [])
        assert slots.running("m") == 2 and not waiting.done()
        slots.ended(runtime, first, 0.0)  # the batch slot frees: the batch request takes it
        assert await asyncio.wait_for(waiting, 5.0)
        slots.ended(runtime, alice, 0.0)  # the kept slot frees: nobody of the class waits
        assert slots.running("m") == 1 and slots.waiting("m") == 0
        assert not slots.start_now(runtime, Turn("etl", 1, 10.0))  # default: not kept for it
        assert slots.start_now(runtime, Turn("bob", 0, 10.0))

    asyncio.run(run())
