"""What the router's routes share, built by the lifespan (``server.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
from starlette.requests import Request

from .defaults import DefaultModel
from .errors import ShuttingDown
from .events import EventBus
from .logs import LogRing
from .metrics import RouterMetrics
from .peers import Peers
from .reload import Reloader
from .resumable import ConversationOwners
from .supervisor import Supervisor

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


class State:
    """What the routes share; built by the lifespan (see ``server.py``)."""

    def __init__(self, supervisor: Supervisor, client: httpx.AsyncClient, events: EventBus,
                 build_info: str, metrics: RouterMetrics, router_log: LogRing,
                 reloader: Reloader, peers: Peers | None = None) -> None:
        self.supervisor = supervisor
        self.client = client
        self.events = events
        self.build_info = build_info
        self.metrics = metrics
        self.router_log = router_log
        self.reloader = reloader
        self.peers = peers  # None in tests that build a State by hand
        self.node = peers.node if peers is not None else ""
        settings = supervisor.settings
        self.default = DefaultModel(settings.default_model,
                                    unknown_to_default=settings.unknown_model_to_default,
                                    peered=bool(settings.peer or settings.peer_dns))
        self.conversations = ConversationOwners()  # resumable streams: which child has each
        self.started = int(time.time())
        self._tasks: set[asyncio.Task[Any]] = set()
        self.shutdown = Shutdown(supervisor.settings.shutdown_grace)
        # Set when the router starts shutting down: endless streams (events, log follow) end
        # so that shutdown waits only for real requests.
        self.closing = self.shutdown.closing

    def request_reload(self) -> None:
        """SIGHUP: re-read the configuration in the background."""
        task = asyncio.create_task(self.reloader.reload("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _state(request: Request) -> State:
    state: State = request.app.state.router
    return state
