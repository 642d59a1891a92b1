"""Raw-socket HTTP for the hostile tier: send exact bytes, read back every response, judge it.

``exchange`` writes bytes as given (no client library normalises them) and parses what comes
back by hand (Content-Length, chunked, or until close; a HEAD answer has no body), so
malformed requests, pipelining and framing attacks are sent as an attacker would. ``judge``
says what is wrong with an answer, if anything.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

HANG_GUARD_S = 20.0  # no answer (and no close) within this long is a hang


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Exchange:
    answers: list[Answer] = field(default_factory=list)
    closed: bool = False  # the server closed the connection
    hung: bool = False  # neither all answers nor a close within the guard


def _parse(buffer: bytes, head_only: bool, closed: bool) -> tuple[Answer, int] | None:
    """The first whole response in ``buffer`` and its length, or None if it is incomplete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end].decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower().encode()] = value.strip().encode("latin-1")
    start = end + 4
    if head_only or status in (204, 304) or 100 <= status < 200:
        return Answer(status, headers, b""), start
    if b"content-length" in headers:
        stop = start + int(headers[b"content-length"])
        return (Answer(status, headers, buffer[start:stop]), stop) \
            if len(buffer) >= stop else None
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body: list[bytes] = []
        at = start
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(buffer[at:line_end].split(b";")[0], 16)
            if size == 0:
                if buffer.find(b"\r\n", line_end + 2) < 0:
                    return None
                return Answer(status, headers, b"".join(body)), line_end + 4
            if len(buffer) < line_end + 2 + size + 2:
                return None
            body.append(buffer[line_end + 2:line_end + 2 + size])
            at = line_end + 2 + size + 2
    return (Answer(status, headers, buffer[start:]), len(buffer)) if closed else None


def exchange(port: int, data: bytes, *, expect: int = 1, head_only: list[bool] | None = None,
             guard: float = HANG_GUARD_S) -> Exchange:
    """Send ``data`` on a new connection; read until ``expect`` responses arrived or the
    server closed the connection (a hang past ``guard`` is reported, never waited out)."""
    heads = head_only or [False] * expect
    result = Exchange()
    buffer = b""
    deadline = time.monotonic() + guard
    with socket.create_connection(("127.0.0.1", port), timeout=guard) as sock:
        with contextlib.suppress(OSError):  # it may close before reading all (an early 400)
            sock.sendall(data)
        while len(result.answers) < expect:
            parsed = _parse(buffer, heads[len(result.answers)], result.closed)
            if parsed is not None:
                result.answers.append(parsed[0])
                buffer = buffer[parsed[1]:]
                continue
            if result.closed:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                result.hung = True
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                result.hung = True
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                result.closed = True
            buffer += chunk
    return result


def judge(answer: Answer, *, head: bool = False) -> str | None:
    """What is wrong with an answer the router made itself: a 5xx, or an error outside the
    OpenAI envelope. None when it is fine."""
    if answer.status >= 500:
        return f"{answer.status} from the router"
    if answer.status < 400:
        return None
    content_type = answer.headers.get(b"content-type", b"")
    if not content_type.startswith(b"application/json"):
        return f"{answer.status} as {content_type.decode(errors='replace')!r}, not JSON"
    if head:
        return None
    try:
        error = answer.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{answer.status} outside the envelope: {answer.body[:120]!r}"
    if not (isinstance(error, dict) and error.get("code") == answer.status
            and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        return f"{answer.status} with a malformed envelope: {answer.body[:120]!r}"
    return None


def request(method: str, target: str, *, headers: dict[str, str] | None = None,
            body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    """One well-framed request (Content-Length from the body unless given)."""
    lines = [f"{method} {target} {version}", "Host: 127.0.0.1"]
    given = {k.lower() for k in (headers or {})}
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body and "content-length" not in given and "transfer-encoding" not in given:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
