"""The floor for a relay in Python: a uvloop TCP proxy that copies bytes both ways and does
nothing else (no HTTP parsing, no routing, no framing, no bookkeeping).

The relay phase (``benchmarks.relay``) puts it in front of a direct llama-server as one more
column: what it costs per relayed event is what any Python relay on uvloop pays for the
event loop's wake-up, a read and a write, so llama-router's CPU per event above it is what
its own code adds::

    python -m benchmarks.floorrelay LISTEN_PORT UPSTREAM_PORT

It prints ``ready`` once listening.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop


class _Upstream(asyncio.Protocol):
    """The connection to the server: what it sends goes to the client as it is."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """A client's connection: one fresh connection to the server each, bytes copied both
    ways until either side closes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.pending: list[bytes] = []
        self.connecting: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: _Upstream(self), "127.0.0.1",
                                                       self.port)
        except OSError:
            self.close()
            return
        self.upstream = upstream
        for data in self.pending:
            upstream.transport.write(data)  # type: ignore[union-attr]
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(data)
        else:
            self.pending.append(data)

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def serve(listen_port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream_port), "127.0.0.1", listen_port)
    print("ready", flush=True)
    await server.serve_forever()


def main() -> None:
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2])))


if __name__ == "__main__":
    main()
