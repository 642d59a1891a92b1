"""A stand-in child that streams as fast as the socket takes: the relay ceiling's upstream.

The relay phase (``benchmarks.relay``) serves a model from it through a preset's
``upstream = http://127.0.0.1:PORT``, so the child is never the limit and what one llama-router
process can relay shows::

    python -m benchmarks.standin PORT

It speaks the slice of llama-server a router needs: ``GET /health``, ``GET /v1/models``, and
``POST /v1/chat/completions`` with ``"stream": true`` in llama-server's shape (one
``chat.completion.chunk`` event per HTTP chunk, ``max_tokens`` of them, the last with
``finish_reason`` and ``timings``, then ``data: [DONE]``); other requests get a 404 envelope.
It writes an event whenever the socket's send buffer has room (asyncio's flow control: past
64 KiB unsent it waits for the reader), so a reader slower than the stand-in makes it wait,
never drop. A request with ``"standin_paced": true`` is paced instead, as a child generating
on many slots at once is: every ``TICK_S`` one event goes to each paced stream, each its own
write, so N paced streams offer about N x 1,000 events/s, one event per wake-up of a reader
that keeps up; a stream whose reader is backed up (64 KiB unsent) skips the tick and is
counted (``skipped_ticks``). ``GET /stats`` says how many ``data:`` events (``[DONE]``
included) it has written and how long it waited for readers in all (``blocked_s``): the
harness compares that with what its clients received.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

HIGH_WATER = 64 * 1024
TICK_S = 0.001
CREATED = 1_700_000_000


class Stats:
    def __init__(self) -> None:
        self.events = 0
        self.streams = 0
        self.blocked_s = 0.0
        self.skipped_ticks = 0

    def as_json(self) -> dict[str, Any]:
        return {"events": self.events, "streams": self.streams, "blocked_s": self.blocked_s,
                "skipped_ticks": self.skipped_ticks}


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def event(obj: dict[str, Any]) -> bytes:
    """One SSE event as one HTTP chunk."""
    return chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def stream_events(model: str, tokens: int) -> tuple[bytes, bytes, bytes]:
    """(the first event, one token's event, the end: the last event and ``[DONE]``)."""
    base = {"created": CREATED, "id": "chatcmpl-standin", "model": model,
            "system_fingerprint": "b0-standin", "object": "chat.completion.chunk"}
    first = event({"choices": [{"finish_reason": None, "index": 0,
                                "delta": {"role": "assistant", "content": None}}], **base})
    token = event({"choices": [{"finish_reason": None, "index": 0,
                                "delta": {"content": "a"}}], **base})
    last = event({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **base,
                  "usage": {"completion_tokens": tokens, "prompt_tokens": 1,
                            "total_tokens": tokens + 1},
                  "timings": {"prompt_n": 1, "predicted_n": tokens}})
    return first, token, last + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def response(status: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    reason = {200: "OK", 404: "Not Found", 400: "Bad Request"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


class PacedStream:
    def __init__(self, writer: asyncio.StreamWriter, token: bytes, end: bytes, left: int
                 ) -> None:
        self.transport = writer.transport
        self.token, self.end, self.left = token, end, left
        self.finished = asyncio.get_running_loop().create_future()


class Ticker:
    """Writes one event to every paced stream each ``TICK_S``."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.streams: list[PacedStream] = []
        self.wake = asyncio.Event()

    async def run(self) -> None:
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
            await asyncio.sleep(TICK_S)
            kept = []
            for stream in self.streams:
                if stream.transport.is_closing():
                    stream.finished.set_result(None)
                    continue
                if stream.transport.get_write_buffer_size() > HIGH_WATER:
                    self.stats.skipped_ticks += 1
                    kept.append(stream)
                    continue
                stream.transport.write(stream.token)
                self.stats.events += 1
                stream.left -= 1
                if stream.left > 0:
                    kept.append(stream)
                    continue
                stream.transport.write(stream.end)
                self.stats.events += 2
                stream.finished.set_result(None)
            self.streams = kept

    async def stream(self, writer: asyncio.StreamWriter, model: str, tokens: int) -> None:
        first, token, end = stream_events(model, tokens)
        writer.write(_STREAM_HEAD + first)
        self.stats.streams += 1
        self.stats.events += 1
        paced = PacedStream(writer, token, end, tokens)
        self.streams.append(paced)
        self.wake.set()
        await paced.finished
        await writer.drain()


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")


async def _stream(writer: asyncio.StreamWriter, model: str, tokens: int, stats: Stats) -> None:
    first, token, end = stream_events(model, tokens)
    writer.write(_STREAM_HEAD + first)
    transport = writer.transport
    stats.streams += 1
    stats.events += 1
    for _ in range(tokens):
        writer.write(token)
        stats.events += 1
        if transport.get_write_buffer_size() > HIGH_WATER:
            began = time.perf_counter()
            await writer.drain()
            stats.blocked_s += time.perf_counter() - began
    writer.write(end)
    stats.events += 2  # the last event (finish_reason) and [DONE]
    await writer.drain()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 stats: Stats, ticker: Ticker) -> None:
    writer.transport.set_write_buffer_limits(high=HIGH_WATER)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            path = target.split("?", 1)[0]
            if method == "GET" and path == "/health":
                writer.write(response(200, {"status": "ok"}))
            elif method == "GET" and path == "/stats":
                writer.write(response(200, stats.as_json()))
            elif method == "GET" and path in ("/v1/models", "/models"):
                writer.write(response(200, {"object": "list", "data": [
                    {"id": "standin", "object": "model", "owned_by": "standin"}]}))
            elif method == "POST" and path == "/v1/chat/completions":
                request = json.loads(body or b"{}")
                tokens = int(request.get("max_tokens") or 16)
                if not request.get("stream"):
                    writer.write(response(400, {"error": {
                        "code": 400, "message": "the stand-in only streams",
                        "type": "invalid_request_error"}}))
                elif request.get("standin_paced"):
                    await ticker.stream(writer, str(request.get("model", "standin")), tokens)
                else:
                    await _stream(writer, str(request.get("model", "standin")), tokens, stats)
            else:
                writer.write(response(404, {"error": {"code": 404, "message": "not found",
                                                      "type": "not_found_error"}}))
            if headers.get("connection", "").lower() == "close":
                break
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, started: asyncio.Future[None] | None = None) -> None:
    stats = Stats()
    ticker = Ticker(stats)
    ticking = asyncio.create_task(ticker.run())
    server = await asyncio.start_server(lambda r, w: _serve(r, w, stats, ticker),
                                        "127.0.0.1", port)
    try:
        async with server:
            if started is not None:
                started.set_result(None)
            await server.serve_forever()
    finally:
        ticking.cancel()


def main(argv: list[str]) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
