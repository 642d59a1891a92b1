"""The router's shutdown as the requests it holds see it: one ``Shutdown``, made by the
lifespan (``server.py``) and read by every request that waits, relays or streams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import ShuttingDown

SHUTDOWN_RETRY_AFTER_S = 5  # Retry-After of a request refused or ended by the shutdown


class Shutdown:
    """The router's shutdown as the requests it holds see it (driven by ``server.py``).

    * ``closing``: set by the first SIGTERM/SIGINT. Endless streams (events, log follow) end;
      a proxied request that arrives now is refused (``refusal()``) instead of started.
    * ``over``: set by ``end()`` when the grace period is over. A request still waiting for its
      model leaves the wait (``forward.py`` races it, where a wait exists anyway), and every relay
      in progress (registered in ``relays``: a set add and discard, no awaits on the hot path)
      is aborted and ends its own response (``proxy.relay``): a 503 envelope if its response has
      not started, a last error event if it is an event stream, an aborted body otherwise.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.closing = asyncio.Event()
        self.over = asyncio.Event()
        self.relays: set[Callable[[], None]] = set()  # each aborts one relay in progress

    def end(self) -> None:
        """The grace period is over: end every request still held, with the envelope."""
        self.closing.set()
        self.over.set()
        for abort in list(self.relays):
            abort()

    def error(self) -> ShuttingDown:
        """What a request still running when the grace period ended gets."""
        return ShuttingDown(f"the router is shutting down; the request did not finish within "
                            f"the {self.grace_s:g} s grace period",
                            headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})

    def refusal(self) -> ShuttingDown:
        """What a proxied request that arrives after the first signal gets."""
        return ShuttingDown("the router is shutting down and starts no new requests",
                            headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S),
                                     "Connection": "close"})
