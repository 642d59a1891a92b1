"""The operator dashboard at ``/dashboard/``: static HTML, CSS and JavaScript in this package.

The files are read once, on first use, and served from memory; there is no build step and
nothing is loaded from elsewhere (the page works offline). They are public even with API
keys (``DASHBOARD_PATHS`` are exempt in ``ApiKeyMiddleware``): they hold no data, and the page
asks for the key and sends it as ``Authorization: Bearer`` on every API call it makes.
``/dashboard`` redirects to ``/dashboard/`` (relative, so a path prefix added by a reverse proxy
is kept); every other path under ``/dashboard/`` is not the router's and gets the 404 envelope.

It owns its static files. It may import ``foundation`` only (the 404 envelope).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ..errors import NotFound

PREFIX = "/dashboard/"
JS = "text/javascript; charset=utf-8"
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "style.css": ("style.css", "text/css; charset=utf-8"),
    **{name: (name, JS) for name in
       ("app.js", "api.js", "charts.js", "format.js", "logs.js", "models.js")},
}
DASHBOARD_PATHS = frozenset({"/dashboard", *(PREFIX + name for name in ASSETS)})
# Same-origin only: no inline script, no other origin, not framed by another site.
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@cache
def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


async def asset(request: Request) -> Response:
    entry = ASSETS.get(request.url.path.removeprefix(PREFIX))
    if entry is None:  # unreachable: only DASHBOARD_PATHS are routed here
        raise NotFound("File Not Found")
    filename, media_type = entry
    return Response(_asset(filename), media_type=media_type, headers=HEADERS)


async def redirect(request: Request) -> Response:
    return RedirectResponse("dashboard/", status_code=307)


def routes() -> list[Route]:
    return [Route("/dashboard", redirect, methods=["GET", "HEAD"]),
            *(Route(PREFIX + name, asset, methods=["GET", "HEAD"]) for name in ASSETS)]
