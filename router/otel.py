"""OpenTelemetry: traces and metrics over OTLP/HTTP, off by default.

On when the environment names an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, or the
traces' or metrics' own) and ``OTEL_SDK_DISABLED`` is not ``true``; everything else is the
SDK's own reading of the standard variables: ``OTEL_SERVICE_NAME`` (default
``llama-router``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and
``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_BSP_*``, ``OTEL_METRIC_EXPORT_INTERVAL``,
``OTEL_EXPORTER_OTLP_HEADERS``. It takes the ``otel`` extra (the SDK and its OTLP/HTTP
exporter); an endpoint named without it, or ``OTEL_EXPORTER_OTLP_PROTOCOL`` other than
``http/protobuf``, stops the router at its start (``check``) instead of exporting nothing.

Every part may make spans, so this module stands in the foundation: the core's wait and load,
the warm swaps, the hop to a peer and the edge ask it, and none of them imports the SDK. Off,
each asks one module attribute (``on``) and makes nothing: no span objects, no context, no
import of ``opentelemetry`` at all. On, spans are the SDK's, made current through its context
(contextvars): a task inherits the span that was current where it was created (a model's load
task, the first waiter's wait: ``core/loader``).

What a span may carry: the names the router decides (models, teams, classes, nodes, ports),
counts and durations. Never a key, a prompt, a completion or a header's value: exceptions are
not recorded on spans (their messages may quote a request), only their type as
``error.type``.

``traceparent`` (W3C trace context, no baggage) is read from a client's request (``extract``:
its span is the server span's parent) and written into the requests the router sends (a
child, a remote upstream, a peer: ``inject``), replacing the client's, so that the next hop
continues the router's span. Off, the router forwards the client's headers as they came.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger("router.otel")

ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
DEFAULT_SERVICE = "llama-router"
SCOPE = "llama-router"  # the instrumentation scope of every span and instrument
SHUTDOWN_BOUND_MS = 5000  # what the last export may take when the router stops
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})

on = False  # the one check on the hot path: set by ``setup``, cleared by ``shutdown``

SERVER, CLIENT, INTERNAL = "server", "client", "internal"

_tracer: Any = None
_meter: Any = None
_providers: list[Any] = []
_kinds: dict[str, Any] = {}
_propagator: Any = None
_api: Any = None  # opentelemetry.trace, once set up


class Unavailable(Exception):
    """OpenTelemetry asked for (an OTLP endpoint named) but not installed or not usable."""


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment turns OpenTelemetry on."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINTS)


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Raise ``Unavailable`` when the environment turns OpenTelemetry on and the router
    cannot do it: the ``otel`` extra missing, or a protocol other than OTLP/HTTP."""
    if not wanted(environ):
        return
    protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip()
    if protocol != "http/protobuf":
        raise Unavailable(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: the router exports OTLP "
                          "over HTTP (http/protobuf) only")
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:
        names = ", ".join(n for n in ENDPOINTS if environ.get(n))
        raise Unavailable(f"{names} is set, but OpenTelemetry is not installed ({exc}): "
                          "pip install 'llama-router[otel]', or unset it") from None


def setup(environ: Mapping[str, str] = os.environ) -> bool:
    """Start the tracer and meter providers and their OTLP/HTTP exporters when the
    environment asks (``check`` first); whether OpenTelemetry is on. Once per process until
    ``shutdown``: a second call keeps what runs."""
    if on or not wanted(environ):
        return on
    check(environ)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    tracing = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER(_ARG)
    tracing.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # No exemplars unless asked (OTEL_METRICS_EXEMPLAR_FILTER): offering one per measurement
    # cost more than the measurement.
    exemplars = environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "always_off").strip()
    metering = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(OTLPMetricExporter())],
        exemplar_filter=_exemplar_filter(exemplars))
    install(tracing, metering)
    log.info("OpenTelemetry on: traces and metrics to %s (service %s)",
             environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the signals' own endpoints",
             resource.attributes.get(SERVICE_NAME), extra={"event": "otel"})
    return True


def _exemplar_filter(name: str) -> Any:
    from opentelemetry.sdk.metrics import (
        AlwaysOffExemplarFilter,
        AlwaysOnExemplarFilter,
        TraceBasedExemplarFilter,
    )
    return {"always_on": AlwaysOnExemplarFilter, "trace_based": TraceBasedExemplarFilter
            }.get(name, AlwaysOffExemplarFilter)()


def install(tracing: Any, metering: Any) -> None:
    """Turn OpenTelemetry on with these SDK providers (``setup``'s; a test's in memory)."""
    global on, _tracer, _meter, _propagator, _api
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _providers[:] = [tracing, metering]
    _tracer = tracing.get_tracer(SCOPE)
    _meter = metering.get_meter(SCOPE)
    _propagator = TraceContextTextMapPropagator()
    _api = trace
    _kinds.update({SERVER: trace.SpanKind.SERVER, CLIENT: trace.SpanKind.CLIENT,
                   INTERNAL: trace.SpanKind.INTERNAL})
    on = True


def shutdown() -> None:
    """Export what is left (bounded) and stop the providers; OpenTelemetry is off after."""
    global on, _tracer, _meter
    on = False
    providers, _providers[:] = list(_providers), []
    _tracer = _meter = None
    for provider in providers:
        try:
            provider.force_flush(SHUTDOWN_BOUND_MS)
            provider.shutdown()
        except Exception as exc:  # an exporter's failure never stops the router's stop
            log.warning("OpenTelemetry shutdown: %s", exc)


def meter() -> Any:
    """The router's meter (None when off): the GenAI histograms' (``observe/genai``)."""
    return _meter


# --------------------------------------------------------------------------------- spans

def start(name: str, kind: str = INTERNAL, attributes: Mapping[str, Any] | None = None,
          parent: Any = None, links: Sequence[Any] = ()) -> Any:
    """A span started now (not made current), a child of ``parent`` (a context from
    ``extract``) or of the current span; None when off."""
    if not on:
        return None
    return _tracer.start_span(name, parent, _kinds[kind], attributes,
                              [_api.Link(c) for c in links if c is not None] or None,
                              record_exception=False, set_status_on_exception=False)


def attach(span: Any) -> Any:
    """Make ``span`` the current one in this task (and the tasks it creates from now);
    the token for ``detach``."""
    from opentelemetry import context
    return context.attach(_api.set_span_in_context(span))


def detach(token: Any) -> None:
    from opentelemetry import context
    context.detach(token)


@contextlib.contextmanager
def span(name: str, kind: str = INTERNAL, attributes: Mapping[str, Any] | None = None,
         links: Sequence[Any] = ()) -> Iterator[Any]:
    """A span around the block, current inside it; yields None (and makes nothing) when
    off. A failure ends it with its type as ``error.type``."""
    if not on:
        yield None
        return
    made = start(name, kind, attributes, links=links)
    token = attach(made)
    try:
        yield made
    except BaseException as exc:
        failed(made, exc)
        raise
    finally:
        detach(token)
        made.end()


def failed(made: Any, exc: BaseException | str) -> None:
    """Mark ``made`` failed: ``error.type`` (an exception's class name, or the text given)
    and the span's status; never the exception's message."""
    kind = exc if isinstance(exc, str) else type(exc).__name__
    made.set_attribute("error.type", kind)
    made.set_status(_api.Status(_api.StatusCode.ERROR))


def note(key: str, value: Any) -> None:
    """Set an attribute on the current span (nothing when off or none records)."""
    if on:
        current = _api.get_current_span()
        if current.is_recording():
            current.set_attribute(key, value)


def current() -> Any:
    """The current span's context, to link to (None when off or none is valid)."""
    if not on:
        return None
    found = _api.get_current_span().get_span_context()
    return found if found.is_valid else None


def link(to: Any) -> None:
    """Link the current span to the span context ``to`` (a load shared by several waits)."""
    if on and to is not None:
        current_span = _api.get_current_span()
        if current_span.is_recording():
            current_span.add_link(to)


# ----------------------------------------------------------------------------- propagation

def extract(headers: Sequence[tuple[bytes, bytes]]) -> Any:
    """The parent context a request's ``traceparent`` (and ``tracestate``) names; None for
    none or when off."""
    if not on:
        return None
    carrier = {name.decode("latin-1"): value.decode("latin-1")
               for name, value in headers if name in TRACE_HEADERS}
    return _propagator.extract(carrier) if carrier else None


def inject(headers: list[tuple[bytes, bytes]], of: Any = None) -> list[tuple[bytes, bytes]]:
    """``headers`` with the ``traceparent`` (and ``tracestate``) of span ``of`` (None: the
    current one) in place of any the client sent; unchanged when off."""
    if not on:
        return headers
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, None if of is None else _api.set_span_in_context(of))
    kept = [pair for pair in headers if pair[0].lower() not in TRACE_HEADERS]
    kept += [(name.encode("latin-1"), value.encode("latin-1"))
             for name, value in carrier.items()]
    return kept
