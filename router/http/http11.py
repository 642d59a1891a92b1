"""The HTTP/1.1 server protocol: uvicorn's (httptools), answering unparsable requests with the
router's JSON error envelope, and ending connections whose request head never completes.

uvicorn answers a request its parser rejects (bad framing, a Content-Length together with
Transfer-Encoding, a bad chunk size, a control character in a header, ...) with a plain-text
``400 Invalid HTTP request received.`` before the app sees anything. Clients of an OpenAI-style
API expect the envelope for every error, so this protocol writes the same 400 as JSON. The
connection still closes after it: what follows a request that could not be framed cannot be
trusted (no request smuggling).

uvicorn also waits for ever for a request head that never ends: a client that connects and
sends nothing, blank lines, or a header a byte at a time holds its connection for good (the
"slowloris" pattern). Here a request head has ``REQUEST_HEAD_TIMEOUT_S`` from the connection
or from the first byte of the request; then the client gets a 408 envelope and the connection
closes. An idle keep-alive connection between requests is closed after ``KEEP_ALIVE_IDLE_S``
(uvicorn's timeout, set by ``serve``): longer than the idle expiry of the common clients'
pools (httpx and the OpenAI SDK 5 s, aiohttp 15 s, Node's fetch 4 s), so that a client never
sends its next request on a connection the router is closing at that instant (a request
lost as "server disconnected", with uvicorn's default of 5 s).

A request body has a deadline too, between chunks (``body_timeout_s``, ``--body-timeout``):
a body that stops arriving while the app waits for it is cut, the app sees the client leave,
and the client gets a 408 envelope (the connection closes). A body that keeps flowing is never
cut, however long it takes, and time the router itself is not reading (its buffer full) does
not count. Once the request is answered (a 401, a 413) the rest of its body gets one deadline
in all, then the connection closes: a client without a key cannot hold a connection by
trickling a body nobody will read. A body whose framing breaks once its request is with the
app (a bad chunk-size line, data not ended by CRLF) is that request's error: the app sees the
client leave, the client gets a 400 envelope (or, if an answer is already going out, the
connection closes), never a wait for bytes that cannot come. At shutdown the deadline shrinks to
``SHUTDOWN_BODY_TIMEOUT_S``, so a stalled upload does not hold SIGTERM for the grace period.

Over ``connection_cap`` open connections (``fdlimit``) the idle connection (between requests)
idle the longest among those that never carried a request with a valid API key is closed to
make room; when there is none, the new one gets a 503 envelope with ``Retry-After`` and is
closed before its request is read. So connections without a key kept alive on the public
``/health`` cannot keep a client with a key out.

A request head is bounded in bytes, not only in time, tighter than llama-server's own limits
(cpp-httplib: 8,192 bytes a target or header line, 100 headers), so nothing the router accepts
is refused by a child with a bare 400: the target at ``MAX_TARGET_BYTES`` (else 414), a header's
name and value at ``MAX_HEADER_BYTES`` and ``MAX_HEADERS`` of them (else 431), and the whole
head, blank lines before it included, at ``MAX_HEAD_BYTES`` (else 431). The parser is never fed
more than that of one head, so an endless head costs at most that much memory per connection.
A request asking to switch protocols (``Upgrade`` with ``Connection: upgrade``, or ``CONNECT``)
is refused with a 400: the router serves HTTP/1.1 only, no WebSocket (uvicorn runs with
``ws="none"``). Every refusal is the envelope, closes the connection, and is counted by reason
(``Refusals``, exposed as ``llamarouter_edge_refusals_total``).

A streamed response's body can also go out without the ASGI ``send`` chain: ``body_writer``
gives the app a ``BodyWriter`` for its request, which writes a body chunk to the client's
transport at once, framed as uvicorn frames it, from any callback (``proxy`` writes from the
child connection's ``data_received``: no task switch per relayed event). It only takes a chunk
when uvicorn's ``send`` would write it at once (the response started with chunked framing, not
HEAD, not complete, the client connected and not backed up); otherwise it says no and the app
uses ``send``, which waits for the client as before. The response's start and end always go
through ``send``. ``BodyWriter.one_write`` makes a small response's head and body, sent one
after the other, go out in one write (one system call, not two).

A response header's name goes out in lower case: uvicorn lowers every name as it writes the
head. ``KeepCase`` is a name that keeps its case on the wire (the CORS headers, which
llama-server's clients look up in a case-sensitive ``dict``: ``cors``).

This module is the one adapter to uvicorn's private protocol: nothing else in the router reads
a private attribute of it. Tested against uvicorn's ``httptools_impl`` in the versions
``pyproject.toml`` allows, with a contract test of every private name used here
(``tests/test_http11.py``): a new minor version is tested before the bound moves.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from ..config.settings import DEFAULT_BODY_TIMEOUT_S
from ..errors import envelope_bytes
from .requests import BODY_TIMED_OUT, CONTEXT, RequestContext

REQUEST_HEAD_TIMEOUT_S = 15.0
KEEP_ALIVE_IDLE_S = 30  # an idle keep-alive connection's life (see the module docstring)
SHUTDOWN_BODY_TIMEOUT_S = 1.0  # a body's deadline between chunks once shutdown has begun
LINGER_S = 2.0  # after an error answer, how long the client may take to close its side

UNPARSABLE = ("the request is not valid HTTP/1.1 (its start line, headers or framing could "
              "not be parsed); the connection is closed")
MALFORMED_BODY = ("the request body's framing is malformed (a bad chunk size line or chunk end); "
                  "the connection is closed")
HEAD_TIMEOUT = (f"the request's start line and headers did not arrive within "
                f"{REQUEST_HEAD_TIMEOUT_S:g} s; the connection is closed")

# The request head's bounds (see the module docstring); llama-server's are 8,192 and 100.
MAX_TARGET_BYTES = 8000  # the request target (path and query) as sent
MAX_HEADER_BYTES = 8000  # one header's name and value
MAX_HEADERS = 64  # the router adds a few on the hop (host, length, via, key): under 100 there
MAX_HEAD_BYTES = 64 * 1024  # the whole head: request line, headers, blank lines before it

TARGET_TOO_LONG = (f"the request target is longer than {MAX_TARGET_BYTES} bytes; the "
                   "connection is closed")
HEADER_TOO_LARGE = (f"a request header is longer than {MAX_HEADER_BYTES} bytes (name and "
                    "value); the connection is closed")
TOO_MANY_HEADERS = f"the request has more than {MAX_HEADERS} headers; the connection is closed"
HEAD_TOO_LARGE = (f"the request's start line and headers are longer than {MAX_HEAD_BYTES} "
                  "bytes; the connection is closed")
UPGRADE_REFUSED = ("the router does not switch protocols (Upgrade, CONNECT): it serves "
                   "HTTP/1.1 only, no WebSocket; the connection is closed")


class KeepCase(bytes):
    """A response header name as HTTP defines names: equal to its spelling in any case (and
    hashed as its lower-case one, the ASGI form), written on the wire in its own. uvicorn
    writes each name as ``name.lower()`` (``RequestResponseCycle.send``); this name's
    ``lower()`` is itself, so the head carries ``Access-Control-Allow-Origin`` as llama-server
    writes it, while whoever compares it with ``b"access-control-allow-origin"`` (an ASGI
    client, a middleware) still finds it. Only for names the router itself writes, never the
    framing ones uvicorn acts on (``content-length``, ``transfer-encoding``, ``connection``)."""

    __slots__ = ()

    def lower(self) -> bytes:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and bytes.lower(self) == bytes.lower(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(bytes.lower(self))


# Why the edge refused a connection or request: the label of llamarouter_edge_refusals_total.
REFUSAL_REASONS = ("unparsable", "target_too_long", "header_too_large", "too_many_headers",
                   "head_too_large", "upgrade", "head_timeout", "body_timeout",
                   "connection_cap")


class Refusals:
    """How many times the edge refused, by reason (``REFUSAL_REASONS``): written by the
    protocol, read by ``/metrics`` at scrape time."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)

    def add(self, reason: str) -> None:
        self.counts[reason] += 1


class _Refused(Exception):
    """Raised from a parser callback after the refusal was written: stops the parser (uvicorn
    then calls ``send_400_response``, which finds the answer already given)."""


def body_timeout_message(timeout_s: float) -> str:
    return (f"the request body stopped arriving: nothing for {timeout_s:g} s; the connection "
            "is closed")


# The ASGI scope's entry holding the request's ``BodyWriter`` (``body_writer``).
BODY_WRITER = "llama_router.body_writer"


class BodyWriter:
    """Writes one response's body chunks straight to the client's transport (see the module
    docstring). Holds its request's cycle weakly: the scope holds the writer."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def write(self, body: bytes) -> bool:
        """Write ``body`` (not empty) as the next chunk of the response now, exactly as
        uvicorn's ``send`` would, if it would write it at once; False, writing nothing, if
        not (the caller sends it with ``send``, which waits as it must)."""
        cycle = self._cycle()
        if (cycle is None or cycle.chunked_encoding is not True or cycle.flow.write_paused
                or cycle.disconnected or cycle.response_complete
                or cycle.transport.is_closing()):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def one_write(self) -> OneWrite:
        """A context in which what the response writes to the client (its head and a whole
        body sent one after the other, without waiting between them) is held, and written
        as one piece when it ends: one system call instead of two, per small response.
        Nothing is held past it, also when it raises; a close within it writes what was held
        first."""
        return OneWrite(self._cycle())


class OneWrite:
    """``BodyWriter.one_write``: while it lasts, the cycle's transport is this stand-in,
    which holds what is written (a class, not a generator: it runs once per request)."""

    __slots__ = ("_cycle", "_parts", "_transport")

    def __init__(self, cycle: RequestResponseCycle | None) -> None:
        self._cycle = cycle
        self._parts: list[bytes] = []
        self._transport: Any = cycle.transport if cycle is not None else None

    def __enter__(self) -> None:
        if self._cycle is not None:
            self._cycle.transport = self  # type: ignore[assignment]

    def __exit__(self, *exc_info: object) -> None:
        cycle = self._cycle
        if cycle is not None:
            cycle.transport = self._transport
            self.flush()

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...
        return getattr(self._transport, name)


def body_writer(scope: Any) -> BodyWriter | None:
    """The request's ``BodyWriter``; None where the server is not this module's (tests that
    call the ASGI app directly) or the request is HEAD (uvicorn writes no body for it)."""
    writer: BodyWriter | None = scope.get(BODY_WRITER)
    return writer


OVER_CAP = ("the router is at its limit of open connections (its file descriptors are kept "
            "for the models); retry shortly")


class EnvelopeHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the envelope for its own errors, a request-head deadline, a
    body deadline between chunks (``body_timeout_s``), and at most ``connection_cap`` client
    connections at once (``fdlimit``; None: no cap)."""

    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_seen = 0.0  # loop time of the body's last chunk (or of the answer, once answered)
    _discarding = False
    _shutting_down = False
    _in_head = True  # waiting for a request head, or inside one: what arrives is bounded
    _head_bytes = 0  # bytes fed to the parser since the last request ended
    _idle_since = 0.0  # loop time of the last answer (or of the connection)
    _trusted = False  # a request on it carried a valid API key (``on_response_complete``)
    connection_cap: int | None = None
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    refusals: Refusals = Refusals()  # ``configured`` gives each server its own

    @classmethod
    def configured(cls, *, cap: int | None = None,
                   body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                   refusals: Refusals | None = None,
                   ) -> type[EnvelopeHttpToolsProtocol]:
        """This protocol with at most ``cap`` client connections, a body deadline of
        ``body_timeout_s`` between chunks, and its refusals counted in ``refusals`` (uvicorn
        takes a class)."""
        return type(f"{cls.__name__}Configured", (cls,),
                    {"connection_cap": cap, "body_timeout_s": body_timeout_s,
                     "refusals": refusals or Refusals()})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        if self.connection_cap is not None and len(self.connections) > self.connection_cap \
                and not self._make_room():
            self.logger.warning("over the cap of %d connections; refusing one",
                                self.connection_cap)
            self._send_error(503, OVER_CAP, "connection_cap", retry_after=True)
            return
        self._arm_head_timer()

    def _make_room(self) -> bool:
        """At the cap: close the connection idle the longest (between requests, nothing of
        the next one read) among those that never carried a request with a valid API key;
        False when there is none, and this one is refused instead. So idle
        connections without a key, kept alive on the public ``/health``, cannot keep a
        client with a key out."""
        idle = [c for c in self.connections
                if isinstance(c, EnvelopeHttpToolsProtocol) and c is not self and c._idle()
                and not c._trusted]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        self.logger.info("at the cap of %d connections: closing one idle without a key",
                         self.connection_cap)
        oldest._discarding = True
        oldest.transport.close()
        return True

    def _idle(self) -> bool:
        """Between requests: the last one answered, nothing of the next one read."""
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and self._in_head \
            and not self._head_bytes and not self.transport.is_closing()


    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_TARGET_BYTES:
            self._refuse(414, TARGET_TOO_LONG, "target_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, bounded (the whole head is bounded by ``data_received``).
        headers = self.headers
        if len(name) + len(value) > MAX_HEADER_BYTES:
            self._refuse(431, HEADER_TOO_LARGE, "header_too_large")
        if len(headers) >= MAX_HEADERS:
            self._refuse(431, TOO_MANY_HEADERS, "too_many_headers")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        headers.append((name, value))

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer a request head the router will not take, and stop the parser."""
        self.logger.warning("refusing a request: %s", message)
        self._send_error(status, message, reason)
        raise _Refused(reason)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._in_head = False
        if self.parser.should_upgrade():  # Upgrade + Connection: upgrade, or CONNECT
            self._refuse(400, UPGRADE_REFUSED, "upgrade")
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not before:  # a request to serve (not an upgrade): its body is due
            self._body_seen = self.loop.time()
            self._arm_body_timer(self._body_timeout())
            if cycle.scope["method"] != "HEAD":
                cycle.scope[BODY_WRITER] = BodyWriter(cycle)  # type: ignore[literal-required]

    def on_body(self, body: bytes) -> None:
        if not self.cycle.response_complete:  # once answered, the rest has one deadline
            self._body_seen = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        self._in_head = True  # the next request's head (pipelined or kept alive) is bounded
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        request = cast("RequestContext | None", self.cycle.scope.get(CONTEXT))
        if request is not None and request.key_hash:  # a valid API key (``keys``) came on it
            self._trusted = True
        if self._body_timer is not None:  # answered before its body came: the rest's window
            self._body_seen = self._idle_since
        super().on_response_complete()

    def shutdown(self) -> None:
        self._shutting_down = True
        super().shutdown()
        if self._body_timer is not None:
            self._arm_body_timer(self._body_timeout())

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _body_timeout(self) -> float:
        if self._shutting_down:
            return min(self.body_timeout_s, SHUTDOWN_BODY_TIMEOUT_S)
        return self.body_timeout_s

    def _arm_body_timer(self, delay: float) -> None:
        self._cancel_body_timer()
        self._body_timer = self.loop.call_later(delay, self._body_timed_out)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        # One timer per request, pushed back by what arrived since it was set (not re-armed
        # on every chunk: the upload path stays a time stamp per chunk).
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        timeout = self._body_timeout()
        now = self.loop.time()
        if not cycle.response_complete and (self.flow.read_paused
                                            or cycle.waiting_for_100_continue):
            self._body_seen = now  # the router is not reading yet: the client is not late
        left = self._body_seen + timeout - now
        if left > 0:
            self._arm_body_timer(left)
            return
        self.logger.warning("request body idle for %g s; closing", timeout)
        if cycle.response_complete:  # answered already: only the connection is left to end
            self.transport.close()
            return
        cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
        self._end_body(cycle, 408, body_timeout_message(timeout), "body_timeout")

    def _end_body(self, cycle: RequestResponseCycle, status: int, message: str,
                  reason: str) -> None:
        """End the request whose body is still due (it stopped arriving, or turned
        unparsable): the app waiting for it sees the client leave, and the client gets
        ``status`` as its answer, or, if an answer is already going out, the connection
        closes (it cannot become an error any more)."""
        cycle.disconnected = True
        cycle.message_event.set()
        if cycle.response_started:
            self.refusals.add(reason)
            self._discarding = True
            self._cancel_body_timer()
            self.transport.close()
            return
        self._send_error(status, message, reason, answering=True)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a response is still going out: the next head waits
            return
        self.logger.warning("request head not complete within %g s; closing",
                            REQUEST_HEAD_TIMEOUT_S)
        self._send_error(408, HEAD_TIMEOUT, "head_timeout")

    def send_400_response(self, msg: str) -> None:
        if not self._discarding:  # else a refusal was answered already (``_Refused``)
            self._send_error(400, UNPARSABLE, "unparsable")

    def _send_error(self, status: int, message: str, reason: str, *,
                    retry_after: bool = False, answering: bool = False) -> None:
        """Write an envelope and close, counting the refusal under ``reason``;
        ``answering``: it is the answer to the current request (whose app no longer
        writes), not an error behind it."""
        self.refusals.add(reason)
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._discarding = True  # nothing after this is parsed: its framing is lost
        if not answering and self.cycle is not None and not self.cycle.response_complete:
            # Bad bytes behind a request still being answered: that answer goes out whole,
            # then the connection closes (writing ours now would cut into it).
            self.cycle.keep_alive = False
            return
        body = envelope_bytes(status, message)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        if retry_after:
            content.append(b"retry-after: 1\r\n")
        content.extend([b"content-type: application/json\r\n",
                        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                        b"connection: close\r\n", b"\r\n", body])
        self.transport.write(b"".join(content))
        # A lingering close: closing with unread input would make the kernel send a reset,
        # which can destroy the answer before the client reads it. So: end our side, read and
        # drop whatever the client still sends, and close at its EOF or after LINGER_S.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        # After an error answer, the rest is dropped. While a head is due, the parser is fed
        # at most ``MAX_HEAD_BYTES`` of it: httptools keeps a header or target that has not
        # ended yet in memory, so an endless one must be cut here, not in its callbacks.
        while not self._discarding:
            if not self._in_head:  # a body, or a request being answered: uvicorn's flow
                self._feed(data)
                return
            room = MAX_HEAD_BYTES - self._head_bytes
            piece = data
            if len(data) > room:
                piece, data = data[:room], data[room:]
            else:
                data = b""
            self._head_bytes += len(piece)
            self._feed(piece)
            if self._in_head and self._head_bytes >= MAX_HEAD_BYTES and not self._discarding:
                self.logger.warning("refusing a request: %s", HEAD_TOO_LARGE)
                self._send_error(431, HEAD_TOO_LARGE, "head_too_large")
            if not data:
                return

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with the router's answers to what the parser
        refuses (a refusal from a callback has been answered already)."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._discarding:
                return
            cycle = self.cycle
            if not self._in_head and cycle is not None and cycle.more_body \
                    and not cycle.response_complete:
                # The body of the request being served broke (a bad chunk): it is that
                # request's error, answered now, never a wait for bytes that cannot come.
                self.logger.warning("malformed request body received; refusing it")
                self._end_body(cycle, 400, MALFORMED_BODY, "unparsable")
                return
            self.logger.warning("invalid HTTP request received; refusing it")
            self._send_error(400, UNPARSABLE, "unparsable")
