"""A real OTLP/HTTP receiver for tests: ``POST /v1/traces`` and ``POST /v1/metrics``, their
protobuf decoded with the official ``opentelemetry-proto`` messages, kept as plain records."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from support import http_server


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL
    attributes: dict[str, Any]
    links: tuple[str, ...]  # the span ids linked
    error: bool


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    metrics: list[tuple[str, str, dict[str, Any], tuple[float, ...]]] = field(
        default_factory=list)  # (service, name, attributes, bucket bounds) of each point
    raw: list[bytes] = field(default_factory=list)  # every export, as it came
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]


def _kind(number: int) -> str:
    return PbSpan.SpanKind.Name(number).removeprefix("SPAN_KIND_")


def _service(resource_attributes: Any) -> str:
    return str(attributes_of(resource_attributes).get("service.name", ""))


class _Handler(BaseHTTPRequestHandler):
    received: Received

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        body = self.rfile.read(length)
        with self.received.lock:
            self.received.raw.append(body)
        if self.path == "/v1/traces":
            self._traces(body)
            answer = ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/metrics":
            self._metrics(body)
            answer = ExportMetricsServiceResponse().SerializeToString()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def _traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        found = []
        for resource_spans in request.resource_spans:
            service = _service(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(Span(
                        service, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.name, _kind(span.kind),
                        attributes_of(span.attributes),
                        tuple(link.span_id.hex() for link in span.links),
                        span.status.code == span.status.STATUS_CODE_ERROR))
        with self.received.lock:
            self.received.spans += found

    def _metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest.FromString(body)
        found = []
        for resource_metrics in request.resource_metrics:
            service = _service(resource_metrics.resource.attributes)
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.WhichOneof("data") != "histogram":
                        continue
                    for point in metric.histogram.data_points:
                        if point.count:
                            found.append((service, metric.name,
                                          attributes_of(point.attributes),
                                          tuple(point.explicit_bounds)))
        with self.received.lock:
            self.received.metrics += found

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve() -> Iterator[tuple[str, Received]]:
    """A receiver on a free port of 127.0.0.1: its endpoint URL and what it received."""
    received = Received()
    with http_server(type("Handler", (_Handler,), {"received": received})) as url:
        yield url, received

