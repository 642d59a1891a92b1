"""Server-sent events the router writes itself (``/models/sse``, ``/logs/stream``).

``frame(data)`` is one event: every line of ``data`` becomes its own ``data:`` field, so a line
break inside (``\\n``, ``\\r`` or ``\\r\\n``, all line ends to an SSE parser) can neither end the
event early nor turn the rest of the line into a field of another name. ``respond`` runs an
endless stream: the headers, each event as it comes, a keep-alive comment after
``KEEPALIVE_S`` of silence, until the client disconnects or the router shuts down; a ``HEAD``
gets the headers and an empty body.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.types import Receive, Scope, Send

from .proxy import wait_disconnect

HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]
KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def frame(data: str) -> bytes:
    """One event carrying ``data`` (see the module docstring)."""
    return b"".join(b"data: " + line.encode() + b"\n"
                    for line in _LINE_BREAK.split(data)) + b"\n"


async def respond(scope: Scope, receive: Receive, send: Send,
                  next_event: Callable[[], Awaitable[str]], closing: asyncio.Event) -> None:
    """Stream ``next_event()`` results as events (see the module docstring). The caller
    subscribes before calling, so nothing published after the headers is missed."""
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    if scope["method"] == "HEAD":
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return

    async def pump() -> None:
        while True:
            try:
                body = frame(await asyncio.wait_for(next_event(), KEEPALIVE_S))
            except TimeoutError:
                body = KEEPALIVE
            await send({"type": "http.response.body", "body": body, "more_body": True})

    await until_disconnect(pump(), receive, closing)
    with contextlib.suppress(Exception):  # the client may already be gone
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive,
                           closing: asyncio.Event) -> None:
    """Run ``work`` until it ends, the client disconnects or the router shuts down."""
    tasks = {asyncio.ensure_future(work), asyncio.ensure_future(wait_disconnect(receive)),
             asyncio.ensure_future(closing.wait())}
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
