"""The HTTP/1.1 protocol (router.http.http11) on uvicorn's, in process: a real asyncio server on
loopback running the router's protocol class around small ASGI apps, and raw sockets as
clients. Fast (short deadlines), so every uvicorn version the bounds allow is checked cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from router.http import http11
from router.http.http11 import EnvelopeHttpToolsProtocol
from router.http.requests import BODY_TIMED_OUT, context

App = Callable[[Any, Any, Any], Awaitable[None]]
GUARD_S = 20.0  # a hang fails the test, it does not hold the suite


class Served:
    """A loopback server with the router's protocol; what its app saw and its connections."""

    def __init__(self, server: asyncio.Server, state: ServerState,
                 refusals: http11.Refusals) -> None:
        self.server = server
        self.state = state
        self.refusals = refusals
        self.port: int = server.sockets[0].getsockname()[1]
        self.seen: list[dict[str, Any]] = []  # what each request's app received, in order
        self.called = asyncio.Event()  # an app was called

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@asynccontextmanager
async def serving(app: App, *, body_timeout_s: float = 0.3,
                  cap: int | None = None) -> AsyncIterator[Served]:
    refusals = http11.Refusals()
    protocol = EnvelopeHttpToolsProtocol.configured(cap=cap, body_timeout_s=body_timeout_s,
                                                    refusals=refusals)
    config = uvicorn.Config(app, log_config=None, access_log=False, ws="none")
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: protocol(config, state, {}, loop),
                                      "127.0.0.1", 0)
    try:
        yield Served(server, state, refusals)
    finally:
        for connection in list(state.connections):
            connection.transport.close()
        server.close()
        await server.wait_closed()


def echo_app(served: list[Served], *, before_read_s: float = 0.0) -> App:
    """Reads the whole body (after ``before_read_s``), answers its length; records what it
    received, and whether it saw the client leave."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        record: dict[str, Any] = {"size": 0, "disconnect": False, "scope": scope}
        served[0].seen.append(record)
        served[0].called.set()
        if before_read_s:
            await asyncio.sleep(before_read_s)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                record["disconnect"] = True
                return
            record["size"] += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = json.dumps({"size": record["size"]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


async def refuse_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers 401 at once without reading the body (a keyed router, no key)."""
    if scope["type"] != "http":
        return
    body = b'{"error": {"code": 401, "message": "Invalid API Key", "type": "x"}}'
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def head(length: int, *extra: str) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: x",
             "Content-Type: application/json", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (bounded by the guard)."""
    async with asyncio.timeout(GUARD_S):
        return await reader.read()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head_part, _, body = raw.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def envelope(raw: bytes, status: int) -> str:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == status
    return str(error["message"])


async def test_a_body_that_stops_arriving_is_cut_with_a_408() -> None:
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=0.3) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(head(100) + b'{"model": "a"')
        await writer.drain()
        started = time.monotonic()
        raw = await read_all(reader)
        waited = time.monotonic() - started
        writer.close()
    assert "stopped arriving" in envelope(raw, 408)
    assert parse(raw)[1]["connection"] == "close"
    assert waited >= 0.3
    [record] = served.seen
    assert record["disconnect"] and record["size"] == 13  # the app saw the client leave
    assert record["scope"][BODY_TIMED_OUT] is True  # what the metrics record as 408


async def test_a_body_that_keeps_flowing_is_never_cut() -> None:
    """20 chunks 0.1 s apart: 2 s in all, far past the 0.3 s deadline between chunks."""
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=0.3) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(head(200))
        for _ in range(20):
            await asyncio.sleep(0.1)
            writer.write(b"x" * 10)
            await writer.drain()
        async with asyncio.timeout(GUARD_S):
            status_line = await reader.readline()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    assert served.seen[0]["size"] == 200


async def test_time_the_router_is_not_reading_does_not_count() -> None:
    """A 4 MiB body sent at once while the app waits 1 s before reading: the server stops
    reading (its buffer is full), and the client, blocked, is not late."""
    box: list[Served] = []
    size = 4 << 20
    async with serving(echo_app(box, before_read_s=1.0), body_timeout_s=0.3) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(head(size) + b"x" * size)
        async with asyncio.timeout(GUARD_S):
            await writer.drain()
            status_line = await reader.readline()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    assert served.seen[0]["size"] == size


async def test_a_client_waiting_for_100_continue_is_not_late() -> None:
    box: list[Served] = []
    async with serving(echo_app(box, before_read_s=1.0), body_timeout_s=0.3) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(head(5, "Expect: 100-continue"))
        async with asyncio.timeout(GUARD_S):
            assert (await reader.readline()).startswith(b"HTTP/1.1 100")
            await reader.readline()
            writer.write(b"hello")
            status_line = await reader.readline()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line


async def test_an_answered_request_gets_one_deadline_for_the_rest_of_its_body() -> None:
    """A client without a key trickling a body nobody reads, a byte every 0.1 s, is closed
    one deadline after its 401; it cannot hold the connection by trickling."""
    async with serving(refuse_app, body_timeout_s=0.5) as served:
        reader, writer = await served.connect()
        writer.write(head(1_000_000))
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            assert (await reader.readline()).startswith(b"HTTP/1.1 401")
        answered = time.monotonic()
        closed = None
        async with asyncio.timeout(GUARD_S):
            while closed is None:
                try:
                    writer.write(b"x")
                    await writer.drain()
                except ConnectionError:
                    closed = time.monotonic()
                    break
                if served.state.connections:
                    await asyncio.sleep(0.1)
                else:
                    closed = time.monotonic()
        writer.close()
    assert 0.4 <= closed - answered < 5.0


async def test_shutdown_cuts_a_stalled_body_at_once() -> None:
    """SIGTERM (uvicorn's ``shutdown`` of each connection) does not wait out a 60 s body
    deadline: a stalled body has ``SHUTDOWN_BODY_TIMEOUT_S``."""
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=60.0) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(head(100) + b"{")
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            await served.called.wait()
        started = time.monotonic()
        for connection in list(served.state.connections):
            connection.shutdown()
        raw = await read_all(reader)
        waited = time.monotonic() - started
        writer.close()
    envelope(raw, 408)
    assert waited < http11.SHUTDOWN_BODY_TIMEOUT_S + 5.0


async def test_a_request_without_a_body_arms_nothing() -> None:
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=0.2) as served:
        box.append(served)
        reader, writer = await served.connect()
        for _ in range(3):  # keep-alive: idle between requests is not a body's pause
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(GUARD_S):
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                await reader.readuntil(b'{"size": 0}')
            await asyncio.sleep(0.3)
        writer.close()
        [connection] = served.state.connections
        assert connection._body_timer is None


async def test_unparsable_requests_get_the_envelope() -> None:
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\nabc")
        raw = await read_all(reader)
        writer.close()
    assert "not valid HTTP/1.1" in envelope(raw, 400)
    assert not served.seen


async def test_a_request_head_that_never_ends_gets_a_408(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http11, "REQUEST_HEAD_TIMEOUT_S", 0.3)
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        raw = await read_all(reader)
        writer.close()
    envelope(raw, 408)


async def test_connections_over_the_cap_get_a_503() -> None:
    """The one connection there is not idle (its request head has begun): no room."""
    box: list[Served] = []
    async with serving(echo_app(box), cap=1) as served:
        box.append(served)
        _, first = await served.connect()
        first.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await first.drain()
        async with asyncio.timeout(GUARD_S):  # until the server has read it
            while not any(c._head_bytes for c in served.state.connections):  # noqa: ASYNC110 (protocol state, no event)
                await asyncio.sleep(0.001)
        reader, writer = await served.connect()
        raw = await read_all(reader)
        writer.close()
        first.close()
    envelope(raw, 503)
    assert parse(raw)[1]["retry-after"] == "1"


def trusting_app(served: list[Served]) -> App:
    """``echo_app``, with the request's context saying a valid API key came with it when the
    request says so (as ``keys.ApiKeyMiddleware`` sets ``key_hash``)."""
    echo = echo_app(served)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (b"x-key", b"yes") in scope["headers"]:
            context(scope).key_hash = "a-key's-hash"
        await echo(scope, receive, send)

    return app


async def exchange_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      *extra: str) -> bytes:
    """One request on a kept-alive connection; its answer's status line."""
    writer.write(head(2, *extra) + b"{}")
    await writer.drain()
    async with asyncio.timeout(GUARD_S):
        line = await reader.readline()
        await reader.readuntil(b"}")  # the rest of the small JSON answer
    return line


async def test_at_the_cap_an_idle_connection_without_a_key_makes_room() -> None:
    """Cap 2: one idle connection that carried a key, one idle without (kept alive on a
    public path, say): a third connection closes the one without a key and is served; with
    both carrying keys, the third gets the 503."""
    box: list[Served] = []
    async with serving(trusting_app(box), cap=2) as served:
        box.append(served)
        keyed = await served.connect()
        keyless = await served.connect()
        assert (await exchange_on(*keyed, "X-Key: yes")).startswith(b"HTTP/1.1 200")
        assert (await exchange_on(*keyless)).startswith(b"HTTP/1.1 200")
        third = await served.connect()
        assert (await exchange_on(*third, "X-Key: yes")).startswith(b"HTTP/1.1 200")
        assert await read_all(keyless[0]) == b""  # closed to make room, nothing written
        assert (await exchange_on(*keyed, "X-Key: yes")).startswith(b"HTTP/1.1 200")
        fourth_reader, fourth = await served.connect()
        raw = await read_all(fourth_reader)
        for _, writer in (keyed, keyless, third):
            writer.close()
        fourth.close()
    envelope(raw, 503)
    assert served.refusals.counts["connection_cap"] == 1


# -- the request head's bounds -----------------------------------------------------------------


async def flood(writer: asyncio.StreamWriter, start: bytes, filler: bytes,
                total: int) -> int:
    """Write ``start`` then ``filler`` repeatedly, up to ``total`` bytes or until the server
    stops taking them; how many bytes went out."""
    sent = 0
    try:
        writer.write(start)
        sent += len(start)
        while sent < total:
            writer.write(filler)
            sent += len(filler)
            await writer.drain()
    except ConnectionError:
        pass
    return sent


async def refused_head(start: bytes, filler: bytes, status: int,
                       total: int = 8 << 20) -> tuple[str, Served, int]:
    """Send a request head that never ends (``start``, then ``filler`` up to ``total``
    bytes); the envelope's message, the server, and what the server read of it."""
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        sending = asyncio.create_task(flood(writer, start, filler, total))
        raw = await read_all(reader)
        sent = await sending if sending.done() else 0
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()
    assert not served.seen  # the app never saw it
    assert parse(raw)[1]["connection"] == "close"
    return envelope(raw, status), served, sent


async def test_an_endless_request_target_gets_a_414() -> None:
    message, served, _ = await refused_head(b"GET /", b"a" * 4096, 414)
    assert str(http11.MAX_TARGET_BYTES) in message
    assert served.refusals.counts["target_too_long"] == 1


async def test_an_endless_header_value_gets_a_431_before_the_head_grows() -> None:
    message, served, _ = await refused_head(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: ",
                                            b"v" * 4096, 431)
    # The value never ends, so no callback sees it: the head's byte bound ends it.
    assert str(http11.MAX_HEAD_BYTES) in message
    assert served.refusals.counts["head_too_large"] == 1


async def test_many_short_headers_get_a_431_at_the_count() -> None:
    message, served, _ = await refused_head(b"GET / HTTP/1.1\r\n", b"X-A: b\r\n" * 64, 431)
    assert f"more than {http11.MAX_HEADERS} headers" in message
    assert served.refusals.counts["too_many_headers"] == 1


async def test_blank_lines_before_a_request_count_toward_its_head() -> None:
    _, served, _ = await refused_head(b"", b"\r\n" * 2048, 431)
    assert served.refusals.counts["head_too_large"] == 1


async def test_one_long_header_gets_a_431() -> None:
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        value = "v" * (http11.MAX_HEADER_BYTES + 1)
        writer.write(f"GET / HTTP/1.1\r\nHost: x\r\nX-Long: {value}\r\n\r\n".encode())
        raw = await read_all(reader)
        writer.close()
    assert str(http11.MAX_HEADER_BYTES) in envelope(raw, 431)
    assert not served.seen
    assert served.refusals.counts["header_too_large"] == 1


async def test_a_head_at_every_bound_is_served() -> None:
    """The largest head the router takes: a target of ``MAX_TARGET_BYTES``, ``MAX_HEADERS``
    headers of which one is ``MAX_HEADER_BYTES`` long, and a body in the same write."""
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        target = "/" + "t" * (http11.MAX_TARGET_BYTES - 1)
        long_value = "v" * (http11.MAX_HEADER_BYTES - len("x-long"))
        headers = ["Host: x", "Content-Length: 200000", f"X-Long: {long_value}"]
        headers += [f"X-{i}: {i}" for i in range(http11.MAX_HEADERS - len(headers))]
        writer.write(f"POST {target} HTTP/1.1\r\n".encode()
                     + "".join(f"{h}\r\n" for h in headers).encode() + b"\r\n"
                     + b"x" * 200_000)
        async with asyncio.timeout(GUARD_S):
            status_line = await reader.readline()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    [record] = served.seen
    assert record["size"] == 200_000
    assert len(record["scope"]["headers"]) == http11.MAX_HEADERS
    assert not any(served.refusals.counts.values())


async def test_each_kept_alive_request_gets_its_own_head_bound() -> None:
    """Pipelined heads of 40 KiB each: together far past ``MAX_HEAD_BYTES``, each within."""
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        reader, writer = await served.connect()
        filler = "".join(f"X-{i}: {'v' * 1000}\r\n" for i in range(40))
        request = f"GET /health HTTP/1.1\r\nHost: x\r\n{filler}\r\n".encode()
        writer.write(request * 5)
        async with asyncio.timeout(GUARD_S):
            for _ in range(5):
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                await reader.readuntil(b'{"size": 0}')
        writer.close()
    assert len(served.seen) == 5


@pytest.mark.parametrize("request_head", [
    # A websocket handshake carrying a body: was held past every deadline, and crashed the
    # shutdown while open.
    b"GET /chat HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Content-Length: 100\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, upgrade\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
])
async def test_protocol_upgrades_are_refused_at_once(request_head: bytes) -> None:
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=60.0) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(request_head)
        started = time.monotonic()
        raw = await read_all(reader)
        waited = time.monotonic() - started
        writer.close()
    assert "does not switch protocols" in envelope(raw, 400)
    assert not served.seen
    assert waited < 5.0  # answered, not held until a deadline
    assert served.refusals.counts["upgrade"] == 1


async def test_an_upgrade_behind_a_request_being_answered_lets_that_answer_finish() -> None:
    box: list[Served] = []
    async with serving(echo_app(box, before_read_s=0.3)) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET / HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\n"
                     b"Upgrade: websocket\r\n\r\n")
        raw = await read_all(reader)
        writer.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert raw.endswith(b'{"size": 0}')
    assert served.refusals.counts["upgrade"] == 1


async def test_every_refusal_is_counted_by_reason() -> None:
    box: list[Served] = []
    async with serving(echo_app(box)) as served:
        box.append(served)
        for raw_request in (b"GARBAGE\r\n\r\n",
                            b"GET /" + b"a" * (http11.MAX_TARGET_BYTES + 1) + b" HTTP/1.1\r\n"):
            reader, writer = await served.connect()
            writer.write(raw_request)
            await read_all(reader)
            writer.close()
    assert served.refusals.counts == {**dict.fromkeys(http11.REFUSAL_REASONS, 0),
                                      "unparsable": 1, "target_too_long": 1}


async def test_a_keepcase_header_name_goes_out_in_its_own_case() -> None:
    """``KeepCase``: ``Access-Control-Allow-Origin`` on the wire as llama-server writes it
    (its clients look it up in a case-sensitive dict), the other names in uvicorn's lower
    case, the framing unchanged; and the name still equals its lower-case spelling, hashed
    alike, for whoever compares it in process."""
    name = http11.KeepCase(b"Access-Control-Allow-Origin")
    assert name == b"access-control-allow-origin" and name == b"ACCESS-control-allow-ORIGIN"
    assert b"access-control-allow-origin" == name  # noqa: SIM300 (the reflected comparison)
    assert not name != b"access-control-allow-origin"  # noqa: SIM202 (its own __ne__)
    assert name.lower() is name and {b"access-control-allow-origin": 1}[name] == 1
    assert name != "access-control-allow-origin" and name != b"access-control-allow"

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-length", b"2"), (name, b"http://localhost:3000"),
            (http11.KeepCase(b"Vary"), b"Origin"), (b"X-Other", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serving(app) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        raw = await read_all(reader)
        writer.close()
    head_part, _, body = raw.partition(b"\r\n\r\n")
    lines = head_part.split(b"\r\n")[1:]
    assert b"Access-Control-Allow-Origin: http://localhost:3000" in lines
    assert b"Vary: Origin" in lines and b"x-other: 1" in lines and b"content-length: 2" in lines
    assert body == b"ok"


def test_uvicorns_private_names_that_the_adapter_uses_exist() -> None:
    """The contract with uvicorn's private protocol (``router/http/http11.py`` is its one reader):
    each name it reads or overrides, on the installed version. A uvicorn release that
    renames one fails here, not in production."""
    from uvicorn.protocols.http import httptools_impl
    protocol_names = ["connections", "tasks", "server_state", "transport", "flow", "cycle",
                      "parser", "headers", "expect_100_continue", "loop", "logger",
                      "pipeline"]
    config = uvicorn.Config(echo_app([]), log_config=None, ws="none")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = httptools_impl.HttpToolsProtocol(config, ServerState(), {}, loop)
    finally:
        loop.close()
    for name in protocol_names:
        assert hasattr(protocol, name), name
    begin = httptools_impl.HttpToolsProtocol.on_message_begin.__code__.co_names
    assert "url" in begin and "headers" in begin  # per request, set at its start
    for method in ["connection_made", "connection_lost", "on_message_begin", "on_url",
                   "on_header", "on_headers_complete", "on_body", "on_message_complete",
                   "on_response_complete", "shutdown", "send_400_response",
                   "_unset_keepalive_if_required"]:
        assert callable(getattr(httptools_impl.HttpToolsProtocol, method)), method
    cycle_names = ["chunked_encoding", "flow", "disconnected", "response_complete",
                   "response_started", "transport", "keep_alive", "more_body", "scope",
                   "message_event", "waiting_for_100_continue", "body"]
    cycle_init = httptools_impl.RequestResponseCycle.__init__.__code__.co_names
    for name in cycle_names:
        assert name in cycle_init, name
    assert httptools_impl.STATUS_LINE[431].startswith(b"HTTP/1.1 431")


def test_uvicorns_server_names_that_the_router_server_uses_exist() -> None:
    """The other half of the contract: what ``server.RouterServer`` reads or overrides of
    ``uvicorn.Server`` (its main loop, its tick, its signal handling, its task set)."""
    import inspect

    server = uvicorn.Server(uvicorn.Config(echo_app([]), log_config=None))
    for name in ("should_exit", "force_exit", "server_state"):
        assert hasattr(server, name), name
    assert hasattr(server.server_state, "tasks")
    for method in ("startup", "shutdown", "main_loop", "on_tick", "capture_signals",
                   "handle_exit", "run"):
        assert callable(getattr(uvicorn.Server, method)), method
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    # The loop the router replaces refreshes the Date header when counter % 10 == 0.
    assert "counter % 10" in inspect.getsource(uvicorn.Server.on_tick)


def chunked_head() -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n")


@pytest.mark.parametrize("broken", [
    b"5\nhello\r\n",  # a chunk-size line ended by a bare LF
    b"zz\r\nhello\r\n",  # a size that is no hex number
    b"5\r\nhelloXX",  # the chunk's data not followed by CRLF
    b"5;\x01=x\r\nhello\r\n",  # a control character in a chunk extension
])
async def test_a_body_that_turns_malformed_after_dispatch_gets_its_400(broken: bytes) -> None:
    """The request was handed to the app (its first chunk arrived), then a chunk is
    malformed: that request gets the 400 envelope at once, the app sees the client leave,
    and the connection closes; no wait for the body deadline (60 s here)."""
    box: list[Served] = []
    async with serving(echo_app(box), body_timeout_s=60.0) as served:
        box.append(served)
        reader, writer = await served.connect()
        writer.write(chunked_head() + b"4\r\n{\"a\"\r\n")
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            await served.called.wait()
        writer.write(broken)
        await writer.drain()
        started = time.monotonic()
        raw = await read_all(reader)
        waited = time.monotonic() - started
        writer.close()
    assert "framing is malformed" in envelope(raw, 400)
    assert parse(raw)[1]["connection"] == "close"
    assert waited < 5.0
    [record] = served.seen
    assert record["disconnect"]  # the app's wait for the body ended
    assert served.refusals.counts["unparsable"] == 1


async def test_a_malformed_body_behind_a_started_answer_closes_the_connection() -> None:
    """An app that answers before reading the whole body (a stream already going out):
    a malformed chunk then cannot become a 400; the connection closes, the app is told."""
    seen: list[str] = []
    started = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        started.set()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen.append("disconnect")
                return
            if not message.get("more_body"):
                return

    async with serving(app, body_timeout_s=60.0) as served:
        reader, writer = await served.connect()
        writer.write(chunked_head() + b"4\r\n{\"a\"\r\n")
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            await started.wait()
        writer.write(b"zz\r\n")
        await writer.drain()
        raw = await read_all(reader)
        writer.close()
    assert raw.startswith(b"HTTP/1.1 200")
    assert seen == ["disconnect"]
