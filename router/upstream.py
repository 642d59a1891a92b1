"""A minimal HTTP/1.1 client for the proxied hop to one child.

Why not httpx here: a profile of the proxy under 32 concurrent connections put 30 % of the
router's time in httpcore's pool bookkeeping (every request walks every pooled connection and
asks each idle one whether it is readable). The hop to a child is the simplest HTTP there is
(plain HTTP/1.1 on 127.0.0.1, one server, no redirects, no cookies, no TLS), so this module
does just that, with llhttp (``httptools``, already uvicorn's parser) reading the responses.

Contract:

* One ``ChildConnections`` per child: a LIFO stack of idle keep-alive connections. Taking one
  is O(1); a connection the child closed, or one idle longer than ``IDLE_EXPIRY_S`` (the child
  closes them after 5 s), is discarded instead of used.
* ``send()`` writes the request in one write and returns once the status line and headers
  have arrived. The body is then read chunk by chunk as the child writes it, de-framed
  (Content-Length or chunked) but never decoded.
* A connection returns to the pool only when its response was read to the end and both sides
  kept it alive; anything else closes it. ``abort()`` closes it at once, which tells
  llama-server to stop generating.
* A reused connection that closes before any byte of the response arrives is retried once on
  a fresh connection: llama-server closes keep-alive connections after every stream and after
  its idle timeout, and such a request never reached it.
* Errors are ``UpstreamError`` (502): ``connect`` failures, a connection lost before the
  headers, and ``BrokenBody`` for a body cut off after the headers were relayed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from typing import cast

import httptools

from .errors import UpstreamError

IDLE_EXPIRY_S = 4.0  # llama-server closes an idle keep-alive connection after 5 s
MAX_IDLE = 64  # idle connections kept per child
CONNECT_TIMEOUT_S = 10.0
READ_HIGH_WATER = 256 * 1024  # stop reading from the child while this much is unconsumed


class BrokenBody(UpstreamError):
    """The child's response ended early, after its headers were already relayed."""


class _Connection(asyncio.Protocol):
    """One TCP connection to a child, carrying one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._reset(head_only=False)

    # -- exchange state ---------------------------------------------------------------------

    def _reset(self, head_only: bool) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.received_any = False
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self._headers_done: asyncio.Future[None] = self._loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._body_waiter: asyncio.Future[None] | None = None

    def begin(self, request: bytes, head_only: bool) -> None:
        assert self.transport is not None
        self._reset(head_only)
        self.transport.write(request)

    async def headers_received(self) -> None:
        await self._headers_done

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while not self._chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._body_waiter = self._loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < READ_HIGH_WATER // 2 and self.transport:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        if not self._headers_done.done():
            self._headers_done.set_exception(error)
            self._headers_done.exception()  # retrieved: nobody may be awaiting it yet
        self._wake()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the model's llama-server sent a malformed response: "
                                     f"{exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers_done.done():
            self._fail(BrokenBody("the model's llama-server closed the connection "
                                  "mid-response"))
        else:
            self._fail(ConnectionClosed(self.received_any))

    # -- llhttp callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim response: the real one follows
            self.headers = []
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._headers_done.set_result(None)
        if self._head_only or status in (204, 304):
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        if self.complete:  # a HEAD response's announced body: not part of the answer
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status == 0 or self.complete:  # end of an interim response, or HEAD's body
            return
        self.complete = True
        if self._head_only:
            self.keep_alive = False  # llhttp cannot skip a HEAD response's body: never reuse
        self._wake()

    # -- lifetime ------------------------------------------------------------------------------

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ConnectionClosed(UpstreamError):
    """The connection closed before a complete response head arrived."""

    def __init__(self, received_any: bool) -> None:
        super().__init__("the model's llama-server closed the connection without a response")
        self.received_any = received_any


class Cancel:
    """Lets another task abort an exchange in progress (the client went away)."""

    __slots__ = ("cancelled", "conn")

    def __init__(self) -> None:
        self.cancelled = False
        self.conn: _Connection | None = None

    def __call__(self) -> None:
        self.cancelled = True
        if self.conn is not None:
            self.conn.abort()


class UpstreamResponse:
    """A response whose headers have arrived; read its body with ``next_chunk``.

    ``release()`` must be called exactly once (``StreamedResponse`` does): it returns the
    connection to the pool if the body was read to the end, and closes it otherwise.
    """

    def __init__(self, pool: ChildConnections, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

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
        self._pool._release(self._conn)


class ChildConnections:
    """Keep-alive connections to one child at ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._host_header = f"{host}:{port}".encode()
        self._idle: collections.deque[_Connection] = collections.deque()
        self._closed = False

    async def send(self, method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                   body: bytes, *, keep_alive: bool = True,
                   cancel: Cancel | None = None) -> UpstreamResponse:
        """Send one request; return once the response headers arrive.

        ``target`` is the path and query as the client sent them; ``headers`` must already
        be filtered (no hop-by-hop headers, no Host, no Content-Length). Calling ``cancel``
        aborts the exchange, here or later while the body is read.
        """
        parts = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", self._host_header,
                 b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        if not keep_alive or self._closed:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        request = b"".join(parts)
        head_only = method == "HEAD"

        conn = self._take()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            if cancel is not None:
                if cancel.cancelled:
                    conn.abort()
                    raise ConnectionClosed(received_any=False)
                cancel.conn = conn
            conn.begin(request, head_only)
            try:
                await conn.headers_received()
            except ConnectionClosed as exc:
                conn.abort()
                if reused and not exc.received_any and not (cancel and cancel.cancelled):
                    conn, reused = None, False  # a stale keep-alive connection: once more
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            if not keep_alive:
                conn.keep_alive = False
            return UpstreamResponse(self, conn)

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when released."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    # -- pool ---------------------------------------------------------------------------------

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        if (self._closed or conn.closed or not conn.complete or not conn.keep_alive
                or len(self._idle) >= MAX_IDLE):
            if conn.complete:
                conn.close()
            else:
                conn.abort()  # unread body: the child must not keep generating it
            return
        now = time.monotonic()
        conn.idle_since = now
        self._idle.append(conn)
        # The oldest connections sit at the bottom of the stack: drop the expired ones.
        while self._idle and now - self._idle[0].idle_since >= IDLE_EXPIRY_S:
            self._idle.popleft().close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"could not reach the model's llama-server on port "
                                f"{self.port}: {exc!r}") from exc
        return conn
