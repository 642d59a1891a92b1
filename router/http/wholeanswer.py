"""The relay of an answer that the router asked of the child as a stream for a client that
asked for none (``llama/unstreamed``): the events are read as they come, assembled, and the
client gets the one whole answer llama-server would have sent unstreamed, in one write.

Until that write, the request's slot can still be taken back (``proxy.Preemption``): the
child's connection closes and llama-server stops at its next token; the relay raises
``Preempted``, nothing sent. A failure before the write is a failure before the first byte:
the child's error event becomes the error answer it would have sent unstreamed (its status
and body), a broken or cut stream the 502 envelope (``UpstreamError``), the shutdown's end its
503, a client that left ends the relay quietly. Memory: the answer's own size, and one event
being read (the buffer drops each event once read; no piece is concatenated twice).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Send

from ..errors import UpstreamError
from ..llama.unstreamed import Assembly, ChildFailed, dumps

if TYPE_CHECKING:
    from .http11 import BodyWriter
    from .upstream import UpstreamResponse

# Headers of the child's event stream that its unstreamed answer does not have.
_STREAM_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding",
                             b"cache-control", b"x-accel-buffering"})
JSON_TYPE = b"application/json; charset=utf-8"  # llama-server's, unstreamed
_DONE = b"[DONE]"


class Events:
    """Server-sent events split from the body's pieces, their ``data`` as parsed JSON (llama-
    server ends each event with a blank line; a comment, a ping, has no data)."""

    __slots__ = ("_buffer", "done")

    def __init__(self) -> None:
        self._buffer = bytearray()  # an event not yet ended, never more
        self.done = False  # ``data: [DONE]`` came

    def feed(self, piece: bytes) -> list[Any]:
        """The data of the events that ``piece`` completes, in order."""
        buffer = self._buffer
        buffer += piece
        # the bytes before held no event's end: search only where the piece may end one
        end = buffer.find(b"\n\n", max(0, len(buffer) - len(piece) - 1))
        found: list[Any] = []
        start = 0
        while end >= 0:
            data = _data(bytes(buffer[start:end]))
            if data is _DONE:
                self.done = True
            elif data is not None:
                found.append(data)
            start = end + 2
            end = buffer.find(b"\n\n", start)
        del buffer[:start]
        return found


def _data(event: bytes) -> Any:
    """An event's data, parsed (``_DONE`` for the end marker; None for none)."""
    lines = [line[5:].lstrip(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n")
             if line.startswith(b"data:")]
    if not lines:
        return None
    text = b"\n".join(lines)
    if text == _DONE:
        return _DONE
    try:
        return json.loads(text)
    except ValueError:
        raise UpstreamError("the model's llama-server sent an event that is not JSON") from None


async def relay_whole(response: UpstreamResponse, assembly: Assembly, send: Send,
                      headers: list[tuple[bytes, bytes]], writer: BodyWriter | None,
                      answered: Callable[[], None],
                      broken: Callable[[UpstreamError], None]) -> None:
    """Assemble the child's event stream (``response``, a 200) and send the whole answer with
    the child's ``headers`` (as relayed: ``proxy.strip_hop_by_hop``) but those of a stream.
    ``answered`` is called just before (it raises ``Preempted`` when the slot was taken back);
    ``broken`` decides what a failed read means (it raises, or returns when the relay should
    end quietly: the client went away); ``writer`` makes the answer one write."""
    events = Events()
    try:
        while not events.done and (piece := await response.next_chunk()) is not None:
            for data in events.feed(piece):
                if isinstance(data, dict) and "error" in data and len(data) == 1:
                    raise ChildFailed(data["error"])
                assembly.event(data)
    except UpstreamError as exc:
        broken(exc)
        return
    except ChildFailed as failed:
        answered()
        await _answer(send, headers, writer, failed.status, failed.body())
        return
    whole = assembly.whole()
    if whole is None:
        raise UpstreamError("the model's llama-server ended its answer before its last event")
    answered()
    await _answer(send, headers, writer, 200, dumps(whole))


async def _answer(send: Send, headers: list[tuple[bytes, bytes]], writer: BodyWriter | None,
                  status: int, body: bytes) -> None:
    """The answer, head and body in one write where the server offers it."""
    headers = [pair for pair in headers if pair[0].lower() not in _STREAM_HEADERS]
    headers += [(b"content-type", JSON_TYPE), (b"content-length", str(len(body)).encode())]
    with writer.one_write() if writer is not None else contextlib.nullcontext():
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
