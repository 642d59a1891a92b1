"""The hop to the child as a client sees it: hop-by-hop headers, header validation, bodies
delimited by the close, upgrades and truncated bodies.

The in-process tests run the router's own proxy (``forward.proxy``) under uvicorn, in front of
a raw asyncio server standing in for the child (faults a real llama-server cannot show on
demand); the last test runs the real router and llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support import proxy_in_uvicorn, start_router, write_presets

from router.config.sources import Catalogue
from router.edge.forward import proxy
from router.edge.metering import Meter
from router.edge.virtual import Virtuals
from router.http.proxy import RESPONSE_DROP, upstream_headers
from router.http.requests import RequestContext
from router.http.shutdown import Shutdown
from router.http.upstream import ChildConnections
from router.peers import hop
from router.teams.usage import Usage

# A scripted child: called with the request head it read (the body, if any, is left unread).
Child = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]
TIMEOUT = 5.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}


# -- the header filter --------------------------------------------------------------------


def test_hop_by_hop_and_connection_named_request_headers_stay_behind() -> None:
    raw = [(b"host", b"router:8080"), (b"connection", b"keep-alive, X-Foo ,x-bar"),
           (b"proxy-connection", b"keep-alive, X-Proxied"), (b"keep-alive", b"timeout=5"),
           (b"te", b"trailers"), (b"trailer", b"x-t"), (b"transfer-encoding", b"chunked"),
           (b"upgrade", b"websocket"), (b"proxy-authorization", b"Basic eA=="),
           (b"authorization", b"Bearer k"), (b"x-api-key", b"k"), (b"expect", b"100-continue"),
           (b"content-length", b"2"), (b"X-Foo", b"1"), (b"x-bar", b"2"), (b"x-proxied", b"3"),
           (b"content-type", b"application/json"), (b"X-Kept", b"yes")]
    assert upstream_headers(raw) == [(b"content-type", b"application/json"),
                                     (b"X-Kept", b"yes")]


@pytest.mark.parametrize("value", [b"keep-alive", b"Keep-Alive", b"close", b"Upgrade",
                                   b"keep-alive, close", b" , ,"])
def test_connection_options_that_name_no_header_drop_nothing_else(value: bytes) -> None:
    raw = [(b"connection", value), (b"accept", b"*/*"), (b"content-type", b"text/plain")]
    assert upstream_headers(raw) == raw[1:]


def test_every_hop_by_hop_header_is_dropped_from_responses() -> None:
    assert {b"connection", b"proxy-connection", b"keep-alive", b"te", b"trailer",
            b"transfer-encoding", b"upgrade", b"proxy-authenticate",
            b"proxy-authorization"} <= RESPONSE_DROP
    assert b"content-length" not in RESPONSE_DROP


# -- the proxy under uvicorn, in front of a scripted child --------------------------------


class FakeSupervisor:
    """Just what ``forward.proxy`` asks of the supervisor: every model is served by ``pool``."""

    settings = SimpleNamespace(max_body_bytes=1 << 20, models_autoload=True, state_dir=None)
    catalogue = Catalogue({})  # no profiles, no virtual models

    def __init__(self, pool: ChildConnections) -> None:
        self.pool = pool

    def find(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(id=model, preset=SimpleNamespace(id=model, prefix_routing=False,
                                                                  upstream=None, policy=None),
                               serving=True)

    def keeps_conversations(self, model: object) -> bool:
        return False

    def lease_now(self, model: SimpleNamespace, prefix: object = None, turn: object = None
                  ) -> SimpleNamespace:
        return SimpleNamespace(child=SimpleNamespace(connections=self.pool),
                               release=lambda: None, learn=lambda tail: None,
                               spent=lambda cost: None)


@contextlib.asynccontextmanager
async def child_server(child: Child) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A scripted child on a free port; yields the port and the request heads it read."""
    heads: list[bytes] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            await child(reader, writer, head)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], heads


@contextlib.asynccontextmanager
async def router_before(child: Child) -> AsyncIterator[httpx.AsyncClient]:
    """``forward.proxy`` served by uvicorn (as the router serves it) in front of ``child``."""
    async with child_server(child) as (port, _):
        pool = ChildConnections("127.0.0.1", port)
        state = SimpleNamespace(router=SimpleNamespace(models=FakeSupervisor(pool),
                                                       default=None,
                                                       shutdown=Shutdown(30.0),
                                                       peers=None,
                                                       meter=Meter(Usage()), virtuals=Virtuals()),
                                webui=None)
        try:
            async with proxy_in_uvicorn(state, TIMEOUT) as client:
                yield client
        finally:
            await pool.aclose()


def answer(raw: bytes) -> Child:
    """A child that answers ``raw`` and keeps the connection open."""
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes) -> None:
        writer.write(raw)
        await writer.drain()
        await reader.read()

    return child


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
    """A child that answers with the request head it got, and hop-by-hop headers of its own."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: X-Secret\r\n"
                 b"x-secret: child-only\r\nkeep-alive: timeout=5\r\n"
                 b"proxy-authenticate: Basic\r\ntrailer: x-t\r\nupgrade: h2c\r\n"
                 b"x-child: visible\r\ncontent-length: %d\r\n\r\n%s" % (len(head), head))
    await writer.drain()
    await reader.read()


async def test_connection_named_headers_reach_neither_the_child_nor_the_client() -> None:
    async with router_before(echo) as client:
        response = await client.post(
            "/v1/chat/completions", json=CHAT,
            headers={"Connection": "keep-alive, X-Api-Thing", "X-Api-Thing": "router-only",
                     "Proxy-Connection": "X-Other", "X-Other": "1", "TE": "trailers",
                     "X-Kept": "yes"})
    assert response.status_code == 200, response.text
    arrived = response.content.lower()
    assert b"\r\nx-kept: yes\r\n" in arrived
    for name in (b"x-api-thing", b"x-other", b"proxy-connection", b"\r\nte:"):
        assert name not in arrived, arrived
    assert response.headers["x-child"] == "visible"
    for header in ("x-secret", "keep-alive", "proxy-authenticate", "trailer", "upgrade"):
        assert header not in response.headers, response.headers


async def test_a_clients_via_header_never_reaches_the_child() -> None:
    """``x-llama-router-via`` is the routers' own: a client's made-up chain stays behind."""
    async with router_before(echo) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=[
            ("X-Llama-Router-Via", "made-up"), ("x-llama-router-via", "a,b"),
            ("X-Kept", "yes")])
    assert response.status_code == 200, response.text
    arrived = response.content.lower()
    assert b"\r\nx-kept: yes\r\n" in arrived
    assert b"via" not in arrived and b"made-up" not in arrived, arrived


def test_the_hop_to_a_peer_sends_the_parsed_via_chain_with_this_routers_id() -> None:
    """What ``hop.relay`` sends a peer: the client's headers as a child gets them (no via),
    then one via header: the chain the request came with, this router's instance id last."""
    raw = [(b"content-type", b"application/json"), (b"x-llama-router-via", b"gw-1, gw-2"),
           (b"X-Llama-Router-Via", b"gw-3")]
    request = RequestContext({"method": "POST", "path": "/v1/chat/completions",
                              "query_string": b"", "headers": raw})
    peer = SimpleNamespace(auth=[(b"authorization", b"Bearer sk-peer")], own_instance="me")
    sent = hop._headers(peer, request, upstream_headers(raw))  # type: ignore[arg-type]
    assert [(k, v) for k, v in sent if k.lower() == b"x-llama-router-via"] == [
        (b"x-llama-router-via", b"gw-1,gw-2,me")]
    assert (b"content-type", b"application/json") in sent


async def test_a_header_that_cannot_be_forwarded_is_a_400_envelope_and_nothing_is_sent(
        ) -> None:
    """uvicorn's own parser refuses such headers from the network, so this calls the proxy
    as an ASGI server that lets them through would."""
    async with child_server(answer(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")) as (
            port, heads):
        pool = ChildConnections("127.0.0.1", port)
        body = json.dumps(CHAT).encode()
        scope: dict[str, Any] = {
            "type": "http", "method": "POST", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(body)),
                        (b"x-note", b"a\r\nx-injected: 1")],
            "app": SimpleNamespace(state=SimpleNamespace(
                router=SimpleNamespace(models=FakeSupervisor(pool), default=None,
                                       shutdown=Shutdown(30.0), peers=None,
                                       meter=Meter(Usage()), virtuals=Virtuals()),
                webui=None))}
        messages: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        await proxy(scope, receive, send)
        await asyncio.sleep(0.05)  # a connection would have been made by now
    assert messages[0]["status"] == 400
    error = json.loads(messages[1]["body"])["error"]
    assert error["type"] == "invalid_request_error" and "x-note" in error["message"]
    assert heads == [] and pool.open_connections == 0


async def test_a_body_delimited_by_the_close_is_relayed_complete(
        caplog: pytest.LogCaptureFixture) -> None:
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it, until the close"

    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes) -> None:
        writer.write(raw)  # and close: that ends the body

    async with router_before(child) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.text == "all of it, until the close"
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # not "broken"


async def test_switching_protocols_from_the_child_is_a_502_envelope() -> None:
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes) -> None:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                     b"connection: upgrade\r\n\r\n")
        await reader.read()

    async with router_before(child) as client:
        for _ in range(2):  # the pool and the loop carry on
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["type"] == "server_error" and "101" in error["message"]


BIG = 2 << 20  # past proxy.SMALL_BODY: relayed as it arrives


@pytest.mark.parametrize("framing", [
    pytest.param(b"transfer-encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n5\r\n01",
                 id="chunked"),
    pytest.param(b"content-length: %d\r\n\r\n%s" % (BIG, b"x" * 70000), id="content-length"),
])
async def test_a_body_that_breaks_midway_is_visibly_truncated(framing: bytes) -> None:
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + framing)
        await writer.drain()
        await asyncio.sleep(0.05)  # the head reaches the client first; then the child dies

    async with router_before(child) as client:
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await response.aread()
        # The router and its pool carry on.
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/v1/chat/completions", json=CHAT)


async def test_an_event_stream_that_breaks_midway_ends_with_an_error_event() -> None:
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes) -> None:
        event = b'data: {"n": 1}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
                     + b'20\r\ndata: {"n"')  # 32 bytes announced; the child dies after 10
        await writer.drain()
        await asyncio.sleep(0.05)

    async with router_before(child) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    # The cut-off event is ended, so the error is an event of its own, and the last one.
    events = response.text.split("\n\n")
    assert events[:2] == ['data: {"n": 1}', 'data: {"n"']
    assert events[2].startswith("data: ") and events[3:] == [""]
    last = json.loads(events[2].removeprefix("data: "))
    assert last["error"]["code"] == 502
    assert "failed mid-stream" in last["error"]["message"]
    assert events[-1] == ""


# -- the real llama-server --------------------------------------------------------------


@pytest.mark.real
def test_a_connection_named_header_never_reaches_the_real_child(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Headers named in ``Connection`` stay behind (what is dropped is checked in process
    above); against the real llama-server the request still works, and the CORS answer is the
    router's own (``--cors-origins``), never the child's echo of the ``Origin``."""
    presets = write_presets(tmp_path / "models.ini", f"version = 1\n[*]\nctx-size = 512\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\n")
    request = {"model": "alpha", "content": "hello"}
    origin = "http://app.example"
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        plain = client.post("/tokenize", json=request, headers={"Origin": origin})
        assert plain.status_code == 200, plain.text
        assert plain.headers.get_list("access-control-allow-origin") == ["*"]
        named = client.post("/tokenize", json=request,
                            headers={"Origin": origin, "Connection": "keep-alive, Origin",
                                     "X-Api-Thing": "x", "Proxy-Connection": "X-Api-Thing"})
        assert named.status_code == 200, named.text
        assert named.json() == plain.json()
        assert origin not in named.headers.get("access-control-allow-origin", "")
        chat = client.post("/v1/chat/completions",
                           headers={"Connection": "X-Api-Thing", "X-Api-Thing": "x"},
                           json={"model": "alpha", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
