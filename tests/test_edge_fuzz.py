"""Both HTTP/1.1 parsers of the router, fed hostile bytes in process (no sockets: a transport
that records what is written): the server protocol (``http11``) a client's requests, the
child connection (``upstream._Connection``) an upstream's responses. Whatever the bytes and
however they are split: nothing raises out of the protocol, the parser is never fed more of
one head than its bound, every answer the edge writes itself is the envelope, and an endless
head costs a bounded amount of memory (tracemalloc)."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uvicorn.server import ServerState

from router.http import http11, upstream
from router.http.http11 import EnvelopeHttpToolsProtocol


class RecordingTransport(asyncio.Transport):
    """Keeps what is written; closing only marks it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False
        self.eof = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.eof

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 9), "sockname": ("127.0.0.1", 8)}.get(name, default)


async def answer_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def server_protocol(loop: asyncio.AbstractEventLoop) -> tuple[EnvelopeHttpToolsProtocol,
                                                                RecordingTransport]:
    config = uvicorn.Config(answer_app, log_config=None, access_log=False, ws="none")
    config.load()
    protocol_class = EnvelopeHttpToolsProtocol.configured(refusals=http11.Refusals())
    protocol = protocol_class(config, ServerState(), {}, loop)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


def feed_server(data: bytes, cuts: list[int]) -> tuple[EnvelopeHttpToolsProtocol,
                                                         RecordingTransport, list[int]]:
    """Feed ``data`` in pieces cut at ``cuts``; the head bytes the parser held after each."""
    loop = asyncio.new_event_loop()
    try:
        protocol, transport = server_protocol(loop)
        held = []
        start = 0
        for cut in sorted({c % (len(data) + 1) for c in cuts} | {len(data)}):
            protocol.data_received(data[start:cut])
            start = cut
            held.append(protocol._head_bytes)
        protocol.connection_lost(None)
        loop.run_until_complete(settle())
        return protocol, transport, held
    finally:
        loop.close()


async def settle() -> None:
    """Let the requests' tasks see the connection gone, and end them."""
    await asyncio.sleep(0)
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def own_answer(written: list[bytes]) -> tuple[int, dict[str, Any]] | None:
    """The envelope the edge wrote itself, if it wrote one (last, with connection: close)."""
    raw = b"".join(written)
    if b"connection: close\r\n\r\n{" not in raw:
        return None
    head, _, body = raw.rpartition(b"connection: close\r\n\r\n")
    status = int(head.rsplit(b"HTTP/1.1 ", 1)[1][:3])
    return status, json.loads(body)


_pieces = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"GET / HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n",
                     b"Host: x\r\n", b"Content-Length: 3\r\n", b"Transfer-Encoding: chunked\r\n",
                     b"Connection: upgrade\r\n", b"Upgrade: websocket\r\n", b"\r\n", b"\n",
                     b"abc", b"0\r\n\r\n", b"X-A: " + b"v" * 9000, b"X-B: b\r\n" * 70,
                     b"/" + b"t" * 9000, b"CONNECT a:1 HTTP/1.1\r\n",
                     b"Expect: 100-continue\r\n"]),
)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_pieces, max_size=40), st.lists(st.integers(min_value=0), max_size=12))
def test_the_server_protocol_survives_any_bytes_within_its_bounds(
        parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    protocol, transport, held = feed_server(data, cuts)
    assert max(held, default=0) <= http11.MAX_HEAD_BYTES
    answer = own_answer(transport.written)
    if answer is not None:
        status, body = answer
        assert status in (400, 408, 414, 431, 503)
        assert body["error"]["code"] == status and body["error"]["message"]
    assert sum(protocol.refusals.counts.values()) <= 1  # one refusal ends the connection


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 100 Continue\r\n\r\n",
                     b"HTTP/1.1 101 Switching Protocols\r\n\r\n", b"content-length: 2\r\n",
                     b"transfer-encoding: chunked\r\n", b"\r\n", b"ok", b"2\r\nok\r\n0\r\n\r\n",
                     b"x-a: " + b"v" * 9000, b"x-b: b\r\n" * 120])), max_size=40),
    st.lists(st.integers(min_value=0), max_size=12))
def test_the_child_connection_survives_any_response_within_its_bounds(
        parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        async def play() -> None:
            conn = upstream._Connection(label="upstream u")
            transport = RecordingTransport()
            conn.connection_made(transport)
            conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False)
            fed: list[int] = []
            real_feed = conn._feed

            def counting(piece: bytes) -> None:
                if conn._in_head:
                    fed.append(len(piece))
                real_feed(piece)

            conn._feed = counting  # type: ignore[method-assign]
            start = 0
            for cut in sorted({c % (len(data) + 1) for c in cuts} | {len(data)}):
                if not transport.closed:
                    conn.data_received(data[start:cut])
                start = cut
            assert sum(fed) <= upstream.MAX_RESPONSE_HEAD_BYTES
            if conn.error is not None:
                assert conn.error.status == 502 and conn.error.message
            conn.connection_lost(None)
            assert conn._head_timer is None  # no deadline outlives the exchange

        loop.run_until_complete(play())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def peak_while(feed: Any, pieces: int, piece: bytes) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(pieces):
            if not feed(piece):
                break
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_an_endless_request_head_costs_bounded_memory() -> None:
    """8 MiB of one header value, 4 KiB at a time: the server protocol's memory peaks
    within a few times the head bound (it was the whole 8 MiB, and more)."""
    loop = asyncio.new_event_loop()
    try:
        protocol, transport = server_protocol(loop)
        protocol.data_received(b"GET / HTTP/1.1\r\nX-A: ")

        def feed(piece: bytes) -> bool:
            protocol.data_received(piece)
            return not transport.is_closing()

        peak = peak_while(feed, 2048, b"v" * 4096)
        protocol.connection_lost(None)
        loop.run_until_complete(settle())
    finally:
        loop.close()
    assert own_answer(transport.written) is not None
    assert peak < 4 * http11.MAX_HEAD_BYTES, peak


def test_an_endless_response_head_costs_bounded_memory() -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        async def play() -> int:
            conn = upstream._Connection(label="peer p")
            transport = RecordingTransport()
            conn.connection_made(transport)
            conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False)
            conn.data_received(b"HTTP/1.1 200 OK\r\nx-a: ")

            def feed(piece: bytes) -> bool:
                conn.data_received(piece)
                return not transport.closed

            peak = peak_while(feed, 2048, b"v" * 4096)
            assert conn.error is not None and "over 65536 bytes" in conn.error.message
            conn.connection_lost(None)
            return peak

        peak = loop.run_until_complete(play())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert peak < 4 * upstream.MAX_RESPONSE_HEAD_BYTES, peak
