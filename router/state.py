"""What the router's routes share, built by the lifespan (``server.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import RouterError
from .events import EventBus
from .logs import LogRing
from .metrics import RouterMetrics
from .reload import Reloader
from .resumable import ConversationOwners
from .supervisor import Supervisor


class State:
    """What the routes share; built by the lifespan (see ``server.py``)."""

    def __init__(self, supervisor: Supervisor, client: httpx.AsyncClient, events: EventBus,
                 build_info: str, metrics: RouterMetrics, router_log: LogRing,
                 reloader: Reloader) -> None:
        self.supervisor = supervisor
        self.client = client
        self.events = events
        self.build_info = build_info
        self.metrics = metrics
        self.router_log = router_log
        self.reloader = reloader
        self.conversations = ConversationOwners()  # resumable streams: which child has each
        self.started = int(time.time())
        self._tasks: set[asyncio.Task[Any]] = set()
        # Set when the router starts shutting down: endless streams (events, log follow) end
        # so that shutdown waits only for real requests.
        self.closing = asyncio.Event()

    def request_reload(self) -> None:
        """SIGHUP: re-read the configuration in the background."""
        task = asyncio.create_task(self.reloader.reload("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _state(request: Request) -> State:
    state: State = request.app.state.router
    return state


def error_response(exc: RouterError) -> Response:
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)
