"""Cancellation in the core's waits: it always propagates, and cleanups run to their end."""

from __future__ import annotations

import asyncio

import pytest

from router.changes import Changes
from router.core.executor import to_the_end


def test_a_cancel_that_comes_as_the_change_is_notified_propagates() -> None:
    """On Python 3.11 ``asyncio.wait_for`` returned normally when its task was cancelled just
    as the awaited event was set; a load cancelled that way stayed queued for admission,
    planning for ever, and the shutdown waited for it (found by the simulation)."""

    async def scenario() -> None:
        changes = Changes()
        waiter = asyncio.ensure_future(changes.wait(10.0))
        await asyncio.sleep(0)
        changes.notify()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())


def test_a_wait_ends_on_its_timeout_or_the_next_change() -> None:
    async def scenario() -> None:
        changes = Changes()
        await changes.wait(0.01)  # the timeout: no error
        waiter = asyncio.ensure_future(changes.wait())
        await asyncio.sleep(0)
        changes.notify()
        await asyncio.wait_for(waiter, 5)

    asyncio.run(scenario())


def test_a_cleanup_runs_to_its_end_through_a_second_cancel() -> None:
    """A load cancelled by an unload and then by the shutdown still stops the children it
    started and reports it; the cancellation comes through afterwards."""
    steps: list[str] = []

    async def cleanup() -> None:
        steps.append("stopping")
        await asyncio.sleep(0.05)
        steps.append("stopped")

    async def load() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            try:
                await to_the_end(cleanup())
            finally:
                steps.append("reported")
            raise

    async def scenario() -> None:
        task = asyncio.ensure_future(load())
        await asyncio.sleep(0)
        task.cancel()  # the unload
        await asyncio.sleep(0.01)
        task.cancel()  # the shutdown, while the cleanup runs
        with pytest.raises(asyncio.CancelledError):
            await task
        assert steps == ["stopping", "stopped", "reported"]

    asyncio.run(scenario())
