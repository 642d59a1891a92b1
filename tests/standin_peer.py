"""A stand-in peer router for the peer tests: an asyncio server speaking the slice of a
llama-router a gateway calls (``/health``, ``/props``, ``/models``, ``/models/sse``), with
knobs for a broken or hostile peer, and the helpers that run one ``Peer`` against it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.events import EventBus
from router.peers.peer import Peer
from router.peers.placement import Candidate
from router.peers.tasks import perform

HANG_GUARD_S = 20.0
ENDLESS_CHUNK = b"x" * (1 << 20)


class StandInPeer:
    """A peer router on a free port: ``/health``, ``/props`` (its node name), ``/models``,
    ``/models/sse`` (events put on ``events``), and ``/stream`` (an event stream that sends
    a chunk per item put on ``chunks``). Knobs: ``silent`` (/health never answers),
    ``listing`` (the raw ``/models`` body instead of ``models``'), ``endless_line`` (bytes of
    one line without a line end that ``/models/sse`` sends after its next event; what it
    managed to send adds up in ``sent``), ``endless_head`` (bytes of a response head that
    never ends, sent to every relayed request: any path but ``/health``, ``/props`` and
    ``/models*``; added up in ``sent`` too)."""

    def __init__(self, node: str, models: dict[str, str], instance: str = "") -> None:
        self.node = node
        self.instance = instance
        self.models = models
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()
        self.silent = False
        self.listing: bytes | None = None
        self.endless_line = 0
        self.endless_head = 0
        self.sent = 0
        self.subscriptions = 0
        self.server: asyncio.Server | None = None
        self.url = ""
        self.auth: list[str | None] = []
        self.via: list[str | None] = []
        self.handlers: set[asyncio.Task[None]] = set()
        self.closing = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each accepted connection is owned by its handler task: ``__aexit__`` cancels the
        ones still running, and the handler closes its connection on every way out."""
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            if not self.closing:  # accepted as it closed: closed at once
                await self._answer(reader, writer)
        finally:
            self.handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError,
                                 asyncio.CancelledError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split(" ", 2)[1]

            def header(name: str) -> str | None:
                return next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                             if line.lower().startswith(name + ":")), None)

            self.auth.append(header("authorization"))
            if path != "/health":
                self.via.append(header("x-llama-router-via"))
            if path == "/health" and self.silent:
                await asyncio.sleep(3600)
            if path in ("/models/sse", "/stream"):
                await self._stream(path, writer)
            if self.endless_head and path not in ("/health", "/props", "/models"):
                await self._endless_head(writer)
            answer: dict[str, Any] = {"status": "ok"}
            if path == "/props":
                answer = {"role": "router", "llama_router": {"node": self.node, **(
                    {"instance": self.instance} if self.instance else {})}}
            elif path == "/models":
                answer = {"object": "list", "data": [
                    {"id": m, "object": "model", "status": {"value": s}}
                    for m, s in self.models.items()]}
            body = json.dumps(answer).encode()
            if path == "/models" and self.listing is not None:
                body = self.listing
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()

    async def _stream(self, path: str, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        if path == "/models/sse":
            self.subscriptions += 1
            first = b'data: {"model": "*", "event": "hello"}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(first), first))
        while True:
            if path == "/models/sse" and self.endless_line:
                await self._endless(writer)
            if path == "/stream":
                data = await self.chunks.get()
            else:
                data = b"data: " + json.dumps(await self.events.get()).encode() + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

    async def _endless_head(self, writer: asyncio.StreamWriter) -> None:
        """``endless_head`` bytes of a response head: one header whose value never ends."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Endless: ")
        left = self.endless_head
        while left > 0:
            data = ENDLESS_CHUNK[:left]
            writer.write(data)
            await writer.drain()
            self.sent += len(data)
            left -= len(data)
        await asyncio.Event().wait()

    async def _endless(self, writer: asyncio.StreamWriter) -> None:
        """``endless_line`` bytes of one line, never ended (then the stream stops)."""
        start = b"data: "
        writer.write(b"%x\r\n%s\r\n" % (len(start), start))
        left = self.endless_line
        while left > 0:
            data = ENDLESS_CHUNK[:left]
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            self.sent += len(data)
            left -= len(data)
        await asyncio.Event().wait()

    async def __aenter__(self) -> StandInPeer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop_listening(self) -> None:
        """Refuse new connections; those open stay (a router shutting down)."""
        assert self.server is not None
        self.server.close()

    async def __aexit__(self, *exc: object) -> None:
        """Stop listening, then end every connection still open (a silent ``/health``, an
        endless stream) and wait until each is closed: nothing outlives the stand-in."""
        assert self.server is not None
        # A connection still in the listening backlog (a probe of a peer just closed) is
        # accepted and attached first: Python 3.11's server fails an assertion on one whose
        # accept it finishes after ``close`` and leaks its socket.
        await asyncio.sleep(0.05)
        self.server.close()
        self.closing = True
        for _ in range(3):  # the handler of a connection accepted as it closed starts late
            handlers = list(self.handlers)
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await asyncio.sleep(0.01)
        await self.server.wait_closed()


async def wait_for(predicate: Any, timeout: float = HANG_GUARD_S) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (peer state, no event to await)
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_peer(stand_in: StandInPeer, events: EventBus, **options: Any
                       ) -> AsyncIterator[Peer]:
    async with httpx.AsyncClient() as client:
        peer = Peer(stand_in.url, client=client, events=events, work=perform, own_node="gw",
                    own_instance="gw-instance", api_key="sk-peer",
                    **{"interval": 0.05, "timeout": 2.0, "misses": 2, **options})
        peer.start()
        try:
            yield peer
        finally:
            await peer.close()


async def collect(events: EventBus, into: list[dict[str, Any]]) -> None:
    async with events.subscribe() as subscription:
        while True:
            into.append(await subscription.get())


class StubPeer:
    def __init__(self, node: str, statuses: dict[str, str], up: bool = True) -> None:
        self.node = node
        self.instance = f"id-{node}"
        self.via = self.instance
        self.up = up
        self.reason = "" if up else "ConnectError"
        self.models = {m: {"id": m, "status": {"value": s}, "node": node}
                       for m, s in statuses.items()}
        self.peer_ids = {m: m for m in statuses}
        self.facts: dict[str, Any] = {}  # what its entries say of it: unknown
        self.outstanding: dict[str, int] = {}

    def status_of(self, model: str) -> str:
        return str(self.models[model]["status"]["value"])

    def candidate(self, model: str) -> Candidate:
        return Candidate(self.node, self.status_of(model) == "loaded",
                         self.outstanding.get(model, 0), self, model)  # type: ignore[arg-type]


class StubPeers:
    def __init__(self, *peers: StubPeer) -> None:
        self.peers = {p.node: p for p in peers}

    def holders(self, model: str, passed: tuple[str, ...] = ()) -> list[StubPeer]:
        return [p for p in self.peers.values() if p.up and model in p.models
                and p.via not in passed]
