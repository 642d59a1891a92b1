"""Forward one request to a child and relay the answer back untouched.

* The body passes through as the bytes the client sent; only headers are filtered:
  hop-by-hop headers, ``Host`` and every credential (``Authorization``, ``X-Api-Key``) stay
  behind, so API keys never reach children.
* The response is relayed chunk by chunk as the child writes it (no decoding, no buffering),
  except a small body of known length, which goes out in one piece.
* A client that disconnects while its request is still running (noticed within
  ``WATCH_AFTER_S`` plus a loop turn) has its connection to the child closed, which makes
  llama-server stop generating and free its slot. Requests that finish sooner never pay for
  the watch.
* If the child fails before its response starts, the caller gets ``UpstreamError`` (a 502
  envelope); if it dies mid-stream, an SSE response gets a final ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from starlette.types import Receive, Send

from .errors import UpstreamError, envelope
from .upstream import Cancel, ChildConnections, UpstreamResponse

log = logging.getLogger("router.proxy")

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    b"authorization", b"x-api-key", b"expect",
})
RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"server",
                           b"date"})
SSE_EXTRA_HEADERS = ((b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache"))
SMALL_BODY = 1 << 20  # a body of known length up to this size is relayed in one message
WATCH_AFTER_S = 0.05  # start watching for a client disconnect once a request runs this long


def upstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in HOP_BY_HOP]


async def relay(connections: ChildConnections, method: str, target: bytes,
                headers: list[tuple[bytes, bytes]], body: bytes, *, receive: Receive,
                send: Send) -> None:
    """Send the request to the child and relay its response to the client.

    Raises ``UpstreamError`` only while nothing has been sent to the client yet. Returns
    quietly when the client went away.
    """
    cancel = Cancel()
    watch = DisconnectWatch(receive, cancel)
    try:
        try:
            response = await connections.send(method, target, headers, body, cancel=cancel)
        except UpstreamError:
            if cancel.cancelled:
                return
            raise
        try:
            await _relay_response(response, send, cancel)
        finally:
            response.release()
    finally:
        watch.stop()


async def _relay_response(response: UpstreamResponse, send: Send, cancel: Cancel) -> None:
    headers = [(k, v) for k, v in response.headers if k not in RESPONSE_DROP]
    is_sse = response.event_stream
    length = response.header(b"content-length")
    if not is_sse and length is not None and length.isdigit() and int(length) <= SMALL_BODY:
        try:
            content = await response.read()
        except UpstreamError:
            if cancel.cancelled:
                return
            raise
        await send({"type": "http.response.start", "status": response.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": content})
        return
    if is_sse:
        present = {k for k, _ in headers}
        headers += [(k, v) for k, v in SSE_EXTRA_HEADERS if k not in present]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    try:
        while (chunk := await response.next_chunk()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        if cancel.cancelled:
            return
        log.warning("%s", exc, extra={"event": "upstream_broken"})
        if is_sse:
            error = envelope(502, f"the model's llama-server failed mid-stream: {exc}")
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(error).encode() + b"\n\n"})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has disconnected (the request body must be read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Call ``on_gone`` when the client disconnects, watching only after ``after`` seconds.

    Most proxied requests finish within milliseconds; starting a task for each of them would
    cost more than the request. A timer is nearly free, and cancelled when the request ends.
    """

    def __init__(self, receive: Receive, on_gone: Callable[[], None],
                 after: float = WATCH_AFTER_S) -> None:
        self._receive = receive
        self._on_gone = on_gone
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            after, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        await wait_disconnect(self._receive)
        self._on_gone()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
