"""The core's clock: monotonic seconds as the running event loop counts them.

Every deadline, wait budget, fairness bound, backoff, TTL and ``last_used`` in the scheduling
core reads ``now()``. In the router the loop's clock is ``time.monotonic()``, so this is the
same clock ``asyncio.sleep`` and ``asyncio.wait_for`` already use; under the scheduler
simulation (``tests/simulation.py``) the loop runs on virtual time, and the core's reading of
time follows it, so a schedule of minutes runs in milliseconds and every run of a seed is the
same.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Seconds on the running loop's monotonic clock (``time.monotonic()`` outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
