"""What the router's routes share, built by the lifespan (``server.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from starlette.requests import Request

from ..core.view import Models
from ..events import EventBus
from ..http.shutdown import Shutdown
from ..logs import LogRing
from ..observe.metrics import RouterMetrics
from ..peers.registry import Peers
from ..teams.usage import Usage
from .defaults import DefaultModel
from .metering import Meter
from .reload import Reloader
from .resumable import StreamOwners
from .virtual import Virtuals


class State:
    """What the routes share; built by the lifespan (see ``server.py``)."""

    def __init__(self, models: Models, client: httpx.AsyncClient, events: EventBus,
                 build_info: str, metrics: RouterMetrics, router_log: LogRing,
                 reloader: Reloader, peers: Peers | None = None,
                 usage: Usage | None = None) -> None:
        self.models = models
        self.client = client
        self.events = events
        self.build_info = build_info
        self.metrics = metrics
        self.router_log = router_log
        self.reloader = reloader
        self.peers = peers  # None in tests that build a State by hand
        self.node = peers.node if peers is not None else ""
        settings = models.settings
        self.default = DefaultModel(settings.default_model,
                                    unknown_to_default=settings.unknown_model_to_default,
                                    peered=bool(settings.peer or settings.peer_dns))
        self.conversations = StreamOwners()  # resumable streams: which child has each
        self.virtuals = Virtuals()  # what each virtual model's targets served (``virtual``)
        events.on_reloaded(lambda: self.virtuals.keep(models.catalogue.virtuals))
        self.usage = usage or Usage()  # what each team used (``teams.usage``)
        self.meter = Meter(self.usage)  # the teams' quotas and turns (``metering``)
        self.started = int(time.time())
        self._tasks: set[asyncio.Task[Any]] = set()
        self.shutdown = Shutdown(models.settings.shutdown_grace)
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
