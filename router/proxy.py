"""Forward one request to a child and stream the answer back untouched.

* The body passes through as the bytes the client sent; only headers are filtered:
  hop-by-hop headers, ``Host`` and every credential (``Authorization``, ``X-Api-Key``) stay
  behind, so API keys never reach children.
* The response streams chunk by chunk as the child writes it (``aiter_raw``: no decoding, no
  buffering). A client disconnect cancels the upstream read and closes the connection to the
  child, which makes llama-server stop generating and free its slot.
* If the child dies mid-stream, an SSE response gets a final ``data: {"error": ...}`` event; a
  response that has not started becomes a 502 envelope.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
from starlette.types import Receive, Scope, Send

from .errors import UpstreamError, envelope

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    b"authorization", b"x-api-key", b"expect",
})
RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"server",
                           b"date"})


def upstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in HOP_BY_HOP]


async def open_upstream(client: httpx.AsyncClient, method: str, url: str,
                        headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
    """Send the request and return once the child's response headers arrive.

    A pooled keep-alive connection that the child already closed fails with "disconnected
    without sending a response" before the request was processed; that case is retried once
    on a fresh connection.
    """
    for attempt in (1, 2):
        request = client.build_request(method, url, headers=headers, content=body)
        try:
            return await client.send(request, stream=True)
        except httpx.RemoteProtocolError as exc:
            if attempt == 1 and "without sending a response" in str(exc):
                continue
            raise UpstreamError(f"the model's llama-server dropped the request: {exc!r}") \
                from exc
        except httpx.TransportError as exc:
            raise UpstreamError(f"could not reach the model's llama-server: {exc!r}") from exc
    raise AssertionError("unreachable")


class StreamedResponse:
    """ASGI response relaying an open ``httpx.Response``; ``on_close`` runs exactly once."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None]) -> None:
        self.upstream = upstream
        self.on_close = on_close
        content_type = upstream.headers.get("content-type", "")
        self.is_sse = content_type.startswith("text/event-stream")
        headers = [(k.lower(), v) for k, v in upstream.headers.raw
                   if k.lower() not in RESPONSE_DROP]
        if self.is_sse:
            present = {k for k, _ in headers}
            for name, value in ((b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache")):
                if name not in present:
                    headers.append((name, value))
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watch):
                    task.cancel()
                await asyncio.gather(pump, watch, return_exceptions=True)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()  # type: ignore[misc]
        finally:
            await self.upstream.aclose()
            self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.upstream.status_code,
                    "headers": self.headers})
        try:
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            if self.is_sse:
                error = envelope(502, f"the model's llama-server failed mid-stream: {exc!r}")
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(error).encode() + b"\n\n"})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
