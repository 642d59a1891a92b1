"""The router's own server-sent events: framing that survives line breaks, keep-alives, and
HEAD, for both /models/sse and /logs/stream."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from support import fake_binary, start_router, write_presets

from router.sse import frame


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
