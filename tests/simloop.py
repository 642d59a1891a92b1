"""An asyncio event loop on virtual time, for the scheduler simulation (``simulation.py``).

The loop is asyncio's own selector loop; only its clock and its selector are replaced:

* ``time()`` is a virtual clock that starts at 0 and moves only when the loop has nothing to
  run: when every task waits and the next timer is ``t`` seconds away, the selector adds ``t``
  to the clock instead of sleeping. A schedule of minutes runs in milliseconds, and the same
  program gives the same interleaving every time (no real I/O, no threads, no wall clock).
* Right before the clock moves, the loop is *quiescent*: every task has run as far as it can
  at this instant. ``on_quiescent`` (if set) is called then, with the virtual time: the one
  moment at which invariants over the whole system hold without transient states in between.
* A loop with nothing ready and no timer at all waits on nothing that can ever happen:
  ``Stalled`` is raised out of ``run_until_complete``. So is a livelock: tasks that keep
  running at one instant (``LIVELOCK_STEPS`` loop iterations) without ever letting time move.

The router's core reads time through ``router.clock.now()`` (the running loop's ``time()``),
so its deadlines, budgets, fairness bound, backoffs and TTLs follow the virtual clock.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from typing import Any

LIVELOCK_STEPS = 200_000  # loop iterations at one virtual instant: far above any real burst


class Stalled(RuntimeError):
    """Nothing can run and no timer is set: every task waits for something that never comes;
    or tasks spin at one instant and time never moves."""


class _VirtualSelector(selectors.SelectSelector):
    """Polls the loop's own self-pipe without blocking; advances the clock instead of waiting."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self._loop
        if loop.threads:  # a thread may wake the loop through its self-pipe
            ready = super().select(0)
            if ready:
                return ready
        if timeout == 0:
            loop.steps_now += 1
            if loop.steps_now > LIVELOCK_STEPS:
                raise Stalled(f"at t={loop.now:.3f}: {LIVELOCK_STEPS} loop iterations without "
                              "time moving (a livelock)")
            return []
        loop.steps_now = 0
        if loop.on_quiescent is not None:
            loop.on_quiescent(loop.now)
        if timeout is None:
            raise Stalled(f"at t={loop.now:.3f}: nothing to run and no timer set")
        loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        self.steps_now = 0  # loop iterations since time last moved
        self.on_quiescent: Callable[[float], None] | None = None
        # Set while code under test may call back from a thread (``call_soon_threadsafe``):
        # then the self-pipe is polled before time moves. The simulation starts none.
        self.threads = False
        super().__init__(_VirtualSelector(self))
        # Timers due within this of now run now: exact virtual times need no tolerance.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now
