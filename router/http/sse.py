"""Server-sent events: those the router writes (``/models/sse``, ``/logs/stream``) and the one
reader of those it follows (a peer's ``/models/sse``, the CLI's ``events`` and ``logs -f``).

``frame(data)`` is one event: every line of ``data`` becomes its own ``data:`` field, so a line
break inside (``\\n``, ``\\r`` or ``\\r\\n``, all line ends to an SSE parser) can neither end the
event early nor turn the rest of the line into a field of another name. ``respond`` runs an
endless stream: the headers, each event as it comes, a keep-alive comment after
``KEEPALIVE_S`` of silence, until the client disconnects or the router shuts down; a ``HEAD``
gets the headers and an empty body.

``EventReader`` is the reader: sans-I/O (fed the bytes as they arrive, by ``aiter_events`` or
``iter_events``), as the HTML standard parses an event stream (lines end with CRLF, LF or CR;
``data``, ``event`` and ``id`` fields; comments; a blank line dispatches). It is bounded: a
line, or an event's data, longer than ``max_bytes`` (``MAX_EVENT_BYTES``, 1 MiB) raises
``EventTooLarge``, so an endless line from a broken or hostile server costs at most that much
memory and ends the stream, never the reader's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from .proxy import wait_disconnect

HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]
KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
MAX_EVENT_BYTES = 1 << 20  # the longest line, and the most data in one event, a reader takes
_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


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
            # ``asyncio.timeout``, not ``wait_for``: Python 3.11's ``wait_for`` returns the
            # event when it arrives in the same loop step as a cancel, and drops the cancel;
            # the stream then outlived its end (a shutdown waited on it for good).
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    event = await next_event()
            except TimeoutError:
                body = KEEPALIVE
            else:
                body = frame(event)
            await send({"type": "http.response.body", "body": body, "more_body": True})

    await until_disconnect(pump(), receive, closing)
    with contextlib.suppress(Exception):  # the client may already be gone
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive,
                           closing: asyncio.Event) -> None:
    """Run ``work`` until it ends, the client disconnects or the router shuts down; none of
    its tasks outlives it, also when the request itself is cancelled (its API key removed:
    ``keys.Keys``)."""
    tasks = {asyncio.ensure_future(work), asyncio.ensure_future(wait_disconnect(receive)),
             asyncio.ensure_future(closing.wait())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------- reading event streams

class EventTooLarge(ValueError):
    """A line or an event's data over the reader's cap: the stream is given up."""


@dataclass(frozen=True)
class Event:
    """One dispatched event: its data (``data`` lines joined by ``\\n``), type and last id."""

    data: str
    event: str = "message"
    id: str = ""


class EventReader:
    """The events in a byte stream fed in pieces (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()  # the unfinished line
        self._scan = 0  # where in it the next line end may be
        self._started = False  # a byte order mark is skipped at the start only
        self._data: list[str] = []
        self._size = 0  # bytes of data in the event being read
        self._type = ""
        self._id = ""

    def feed(self, chunk: bytes) -> list[Event]:
        """The events ``chunk`` completes. Raises ``EventTooLarge``: the caller gives up."""
        buffer = self._buffer
        buffer += chunk
        if not self._started:
            if len(buffer) < 3 and _BOM.startswith(buffer):
                return []  # maybe the start of a byte order mark
            self._started = True
            if buffer.startswith(_BOM):
                del buffer[:3]
        events: list[Event] = []
        start = 0
        while (end := _LINE_END.search(buffer, max(start, self._scan))) is not None:
            if end.group() == b"\r" and end.end() == len(buffer):
                break  # a CR last: the LF of a CRLF may be in the next piece
            self._line(bytes(buffer[start:end.start()]), events)
            start = end.end()
        del buffer[:start]
        self._scan = max(len(buffer) - 1, 0)
        if len(buffer) > self.max_bytes:
            raise EventTooLarge(f"a line longer than {self.max_bytes} bytes")
        return events

    def _line(self, raw: bytes, events: list[Event]) -> None:
        if not raw:  # dispatch
            if self._data:
                events.append(Event("\n".join(self._data), self._type or "message", self._id))
            self._data, self._size, self._type = [], 0, ""
            return
        if raw[:1] == b":":
            return  # a comment (keep-alives)
        name, colon, value = raw.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        text = value.decode("utf-8", "replace")
        if name == b"data":
            self._size += len(value) + 1
            if self._size > self.max_bytes:
                raise EventTooLarge(f"an event with more than {self.max_bytes} bytes of data")
            self._data.append(text)
        elif name == b"event":
            self._type = text
        elif name == b"id" and "\0" not in text:
            self._id = text


async def aiter_events(next_chunk: Callable[[], Awaitable[bytes | None]],
                       max_bytes: int = MAX_EVENT_BYTES) -> AsyncIterator[Event]:
    """The events of a body read with ``next_chunk`` (None at its end)."""
    reader = EventReader(max_bytes)
    while (chunk := await next_chunk()) is not None:
        for event in reader.feed(chunk):
            yield event


def iter_events(chunks: Iterable[bytes], max_bytes: int = MAX_EVENT_BYTES) -> Iterator[Event]:
    """The events of a body read in ``chunks`` (a blocking client's)."""
    reader = EventReader(max_bytes)
    for chunk in chunks:
        yield from reader.feed(chunk)
