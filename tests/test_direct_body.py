"""A streamed body relayed straight from the child's connection to the client's
(``proxy.DirectBody``, ``http11.BodyWriter``, ``upstream``'s sink), in process: a real uvicorn
protocol (the router's) on loopback, a scripted child, raw sockets as clients.

What the direct path must keep from the ASGI ``send`` path it bypasses: the same bytes in the
same order (also across a client that falls behind and catches up), HTTP framing for HTTP/1.1
and HTTP/1.0 clients, the metrics middleware's record (time to first byte, token count), and a
broken body's error event. And what it is for: no task wake-up per event.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from test_http11 import GUARD_S, serving
from test_upstream import Server, serve

from router.edge.middleware import RequestMetricsMiddleware
from router.http import http11, upstream
from router.http.proxy import direct_body, relay
from router.http.requests import context
from router.http.upstream import ChildConnections
from router.observe.activity import Activity
from router.observe.metrics import RouterMetrics

STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def event(i: int, pad: int = 0) -> bytes:
    return b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * pad)


def streaming_child(events: list[bytes], *, abort_after: bytes | None = None,
                    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter, Server],
                                  Awaitable[None]]:
    """A child that streams ``events``, each in a write of its own, as fast as the socket
    takes them; then ends the body, or (``abort_after``) writes those bytes and resets the
    connection."""
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    server: Server) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD)
        for data in events:
            writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0)  # one event per read, as a generating child writes them
        if abort_after is not None:
            if abort_after:
                writer.write(b"%x\r\n%b\r\n" % (len(abort_after), abort_after))
                await writer.drain()
            writer.transport.abort()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()
    return child


class Counts:
    """How each chunk of the body went out: directly, or through ``next_chunk`` and the ASGI
    ``send`` (a task wake-up each)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct = 0
        self.woken = 0
        self.fell_back = asyncio.Event()
        write, next_chunk = http11.BodyWriter.write, upstream._Connection.next_chunk

        def counted_write(writer: http11.BodyWriter, body: bytes) -> bool:
            wrote = write(writer, body)
            self.direct += wrote
            return wrote

        async def counted_next_chunk(conn: upstream._Connection) -> bytes | None:
            chunk = await next_chunk(conn)
            if chunk is not None:
                self.woken += 1
                if self.direct:  # queued after direct writes began: the client fell behind
                    self.fell_back.set()
            return chunk

        monkeypatch.setattr(http11.BodyWriter, "write", counted_write)
        monkeypatch.setattr(upstream._Connection, "next_chunk", counted_next_chunk)


def relay_app(pool: ChildConnections, activity: Activity, *, direct: bool = True) -> Any:
    """The proxy's relay behind the metrics middleware, as the router runs it."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        context(scope).model_id = "alpha"
        await relay(pool, scope["method"], scope["raw_path"], [], b"", receive=receive,
                    send=send, direct=direct_body(scope) if direct else None)
    metrics = RouterMetrics()
    return RequestMetricsMiddleware(app, metrics, activity)


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """The head and the de-chunked body of a chunked response (asserting its framing)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", rest[:100]
            return head, b"".join(body)
        body.append(rest[:size])
        assert rest[size:size + 2] == b"\r\n", rest[:size + 10][-50:]
        rest = rest[size + 2:]


async def fetch(port: int, request: bytes, *, small_buffer: bool = False,
                hold: asyncio.Event | None = None) -> bytes:
    """Send ``request``; read the whole answer (until the server closes, or the chunked
    body's end). ``hold``: read nothing until it is set; ``small_buffer``: a small receive
    buffer, so that a client that does not read backs the router up soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if small_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    writer.write(request)
    async with asyncio.timeout(GUARD_S):
        if hold is not None:
            await hold.wait()
        raw = bytearray()
        while not raw.endswith(b"\r\n0\r\n\r\n") and (data := await reader.read(1 << 20)):
            raw += data
    writer.close()
    return bytes(raw)


GET = b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_a_stream_goes_out_directly_without_a_wakeup_per_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    events = [event(i) for i in range(300)]
    async with serve(streaming_child(events)) as child, \
            serving(relay_app(ChildConnections("127.0.0.1", child.port), Activity())) as served:
        raw = await fetch(served.port, GET)
    head, body = dechunk(raw)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
    assert body == b"".join(events)
    assert counts.direct > 0
    # At most once: what came with the child's response head, before the relay's start.
    assert counts.woken <= 1, f"{counts.woken} chunks of 300 events woke the relay's task"


async def test_a_client_that_falls_behind_gets_every_byte_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads nothing until the router had to queue (its transport backed up),
    then everything: the chunks written directly before and after, and those queued and sent
    through ``send`` in between, arrive whole and in order."""
    counts = Counts(monkeypatch)
    events = [event(i, pad=1000) for i in range(16_000)]  # ~16 MB: more than any buffer
    async with serve(streaming_child(events)) as child, \
            serving(relay_app(ChildConnections("127.0.0.1", child.port), Activity())) as served:
        raw = await fetch(served.port, GET, small_buffer=True, hold=counts.fell_back)
    _, body = dechunk(raw)
    numbers = [int(n) for n in re.findall(rb'"n": (\d+)', body)]
    assert numbers == list(range(len(events)))
    assert body == b"".join(events)
    assert counts.direct > 0 and counts.woken > 0, (counts.direct, counts.woken)


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
async def test_the_direct_path_frames_the_body_as_send_does(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    counts = Counts(monkeypatch)
    events = [event(i, pad=i) for i in range(50)]
    request = f"GET /v1/stream {version}\r\nHost: x\r\n\r\n".encode()
    answers = {}
    for direct in (True, False):
        async with serve(streaming_child(events)) as child, serving(relay_app(
                ChildConnections("127.0.0.1", child.port), Activity(), direct=direct)) as served:
            answers[direct] = await fetch(served.port, request)
    (head, body), (plain_head, plain_body) = dechunk(answers[True]), dechunk(answers[False])
    assert body == plain_body == b"".join(events)

    def framing(h: bytes) -> list[bytes]:
        return sorted(line for line in h.lower().split(b"\r\n")
                      if line.startswith((b"http/", b"transfer-encoding", b"connection",
                                          b"content-length")))
    assert framing(head) == framing(plain_head)
    assert counts.direct > 0


async def test_a_head_request_gets_no_body_and_no_direct_writer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(direct_body(scope))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with serving(app) as served:
        reader, writer = await served.connect()
        writer.write(b"HEAD /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(GUARD_S):
            raw = await reader.read()
        writer.close()
    assert seen == [None]
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"\r\n\r\n")
    assert counts.direct == 0


async def test_chunks_written_directly_are_recorded_for_ttft_and_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    last = (b'data: {"choices":[{"finish_reason":"length","delta":{}}],'
            b'"timings":{"predicted_n":7}}\n\n')
    events = [event(i) for i in range(20)] + [last, b"data: [DONE]\n\n"]
    activity = Activity()
    recorded = asyncio.Event()  # the middleware records as the app returns

    async with serve(streaming_child(events)) as child:
        app = relay_app(ChildConnections("127.0.0.1", child.port), activity)

        async def edge(scope: Any, receive: Any, send: Any) -> None:
            try:
                await app(scope, receive, send)
            finally:
                recorded.set()

        async with serving(edge) as served:
            await fetch(served.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 0\r\n\r\n")
            async with asyncio.timeout(GUARD_S):
                await recorded.wait()
    [record] = activity.recent()
    assert record.status == 200 and record.model == "alpha"
    assert record.tokens == 7
    assert record.ttft_s is not None and 0 <= record.ttft_s <= record.total_s
    assert counts.direct > 0 and counts.woken <= 1


@pytest.mark.parametrize("tail", [b'data: {"n": 99, "cut', b""])
async def test_a_body_broken_after_direct_chunks_ends_with_an_error_event(
        monkeypatch: pytest.MonkeyPatch, tail: bytes) -> None:
    """The error event follows what went out directly; a blank line first only when the
    child left an event unfinished."""
    counts = Counts(monkeypatch)
    events = [event(i) for i in range(5)]
    async with serve(streaming_child(events, abort_after=tail)) as child, \
            serving(relay_app(ChildConnections("127.0.0.1", child.port), Activity())) as served:
        raw = await fetch(served.port, GET)
    _, body = dechunk(raw)
    sent = b"".join(events) + tail
    assert body.startswith(sent)
    error_event = body[len(sent):]
    assert error_event.startswith(b"\n\ndata: " if tail else b"data: "), error_event[:40]
    error = json.loads(error_event.strip().removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert counts.direct > 0


class CountedTransport:
    """A client connection's transport that counts the writes made to it."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def small_child(body: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter, Server],
                                         Awaitable[None]]:
    """A child answering each request with ``body`` as JSON, with a Content-Length."""
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()
    return child


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
async def test_a_small_response_goes_out_in_one_write(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Its head and its body, sent one after the other, are one write to the client's
    transport (one system call); the client gets the same bytes as through two writes, kept
    alive (HTTP/1.1) or closed after it (HTTP/1.0, where the close comes within the write)."""
    writes: list[bytes] = []
    made = http11.EnvelopeHttpToolsProtocol.connection_made

    def counted(protocol: http11.EnvelopeHttpToolsProtocol, transport: Any) -> None:
        made(protocol, CountedTransport(transport, writes))  # type: ignore[arg-type]

    monkeypatch.setattr(http11.EnvelopeHttpToolsProtocol, "connection_made", counted)
    body = json.dumps({"tokens": list(range(40))}).encode()
    request = f"POST /tokenize {version}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
    answers, counts = {}, {}
    for direct in (True, False):
        writes.clear()
        async with serve(small_child(body)) as child, serving(relay_app(
                ChildConnections("127.0.0.1", child.port), Activity(), direct=direct)) as served:
            reader, writer = await served.connect()
            writer.write(request)
            async with asyncio.timeout(GUARD_S):
                head = await reader.readuntil(b"\r\n\r\n")
                answers[direct] = head + await reader.readexactly(len(body))
                if version == "HTTP/1.0":
                    assert await reader.read() == b""  # and the router closed it
            writer.close()
        counts[direct] = len(writes)
        assert b"".join(writes) == answers[direct]
    assert counts == {True: 1, False: 2}  # one write instead of head, then body
    dated = re.compile(rb"\r\ndate: [^\r]*")  # the second may change between the two
    assert dated.sub(b"", answers[True]) == dated.sub(b"", answers[False])
    assert answers[True].startswith(b"HTTP/1.1 200") and answers[True].endswith(body)
