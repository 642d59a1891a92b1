"""The proxied hop's HTTP/1.1 client, against scripted servers that misbehave on demand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from router.errors import UpstreamError
from router.http import upstream
from router.http.upstream import BrokenBody, Cancel, ChildConnections

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]
TIMEOUT = 5.0


@dataclass
class Server:
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (head and Content-Length body), or None when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        self.got_request.set()
        return request


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    state = Server()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(reader, writer, state)
        except (ConnectionError, asyncio.CancelledError):  # the test is over
            pass
        finally:
            writer.close()
            state.closed.set()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    async with server:
        yield state


def ok(body: bytes, *extra: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(body), b"".join(h + b"\r\n" for h in extra), body))


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
    while (request := await server.read_request(reader)) is not None:
        writer.write(ok(b'{"n": %d}' % len(server.requests)))
        if b"connection: close" in request:
            return


async def answer_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           server: Server) -> None:
    await server.read_request(reader)
    writer.write(ok(b"bye", b"connection: close"))


async def fetch(pool: ChildConnections, target: bytes) -> bytes:
    """GET ``target`` and read the whole answer, giving the connection back."""
    response = await pool.send("GET", target, [], b"")
    try:
        return await response.read()
    finally:
        response.release()


def reply_once(raw: bytes) -> Handler:
    """A server that sends ``raw`` to the first request, then waits for the client to close."""
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    server: Server) -> None:
        await server.read_request(reader)
        writer.write(raw)
        await reader.read()

    return reply


def answer_after(gate: asyncio.Event) -> Handler:
    """A server that answers each request with ``x`` once ``gate`` is set."""
    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   server: Server) -> None:
        while await server.read_request(reader) is not None:
            await gate.wait()
            writer.write(ok(b"x"))

    return held


async def test_keep_alive_connection_is_reused_and_request_is_framed() -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        for n in (1, 2):
            response = await pool.send("POST", b"/tokenize?x=1", [(b"x-a", b"1")], b'{"a":1}')
            assert response.status == 200
            assert response.header(b"content-type") == b"application/json"
            assert await response.read() == b'{"n": %d}' % n
            response.release()
        await pool.aclose()
    assert server.connections == 1
    assert server.requests[0] == (b"POST /tokenize?x=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                                  b"x-a: 1\r\ncontent-length: 7\r\n\r\n{\"a\":1}" % server.port)


async def test_get_without_body_sends_no_content_length() -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        await fetch(pool, b"/slots")
    assert b"content-length" not in server.requests[0]


async def test_chunked_body_is_relayed_as_it_arrives() -> None:
    second_chunk_allowed = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n9\r\ndata: one\r\n")
        await second_chunk_allowed.wait()
        writer.write(b"9\r\ndata: two\r\n0\r\n\r\n")
        await server.read_request(reader)

    async with serve(stream) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("POST", b"/completion", [], b"{}")
        first = await asyncio.wait_for(response.next_chunk(), TIMEOUT)
        assert first == b"data: one"  # before the server was allowed to write the rest
        second_chunk_allowed.set()
        assert await response.next_chunk() == b"data: two"
        assert await response.next_chunk() is None
        response.release()
        # llama-server closes a connection after an event stream: it is closed here first,
        # and a fresh one is opened in the background for the next request.
        await asyncio.wait_for(asyncio.gather(*pool._warming), TIMEOUT)
        assert len(pool._idle) == 1
        assert pool._idle[0] is not response._conn
        assert server.connections == 2


async def test_stale_keep_alive_connection_is_retried_once_on_a_fresh_one() -> None:
    async def close_on_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(b"first"))
        if server.connections == 1:
            await server.read_request(reader)  # the second request: closed unanswered
            return
        await answer_each(reader, writer, server)

    async with serve(close_on_second) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("POST", b"/tokenize", [], b"{}")
        await response.read()
        response.release()
        response = await pool.send("POST", b"/tokenize", [], b"{}")
        assert await response.read() == b"first"
        response.release()
    assert server.connections == 2


async def test_a_fresh_connection_closed_without_answer_is_an_error_and_not_retried() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)

    async with serve(hang_up) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        with pytest.raises(UpstreamError, match="closed the connection without a response"):
            await pool.send("POST", b"/completion", [], b"{}")
    assert server.connections == 1


async def test_body_cut_short_is_a_broken_body() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")

    async with serve(cut) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/x", [], b"")
        assert await response.next_chunk() == b"0123456789"
        with pytest.raises(BrokenBody):
            await response.next_chunk()
        response.release()
        assert not pool._idle


async def test_malformed_response_is_an_error() -> None:
    async with serve(reply_once(b"SPDY/9 banana\r\n\r\n")) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        with pytest.raises(UpstreamError):
            await pool.send("GET", b"/x", [], b"")


async def test_nothing_listening_is_an_error_naming_the_port() -> None:
    async with serve(answer_each) as server:
        port = server.port
    pool = ChildConnections("127.0.0.1", port)
    with pytest.raises(UpstreamError, match=f"could not reach .* on port {port}"):
        await pool.send("GET", b"/health", [], b"")


async def test_unread_body_closes_the_connection_instead_of_pooling_it() -> None:
    partial = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789"
    async with serve(reply_once(partial)) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/x", [], b"")
        response.release()  # body not read to its end
        await asyncio.wait_for(server.closed.wait(), TIMEOUT)
        assert not pool._idle


async def test_a_complete_answer_is_pooled_even_if_not_read() -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/x", [], b"")
        async with asyncio.timeout(TIMEOUT):
            while not response._conn.complete:  # noqa: ASYNC110 (protocol state, no event)
                await asyncio.sleep(0)
        response.release()
        assert len(pool._idle) == 1


async def test_connection_close_is_asked_for_and_never_pooled() -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("POST", b"/v1/chat/completions", [], b"{}",
                                   keep_alive=False)
        await response.read()
        response.release()
        assert b"connection: close\r\n" in server.requests[0]
        assert not pool._idle


async def test_server_that_closes_after_its_answer_is_not_pooled() -> None:
    async with serve(answer_and_close) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/x", [], b"")
        assert await response.read() == b"bye"
        response.release()
        assert not pool._idle


async def test_cancel_aborts_a_request_waiting_for_its_answer() -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           server: Server) -> None:
        await server.read_request(reader)
        await reader.read()  # until the client goes away

    async with serve(never_answer) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        cancel = Cancel()
        sending = asyncio.ensure_future(pool.send("POST", b"/x", [], b"{}", cancel=cancel))
        await asyncio.wait_for(server.got_request.wait(), TIMEOUT)
        cancel()
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(sending, TIMEOUT)
        await asyncio.wait_for(server.closed.wait(), TIMEOUT)
    assert server.connections == 1  # not retried


async def test_a_reused_connection_aborted_by_abort_all_is_not_retried() -> None:
    """A server found frozen: ``abort_all`` ends the request waiting on a reused keep-alive
    connection, and the pool does not send it again on a fresh one (that would hang too)."""
    async def answer_first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(b"first"))
        await server.read_request(reader)  # frozen: the next one is never answered
        await reader.read()

    async with serve(answer_first_only) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        assert await fetch(pool, b"/first") == b"first"
        server.got_request.clear()
        sending = asyncio.ensure_future(pool.send("POST", b"/x", [], b"{}"))
        await asyncio.wait_for(server.got_request.wait(), TIMEOUT)  # on the reused one
        pool.abort_all()
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(sending, TIMEOUT)
    assert server.connections == 1  # not retried


async def test_expired_idle_connection_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        await fetch(pool, b"/x")
        monkeypatch.setattr(upstream, "IDLE_EXPIRY_S", 0.0)
        await fetch(pool, b"/x")
    assert server.connections == 2


async def test_head_response_is_complete_at_its_headers() -> None:
    async with serve(reply_once(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n")) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("HEAD", b"/x", [], b"")
        assert response.header(b"content-length") == b"50"
        assert await asyncio.wait_for(response.read(), TIMEOUT) == b""
        response.release()
        assert not pool._idle


async def test_aclose_closes_idle_connections_and_later_ones_on_release() -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        await fetch(pool, b"/x")
        await pool.aclose()
        await asyncio.wait_for(server.closed.wait(), TIMEOUT)
        await fetch(pool, b"/x")
        assert b"connection: close" in server.requests[-1]
        assert not pool._idle


async def test_a_large_body_is_not_buffered_past_the_high_water_mark() -> None:
    size = 8 * upstream.READ_HIGH_WATER

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        await server.read_request(reader)

    async with serve(big) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/big", [], b"")
        conn = response._conn
        async with asyncio.timeout(TIMEOUT):
            # Reading stops once the high-water mark is passed (protocol state, no event).
            while not conn._paused:  # noqa: ASYNC110
                await asyncio.sleep(0)
        assert conn._buffered <= 2 * upstream.READ_HIGH_WATER  # plus at most one read
        assert len(await asyncio.wait_for(response.read(), TIMEOUT)) == size
        response.release()
        assert len(pool._idle) == 1


async def test_connections_stay_within_the_cap_and_waiters_are_served_in_order() -> None:
    gate = asyncio.Event()
    concurrent = 0
    most = 0

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   server: Server) -> None:
        nonlocal concurrent, most
        concurrent += 1
        most = max(most, concurrent)
        try:
            while (request := await server.read_request(reader)) is not None:
                await gate.wait()
                writer.write(ok(request.split(b"\r\n\r\n", 1)[1]))
        finally:
            concurrent -= 1

    async with serve(held) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=2)
        done: list[int] = []

        async def one(n: int) -> None:
            response = await pool.send("POST", b"/x", [], b"%d" % n)
            assert await response.read() == b"%d" % n
            response.release()
            done.append(n)

        tasks = [asyncio.ensure_future(one(n)) for n in range(6)]
        async with asyncio.timeout(TIMEOUT):
            while len(pool._waiters) < 4:  # noqa: ASYNC110 (pool state, no event)
                await asyncio.sleep(0)
        assert pool.open_connections == 2
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
        assert most == 2
        assert server.connections == 2  # released connections were handed over, not reopened
        assert done[2:] == [2, 3, 4, 5]  # waiters in arrival order


async def test_a_waiter_that_gives_up_keeps_nobody_waiting() -> None:
    gate = asyncio.Event()
    async with serve(answer_after(gate)) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=1)
        first = asyncio.ensure_future(pool.send("GET", b"/a", [], b""))
        await asyncio.wait_for(server.got_request.wait(), TIMEOUT)
        quitter = asyncio.ensure_future(pool.send("GET", b"/b", [], b""))
        patient = asyncio.ensure_future(pool.send("GET", b"/c", [], b""))
        async with asyncio.timeout(TIMEOUT):
            while len(pool._waiters) < 2:  # noqa: ASYNC110 (pool state, no event)
                await asyncio.sleep(0)
        quitter.cancel()
        gate.set()
        response = await asyncio.wait_for(first, TIMEOUT)
        await response.read()
        response.release()
        response = await asyncio.wait_for(patient, TIMEOUT)
        assert await response.read() == b"x"
        response.release()
        assert pool.open_connections == 1
        assert quitter.cancelled()


async def test_a_closed_connection_frees_its_place() -> None:
    async with serve(answer_and_close) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=1)
        for _ in range(3):
            response = await asyncio.wait_for(pool.send("GET", b"/x", [], b""), TIMEOUT)
            assert await response.read() == b"bye"
            response.release()
    assert server.connections == 3


async def test_a_failed_connect_frees_its_place() -> None:
    async with serve(answer_each) as server:
        port = server.port
    pool = ChildConnections("127.0.0.1", port, max_connections=1)
    for _ in range(2):
        with pytest.raises(UpstreamError, match="could not reach"):
            await asyncio.wait_for(pool.send("GET", b"/x", [], b""), TIMEOUT)
    assert pool.open_connections == 0


async def test_cancel_ends_a_wait_for_a_place() -> None:
    gate = asyncio.Event()
    async with serve(answer_after(gate)) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=1)
        first = asyncio.ensure_future(pool.send("GET", b"/a", [], b""))
        await asyncio.wait_for(server.got_request.wait(), TIMEOUT)
        cancel = Cancel()
        queued = asyncio.ensure_future(pool.send("GET", b"/b", [], b"", cancel=cancel))
        async with asyncio.timeout(TIMEOUT):
            while not pool._waiters:  # noqa: ASYNC110 (pool state, no event)
                await asyncio.sleep(0)
        cancel()
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(queued, TIMEOUT)
        assert not pool._waiters
        gate.set()
        response = await asyncio.wait_for(first, TIMEOUT)
        await response.read()
        response.release()
        assert len(server.requests) == 1  # the cancelled request never reached the server


async def test_a_connection_closed_as_soon_as_it_is_made_fails_fast_and_frees_its_place(
        ) -> None:
    async def slam(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   server: Server) -> None:
        return  # closed at once, before any request

    async with serve(slam) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=1)
        for _ in range(3):
            with pytest.raises(UpstreamError):
                await asyncio.wait_for(pool.send("GET", b"/x", [], b""), TIMEOUT)
        async with asyncio.timeout(TIMEOUT):
            while pool.open_connections:  # noqa: ASYNC110 (pool state, no event)
                await asyncio.sleep(0)


async def test_places_are_not_lost_when_requests_are_cancelled_at_every_stage() -> None:
    gate = asyncio.Event()
    async with serve(answer_after(gate)) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=2)

        async def one() -> bytes:
            response = await pool.send("GET", b"/x", [], b"")
            try:
                return await response.read()
            finally:
                response.release()

        tasks = [asyncio.ensure_future(one()) for _ in range(8)]
        for _ in range(3):
            await asyncio.sleep(0)
        for task in tasks[::2]:  # connecting, sending or queued
            task.cancel()
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                         TIMEOUT)
        assert results[1::2] == [b"x"] * 4
        async with asyncio.timeout(TIMEOUT):
            while pool._waiters:  # noqa: ASYNC110 (pool state, no event)
                await asyncio.sleep(0)
        assert pool.open_connections <= 2
        response = await asyncio.wait_for(pool.send("GET", b"/x", [], b""), TIMEOUT)
        assert await response.read() == b"x"
        response.release()


# -- hardening: framing, upgrades, header validation ---------------------------------------


async def test_a_body_delimited_by_the_close_is_complete_and_the_connection_not_reused(
        ) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"world")  # no length, not chunked: the body ends where the connection does

    async with serve(until_close) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("GET", b"/x", [], b"")
        assert await asyncio.wait_for(response.read(), TIMEOUT) == b"hello world"
        response.release()
        assert not pool._idle
        assert await fetch(pool, b"/y") == b"hello world"  # the next one on a fresh connection
    assert server.connections == 2


async def test_switching_protocols_is_a_clean_error_and_the_pool_goes_on() -> None:
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))

    async def switch_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                 server: Server) -> None:
        await server.read_request(reader)
        if server.connections == 1:
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                         b"connection: upgrade\r\n\r\n\x81\x05hello")
            await reader.read()
            return
        writer.write(ok(b"fine"))
        await reader.read()

    async with serve(switch_then_answer) as server:
        pool = ChildConnections("127.0.0.1", server.port, max_connections=1)
        with pytest.raises(UpstreamError, match="101") as raised:
            await asyncio.wait_for(pool.send("GET", b"/x", [], b""), TIMEOUT)
        assert raised.value.status == 502
        assert type(raised.value) is UpstreamError  # not a lost connection: never retried
        assert await asyncio.wait_for(fetch(pool, b"/y"), TIMEOUT) == b"fine"
    assert loop_errors == []  # nothing raised inside the protocol's callbacks


BAD_HEADERS = [
    pytest.param((b"x-a", b"1\r\nx-injected: 2"), id="crlf-in-value"),
    pytest.param((b"x-a", b"1\nx-injected: 2"), id="lf-in-value"),
    pytest.param((b"x-a", b"1\r"), id="cr-in-value"),
    pytest.param((b"x-a", b"1\x00"), id="nul-in-value"),
    pytest.param((b"x-a: 1\r\nx-b", b"2"), id="crlf-in-name"),
    pytest.param((b"authorization: Bearer k", b"x"), id="colon-in-name"),
    pytest.param((b"x a", b"1"), id="space-in-name"),
    pytest.param((b"", b"1"), id="empty-name"),
    pytest.param((b"x-\xe9", b"1"), id="non-ascii-name"),
]


@pytest.mark.parametrize("bad", BAD_HEADERS)
async def test_a_header_that_cannot_be_written_as_itself_is_refused_before_sending(
        bad: tuple[bytes, bytes]) -> None:
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        with pytest.raises(upstream.InvalidHeader) as raised:
            await pool.send("POST", b"/x", [(b"x-fine", b"ok"), bad], b"{}")
        assert raised.value.status == 400
        assert pool.open_connections == 0
        assert await fetch(pool, b"/y") == b'{"n": 1}'  # the pool is untouched
    assert server.connections == 1 and len(server.requests) == 1


async def test_valid_headers_with_any_other_bytes_in_values_pass_through() -> None:
    headers = [(b"x-tab", b"a\tb"), (b"x-latin", b"caf\xe9"), (b"x-colon", b"a: b"),
               (b"X-Mixed-Case!#$%&'*+.^_`|~9", b"")]
    async with serve(answer_each) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        response = await pool.send("POST", b"/x", headers, b"{}")
        await response.read()
        response.release()
    head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[2:6] == [b"x-tab: a\tb", b"x-latin: caf\xe9", b"x-colon: a: b",
                         b"X-Mixed-Case!#$%&'*+.^_`|~9: "]


class NullTransport(asyncio.Transport):
    """A transport that takes every write and call, for a connection fed by the test."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_a_sink_never_overtakes_a_chunk_the_relay_still_holds() -> None:
    """Chunks go to the relay's sink as they arrive; one the sink refused goes through
    ``next_chunk``, and while the relay holds it (sending it on) every later chunk queues
    behind it: the client gets them in order. Once the relay asks again with nothing queued,
    the sink takes them directly again."""
    conn = upstream._Connection()
    conn.connection_made(NullTransport())
    conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False)  # a response is read once asked for
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                       b"transfer-encoding: chunked\r\n\r\n")
    await conn.headers_received()
    sent: list[bytes] = []
    accepting = False

    def sink(body: bytes) -> bool:
        if accepting:
            sent.append(body)
        return accepting

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data)

    conn.sink = sink
    conn.data_received(chunk(b"1"))  # refused (the client is backed up): queued
    held = await conn.next_chunk()
    assert held == b"1" and sent == []
    accepting = True  # the client caught up while the relay was still sending "1"
    conn.data_received(chunk(b"2"))
    assert sent == [], "a later chunk overtook the one the relay holds"
    sent.append(held)  # the relay's send of "1" completes
    assert await conn.next_chunk() == b"2"
    sent.append(b"2")
    waiting = asyncio.create_task(conn.next_chunk())  # asks again: nothing queued
    await asyncio.sleep(0)
    conn.data_received(chunk(b"3") + chunk(b"4"))  # one read: one piece, to the sink
    assert sent == [b"1", b"2", b"34"] and not waiting.done()
    conn.data_received(b"0\r\n\r\n")
    assert await asyncio.wait_for(waiting, TIMEOUT) is None


# -- the response head's bounds ----------------------------------------------------------------


def endless_head(start: bytes, filler: bytes) -> Handler:
    """Answers every request with ``start``, then ``filler`` for ever (until the client
    closes): a hostile peer's response head that never ends."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(start)
        sent = len(start)
        while sent < 64 << 20:  # bounded: a broken test cannot run for ever
            writer.write(filler)
            sent += len(filler)
            await writer.drain()

    return handler


@pytest.mark.parametrize(("start", "filler", "what"), [
    (b"HTTP/1.1 200 OK\r\nx-a: ", b"v" * 65536, "over 65536 bytes"),
    (b"HTTP/1.1 200 OK\r\n", b"x-a: b\r\n" * 1000, "more than 100 response headers"),
    (b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 1000, "over 65536 bytes"),
])
async def test_an_endless_response_head_fails_the_exchange_naming_the_upstream(
        start: bytes, filler: bytes, what: str) -> None:
    async with serve(endless_head(start, filler)) as server:
        pool = ChildConnections("127.0.0.1", server.port, label="peer router http://x:1")
        fed: list[int] = []
        real_feed = upstream._Connection._feed

        def counting_feed(self: upstream._Connection, data: bytes) -> None:
            fed.append(len(data))
            real_feed(self, data)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(upstream._Connection, "_feed", counting_feed)
            with pytest.raises(UpstreamError) as caught:
                async with asyncio.timeout(TIMEOUT):
                    await pool.send("GET", b"/", [], b"")
        async with asyncio.timeout(TIMEOUT):
            await server.closed.wait()  # the connection was aborted, not kept
    assert caught.value.status == 502
    assert caught.value.message.startswith("peer router http://x:1 sent ")
    assert what in caught.value.message
    assert sum(fed) <= upstream.MAX_RESPONSE_HEAD_BYTES  # never parsed past the bound
    assert pool.open_connections == 0


async def test_a_head_at_the_bounds_is_read() -> None:
    headers = [b"x-%d: %s" % (i, b"v" * 500) for i in range(upstream.MAX_RESPONSE_HEADERS - 2)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"{}", *headers))

    async with serve(handler) as server:
        pool = ChildConnections("127.0.0.1", server.port)
        async with asyncio.timeout(TIMEOUT):
            response = await pool.send("GET", b"/", [], b"")
            assert await response.read() == b"{}"
        response.release()
    assert response.status == 200
    assert len(response.headers) == upstream.MAX_RESPONSE_HEADERS


async def test_a_response_head_that_never_comes_is_a_504_naming_the_upstream() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")  # a head begun, never ended
        await reader.read()  # until the router aborts

    async with serve(silent) as server:
        pool = ChildConnections("127.0.0.1", server.port, label="upstream http://u:9",
                                head_timeout_s=0.3)
        with pytest.raises(upstream.UpstreamTimeout) as caught:
            async with asyncio.timeout(TIMEOUT):
                await pool.send("POST", b"/v1/chat/completions", [], b"{}")
        async with asyncio.timeout(TIMEOUT):
            await server.closed.wait()
    assert caught.value.status == 504
    assert caught.value.message == "upstream http://u:9 sent no response head within 0.3 s"
    assert pool.open_connections == 0


async def test_the_head_deadline_ends_with_the_head() -> None:
    """A body that takes longer than the head deadline is never cut by it."""
    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(4):
            await asyncio.sleep(0.2)
            writer.write(b"1\r\nx\r\n")
        writer.write(b"0\r\n\r\n")

    async with serve(slow_body) as server:
        pool = ChildConnections("127.0.0.1", server.port, head_timeout_s=0.3)
        async with asyncio.timeout(TIMEOUT):
            response = await pool.send("GET", b"/", [], b"")
            assert await response.read() == b"xxxx"
        response.release()
