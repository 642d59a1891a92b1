"""The GenAI semantic conventions: a request's server span and the three server histograms.

* ``OPERATIONS``: the ``gen_ai.operation.name`` of each proxied path (``chat``,
  ``text_completion``, ``embeddings``, ``rerank``, ...). Another proxied path (``/tokenize``,
  ``/props?model=``, ``/slots``) still gets its server span, named by its path, but no
  histogram: it is no generation.
* The server span (``begin``, ``end``): one per proxied request, kind SERVER, begun by the
  edge (``middleware``) when the request arrives, as the child of the client's
  ``traceparent`` when it sends one, and named ``{gen_ai.operation.name}
  {gen_ai.request.model}`` when it ends. It carries ``gen_ai.provider.name`` (``llama.cpp``),
  the model the client asked for and the one that answered, ``server.port`` (the router's),
  ``http.response.status_code``, ``error.type`` (the status, for 400 and above) and the
  usage: ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens`` and the child's
  ``cache_n`` as ``gen_ai.usage.cache_read.input_tokens``, as the router already read them
  from the end of the answer (``tail.ResponseTail``, read once, which the teams' usage
  charges too).
* The exchange (``exchange``, ``exchanged``): a CLIENT span, the server span's child, around
  the request's relay to its child or to a peer (named like the server span, with the
  upstream's ``server.address``, ``server.port`` and, for a peer, ``llama_router.node``). Its
  context is what the upstream gets as ``traceparent`` (``otel.inject``): a peer continues the
  trace, so a gateway and its nodes make one.
* The histograms (``GenAIMetrics``), always on ``/metrics`` (prometheus-client:
  ``gen_ai_server_request_duration_seconds``, ``gen_ai_server_time_to_first_token_seconds``,
  ``gen_ai_server_time_per_output_token_seconds``) and over OTLP when OpenTelemetry is on,
  with the conventions' buckets and attributes. The measurements are the ones the router's
  own ``llamarouter_request_duration_seconds`` and ``llamarouter_time_to_first_byte_seconds``
  take (``middleware``): the request's time to its last byte; for a streamed answer, to its
  first byte; for one answered whole, to when the child began generating (its
  ``predicted_ms`` per token taken off the whole, less one token). The time per output token
  is the child's (``predicted_ms / predicted_n``), else a stream's time after its first byte
  over its tokens after the first.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram

from .. import otel

if TYPE_CHECKING:
    from ..http.requests import RequestContext

PROVIDER = "llama.cpp"
_CHAT = "chat"
_TEXT = "text_completion"
OPERATIONS: dict[str, str] = {
    "/v1/chat/completions": _CHAT, "/chat/completions": _CHAT, "/v1/messages": _CHAT,
    "/v1/responses": _CHAT, "/responses": _CHAT,
    "/v1/completions": _TEXT, "/completions": _TEXT, "/completion": _TEXT, "/infill": _TEXT,
    "/v1/embeddings": "embeddings", "/embeddings": "embeddings", "/embedding": "embeddings",
    "/v1/rerank": "rerank", "/rerank": "rerank", "/v1/reranking": "rerank",
    "/reranking": "rerank",
    "/v1/audio/transcriptions": "transcription", "/audio/transcriptions": "transcription",
    # Ollama's, answered by the router on the proxy's path (``edge.ollamachat``).
    "/api/chat": _CHAT, "/api/generate": _TEXT, "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
}
# The conventions' advised bucket boundaries, in seconds.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# The histograms' attributes, in order; as Prometheus labels, their dots are underscores.
ATTRIBUTES = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
              "gen_ai.response.model", "server.port", "error.type")
LABELS = tuple(name.replace(".", "_") for name in ATTRIBUTES)


def operation_of(path: str) -> str:
    """The ``gen_ai.operation.name`` of a proxied path; another path's is the path."""
    return OPERATIONS.get(path) or path


class GenAIMetrics:
    """The three ``gen_ai.server.*`` histograms: in ``registry`` (``/metrics``) always, and
    over OTLP when OpenTelemetry is on (``otel.meter``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds", "Generative AI server request duration "
            "such as time-to-last byte or last output token", LABELS,
            buckets=DURATION_BUCKETS, registry=registry)
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds", "Time to generate first token for "
            "successful responses", LABELS, buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds", "Time per output token generated "
            "after the first token for successful responses", LABELS, buckets=TPOT_BUCKETS,
            registry=registry)
        self._otlp: tuple[Any, Any, Any] | None = None
        meter = otel.meter()
        if meter is not None:
            self._otlp = (
                meter.create_histogram("gen_ai.server.request.duration", "s",
                                       self.duration._documentation,
                                       explicit_bucket_boundaries_advisory=DURATION_BUCKETS),
                meter.create_histogram("gen_ai.server.time_to_first_token", "s",
                                       self.ttft._documentation,
                                       explicit_bucket_boundaries_advisory=TTFT_BUCKETS),
                meter.create_histogram("gen_ai.server.time_per_output_token", "s",
                                       self.tpot._documentation,
                                       explicit_bucket_boundaries_advisory=TPOT_BUCKETS))
        # (labels): the labelled children and the OTLP attributes, one dict lookup a request
        self._children: dict[tuple[str, ...], tuple[Any, Any, Any, dict[str, Any]]] = {}

    def observe(self, request: RequestContext, status: int, port: int, total_s: float,
                ttft_s: float | None) -> None:
        """One proxied request to a model, answered with ``status`` after ``total_s``
        (``ttft_s``: its first byte; None: none went out)."""
        operation = OPERATIONS.get(request.path)
        if operation is None:
            return
        error = str(status) if status >= 400 else ""
        labels = (operation, PROVIDER, requested_model(request), request.model_id, str(port),
                  error)
        children = self._children.get(labels)
        if children is None:
            attributes: dict[str, Any] = {
                name: value for name, value in zip(ATTRIBUTES, labels, strict=True) if value}
            attributes["server.port"] = port
            children = self._children[labels] = (self.duration.labels(*labels),
                                                 self.ttft.labels(*labels),
                                                 self.tpot.labels(*labels), attributes)
        duration, ttft, tpot, attributes = children
        duration.observe(total_s)
        first = per_token = None
        if not error and ttft_s is not None:
            first, per_token = token_times(request, total_s, ttft_s)
            if first is not None:
                ttft.observe(first)
            if per_token is not None:
                tpot.observe(per_token)
        if self._otlp is not None:
            self._otlp[0].record(total_s, attributes)
            if first is not None:
                self._otlp[1].record(first, attributes)
            if per_token is not None:
                self._otlp[2].record(per_token, attributes)


def requested_model(request: RequestContext) -> str:
    """``gen_ai.request.model``: the name the client gave (the default model's, when it
    named none)."""
    return (request.named if request.defaulted and request.named else request.model) or ""


def token_times(request: RequestContext, total_s: float, first_s: float
                ) -> tuple[float | None, float | None]:
    """The time to the first token and per output token after it (module docstring); None
    for what the answer does not tell (an embedding generates no token)."""
    tail = request.tail()
    timings = tail.timings
    per_token = None
    if timings is not None and timings.predicted_n > 0:
        per_token = timings.predicted_ms / 1000 / timings.predicted_n
    streamed = request.fields.get("stream") is True
    if streamed:
        tokens = tail.tokens
        if per_token is None and tokens is not None and tokens > 1:
            per_token = max(total_s - first_s, 0.0) / (tokens - 1)
        return first_s, per_token
    if per_token is None or timings is None:
        return None, None
    return max(total_s - per_token * (timings.predicted_n - 1), 0.0), per_token


# ----------------------------------------------------------------------------- the span

def begin(request: RequestContext, headers: list[tuple[bytes, bytes]], port: int) -> Any:
    """The server span of a proxied request arriving now, current in its task (None when
    OpenTelemetry is off); ``end`` ends it."""
    operation = operation_of(request.path)
    span = otel.start(operation, otel.SERVER, {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
        "server.port": port}, parent=otel.extract(headers))
    return span, otel.attach(span)


def end(begun: tuple[Any, Any], request: RequestContext, status: int) -> None:
    """End the server span ``begin`` made, with what the request became."""
    span, token = begun
    otel.detach(token)
    model = requested_model(request)
    if model:
        span.update_name(f"{operation_of(request.path)} {model}")
        span.set_attribute("gen_ai.request.model", model)
    if request.model_id:
        span.set_attribute("gen_ai.response.model", request.model_id)
    if request.node:
        span.set_attribute("llama_router.node", request.node)
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        otel.failed(span, str(status))
    elif request.first_sent:
        _usage(span, request)
    span.end()


def _usage(span: Any, request: RequestContext) -> None:
    """The answer's usage, as the router read it (``tail``)."""
    tail = request.tail()
    prompt, generated, timings = tail.prompt_tokens, tail.tokens, tail.timings
    if prompt is not None:
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
    if generated is not None:
        span.set_attribute("gen_ai.usage.output_tokens", generated)
    if timings is not None:
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", timings.cache_n)


def exchange(request: RequestContext, model: str, url: str, node: str | None = None) -> Any:
    """The CLIENT span of the request's exchange with its child (or remote upstream) or a
    peer (``node``) at ``url``, started now; ``exchanged`` ends it."""
    operation = operation_of(request.path)
    host, _, port = url.partition("://")[2].partition("/")[0].rpartition(":")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model, "server.address": host.strip("[]")}
    if port.isdigit():
        attributes["server.port"] = int(port)
    if node is not None:
        attributes["llama_router.node"] = node
    return otel.start(f"{operation} {model}", otel.CLIENT, attributes)


async def exchanged(span: Any, request: RequestContext, relay: Awaitable[None]) -> None:
    """Await the relay of the exchange ``span`` (``exchange``), then end it with the status
    the client got, or the failure's type."""
    try:
        await relay
    except BaseException as exc:
        otel.failed(span, exc)
        raise
    else:
        status = request.status
        if status:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                otel.failed(span, str(status))
    finally:
        span.end()
