"""Timed HTTP requests to a target: the request bodies, one request's time, the time to a
stream's first token, a stream's events, and the retries a dropped keep-alive connection or a
router's 502 earns (counted, never hidden)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx

from .errors import BenchError

JSON_HEADERS = {"content-type": "application/json"}
STREAM_HEADERS = {**JSON_HEADERS, "connection": "close"}
TOKENIZE_TEXT = "The quick brown fox jumps over the lazy dog."
# A keep-alive connection the server closed (llama-server closes some after an SSE stream
# while announcing keep-alive) surfaces as one of these when the client reuses it.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

T = TypeVar("T")


# --------------------------------------------------------------------------- bodies

def _body(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def chat_body(model: str, *, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4 if stream else 1}
    if stream:
        body["stream"] = True
    return _body(body)


def ollama_chat_body(model: str) -> bytes:
    """``chat_body``'s streamed request in Ollama's words (``/api/chat``: NDJSON)."""
    return _body({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                  "options": {"num_predict": 4}})


def tokenize_body(model: str) -> bytes:
    return _body({"model": model, "content": TOKENIZE_TEXT})


# --------------------------------------------------------------------------- retries

class Retry(Exception):
    """A sample worth another attempt: ``kind`` is ``dropped`` (connection closed under the
    client) or ``http_502`` (a router could not reach its child)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        raise BenchError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")


def _classify(response: httpx.Response, what: str) -> None:
    if response.status_code == 502:
        raise Retry("http_502", f"{what}: {response.text[:200]}")
    _check(response, what)


def attempt(measure: Callable[[], T], tally: dict[str, int], tries: int = 4) -> T:
    """Run ``measure`` until it succeeds (at most ``tries`` times), counting each retry."""
    for _ in range(tries - 1):
        try:
            return measure()
        except Retry as exc:
            tally[exc.kind] = tally.get(exc.kind, 0) + 1
    return measure()


# --------------------------------------------------------------------------- requests

def timed_request(client: httpx.Client, method: str, path: str, body: bytes | None) -> float:
    what = f"{method} {client.base_url}{path}"
    start = time.perf_counter()
    try:
        response = client.request(method, path, content=body,
                                  headers=JSON_HEADERS if body is not None else None)
    except DROPPED as exc:
        raise Retry("dropped", f"{what}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise BenchError(f"{what}: {exc!r}") from exc
    elapsed = time.perf_counter() - start
    _classify(response, what)
    return elapsed


def request_json(client: httpx.Client, method: str, path: str, tally: dict[str, int],
                 payload: dict[str, Any] | None = None) -> Any:
    """An untimed control request (listing, unload), retried like the samples."""
    body = None if payload is None else _body(payload)

    def once() -> Any:
        what = f"{method} {client.base_url}{path}"
        try:
            response = client.request(method, path, content=body,
                                      headers=JSON_HEADERS if body is not None else None)
        except DROPPED as exc:
            raise Retry("dropped", f"{what}: {exc!r}") from exc
        _classify(response, what)
        return response.json()

    return attempt(once, tally)


# --------------------------------------------------------------------------- streams

def _has_content(line: bytes) -> bool:
    if line.startswith(b"{"):  # an NDJSON line (Ollama's stream)
        try:
            event = json.loads(line)
            return bool((event.get("message") or {}).get("content") or event.get("response"))
        except (ValueError, AttributeError):
            return False
    if not line.startswith(b"data:"):
        return False
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return False
    try:
        event = json.loads(payload)
        return bool(event["choices"][0]["delta"].get("content"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False


def timed_first_token(client: httpx.Client, body: bytes,
                      url: str = "/v1/chat/completions", keep_alive: bool = False) -> float:
    """Seconds from sending a streaming chat request to its first ``data:`` with content
    (or, for Ollama's ``/api/chat``, its first NDJSON line with content).

    By default every sample opens a new connection (``Connection: close``): llama-server
    closes its side after a stream anyway while a router may keep it, and a connect in one
    column only would skew the comparison. ``keep_alive`` measures what a client with a
    connection pool sees instead: a server that keeps the connection saves the connect.
    """
    what = f"stream {client.base_url}{url}"
    start = time.perf_counter()
    first: float | None = None
    try:
        with client.stream("POST", url, content=body,
                           headers=JSON_HEADERS if keep_alive else STREAM_HEADERS) as response:
            if response.status_code != 200:
                response.read()
                _classify(response, what)
            buffer = b""
            for chunk in response.iter_raw():
                if first is not None:
                    continue  # drain, so the connection can be reused
                buffer += chunk
                while first is None and b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if _has_content(line.rstrip(b"\r")):
                        first = time.perf_counter() - start
    except DROPPED as exc:
        raise Retry("dropped", f"{what}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise BenchError(f"{what}: {exc!r}") from exc
    if first is None:
        raise BenchError(f"{what}: no content chunk")
    return first


@contextlib.asynccontextmanager
async def chat_events(client: httpx.AsyncClient, url: str, body: dict[str, Any], what: str
                      ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """POST ``body`` to ``url``'s ``/v1/chat/completions`` as a stream; the parsed JSON of
    each of its ``data:`` events (BenchError, naming ``what``, for a status other than 200)."""
    async with client.stream("POST", url + "/v1/chat/completions", content=json.dumps(body),
                             headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            raise BenchError(f"{what}: HTTP {response.status_code}: "
                             f"{(await response.aread())[:300]!r}")

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    yield json.loads(line[6:])

        yield events()
