"""N concurrent streamed requests on raw asyncio connections, counting SSE events as they arrive.

The relay phase (``benchmarks.relay``) runs it as a subprocess, so its CPU is not the harness's
and it can be the lightest client the measurement allows (uvloop, one ``asyncio.Protocol`` per
stream, no HTTP library)::

    python -m benchmarks.streamclient URL N BODY

It opens ``N`` connections, prints ``ready``, waits for a line on stdin, then POSTs ``BODY`` (JSON)
to ``URL`` on every connection at once (``Connection: close``), de-chunks each response and
counts its ``data:`` events as they arrive, and prints one JSON line: events and bytes received,
the streams that ended with ``data: [DONE]``, the wall time from the go to the last stream's
end, the time to each stream's first event, and the gap before each event on its stream (the
events that arrive in one read share it: all but the first get 0), as percentiles in ms.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import Any, cast

EVENT = b"\ndata: "  # an SSE data line at the start of a line (the body gets a leading "\n")
DONE = b"\ndata: [DONE]"


class ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoder: ``feed`` returns the payload bytes
    that ``data`` completes; ``done`` once the last (empty) chunk has been read."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # payload bytes still due in the current chunk
        self._trailer = False  # the current chunk's payload is read; its CRLF is due
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data
        out: list[bytes] = []
        pos = 0
        while not self.done:
            if self._left:
                take = buffer[pos:pos + self._left]
                out.append(take)
                pos += len(take)
                self._left -= len(take)
                if self._left:
                    break
                self._trailer = True
            if self._trailer:
                if len(buffer) - pos < 2:
                    break
                pos += 2
                self._trailer = False
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                break
            size = int(buffer[pos:end].split(b";", 1)[0], 16)
            pos = end + 2
            if size == 0:
                self.done = True  # trailers, if any, are not read: the connection closes
            self._left = size
        self._buffer = buffer[pos:]
        return b"".join(out)


class Counter:
    """Counts occurrences of ``needle`` in a byte stream fed in arbitrary pieces."""

    def __init__(self, needle: bytes) -> None:
        self.needle = needle
        self._tail = b""
        self.count = 0

    def feed(self, data: bytes) -> int:
        text = self._tail + data
        found = text.count(self.needle)
        self.count += found
        self._tail = text[-(len(self.needle) - 1):]
        return found


class Stream(asyncio.Protocol):
    """One streamed request: its response's events, their arrival gaps, its end."""

    def __init__(self, gaps: array[float], first: list[float]) -> None:
        self.gaps = gaps
        self.first = first
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.status = 0
        self.chunked: ChunkedDecoder | None = None
        self.events = Counter(EVENT)
        self.done = Counter(DONE)
        self.sent_at = 0.0
        self.last: float | None = None
        self.bytes = 0
        self.reads = 0
        self.error: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.connected.set_result(None)

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.reads += 1
        if not self.status:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4:]
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split()[1])
            if any(line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
                   for line in lines[1:]):
                self.chunked = ChunkedDecoder()
            self.events.feed(b"\n")  # the body's first line starts a line
            self.done.feed(b"\n")
        payload = self.chunked.feed(data) if self.chunked is not None else data
        self.bytes += len(payload)
        found = self.events.feed(payload) if self.status == 200 else 0
        if found:
            self.done.feed(payload)
            if self.last is None:
                self.first.append(now - self.sent_at)
            else:
                self.gaps.append(now - self.last)
            self.gaps.extend([0.0] * (found - 1))
            self.last = now
        if self.status != 200 and self.error is None:
            self.error = f"HTTP {self.status}: {payload[:200]!r}"
        if self.chunked is not None and self.chunked.done and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.error is None:
            self.error = repr(exc)
        if not self.connected.done():
            self.connected.set_exception(exc or ConnectionError("closed before use"))
        if not self.ended.done():
            self.ended.set_result(None)


def _percentiles_ms(values: array[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] * 1000.0

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "p999": at(0.999), "max": ordered[-1] * 1000.0}


def request_bytes(url: str, body: bytes) -> tuple[str, int, bytes]:
    """(host, port, the POST request) for ``url`` (``http://host:port/path``)."""
    rest = url.removeprefix("http://")
    netloc, _, path = rest.partition("/")
    host, _, port = netloc.rpartition(":")
    head = (f"POST /{path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return host, int(port), head.encode() + body


async def run(url: str, streams: int, body: bytes,
              go: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Open ``streams`` connections, await ``go()`` (None: start at once), stream them all."""
    loop = asyncio.get_running_loop()
    host, port, request = request_bytes(url, body)
    gaps: array[float] = array("d")
    first: list[float] = []
    protocols: list[Stream] = []
    for _ in range(streams):
        _, protocol = await loop.create_connection(lambda: Stream(gaps, first), host, port)
        protocols.append(protocol)
    if go is not None:
        await go()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    began = time.perf_counter()
    for protocol in protocols:
        protocol.send(request)
    await asyncio.gather(*(p.ended for p in protocols))
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_SELF)
    events = sum(p.events.count for p in protocols)
    done = sum(p.done.count for p in protocols)
    errors = [p.error for p in protocols if p.error is not None or p.status != 200]
    return {
        "streams": streams, "events": events - done, "done": done,
        "bytes": sum(p.bytes for p in protocols), "reads": sum(p.reads for p in protocols),
        "wall_s": wall, "events_per_s": (events - done) / wall if wall > 0 else 0.0,
        "errors": len(errors), "error_samples": [str(e) for e in errors[:3]],
        "first_event_ms": _percentiles_ms(array("d", first)), "gap_ms": _percentiles_ms(gaps),
        "client_cpu_s": (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime),
    }


async def _main(url: str, streams: int, body: bytes) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def go() -> None:
        print("ready", flush=True)
        await reader.readline()

    return await run(url, streams, body, go)


def main(argv: list[str]) -> int:
    url, streams, body = argv[0], int(argv[1]), argv[2].encode()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(_main(url, streams, body))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
