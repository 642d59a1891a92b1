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
closes. (Idle keep-alive connections between requests are uvicorn's own timeout.)

Over ``connection_cap`` open connections (``fdlimit``) a new one gets a 503 envelope with
``Retry-After`` and is closed before its request is read.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import envelope_bytes

REQUEST_HEAD_TIMEOUT_S = 15.0
LINGER_S = 2.0  # after an error answer, how long the client may take to close its side

UNPARSABLE = ("the request is not valid HTTP/1.1 (its start line, headers or framing could "
              "not be parsed); the connection is closed")
HEAD_TIMEOUT = (f"the request's start line and headers did not arrive within "
                f"{REQUEST_HEAD_TIMEOUT_S:g} s; the connection is closed")


OVER_CAP = ("the router is at its limit of open connections (its file descriptors are kept "
            "for the models); retry shortly")


class EnvelopeHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the envelope for its own errors, a request-head deadline, and
    at most ``connection_cap`` client connections at once (``fdlimit``; None: no cap)."""

    _head_timer: asyncio.TimerHandle | None = None
    _discarding = False
    connection_cap: int | None = None

    @classmethod
    def capped(cls, cap: int) -> type[EnvelopeHttpToolsProtocol]:
        """This protocol with at most ``cap`` client connections (uvicorn takes a class)."""
        return type(f"{cls.__name__}Capped", (cls,), {"connection_cap": cap})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.connection_cap is not None and len(self.connections) > self.connection_cap:
            self.logger.warning("over the cap of %d connections; refusing one",
                                self.connection_cap)
            self._send_error(503, OVER_CAP, retry_after=True)
            return
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

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
        self._send_error(408, HEAD_TIMEOUT)

    def send_400_response(self, msg: str) -> None:
        self._send_error(400, UNPARSABLE)

    def _send_error(self, status: int, message: str, *, retry_after: bool = False) -> None:
        self._cancel_head_timer()
        self._discarding = True  # nothing after this is parsed: its framing is lost
        if self.cycle is not None and not self.cycle.response_complete:
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
        if not self._discarding:  # after an error answer, the rest is dropped
            super().data_received(data)
