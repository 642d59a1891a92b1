"""OpenTelemetry in process: off by default and making nothing; the environment that turns it
on, and the clear error without the extra; the server span's attributes as the GenAI
conventions name them, with the usage the router read from the answer and nothing of the
prompt or the key; ``traceparent`` read and written; the three ``gen_ai.server.*`` histograms
on ``/metrics`` with the conventions' buckets.

The real exports (a router started with the variables, an OTLP/HTTP receiver decoding the
protobuf) are ``tests/test_otel_real.py``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from router import otel
from router.http.requests import RequestContext
from router.observe import genai

PROMPT = "the secret prompt about llamas"
KEY = "sk-very-secret-key"
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _scope(path: str = "/v1/chat/completions", headers: list[tuple[bytes, bytes]] | None = None
           ) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "query_string": b"",
            "raw_path": path.encode(), "server": ("127.0.0.1", 8080),
            "headers": headers or [(b"authorization", b"Bearer " + KEY.encode()),
                                   (b"content-type", b"application/json")]}


def _answered(request: RequestContext, body: dict[str, Any], stream: bool = False) -> None:
    """The request as the edge leaves it once its answer went out."""
    request.model = request.model_id = "tiny"
    request.parsed = {"model": "tiny", "stream": stream,
                      "messages": [{"role": "user", "content": PROMPT}]}
    request.body = json.dumps(request.parsed).encode()
    request.status = 200
    request.sent(json.dumps(body).encode())


ANSWER = {"choices": [{"message": {"content": "a completion about llamas"}}],
          "usage": {"completion_tokens": 7, "prompt_tokens": 20, "total_tokens": 27},
          "timings": {"cache_n": 12, "prompt_n": 8, "prompt_ms": 4.0, "predicted_n": 7,
                      "predicted_ms": 70.0}}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """OpenTelemetry on, with spans kept in memory and metrics read on demand."""
    exporter = InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    otel.install(tracing, MeterProvider(metric_readers=[reader]))
    exporter.reader = reader  # type: ignore[attr-defined]
    try:
        yield exporter
    finally:
        otel.shutdown()


# ----------------------------------------------------------------------------- off

def test_off_by_default_makes_nothing() -> None:
    assert not otel.on
    with otel.span("wait") as made:
        assert made is None
    assert otel.start("x") is None
    headers = [(b"traceparent", PARENT.encode())]
    assert otel.inject(headers) is headers  # the client's, forwarded as it came
    assert otel.extract(headers) is None
    assert otel.current() is None
    otel.note("k", 1)  # nothing to note on, nothing raised
    assert otel.meter() is None


def test_the_environment_turns_it_on() -> None:
    assert not otel.wanted({})
    assert otel.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert otel.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not otel.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                            "OTEL_SDK_DISABLED": "true"})
    assert not otel.setup({})  # nothing asked: stays off
    assert not otel.on


def test_an_endpoint_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)  # as if not installed
    with pytest.raises(otel.Unavailable, match=r"llama-router\[otel\]"):
        otel.check({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    otel.check({})  # not asked: no error


def test_only_otlp_over_http() -> None:
    with pytest.raises(otel.Unavailable, match="http/protobuf"):
        otel.check({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


@pytest.mark.process
def test_the_router_runs_without_opentelemetry() -> None:
    """Without the extra (its imports made to fail), the router imports, makes its metrics
    and says what is missing when an endpoint is named; off, it never imports the SDK."""
    import subprocess
    code = """
import sys
class NoOtel:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError("no " + name)
sys.meta_path.insert(0, NoOtel())
import router.server, router.edge.app
from router import otel
from router.observe.metrics import RouterMetrics
RouterMetrics()
assert not otel.setup({})
try:
    otel.setup({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
except otel.Unavailable as exc:
    print("refused:", exc)
print(any(m.startswith("opentelemetry") for m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    refused, imported = out.stdout.strip().splitlines()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT is set" in refused
    assert "pip install 'llama-router[otel]'" in refused
    assert imported == "False"


# ----------------------------------------------------------------------------- on

def test_the_server_span_as_the_conventions_name_it(spans: InMemorySpanExporter) -> None:
    request = RequestContext(_scope())
    begun = genai.begin(request, _scope()["headers"], 8080)
    _answered(request, ANSWER)
    genai.end(begun, request, 200)
    (span,) = spans.get_finished_spans()
    assert span.name == "chat tiny"
    assert span.kind.name == "SERVER"
    attributes = dict(span.attributes or {})
    assert attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp",
        "gen_ai.request.model": "tiny", "gen_ai.response.model": "tiny",
        "server.port": 8080, "http.response.status_code": 200,
        "gen_ai.usage.input_tokens": 20, "gen_ai.usage.output_tokens": 7,
        "gen_ai.usage.cache_read.input_tokens": 12}
    assert PROMPT not in repr(span.to_json()) and KEY not in repr(span.to_json())
    assert "llamas" not in span.to_json()  # nor the completion


def test_an_error_carries_its_type(spans: InMemorySpanExporter) -> None:
    request = RequestContext(_scope("/v1/embeddings"))
    begun = genai.begin(request, [], 8080)
    request.model = "nope"
    genai.end(begun, request, 404)
    (span,) = spans.get_finished_spans()
    assert span.name == "embeddings nope"
    assert span.attributes is not None and span.attributes["error.type"] == "404"
    assert span.status.status_code.name == "ERROR"
    assert "gen_ai.usage.input_tokens" not in span.attributes


def test_a_clients_traceparent_is_the_parent(spans: InMemorySpanExporter) -> None:
    headers = [(b"traceparent", PARENT.encode())]
    request = RequestContext(_scope(headers=headers))
    begun = genai.begin(request, headers, 8080)
    with otel.span("exchange", otel.CLIENT) as exchange:
        sent = otel.inject([(b"traceparent", b"00-client-should-not-pass-01"),
                            (b"content-type", b"application/json")])
    genai.end(begun, request, 200)
    server = next(s for s in spans.get_finished_spans() if s.kind.name == "SERVER")
    assert f"{server.context.trace_id:032x}" == PARENT.split("-")[1]
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT.split("-")[2]
    # The next hop gets the exchange's span as its parent, the client's traceparent replaced.
    (written,) = [v.decode() for k, v in sent if k == b"traceparent"]
    assert written.split("-")[1] == PARENT.split("-")[1]
    assert written.split("-")[2] == f"{exchange.get_span_context().span_id:016x}"
    assert (b"content-type", b"application/json") in sent


def test_a_span_that_fails_says_its_type_never_its_message(spans: InMemorySpanExporter
                                                           ) -> None:
    with pytest.raises(ValueError), otel.span("load"):
        raise ValueError(PROMPT)
    (span,) = spans.get_finished_spans()
    assert span.attributes == {"error.type": "ValueError"}
    assert not span.events  # no exception event: its message may quote a request
    assert PROMPT not in span.to_json()


def test_the_histograms_go_over_otlp_too(spans: InMemorySpanExporter) -> None:
    metrics = genai.GenAIMetrics(CollectorRegistry())
    request = RequestContext(_scope())
    _answered(request, ANSWER)
    metrics.observe(request, 200, 8080, 0.5, 0.5)
    data = spans.reader.get_metrics_data()  # type: ignore[attr-defined]
    found = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert set(found) == {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                          "gen_ai.server.time_per_output_token"}
    point = found["gen_ai.server.request.duration"].data.data_points[0]
    assert tuple(point.explicit_bounds) == genai.DURATION_BUCKETS
    assert dict(point.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp",
        "gen_ai.request.model": "tiny", "gen_ai.response.model": "tiny", "server.port": 8080}
    assert found["gen_ai.server.request.duration"].unit == "s"


# ----------------------------------------------------------------------------- /metrics

LABELS = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "llama.cpp",
          "gen_ai_request_model": "tiny", "gen_ai_response_model": "tiny",
          "server_port": "8080", "error_type": ""}


def test_the_histograms_on_metrics() -> None:
    """Always on /metrics, whatever OpenTelemetry: a whole answer's time to its first token
    is the time before the child generated (its decode time per token, from its timings)."""
    registry = CollectorRegistry()
    metrics = genai.GenAIMetrics(registry)
    request = RequestContext(_scope())
    _answered(request, ANSWER)
    metrics.observe(request, 200, 8080, 0.5, 0.5)
    value = registry.get_sample_value
    assert value("gen_ai_server_request_duration_seconds_count", LABELS) == 1
    assert value("gen_ai_server_request_duration_seconds_bucket",
                 {**LABELS, "le": "0.64"}) == 1
    assert value("gen_ai_server_request_duration_seconds_bucket",
                 {**LABELS, "le": "0.32"}) == 0
    # 7 tokens in 70 ms: 10 ms each; the first one 0.5 - 6 * 0.01 = 0.44 s in
    assert value("gen_ai_server_time_per_output_token_seconds_sum", LABELS) == \
        pytest.approx(0.01)
    assert value("gen_ai_server_time_to_first_token_seconds_sum", LABELS) == \
        pytest.approx(0.44)
    text = generate_latest(registry).decode()
    for name, buckets in (("request_duration", genai.DURATION_BUCKETS),
                          ("time_to_first_token", genai.TTFT_BUCKETS),
                          ("time_per_output_token", genai.TPOT_BUCKETS)):
        bounds = {line.split('le="')[1].split('"')[0] for line in text.splitlines()
                  if line.startswith(f"gen_ai_server_{name}_seconds_bucket")}
        assert bounds == {str(float(b)) for b in buckets} | {"+Inf"}


def test_a_streams_first_token_is_its_first_byte() -> None:
    registry = CollectorRegistry()
    metrics = genai.GenAIMetrics(registry)
    request = RequestContext(_scope())
    _answered(request, {"choices": [], "usage": {"completion_tokens": 5}}, stream=True)
    metrics.observe(request, 200, 8080, 1.0, 0.2)
    value = registry.get_sample_value
    assert value("gen_ai_server_time_to_first_token_seconds_sum", LABELS) == 0.2
    # no timings: (1.0 - 0.2) / (5 - 1) per token after the first
    assert value("gen_ai_server_time_per_output_token_seconds_sum", LABELS) == \
        pytest.approx(0.2)


def test_errors_and_other_paths() -> None:
    registry = CollectorRegistry()
    metrics = genai.GenAIMetrics(registry)
    failed = RequestContext(_scope())
    failed.model = failed.model_id = "tiny"
    metrics.observe(failed, 503, 8080, 0.1, 0.1)
    tokenize = RequestContext(_scope("/tokenize"))
    tokenize.model = tokenize.model_id = "tiny"
    metrics.observe(tokenize, 200, 8080, 0.1, 0.1)  # no generation: no histogram
    value = registry.get_sample_value
    assert value("gen_ai_server_request_duration_seconds_count",
                 {**LABELS, "error_type": "503"}) == 1
    assert value("gen_ai_server_time_to_first_token_seconds_count",
                 {**LABELS, "error_type": "503"}) == 0  # only successful answers
    text = generate_latest(registry).decode()
    assert "tokenize" not in text
    assert genai.operation_of("/tokenize") == "/tokenize"
    assert genai.operation_of("/v1/completions") == "text_completion"
