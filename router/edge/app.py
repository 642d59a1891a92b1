"""The router's ASGI app: its routes (``routes``, and Ollama's: ``ollamaroutes``), the
proxy for everything else (``forward``), and the middleware around both (``middleware``);
``paths`` says which is which.

The router's own middleware is the outermost layer, outside Starlette's error middleware: a
proxied request passes the router's middleware only (the proxy answers its own failures with
the envelope, ``forward.proxy``), and the router's routes get Starlette's error and exception
middleware as before. What escapes any layer unanswered gets the envelope at the edge
(``middleware.RequestMetricsMiddleware``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from starlette.applications import Starlette
from starlette.types import ASGIApp

from ..config.origins import CorsPolicy
from ..llama.webui import StaticUI
from ..observe.activity import Activity
from ..observe.metrics import RouterMetrics
from .cors import CorsMiddleware
from .forward import ProxyMiddleware
from .keys import ApiKeyMiddleware, Keys
from .middleware import EXCEPTION_HANDLERS, RequestMetricsMiddleware
from .ollamaroutes import routes as ollama_routes
from .routes import routes
from .state import State

__all__ = ["Lifespan", "RouterApp", "State", "create_app"]

Lifespan = Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]


class RouterApp(Starlette):
    """Starlette with the middleware added by ``add_middleware`` around its error middleware
    instead of inside it (see the module docstring): two layers fewer on every proxied
    request, and on each of its ``send`` calls."""

    def build_middleware_stack(self) -> ASGIApp:
        own, self.user_middleware = self.user_middleware, []
        try:
            app = super().build_middleware_stack()  # errors, exceptions, the routes
        finally:
            self.user_middleware = own
        for cls, args, kwargs in reversed(own):
            app = cls(app, *args, **kwargs)
        return app


def create_app(lifespan: Lifespan, api_keys: Keys | Sequence[str],
               metrics: RouterMetrics | None = None, webui: StaticUI | None = None,
               cors: CorsPolicy | None = None) -> RouterApp:
    """The router's ASGI app; ``api_keys``: the keys in force (a ``Keys`` that a reload
    swaps, or the keys themselves); ``metrics``: what the edge counts every request into
    (None: nothing); ``webui``: the web UI served at ``/``, None for none; ``cors``: what
    pages of other origins may use (default: llama-server's ``*``)."""
    app = RouterApp(routes=[*routes(), *ollama_routes()], lifespan=lifespan,
                    exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(ProxyMiddleware)
    app.state.webui = webui
    app.add_middleware(ApiKeyMiddleware, keys=api_keys, webui=webui)
    app.add_middleware(CorsMiddleware, policy=cors)  # before the key: preflights carry none
    app.state.activity = activity = Activity()
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, activity=activity)
    return app
