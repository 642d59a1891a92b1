"""A minimal HTTP/1.1 client for the proxied hop to one child.

Why not httpx here: a profile of the proxy under 32 concurrent connections put 30 % of the
router's time in httpcore's pool bookkeeping (every request walks every pooled connection and
asks each idle one whether it is readable). The hop to a child is the simplest HTTP there is
(plain HTTP/1.1 on 127.0.0.1, one server, no redirects, no cookies, no TLS), so this module
does just that, with llhttp (``httptools``, already uvicorn's parser) reading the responses.

Contract:

* One ``ChildConnections`` per child: a LIFO stack of idle keep-alive connections. Taking one
  is O(1); a connection the child closed, or one idle longer than ``IDLE_EXPIRY_S`` (the child
  closes them after 5 s), is discarded instead of used. At most ``max_connections`` are open
  at once (see the class); further requests wait for one in arrival order.
* ``send()`` writes the request in one write and returns once the status line and headers
  have arrived. The body is then read chunk by chunk as the child writes it, de-framed
  (Content-Length, chunked, or neither: then it ends where the child closes the connection,
  and that connection is not reused) but never decoded.
* Nothing that could change the request's framing is ever written: a header name that is not
  an HTTP token, or a CR, LF or NUL in a header value or the target, is refused with
  ``InvalidHeader`` (400) before a connection is even taken.
* A connection's lifecycle is one state (``ConnState``: idle, head due, body, done, closed,
  with the failure's reason) that only one pure function changes (``transition``; the
  connection's ``_apply`` is its one caller), once per exchange, never per chunk.
* A connection returns to the pool only when its response was read to the end and both sides
  kept it alive; anything else closes it. ``abort()`` closes it at once, which tells
  llama-server to stop generating.
* llama-server closes the connection after every event stream although it announces
  keep-alive, so a connection that carried one is closed here first and a fresh one is
  opened in the background: the next request, often another stream, finds one ready.
* A reused connection that closes before any byte of the response arrives is retried once on
  a fresh connection: llama-server closes keep-alive connections after every stream and after
  its idle timeout, and such a request never reached it. One that ``abort_all`` ended is not:
  the server behind it was found gone or frozen, and a fresh connection would hang as well.
* The body is read with ``next_chunk``, or, once the relay hands the response a sink
  (``UpstreamResponse.relay_to``), written by the sink from the connection's own protocol
  callback, as it arrives: no future and no task switch per chunk. What arrives in one read
  goes to the sink in one piece. The sink may refuse a chunk (the client is backed up): that
  chunk and every later one queue for ``next_chunk`` until the relay has taken and sent the
  queue, so the order never changes; the relay's ``next_chunk`` wakes only for a queued
  chunk, the body's end or its failure.
* Errors are ``UpstreamError`` (502): ``connect`` failures, a connection lost before the
  headers, a ``101 Switching Protocols`` (the hop relays HTTP only), and ``BrokenBody`` for a
  body cut off after the headers were relayed.
* The response head is bounded like a request head at the edge: at most
  ``MAX_RESPONSE_HEAD_BYTES`` (interim 1xx heads included) and ``MAX_RESPONSE_HEADERS``
  headers, else the exchange fails with a 502 naming the upstream and its connection is
  aborted; the parser is never fed more of a head than that, so an endless head from a
  hostile peer or remote costs the router at most that much memory per connection. A head
  must also arrive whole within the pool's ``head_timeout_s`` of the request being written
  (``UpstreamTimeout``, 504; llama-server's own read timeout is the default, 600 s): a
  non-streamed answer's head comes when its generation ends, so this is the longest such a
  generation may take.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from collections.abc import Callable, Sequence
from typing import cast

import httptools

from ..config.settings import DEFAULT_UPSTREAM_TIMEOUT_S
from ..errors import BadRequest, RouterError, UpstreamError
from .connstate import (  # the connection's lifecycle
    BEGIN_LAST,
    BEGIN_REUSABLE,
    BODY,
    BODY_ENDED,
    CLOSE,
    CLOSED,
    DONE,
    HEAD_DUE,
    HEADS,
    IDLE,
    IDLE_STATE,
    Aborted,
    ConnectionView,
    Event,
    GivenUp,
    HeadLate,
    InvalidTransition,
    Lost,
    Refused,
    transition,
)
from .connstate import BrokenBody as BrokenBody  # re-exported: the relay's readers
from .connstate import ConnectionClosed as ConnectionClosed  # idem

IDLE_EXPIRY_S = 4.0  # llama-server closes an idle keep-alive connection after 5 s
DEFAULT_MAX_CONNECTIONS = 14  # per child; the supervisor sets it from --threads-http
CONNECT_TIMEOUT_S = 10.0
READ_HIGH_WATER = 256 * 1024  # stop reading from the child while this much is unconsumed
MAX_RESPONSE_HEAD_BYTES = 64 * 1024  # status line, headers and interim responses
MAX_RESPONSE_HEADERS = 100
DEFAULT_HEAD_TIMEOUT_S = DEFAULT_UPSTREAM_TIMEOUT_S  # --upstream-timeout: 600 s


class UpstreamTimeout(UpstreamError):
    """The upstream's response head did not arrive within the pool's deadline (504)."""

    status = 504


class InvalidHeader(BadRequest):
    """A header that cannot be written as itself (400): it would end its line early."""


class _HeadRefused(Exception):
    """Raised from a parser callback to stop reading a head that was refused."""


# -- the request's bytes -----------------------------------------------------------------------

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")  # RFC 9110 §5.6.2: a field name
_LINE_BREAK_OR_NUL = re.compile(rb"[\r\n\0]")
_FORBIDDEN = b"\r\n\0"
_NAMES_SEEN_MAX = 1024
_names_seen: set[bytes] = set()  # names already found to be tokens: a set lookup, not a match
NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
ONE_PIECE_BYTES = 1 << 20  # a request body up to this size is written with its head
Wire = bytes | tuple[bytes, bytes]  # a request as written: one piece, or head and body


def encode_request(method: str, target: bytes, host: bytes,
                   headers: Sequence[tuple[bytes, bytes]], body: bytes, close: bool) -> Wire:
    """The request as written to the child: in one piece, or the head and a body over
    ``ONE_PIECE_BYTES`` apart (joining them would copy the body in one step of the loop).

    Raises ``InvalidHeader`` if a name is not a token or a CR, LF or NUL is in a value or the
    target: written as is, it would let the client end a line early and add headers, or a
    whole request, of its own. Cost on the hot path: a set lookup per name and one
    ``translate`` over the head, which counts every CR, LF and NUL at once (each line this
    function ends contributes exactly one CR and one LF).
    """
    parts = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        if name not in _names_seen:
            _check_name(name)
        parts += (name, b": ", value, b"\r\n")
    lines = 3 + len(headers)  # request line, host, headers, the empty line
    if body or method not in NO_BODY_METHODS:
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        lines += 1
    if close:
        parts.append(b"connection: close\r\n")
        lines += 1
    parts.append(b"\r\n")
    head = b"".join(parts)
    if len(head) - len(head.translate(None, _FORBIDDEN)) != 2 * lines:
        raise _line_break_in(target, headers)
    if len(body) > ONE_PIECE_BYTES:
        return head, body
    return head + body if body else head


def _check_name(name: bytes) -> None:
    if _TOKEN.fullmatch(name) is None:
        raise InvalidHeader(f"header name {name.decode('latin-1')!r} is not a valid HTTP "
                            "field name")
    if len(_names_seen) < _NAMES_SEEN_MAX:
        _names_seen.add(name)


def _line_break_in(target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> InvalidHeader:
    """The error for a head with a CR, LF or NUL where none may be (the slow path)."""
    for name, value in headers:
        if _LINE_BREAK_OR_NUL.search(value):
            return InvalidHeader(f"header {name.decode('latin-1')!r} has a CR, LF or NUL "
                                 "in its value")
    return InvalidHeader("the request target has a CR, LF or NUL in it")


class _Connection(ConnectionView, asyncio.Protocol):
    """One TCP connection to a child, carrying one exchange at a time.

    Its lifecycle is one ``ConnState`` (``_state``): set to ``IDLE_STATE`` by ``__init__``,
    then changed only by ``_apply`` (``tests/test_connection_state.py`` checks both), and so
    is the head deadline that goes with ``HEAD_DUE``. What the pool and the relay ask
    (``closed``, ``complete``, ``reusable``, ``error``, ``given_up``, ...) is read from it.
    The other fields are the exchange's data (the parser, the response head, the request's
    ``_head_only``) and its flow control (the queue, ``_paused``, ``_handed``, the sink,
    ``_head_bytes``), not its lifecycle.
    """

    def __init__(self, on_lost: Callable[[], None] | None = None, *,
                 label: str = "the upstream",
                 head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> None:
        self.transport: asyncio.Transport | None = None
        self.label = label  # names the upstream in errors: "node x (url)", ...
        self.head_timeout_s = head_timeout_s
        self.idle_since = 0.0
        self.on_lost = on_lost  # called once, when a connection that was made closes
        self._loop = asyncio.get_running_loop()
        # Set here, not as class defaults: an instance attribute that shadows a class one is
        # read unspecialised (slower) on every chunk.
        self._state = IDLE_STATE
        self._head_timer: asyncio.TimerHandle | None = None  # armed exactly while HEAD_DUE
        self._paused = False
        self._reset(head_only=False)

    # -- lifecycle -----------------------------------------------------------------------------

    def _apply(self, event: Event) -> None:
        """The one place the state changes: ``transition``, then what the change means for
        the exchange (the head deadline, the head's waiter, the body's waiter)."""
        old = self._state
        new = self._state = transition(old, event)
        phase = new.phase
        if phase is BODY:  # from HEAD_DUE: the head is here, its deadline goes
            timer = self._head_timer
            if timer is not None:
                self._head_timer = None
                timer.cancel()
            self._headers_done.set_result(None)
        elif phase is DONE:  # from BODY
            self._wake()
        elif phase is HEAD_DUE:  # from IDLE or DONE
            self._head_timer = self._loop.call_later(self.head_timeout_s, self._head_late)
        elif new is not old:  # CLOSED
            timer = self._head_timer
            if timer is not None:  # the head was due: its deadline goes
                self._head_timer = None
                timer.cancel()
            error = new.error
            if error is not None and error is not old.error:  # the exchange failed
                headers_done = self._headers_done
                if not headers_done.done():
                    headers_done.set_exception(error)
                    headers_done.exception()  # retrieved: nobody may be awaiting it yet
                self._wake()

    # -- exchange state ---------------------------------------------------------------------

    def _reset(self, head_only: bool) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.event_stream = False
        self._headers_done: asyncio.Future[None] = self._loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        if self._paused and self.transport is not None:  # a body left unread past the mark
            self._paused = False
            self.transport.resume_reading()
        self._body_waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], bool] | None = None  # see ``UpstreamResponse.relay_to``
        self._direct: list[bytes] = []  # for the sink, from the read in progress
        self._handed = False  # ``next_chunk`` returned a chunk its caller may still be sending
        self._head_bytes = 0  # of the response head so far, interim heads included

    def begin(self, request: Wire, head_only: bool, keep_alive: bool = True) -> None:
        """Write ``request``: its response head is now due. ``keep_alive`` False: the
        connection carries no other exchange after this one."""
        assert self.transport is not None
        self._reset(head_only)
        self._apply(BEGIN_REUSABLE if keep_alive and not head_only else BEGIN_LAST)
        if self._state.phase is HEAD_DUE:  # else closed since it was chosen: failed at once
            if isinstance(request, tuple):
                self.transport.writelines(request)
            else:
                self.transport.write(request)

    def _head_late(self) -> None:
        self._apply(HeadLate(UpstreamTimeout(f"{self.label} sent no response head within "
                                             f"{self.head_timeout_s:g} s")))
        self.abort()

    async def headers_received(self) -> None:
        await self._headers_done

    async def next_chunk(self) -> bytes | None:
        """The body received since the last call (waiting for some), or None at its end.
        Calling it again says the chunk it returned last has been sent on."""
        self._handed = False
        while not self._chunks:
            state = self._state
            if state.error is not None:
                raise state.error
            if state.phase is not BODY and state.phase is not HEAD_DUE:  # ``complete``
                return None
            self._body_waiter = self._loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        # Everything that has arrived goes out in one piece: fewer writes to the client.
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._handed = True
        if self._paused and self.transport:  # all taken: read on
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        phase = self._state.phase
        if phase is BODY:  # the hot path: one check per read
            self._feed(data)
        elif phase is HEAD_DUE:
            room = MAX_RESPONSE_HEAD_BYTES - self._head_bytes
            if len(data) > room:  # feed no more of a head than its bound
                self._head_bytes = MAX_RESPONSE_HEAD_BYTES
                self._feed(data[:room])
                if self._state.phase is HEAD_DUE:
                    self._refuse_head(f"a response head over {MAX_RESPONSE_HEAD_BYTES} "
                                      "bytes")
                if self._state.phase is CLOSED:  # refused, here or while parsing
                    return
                data = data[room:]
            else:
                self._head_bytes += len(data)
            self._feed(data)
        elif phase is DONE:  # after the response: a HEAD's announced body, or unasked-for
            self._feed(data)
        elif phase is IDLE:  # before any request: no answer to anything, never read
            self.abort()
        # CLOSED: aborted or closed here, nothing more is read

    def _refuse_head(self, what: str) -> None:
        self._apply(Refused(UpstreamError(f"{self.label} sent {what}; the router reads no "
                                          "more of it")))
        self.abort()

    def _feed(self, data: bytes) -> None:
        if not data:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101: on_headers_complete failed the exchange
            self.abort()
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, InvalidTransition):  # a bug, not the upstream's
                raise exc.__context__ from None
            self._apply(Refused(UpstreamError(f"{self.label} sent a malformed response: "
                                              f"{exc}")))
            self.abort()
        finally:
            if self._direct:  # the body of this read, for the sink: before anyone wakes
                self._to_sink()

    def _to_sink(self) -> None:
        direct = self._direct
        body = direct[0] if len(direct) == 1 else b"".join(direct)
        direct.clear()
        sink = self.sink
        if sink is None or not sink(body):
            self._queue(body)

    def eof_received(self) -> bool | None:
        state = self._state
        if state.until_eof:  # a clean close ends such a body
            self._apply(BODY_ENDED)
        elif state.phase is IDLE or state.phase is DONE:  # closed now: never handed out
            self._apply(CLOSE)
        return False  # close the transport; connection_lost follows (and fails an exchange)

    def connection_lost(self, exc: Exception | None) -> None:
        self._apply(Lost(self._head_bytes > 0))
        on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost()

    # -- llhttp callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state.phase is DONE:  # a head nobody asked for, after the response
            raise _HeadRefused  # stops the parser: ``_feed`` refuses what was sent
        headers = self.headers
        if len(headers) >= MAX_RESPONSE_HEADERS:
            self._refuse_head(f"more than {MAX_RESPONSE_HEADERS} response headers")
            raise _HeadRefused  # stops the parser; the exchange has failed already
        headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._state.phase is not HEAD_DUE:  # a head nobody asked for, after the response
            raise _HeadRefused
        status = self._parser.get_status_code()
        if status == 101:  # llhttp stops here (HttpParserUpgrade); the hop is HTTP only
            self._apply(Refused(UpstreamError(
                "the model's llama-server answered 101 Switching Protocols; the router does "
                "not relay protocol upgrades")))
            self.abort()  # what follows is another protocol: never read, never reused
            return
        if 100 <= status < 200:  # an interim response: the real one follows
            self.headers = []
            return
        self.status = status
        framed = False
        event_stream = False
        for name, value in self.headers:  # one pass, names already lower-case
            if name == b"content-type":
                event_stream = event_stream or value.startswith(b"text/event-stream")
            elif name == b"content-length":
                framed = True
            elif name == b"transfer-encoding":
                framed = framed or value.rstrip().lower().endswith(b"chunked")
        self.event_stream = event_stream
        no_body = self._head_only or status in (204, 304)
        # llama-server closes the connection after every event stream although it announces
        # keep-alive: such a connection is never reused (the pool opens a fresh one).
        self._apply(HEADS[self._parser.should_keep_alive() and not event_stream]
                    [not framed and not no_body])
        if no_body:
            self._apply(BODY_ENDED)

    def on_body(self, body: bytes) -> None:
        if self._state.phase is not BODY:  # a HEAD response's announced body: not the answer
            return
        if self.sink is not None and not self._chunks and not self._handed:
            self._direct.append(body)  # to the sink once this read is parsed (``_to_sink``)
            return
        self._queue(body)

    def _queue(self, body: bytes) -> None:
        """Keep ``body`` for ``next_chunk``."""
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._state.phase is BODY:  # else an interim response's end, or a HEAD's body
            self._apply(BODY_ENDED)

    # -- lifetime ------------------------------------------------------------------------------

    def abort(self) -> None:
        """Close the connection at once; an exchange in progress fails."""
        self._apply(Aborted(self._head_bytes > 0))
        if self.transport is not None:
            self.transport.abort()

    def give_up(self) -> None:
        """``abort``, for ``abort_all``: the exchange in progress is never retried."""
        self._apply(GivenUp(self._head_bytes > 0))
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close the connection once what was written is sent: nothing is left to read."""
        self._apply(CLOSE)
        if self.transport is not None:
            self.transport.close()


async def probe(host: str, port: int, target: bytes) -> int:
    """One ``GET target`` on a fresh connection, closed after it: the response's status (a
    liveness check: the server still accepts and answers, whatever its keep-alive pool
    holds). Raises ``UpstreamError`` when it cannot connect or the connection closes first;
    the caller bounds the wait (``asyncio.timeout``). A few syscalls and no pool: what an
    idle router spends on its children's liveness."""
    conn = _Connection(label=f"{host}:{port}")
    await _connect(conn, host, port)
    try:
        conn.begin(encode_request("GET", target, f"{host}:{port}".encode(), (), b"",
                                  close=True), head_only=False, keep_alive=False)
        await conn.headers_received()
        return conn.status
    finally:
        conn.abort()  # the body, if any, is not wanted; nothing is reused


class Cancel:
    """Lets another task abort an exchange in progress (the client went away)."""

    __slots__ = ("cancelled", "conn", "waiter")

    def __init__(self) -> None:
        self.cancelled = False
        self.conn: _Connection | None = None
        self.waiter: asyncio.Future[_Connection | None] | None = None  # queued for a place

    def __call__(self) -> None:
        self.cancelled = True
        if self.conn is not None:
            self.conn.abort()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionClosed(received_any=False))


class UpstreamResponse:
    """A response whose headers have arrived; read its body with ``next_chunk``.

    ``release()`` must be called exactly once (``proxy.relay`` does): it returns the
    connection to the pool if the body was read to the end, and closes it otherwise.
    """

    def __init__(self, pool: ChildConnections, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self.event_stream = conn.event_stream  # text/event-stream

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def relay_to(self, sink: Callable[[bytes], bool]) -> None:
        """From now on, give each piece of the body to ``sink`` as it arrives, from the
        connection's protocol callback; ``sink`` returns False when it cannot take it now
        (then ``next_chunk`` returns it, and every later piece until the queue was taken).
        ``next_chunk`` still reports the end and failures, and must be called until it
        returns None or raises: the caller owns the exchange as before."""
        self._conn.sink = sink

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as the child wrote it; None at its end."""
        try:
            return await self._conn.next_chunk()
        except ConnectionClosed as exc:
            raise BrokenBody(str(exc)) from None

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def abort(self) -> None:
        """Close the connection now (the client went away): the child stops generating."""
        self._conn.abort()

    def release(self) -> None:
        self._conn.sink = None
        self._pool._release(self._conn)


class ChildConnections:
    """Keep-alive connections to one child at ``host:port``, at most ``max_connections``.

    Each open connection holds one of llama-server's HTTP threads for as long as it stays
    open, idle or not, and a connection beyond its fixed thread count may wait for a free
    thread until some keep-alive connection times out (5 s; a race in cpp-httplib's dynamic
    threads). So the pool never opens more than ``max_connections``: a request that finds
    none idle and the cap reached waits, first come first served, for the next connection
    released or closed.
    """

    def __init__(self, host: str, port: int,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, *,
                 label: str | None = None,
                 head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> None:
        self.host = host
        self.port = port
        # Names the upstream in the errors its exchanges fail with.
        self.label = label or f"the model's llama-server on port {port}"
        self.head_timeout_s = head_timeout_s
        self.max_connections = max(1, max_connections)
        self._host_header = f"{host}:{port}".encode()
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0  # connections open or being opened
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = \
            collections.deque()
        self._closed = False
        # Why every exchange was ended on purpose (``abort_all(error)``): what the requests
        # that were using it answer instead of a 502.
        self.ended: RouterError | None = None
        self._warming: set[asyncio.Task[None]] = set()
        self._made: set[_Connection] = set()  # connected and not yet lost, idle or in use

    @property
    def open_connections(self) -> int:
        return self._open

    async def send(self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]],
                   body: bytes, *, keep_alive: bool = True,
                   cancel: Cancel | None = None) -> UpstreamResponse:
        """Send one request; return once the response headers arrive.

        ``target`` is the path and query as the client sent them; ``headers`` must already
        be filtered (no hop-by-hop headers, no Host, no Content-Length). Raises
        ``InvalidHeader`` (400) before anything is sent for a header that cannot be written
        as itself (``encode_request``). Calling ``cancel`` aborts the exchange, here or later
        while the body is read.
        """
        if self.ended is not None:
            raise ConnectionClosed(received_any=False)  # the relay answers ``ended``
        request = encode_request(method, target, self._host_header, headers, body,
                                 close=not keep_alive or self._closed)
        head_only = method == "HEAD"

        fresh = False
        while True:
            conn, reused = await self._acquire(fresh, cancel)
            if cancel is not None:
                if cancel.cancelled:
                    self._release(conn)
                    raise ConnectionClosed(received_any=False)
                cancel.conn = conn
            conn.begin(request, head_only, keep_alive)
            try:
                await conn.headers_received()
            except ConnectionClosed as exc:
                conn.abort()
                if reused and not exc.received_any and not conn.given_up and \
                        not (cancel and cancel.cancelled):
                    fresh = True  # a stale keep-alive connection: once more, on a new one
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return UpstreamResponse(self, conn)

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when released."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def abort_all(self, error: RouterError | None = None) -> None:
        """Abort every connection, idle or in use. Without ``error``, the server behind them
        is gone (a remote upstream or peer that stopped answering): a request in flight on
        one sees its exchange break (a 502, or a stream's error event) and the pool stays
        usable. With ``error``, the router ends them on purpose (the model was unloaded):
        every request on it, in flight or still to send, answers ``error`` instead
        (``proxy.relay``), and the pool is done."""
        if error is not None:
            self.ended = error
            self._closed = True
        for conn in list(self._made):
            conn.give_up()  # never retried on a fresh one: that would hang as well

    # -- pool ---------------------------------------------------------------------------------

    async def _acquire(self, fresh: bool, cancel: Cancel | None = None
                       ) -> tuple[_Connection, bool]:
        """A connection and whether it was used before: an idle one (unless ``fresh``), a
        new one within the cap, or else the next one released (``cancel`` ends the wait)."""
        if not fresh and (conn := self._take()) is not None:
            return conn, True
        if self._open < self.max_connections and not self._waiters:
            self._open += 1
            return await self._open_reserved(), False
        waiter: asyncio.Future[_Connection | None] = \
            asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        if cancel is not None:
            cancel.waiter = waiter
        try:
            granted = await waiter
        except ConnectionClosed:  # cancelled while waiting: nothing was granted
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            raise
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # granted as we were cancelled
                self._give_back(waiter.result())
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        if granted is None:  # a free place, reserved for us
            return await self._open_reserved(), False
        return granted, True

    async def _open_reserved(self) -> _Connection:
        """Connect in a place already counted in ``_open``; the place is freed exactly once,
        by the connection's loss or, if it was never made, here."""
        conn = _Connection(on_lost=lambda: self._lost(conn), label=self.label,
                           head_timeout_s=self.head_timeout_s)
        try:
            await self._connect(conn)
        except BaseException:
            if conn.transport is None:
                self._open -= 1
                self._grant_places()
            else:
                conn.abort()  # made after all (a late cancellation): its loss frees the place
            raise
        if not conn.closed:
            self._made.add(conn)
        return conn

    def _give_back(self, granted: _Connection | None) -> None:
        if granted is None:
            self._open -= 1
            self._grant_places()
        else:
            self._release(granted)

    def _lost(self, conn: _Connection) -> None:
        """A connection closed, by either side: its place is free."""
        self._made.discard(conn)
        self._open -= 1
        self._grant_places()

    def _grant_places(self) -> None:
        while self._waiters and self._open < self.max_connections:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._open += 1
                waiter.set_result(None)

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable and now - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        if (conn.event_stream and conn.complete and not self._closed and not self._warming
                and not self._waiters):
            self._warm_one_later()
        if self._closed or not conn.reusable:  # closed, unfinished, or not to be kept alive
            if conn.complete:
                conn.close()
            else:
                conn.abort()  # unread body: the child must not keep generating it
            return  # its place frees when the close completes (``_lost``)
        while self._waiters:  # hand it straight to the longest waiting request
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        now = time.monotonic()
        conn.idle_since = now
        self._idle.append(conn)
        # The oldest connections sit at the bottom of the stack: drop the expired ones.
        while self._idle and now - self._idle[0].idle_since >= IDLE_EXPIRY_S:
            self._idle.popleft().close()

    def _warm_one_later(self) -> None:
        """Open a connection in the background to replace one the child is closing."""
        if self._open >= self.max_connections:
            return
        self._open += 1
        task = asyncio.get_running_loop().create_task(self._warm_one())
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm_one(self) -> None:
        try:
            conn = await self._open_reserved()
        except UpstreamError:
            return  # the next request finds out for itself
        self._release(conn)  # no exchange yet: reusable

    async def _connect(self, conn: _Connection) -> None:
        await _connect(conn, self.host, self.port)


async def _connect(conn: _Connection, host: str, port: int) -> None:
    """Connect ``conn`` to ``host:port``; ``UpstreamError`` when that fails or takes longer
    than ``CONNECT_TIMEOUT_S``."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await loop.create_connection(lambda: conn, host, port)
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"could not reach the model's llama-server on port "
                            f"{port}: {exc!r}") from exc
