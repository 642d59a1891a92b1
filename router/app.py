"""The router's ASGI app: its routes (``routes``), the proxy for everything else
(``forward``), and the middleware around both (``middleware``); ``paths`` says which is which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from starlette.applications import Starlette

from .activity import Activity
from .cors import CorsMiddleware, CorsPolicy
from .metrics import RouterMetrics
from .middleware import (
    EXCEPTION_HANDLERS,
    ApiKeyMiddleware,
    ProxyMiddleware,
    RequestMetricsMiddleware,
)
from .routes import routes
from .state import State
from .webui import StaticUI

__all__ = ["Lifespan", "State", "create_app"]

Lifespan = Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]


def create_app(lifespan: Lifespan, api_keys: list[str],
               webui: StaticUI | None = None, cors: CorsPolicy | None = None) -> Starlette:
    """The router's ASGI app; ``webui``: the web UI served at ``/``, None for none;
    ``cors``: what pages of other origins may use (default: llama-server's ``*``)."""
    app = Starlette(routes=routes(), lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(ProxyMiddleware)
    app.state.webui = webui
    app.add_middleware(ApiKeyMiddleware, keys=api_keys, webui=webui)
    app.add_middleware(CorsMiddleware, policy=cors)  # before the key: preflights carry none

    def current_metrics() -> RouterMetrics | None:
        state = getattr(app.state, "router", None)
        return state.metrics if state is not None else None

    app.state.activity = activity = Activity()
    app.add_middleware(RequestMetricsMiddleware, metrics=current_metrics, activity=activity)
    return app
