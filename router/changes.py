"""One signal for "something changed": a model's status, the capacity, the admission queue.

Waiters (loads waiting for room, for an old child to be gone, for their turn) call
``wait()``; whoever changes any of those calls ``notify()``, which wakes every current waiter
at once. A waiter then looks again at what it waits for: a wake-up says only that something
changed, not what.
"""

from __future__ import annotations

import asyncio
import contextlib


class Changes:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake everything waiting now (later waiters wait for the next change)."""
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        """Until the next ``notify()``, or ``timeout`` seconds (None: no limit). A cancellation
        always propagates: not ``asyncio.wait_for``, which on Python 3.11 swallows one that
        comes as the event is set (a cancelled load then planned for ever)."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
