"""Server-sent events: the router's own framing that survives line breaks, keep-alives, and
HEAD, for both /models/sse and /logs/stream; and the one reader of event streams, as the
standard parses them, bounded (an endless line ends the stream, never grows memory), as the
CLI uses it."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import fake_binary, start_router, write_presets

from router import client as commands
from router.http.sse import MAX_EVENT_BYTES, Event, EventReader, EventTooLarge, frame, respond


def parse(stream: bytes) -> list[str]:
    """A minimal SSE parser per the HTML spec: the data of each event."""
    events, data = [], []
    for line in stream.decode().replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


@pytest.mark.parametrize("text", ["plain", "", "two\nlines", "carriage\rreturn",
                                  "crlf\r\nend", "trailing\n", "data: looks like a field",
                                  "event: x\nid: 3", "ünïcödé ✓"])
def test_a_framed_event_carries_exactly_its_text(text: str) -> None:
    expected = text.replace("\r\n", "\n").replace("\r", "\n")
    assert parse(frame(text)) == [expected]
    assert parse(frame(text) + frame("next")) == [expected, "next"]


def test_a_json_event_is_one_data_line() -> None:
    event = {"model": "a", "event": "status_change", "data": {"status": "loaded"}}
    assert frame(json.dumps(event)) == b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.mark.fake
def test_head_on_event_streams_answers_and_ends(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "p.ini", f"[m]\nmodel = {model}\n")
    with start_router(tmp_path, "--llama-server", str(fake_binary(tmp_path)),
                      "--presets", str(presets)) as router:
        host, port = router.url.removeprefix("http://").split(":")
        # Pipelined: each HEAD must end, or the request behind it is never answered.
        request = (b"HEAD /models/sse HTTP/1.1\r\nHost: x\r\n\r\n"
                   b"HEAD /logs/stream?model=m HTTP/1.1\r\nHost: x\r\n\r\n"
                   b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        answers = received.split(b"HTTP/1.1 ")[1:]
        assert [a[:3] for a in answers] == [b"200", b"200", b"200"], received
        assert b"text/event-stream" in answers[0] and b"text/event-stream" in answers[1]
        assert answers[2].endswith(b'{"status":"ok"}')


# -- the reader -----------------------------------------------------------------------------


def read(stream: bytes, piece: int, max_bytes: int = MAX_EVENT_BYTES) -> list[Event]:
    reader = EventReader(max_bytes)
    return [e for i in range(0, len(stream), piece) for e in reader.feed(stream[i:i + piece])]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1 << 16])
def test_the_reader_parses_as_the_standard_does_in_any_pieces(piece: int) -> None:
    stream = ("\ufeffdata: one\n\n: a comment\r\ndata:two\r\ndata:  three\r\n\r\n"
              "event: status\rid: 7\rdata\r\rdata: after\n\nid\n\ndata: last\n\n"
              "data: never dispatched").encode()
    assert read(stream, piece) == [Event("one"), Event("two\n three"),
                                   Event("", "status", "7"), Event("after", id="7"),
                                   Event("last")]
    texts = ["plain", "two\nlines", "carriage\rreturn", "crlf\r\nend", "ünïcödé ✓"]
    framed = b"".join(frame(t) for t in texts)
    assert [e.data for e in read(framed, piece)] == [
        t.replace("\r\n", "\n").replace("\r", "\n") for t in texts]


def test_an_endless_line_ends_the_stream_at_the_cap_and_never_grows() -> None:
    reader = EventReader(max_bytes=1 << 20)
    chunk = b"x" * (64 << 10)
    fed = 0
    with pytest.raises(EventTooLarge, match="line longer than 1048576 bytes"):
        reader.feed(b"data: ")
        for _ in range((100 << 20) // len(chunk)):  # a 100 MiB line, never ended
            reader.feed(chunk)
            fed += len(chunk)
    assert fed <= (1 << 20) + len(chunk)  # given up at the cap, not at the end
    assert len(reader._buffer) <= (1 << 20) + 2 * len(chunk)


def test_an_event_of_many_lines_is_capped_too() -> None:
    reader = EventReader(max_bytes=1000)
    with pytest.raises(EventTooLarge, match="more than 1000 bytes of data"):
        for _ in range(100):  # short lines, never a blank one
            reader.feed(b"data: " + b"y" * 50 + b"\n")


def test_the_cli_stops_on_an_endless_line_with_an_error() -> None:
    def endless() -> Iterator[bytes]:
        yield b'data: {"model": "m", "event": "x"}\n\n'
        while True:
            yield b"z" * (1 << 16)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Iter(endless()))

    out = io.StringIO()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://r") as client, \
            pytest.raises(commands.ClientError, match="event stream broke off: a line longer"):
        commands.cmd_events(client, argparse.Namespace(json=True), out)
    assert out.getvalue() == '{"model": "m", "event": "x"}\n'


class _Iter(httpx.SyncByteStream):
    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks


async def test_a_stream_ends_when_an_event_and_its_end_come_in_one_loop_step() -> None:
    """The router's shutdown (``closing``) and an event arriving at the same loop step: the
    stream still ends. Python 3.11's ``asyncio.wait_for`` returned the event and dropped the
    cancel, so the stream went on, and the shutdown waited on it until the process was
    killed (a router that had been frozen, then stopped, with a peer subscribed)."""
    go, closing, waiting = asyncio.Event(), asyncio.Event(), asyncio.Event()
    sent: list[MutableMapping[str, Any]] = []

    async def next_event() -> str:  # one event each time ``go`` is set
        waiting.set()
        await go.wait()
        go.clear()
        return "{}"

    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    stream = asyncio.ensure_future(respond({"method": "GET"}, receive, send, next_event,
                                           closing))
    await asyncio.wait_for(waiting.wait(), 5)
    closing.set()  # the same step: the event is ready as the stream is told to end
    go.set()
    done, _ = await asyncio.wait({stream}, timeout=5)
    if not done:
        stream.cancel()
    assert done, "the stream outlived its end"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
