"""Forward one request to a child and relay the answer back untouched.

* The body passes through as the bytes the client sent; only headers are filtered:
  hop-by-hop headers (RFC 9110 §7.6.1: the fixed set and every header a ``Connection``
  header names), ``Host``, the via chain (``x-llama-router-via``: ``hop`` sends a peer the
  one the router parsed) and every credential (``Authorization``, ``X-Api-Key``) stay
  behind, so API keys never reach children (a remote upstream gets its own key instead,
  ``for_remote``). Hop-by-hop headers of the child's response stay
  behind too, and so do its CORS headers (``Access-Control-*``: the router answers for
  itself, ``cors``). ``strip_hop_by_hop`` is the one place that does it, for both directions.
* The response is relayed chunk by chunk as the child writes it (no decoding, no buffering),
  except a small body of known length, which goes out in one piece. A streamed body goes
  straight from the child's connection to the client's (``DirectBody``: written from the
  child connection's protocol callback, no task switch per event) while the client keeps up,
  and through the ASGI ``send``, which waits for it, while it does not.
* A client that disconnects while its request is still running (noticed within
  ``WATCH_AFTER_S`` plus a loop turn) has its connection to the child closed, which makes
  llama-server stop generating and free its slot. Requests that finish sooner never pay for
  the watch.
* If the child fails before its response starts, the caller gets ``UpstreamError`` (a 502
  envelope); if it dies mid-stream, an SSE response gets a final ``data: {"error": ...}`` event
  (after a blank line if the stream broke inside an event, so the error is an event of its
  own), and any other response is aborted (``ResponseAborted``): the client must see a
  truncated body, never a complete-looking one.
* When the shutdown grace period ends (``shutdown.Shutdown``), a relay still running is aborted
  the same way, with the shutdown's 503 instead: as the envelope if the response has not
  started, as the last event of an event stream, or as an aborted body. So is a relay to a
  model being unloaded (``ChildConnections.abort_all(error)``), with the unload's 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Send

from ..errors import UpstreamError, envelope
from ..teams.members import FAIRNESS_HEADER, PRIORITY_HEADER
from .http11 import BodyWriter, body_writer
from .requests import (
    CONTEXT,
    MULTIPART,
    VIA_HEADER,
    RequestContext,
    media_kind,
    with_multipart_model,
)
from .upstream import Cancel, ChildConnections, UpstreamResponse
from .wholeanswer import relay_whole

if TYPE_CHECKING:
    from ..llama.unstreamed import Assembly
    from .jsonscan import Scanned
    from .shutdown import Shutdown

log = logging.getLogger("router.proxy")

# RFC 9110 §7.6.1: headers about one connection, never forwarded in either direction
# (``proxy-connection``: Connection's pre-standard twin, still sent by some clients).
HOP_BY_HOP = frozenset({
    b"connection", b"proxy-connection", b"keep-alive", b"te", b"trailer", b"trailers",
    b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"proxy-authorization",
})
# Not forwarded to the child: hop-by-hop, what the upstream client writes itself (Host,
# Content-Length), credentials, Expect (the body has been read already), where a
# browser says the request comes from (the router decided on it: ``cors``), and the via
# chain (the router's own between routers: ``hop`` sends the one it parsed, with its own id,
# to a peer; a child never gets it, nor a client's made-up one).
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"authorization", b"x-api-key",
                             b"expect", b"origin", b"sec-fetch-site", VIA_HEADER,
                             # the router's own: a peer gets what this router decided
                             FAIRNESS_HEADER, PRIORITY_HEADER}
# Every CORS header a response may carry (Fetch standard): the router's own, never a child's.
CORS_HEADERS = frozenset({
    b"access-control-allow-origin", b"access-control-allow-credentials",
    b"access-control-allow-methods", b"access-control-allow-headers",
    b"access-control-expose-headers", b"access-control-max-age",
    b"access-control-allow-private-network"})
# Not relayed to the client: hop-by-hop, what uvicorn writes itself, and CORS headers.
RESPONSE_DROP = HOP_BY_HOP | CORS_HEADERS | {b"server", b"date"}
CONNECTION_HEADERS = frozenset({b"connection", b"proxy-connection"})
# Connection values that name no other header: the usual ones skip the parsing.
PLAIN_CONNECTION = frozenset({b"keep-alive", b"close", b"upgrade", b"keep-alive, upgrade"})
SSE_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")
SSE_EXTRA_HEADERS = ((b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache"))
SMALL_BODY = 1 << 20  # a body of known length up to this size is relayed in one message
WATCH_AFTER_S = 0.05  # start watching for a client disconnect once a request runs this long


class ResponseAborted(Exception):
    """The child's body broke after the client's response started and it is not an event
    stream: the response must be left incomplete, so that the ASGI server closes the
    client's connection and the client sees no terminating chunk, or fewer bytes than
    announced."""


class Preempted(Exception):
    """The slot queue took the request's slot back before its answer began (``Preemption``):
    nothing was sent to the client, and the request may be sent again."""


class Preemption:
    """Lets another task take a request's slot back while the child has not begun to answer:
    ``__call__`` aborts the exchange (True), or does nothing once the response's head has
    arrived or it was asked already (False); ``relay`` then raises ``Preempted``."""

    __slots__ = ("_cancel", "answered", "asked")

    def __init__(self) -> None:
        self._cancel: Cancel | None = None
        self.asked = False
        self.answered = False

    def __call__(self) -> bool:
        if self.asked or self.answered:
            return False
        self.asked = True
        if self._cancel is not None:
            self._cancel()
        return True


class FailOver(Exception):
    """The upstream answered ``status`` (one of ``fail_over``) and nothing was sent to the
    client: the caller may try another node (``nodes``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"answered {status}")
        self.status = status


class DirectBody:
    """A relay's way around the ASGI ``send`` chain for a streamed body (``upstream``'s
    sink): writes a chunk to the client's transport at once (``http11.BodyWriter``) and
    records it in the request's context as the metrics middleware records what passes its
    ``send`` (``RequestContext.sent``); False when the writer cannot take it now.

    Contract: no middleware between the server and the proxy changes a response's body
    (they read it, or add headers to its start); one that must would have to turn this off.
    """

    __slots__ = ("_sent", "_write", "request", "writer")

    def __init__(self, writer: BodyWriter, request: RequestContext) -> None:
        self.writer = writer
        self._write = writer.write
        self._sent = request.sent
        self.request = request

    def __call__(self, body: bytes) -> bool:
        if self._write(body):
            self._sent(body)
            return True
        return False


def direct_body(scope: Any) -> DirectBody | None:
    """The request's ``DirectBody``, where its server offers a ``BodyWriter`` (``http11``)
    and the edge made its context (``middleware``); None elsewhere (the ASGI ``send`` then
    carries every chunk)."""
    writer = body_writer(scope)
    request = scope.get(CONTEXT)
    if writer is None or request is None:
        return None
    return DirectBody(writer, request)


def upstream_headers(raw: list[tuple[bytes, bytes]], request: RequestContext | None = None
                     ) -> list[tuple[bytes, bytes]]:
    """The client's headers as the child gets them. A JSON body sent with a form's media
    type (``RequestContext.json_as_form``, ``curl -d``) goes as ``application/json``:
    llama-server would also read a form's fields as the request's parameters."""
    kept = strip_hop_by_hop(raw, REQUEST_DROP)
    if request is not None and request.json_as_form:
        kept = [pair for pair in kept if pair[0].lower() != b"content-type"]
        kept.append((b"content-type", b"application/json"))
    return kept


def for_remote(headers: list[tuple[bytes, bytes]], body: bytes, scanned: Scanned | None,
               key: str | None, model: str | None, content_type: bytes = b"", *,
               add: bool = False) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A request as a remote upstream (``remote``) gets it: its own bearer key (the client's
    credentials were dropped already), and the body's ``model`` set to ``model`` when the
    router decides the name the upstream gets (the preset's ``upstream-model``, or the
    default model's for a request the default took): in a JSON body (``scanned``), or the
    ``model`` field of a multipart body (``content_type``), as the router read it; with
    ``add`` a multipart body without the field gets one (a JSON object always does). Only
    models with ``upstream`` pay for this."""
    if key is not None:
        headers = [*headers, (b"authorization", b"Bearer " + key.encode("latin-1"))]
    if model is not None:
        body = with_model(body, scanned, content_type, model, add=add)
    return headers, body


def with_model(body: bytes, scanned: Scanned | None, content_type: bytes, model: str,
               *, add: bool = False) -> bytes:
    """``body`` naming ``model``: the JSON object's ``model`` set where the router read it
    (``scanned``; every other byte kept, ``Scanned.with_model``), or the multipart ``model``
    field's value (with ``add``, a field added where it has none); any other body
    unchanged."""
    if scanned is not None:
        return scanned.with_model(body, model)
    if media_kind(content_type.decode("latin-1")) == MULTIPART:
        return with_multipart_model(content_type.decode("latin-1"), body, model, add=add)
    return body


def strip_hop_by_hop(raw: list[tuple[bytes, bytes]], drop: frozenset[bytes]
                     ) -> list[tuple[bytes, bytes]]:
    """``raw`` without the headers in ``drop`` (lower-case names) and without those that a
    Connection header names, in their order and spelling. One pass; a second one, over what
    is left, only where a Connection header names a header outside ``drop``."""
    kept = []
    named: set[bytes] | None = None
    for pair in raw:
        key = pair[0].lower()
        if key not in drop:
            kept.append(pair)
        elif key in CONNECTION_HEADERS and pair[1].lower() not in PLAIN_CONNECTION:
            named = _connection_options(pair[1], drop, named)
    if named:
        return [pair for pair in kept if pair[0].lower() not in named]
    return kept


def _connection_options(value: bytes, drop: frozenset[bytes], named: set[bytes] | None
                        ) -> set[bytes] | None:
    """``named`` plus the header names in a Connection value that ``drop`` lacks (``close``
    is an option, not a name)."""
    for option in value.lower().split(b","):
        option = option.strip()
        if option and option not in drop and option != b"close":
            if named is None:
                named = set()
            named.add(option)
    return named


async def relay(connections: ChildConnections, method: str, target: bytes,
                headers: list[tuple[bytes, bytes]], body: bytes, *, receive: Receive,
                send: Send, shutdown: Shutdown | None = None,
                fail_over: frozenset[int] = frozenset(),
                direct: DirectBody | None = None,
                preemption: Preemption | None = None, whole: Assembly | None = None) -> None:
    """Send the request to the child and relay its response to the client; a streamed
    body through ``direct`` while the client keeps up, when given (``direct_body``).

    A response whose status is in ``fail_over`` is not relayed: ``FailOver`` is raised
    instead (its connection is closed), so that the caller can try another node. A request
    whose ``preemption`` was asked for before its response's head arrived raises
    ``Preempted`` (its exchange aborted, nothing sent). With ``whole``, it was asked as a
    stream for a client that asked for none: the events make the one whole answer
    (``wholeanswer``), and its slot may be taken back until that answer is sent.

    Raises ``RouterError`` (``UpstreamError``, or ``InvalidHeader`` for a header that cannot
    be forwarded; ``ShuttingDown`` when ``shutdown``'s grace period ends first) only while
    nothing has been sent to the client yet, and ``ResponseAborted`` when a body that is not
    an event stream broke (or the grace period ended) after its response started: the caller
    must send nothing more and return (``forward.proxy``). Returns quietly when the client
    went away.
    """
    cancel = Cancel()
    if shutdown is not None:
        if shutdown.over.is_set():
            raise shutdown.error()
        shutdown.relays.add(cancel)
    watch = DisconnectWatch(receive, cancel)
    if preemption is not None:
        preemption._cancel = cancel
    try:
        try:
            if preemption is not None and preemption.asked:
                raise Preempted
            response = await connections.send(method, target, headers, body, cancel=cancel)
        except UpstreamError as exc:
            _broken(exc, cancel, shutdown, connections, preemption, watch)
            return
        if response.status in fail_over:
            response.abort()
            response.release()
            raise FailOver(response.status)
        try:
            if whole is not None and response.status == 200 and response.event_stream:
                def broken(exc: UpstreamError) -> None:
                    _broken(exc, cancel, shutdown, connections, preemption, watch)
                await relay_whole(response, whole, send,
                                  strip_hop_by_hop(response.headers, RESPONSE_DROP),
                                  direct.writer if direct is not None else None,
                                  lambda: _answered(preemption, response), broken)
                return
            _answered(preemption, response)
            await _relay_response(response, send, cancel, shutdown, connections, direct)
        finally:
            response.release()
    finally:
        watch.stop()
        if shutdown is not None:
            shutdown.relays.discard(cancel)


def _broken(exc: UpstreamError, cancel: Cancel, shutdown: Shutdown | None,
            connections: ChildConnections, preemption: Preemption | None,
            watch: DisconnectWatch) -> None:
    """What the exchange failing before anything was sent means: the shutdown's end, a
    take-back (``Preempted``), the unload that ended it, the child's failure (each raised), or
    the client gone (returns)."""
    if cancel.cancelled:
        if shutdown is not None and shutdown.over.is_set():
            raise shutdown.error() from None
        if preemption is not None and preemption.asked and not watch.gone:
            raise Preempted from None
        return
    if connections.ended is not None:  # ended on purpose (an unload)
        raise connections.ended from None
    raise exc


def _answered(preemption: Preemption | None, response: UpstreamResponse) -> None:
    """The answer is about to go out (its head arrived; for an assembled answer, it is
    whole): its slot can no longer be taken back, unless that was asked in the same instant
    (nothing was sent yet: ``Preempted``)."""
    if preemption is None:
        return
    preemption.answered = True
    if preemption.asked:
        response.abort()  # (the caller releases it)
        raise Preempted


async def _relay_response(response: UpstreamResponse, send: Send, cancel: Cancel,
                          shutdown: Shutdown | None, connections: ChildConnections,
                          direct: DirectBody | None) -> None:
    headers = strip_hop_by_hop(response.headers, RESPONSE_DROP)
    is_sse = response.event_stream
    length = response.header(b"content-length")
    if not is_sse and length is not None and length.isdigit() and int(length) <= SMALL_BODY:
        try:
            content = await response.read()
        except UpstreamError:
            if cancel.cancelled:
                if shutdown is not None and shutdown.over.is_set():
                    raise shutdown.error() from None
                return
            if connections.ended is not None:
                raise connections.ended from None
            raise
        with direct.writer.one_write() if direct is not None else contextlib.nullcontext():
            await send({"type": "http.response.start", "status": response.status,
                        "headers": headers})
            await send({"type": "http.response.body", "body": content})
        return
    if is_sse:
        present = {k for k, _ in headers}
        headers += [(k, v) for k, v in SSE_EXTRA_HEADERS if k not in present]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if direct is not None:
        response.relay_to(direct)
    chunk: bytes | None = b""  # the last one relayed here, when the body breaks
    try:
        while (chunk := await response.next_chunk()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        if direct is not None:  # what went out last, here or directly
            chunk = direct.request.sent_last
        if cancel.cancelled:
            if shutdown is None or not shutdown.over.is_set():
                return  # the client went away
            error = shutdown.error()  # the grace period ended
            status, message = error.status, error.message
        elif connections.ended is not None:  # ended on purpose (an unload)
            status, message = connections.ended.status, connections.ended.message
        else:
            log.warning("%s", exc, extra={"event": "upstream_broken"})
            status, message = 502, f"the model's llama-server failed mid-stream: {exc}"
        if not is_sse:
            raise ResponseAborted(message) from None
        await send({"type": "http.response.body", "more_body": True, "body": _error_event(
            status, message, ended=not chunk or chunk.endswith(SSE_EVENT_ENDS))})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_event(status: int, message: str, ended: bool) -> bytes:
    """The stream's last event; a blank line first ends an event the child left unfinished
    (else the error would be read as the rest of it)."""
    error = envelope(status, message)
    return (b"" if ended else b"\n\n") + b"data: " + json.dumps(error).encode() + b"\n\n"


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
        self.gone = False  # the client disconnected
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            after, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        await wait_disconnect(self._receive)
        self.gone = True
        self._on_gone()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
