"""The app's layers: the router's middleware outside Starlette's error middleware, and every
failure answered with the envelope, wherever it happens (a middleware, the proxy, a route)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.middleware.errors import ServerErrorMiddleware
from test_activity import no_lifespan

import router.edge.forward as forward_module
from router.edge.app import create_app
from router.edge.cors import CorsMiddleware
from router.edge.forward import ProxyMiddleware
from router.edge.keys import ApiKeyMiddleware
from router.edge.middleware import RequestMetricsMiddleware
from router.observe.activity import Activity


async def request(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    # As ``test_activity.request``, but the app's exceptions are not raised here: the client
    # sees what the server would send.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, **kw)


def layers(app: Any) -> list[type]:
    found: list[type] = []
    while app is not None and len(found) < 10:
        found.append(type(app))
        app = getattr(app, "app", None)
    return found


def test_a_proxied_request_passes_the_routers_middleware_only() -> None:
    app = create_app(no_lifespan, ["k"])
    stack = app.build_middleware_stack()
    # The proxy switch comes before Starlette's error middleware: the proxy answers its own
    # failures (``forward.proxy``), the edge what escapes a middleware.
    assert layers(stack)[:5] == [RequestMetricsMiddleware, CorsMiddleware, ApiKeyMiddleware,
                                 ProxyMiddleware, ServerErrorMiddleware]


def assert_internal_error(response: httpx.Response, name: str) -> None:
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == 500 and error["message"] == f"internal error: {name}"


async def test_a_failing_middleware_is_answered_with_the_envelope_and_recorded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: ApiKeyMiddleware, request: Any) -> bool:
        raise RuntimeError("a bug in a middleware")

    monkeypatch.setattr(ApiKeyMiddleware, "_public", broken)
    app = create_app(no_lifespan, ["k"])
    response = await request(app, "POST", "/v1/chat/completions", json={"model": "m"})
    assert_internal_error(response, "RuntimeError")
    activity: Activity = app.state.activity
    [record] = activity.recent()
    assert (record.status, record.endpoint) == (500, "/v1/chat/completions")
    assert "a bug in a middleware" in caplog.text  # with its traceback, in the log


async def test_a_proxied_request_that_fails_unexpectedly_gets_the_envelope() -> None:
    app = create_app(no_lifespan, [])  # no lifespan: the proxy finds no router state
    response = await request(app, "POST", "/v1/chat/completions", json={"model": "m"})
    assert_internal_error(response, "AttributeError")
    [record] = app.state.activity.recent()
    assert record.status == 500


async def test_a_failing_route_gets_the_envelope_from_starlettes_error_middleware(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Activity, *args: Any, **kwargs: Any) -> Any:
        raise KeyError("a bug in a route")

    monkeypatch.setattr(Activity, "recent", broken)
    app = create_app(no_lifespan, [])
    response = await request(app, "GET", "/activity")
    assert_internal_error(response, "KeyError")


async def test_a_failure_after_the_answer_started_is_not_answered_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def half_answered(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("broke while answering")

    monkeypatch.setattr(forward_module, "proxy", half_answered)
    app = create_app(no_lifespan, [])
    response = await request(app, "POST", "/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 200  # the start went out; nothing else could follow it
    assert response.content == b""
    [record] = app.state.activity.recent()
    assert record.status == 200
