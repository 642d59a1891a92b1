"""The per-request activity record: bounded, token counts from a response's end, TTFT, filters,
and what is (and is not) recorded, in process through the real middleware and routes."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, fields
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

import router.edge.middleware as middleware_module
import router.http.requests as requests_module
from router.dashboard import DASHBOARD_PATHS
from router.edge.app import create_app
from router.edge.middleware import RequestMetricsMiddleware
from router.http.requests import context
from router.http.tail import TAIL_BYTES, generated_tokens
from router.observe.activity import Activity, Record
from router.observe.metrics import RouterMetrics

# The end of a real llama-server b11434 chat stream: the last event carries the timings.
STREAM_END = (
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796072989,'
    b'"id":"chatcmpl-x","model":"a.gguf","object":"chat.completion.chunk","timings":'
    b'{"cache_n":18,"prompt_n":1,"prompt_ms":4.302,"predicted_n":3,"predicted_ms":1.37}}\n\n')
DONE = b"data: [DONE]\n\n"
# A real non-streamed answer: usage and timings at the end of the body.
JSON_BODY = (
    b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant",'
    b'"content":"SECRET-ANSWER"}}],"created":1796072989,"model":"a.gguf",'
    b'"object":"chat.completion","usage":{"completion_tokens":4,"prompt_tokens":19,'
    b'"total_tokens":23},"id":"chatcmpl-y","timings":{"prompt_n":19,"predicted_n":4}}')


# --------------------------------------------------------------------------- the record

def test_the_record_is_bounded_and_newest_first() -> None:
    activity = Activity(capacity=3)
    for n in range(5):
        activity.add(model="a" if n % 2 else "b", method="POST", path="/v1/completions",
                     status=200, started=1000.0 + n, total_s=0.5, tokens=2)
    assert len(activity.records) == 3
    assert [r.id for r in activity.recent()] == [5, 4, 3]
    assert [r.id for r in activity.recent(limit=2)] == [5, 4]
    assert [r.id for r in activity.recent(model="a")] == [4]
    assert [r.id for r in activity.recent(after=3)] == [5, 4]
    # Totals count every request since start, not only the ones still listed.
    assert activity.totals["b"].requests == 3 and activity.totals["b"].tokens == 6
    assert activity.totals["a"].requests == 2


def test_totals_answer_only_models_changed_since_a_seq() -> None:
    activity = Activity()
    activity.add(model="a", method="POST", path="/x", status=200, started=0, total_s=1,
                 ttft_s=0.25, queue_s=0.5, tokens=7)
    seq = activity.seq
    activity.add(model="b", method="POST", path="/x", status=503, started=0, total_s=1,
                 ttft_s=1.0, queue_s=2.0)
    assert set(activity.changed(0)) == {"a", "b"}
    assert set(activity.changed(seq)) == {"b"}
    assert activity.changed(activity.seq) == {}
    a, b = activity.changed(0)["a"], activity.changed(0)["b"]
    assert (a["requests"], a["tokens"], a["ttft_sum"], a["ttft_count"]) == (1, 7, 0.25, 1)
    assert (b["errors"], b["ttft_count"], b["queue_sum"], b["queue_count"]) == (1, 0, 2.0, 1)
    # Requests to no model (a 401 on a model path) and the router's own actions on a model
    # are listed, but are not requests to a model: no totals.
    activity.add(model="", method="POST", path="/x", status=401, started=0, total_s=0)
    activity.add(model="c", method="POST", path="/models/load", status=200, started=0,
                 total_s=0, ttft_s=0.001, proxied=False)
    assert set(activity.changed(0)) == {"a", "b"}
    assert len(activity.recent()) == 4


def test_a_record_holds_no_request_or_response_content() -> None:
    names = {f.name for f in fields(Record)}
    assert names == {"id", "time", "model", "method", "endpoint", "status", "queue_s",
                     "ttft_s", "total_s", "tokens"}
    activity = Activity()
    record = activity.add(model="a", method="GET", path="/x" * 500, status=200, started=0,
                          total_s=0)
    assert len(record.endpoint) == 200


@pytest.mark.parametrize(("tail", "expected"), [
    (STREAM_END + DONE, 3),
    (DONE, None),
    (JSON_BODY, 4),
    # predicted_n (the model's own count) wins over usage, wherever each comes
    (b'"timings":{"predicted_n":5},"usage":{"completion_tokens":9}', 5),
    (b'{"usage":{"input_tokens":3,"output_tokens":11}}', 11),  # /v1/messages, /v1/responses
    (b'{"content":"x","tokens_predicted":6}', 6),  # /completion without timings
    (b'{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":3}}', None),
    (b"", None),
])
def test_generated_tokens(tail: bytes, expected: int | None) -> None:
    assert generated_tokens(tail) == expected


def test_generated_tokens_reads_only_the_tail() -> None:
    body = b'{"predicted_n": 99, "x": "' + b"a" * TAIL_BYTES + b'"}'
    assert generated_tokens(body) is None


# --------------------------------------------------------------------------- the middleware

class Clock:
    """``time`` for ``router.edge.middleware``: perf_counter advances only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_800_000_000.0 + self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    now = types.SimpleNamespace(perf_counter=fake.perf_counter, time=fake.time)
    monkeypatch.setattr(middleware_module, "time", now)
    monkeypatch.setattr(requests_module, "time", now)  # when a body chunk went out
    return fake


def streaming_app(chunks: list[tuple[float, bytes]], model: str = "alpha",
                  queue_s: float | None = 0.25, status: int = 200,
                  clock: Clock | None = None) -> Any:
    """A stand-in for the proxy: names its model and queue time like ``_forward`` does, then
    sends each chunk after advancing the clock by its delay."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = context(scope)  # the one RequestMetricsMiddleware made at the edge
        request.model_id = model
        if queue_s is not None:
            request.queue_s = queue_s
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for delay, chunk in chunks:
            if clock is not None:
                clock.now += delay
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def request(app: Any, method: str = "POST", path: str = "/v1/chat/completions",
                  **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.request(method, path, **kw)


async def test_a_stream_is_recorded_with_ttft_from_the_first_non_empty_chunk(
        clock: Clock) -> None:
    metrics, activity = RouterMetrics(), Activity()
    chunks = [(1.0, b""), (2.0, b'data: {"choices":[{"delta":{"content":"D"}}]}\n\n'),
              (0.5, STREAM_END), (0.5, DONE)]
    app = RequestMetricsMiddleware(streaming_app(chunks, clock=clock), metrics,
                                   activity)
    response = await request(app, json={"model": "alpha", "messages": [
        {"role": "user", "content": "SECRET-PROMPT"}]})
    assert response.status_code == 200
    [record] = activity.recent()
    assert (record.model, record.method, record.endpoint, record.status) == \
        ("alpha", "POST", "/v1/chat/completions", 200)
    assert record.ttft_s == 3.0  # the empty chunk at +1 s did not count
    assert record.total_s == 4.0
    assert record.queue_s == 0.25
    assert record.tokens == 3
    assert record.time == 1_800_000_000.0 + 100.0  # when it arrived, wall clock
    registry = metrics.registry
    assert registry.get_sample_value("llamarouter_generated_tokens_total",
                                     {"model": "alpha"}) == 3
    assert registry.get_sample_value("llamarouter_time_to_first_byte_seconds_sum",
                                     {"model": "alpha"}) == 3.0


async def test_a_json_body_in_one_chunk_and_a_body_never_sent(clock: Clock) -> None:
    activity = Activity()
    big = JSON_BODY.replace(b"SECRET-ANSWER", b"x" * 100_000)
    app = RequestMetricsMiddleware(streaming_app([(0.125, big)], clock=clock), None,
                                   activity)
    await request(app, json={"model": "alpha"})
    assert activity.recent()[0].tokens == 4
    assert activity.recent()[0].ttft_s == 0.125
    silent = RequestMetricsMiddleware(streaming_app([], queue_s=None), None, activity)
    await request(silent, json={"model": "alpha"})
    record = activity.recent()[0]
    assert record.ttft_s is None and record.tokens is None
    assert record.queue_s == 0.0  # served at once: nothing waited


async def test_no_body_content_reaches_the_record_or_its_api(clock: Clock) -> None:
    activity = Activity()
    app = RequestMetricsMiddleware(streaming_app([(0.0, JSON_BODY)], clock=clock),
                                   None, activity)
    await request(app, path="/v1/chat/completions?secret=SECRET-QUERY", json={
        "model": "alpha", "messages": [{"role": "user", "content": "SECRET-PROMPT"}]})
    text = json.dumps([asdict(r) for r in activity.records])
    for secret in ("SECRET-PROMPT", "SECRET-ANSWER", "SECRET-QUERY"):
        assert secret not in text


# --------------------------------------------------------------------------- routes

@contextlib.asynccontextmanager
async def no_lifespan(app: Starlette) -> AsyncIterator[None]:
    yield


@pytest.fixture
def router_app() -> Iterator[Starlette]:
    yield create_app(no_lifespan, [])


async def test_router_reads_are_not_recorded_and_actions_are(router_app: Starlette) -> None:
    for path in ("/health", "/activity", "/activity/totals", "/dashboard/",
                 "/dashboard/app.js"):
        assert (await request(router_app, "GET", path)).status_code == 200, path
    # Nor a read without a model on a proxied path (the web UI's files are served there).
    await request(router_app, "GET", "/favicon.ico")
    assert router_app.state.activity.recent() == []
    # Anything but a read of a router path is recorded, as an action (here refused).
    assert (await request(router_app, "POST", "/health")).status_code == 405
    [record] = router_app.state.activity.recent()
    assert (record.method, record.endpoint, record.status) == ("POST", "/health", 405)
    assert (record.model, record.queue_s, record.tokens) == ("", None, None)


async def test_activity_api_filters_and_errors(router_app: Starlette) -> None:
    activity: Activity = router_app.state.activity
    for n, model in enumerate(["a", "b", "a", "a"]):
        activity.add(model=model, method="POST", path="/v1/completions", status=200,
                     started=float(n), total_s=0.5, ttft_s=0.1, queue_s=0.0, tokens=n)
    body = (await request(router_app, "GET", "/activity")).json()
    assert body["capacity"] == 500 and body["last_id"] == 4
    assert [r["id"] for r in body["requests"]] == [4, 3, 2, 1]
    assert body["requests"][0] == {"id": 4, "time": 3.0, "model": "a", "method": "POST",
                                   "endpoint": "/v1/completions", "status": 200,
                                   "queue_s": 0.0, "ttft_s": 0.1, "total_s": 0.5, "tokens": 3}
    body = (await request(router_app, "GET", "/activity?model=a&limit=2")).json()
    assert [r["id"] for r in body["requests"]] == [4, 3]
    body = (await request(router_app, "GET", "/activity?after=2")).json()
    assert [r["id"] for r in body["requests"]] == [4, 3]
    bad = await request(router_app, "GET", "/activity?limit=-1")
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "limit" in bad.json()["error"]["message"]

    totals = (await request(router_app, "GET", "/activity/totals")).json()
    assert totals["seq"] == 4 and set(totals["models"]) == {"a", "b"}
    assert totals["models"]["a"]["requests"] == 3 and totals["models"]["a"]["tokens"] == 5
    later = (await request(router_app, "GET", f"/activity/totals?since={totals['seq']}")).json()
    assert later["models"] == {}


async def test_dashboard_files_are_public_and_its_api_is_not() -> None:
    app = create_app(no_lifespan, ["sekrit"])
    page = await request(app, "GET", "/dashboard/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert '<script type="module" src="app.js">' in page.text
    for path in DASHBOARD_PATHS - {"/dashboard"}:
        assert (await request(app, "GET", path)).status_code == 200, path
    redirect = await request(app, "GET", "/dashboard")
    assert redirect.status_code == 307 and redirect.headers["location"] == "dashboard/"
    for path in ("/activity", "/activity/totals"):
        denied = await request(app, "GET", path)
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        allowed = await request(app, "GET", path, headers={"Authorization": "Bearer sekrit"})
        assert allowed.status_code == 200
