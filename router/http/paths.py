"""Which paths the router answers itself, which it proxies, and how they are labelled.

One set of tables for every part that must agree: the proxy (``forward.ProxyMiddleware``
sends everything not local to ``forward``), the API-key check (public paths, and what each role
of a scoped key reaches: ``keys.needed_role``), the metrics (endpoint labels) and the web UI's
page fallback (API roots never get it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from starlette.datastructures import QueryParams

from .. import dashboard

PUBLIC_PATHS = frozenset({"/health", "/v1/health", *dashboard.DASHBOARD_PATHS})
# GET endpoints of llama-server that need a model: without ?model= they are a 400, not a 404.
CHILD_GET_PATHS = frozenset({"/slots", "/metrics", "/lora-adapters", "/props", "/v1/props"})
# The routes the router answers itself, each path with its methods: one list, from which the
# route table is made (``routes.routes`` gives each (path, method) its handler) and the path
# tables below are read. The dashboard's files add their own (``dashboard.DASHBOARD_PATHS``).
LOCAL_ROUTES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "/health": ("GET",), "/v1/health": ("GET",), "/props": ("GET",),
    "/models": ("GET", "POST", "DELETE"), "/v1/models": ("GET",), "/models/load": ("POST",),
    "/models/unload": ("POST",), "/models/reload": ("POST",), "/models/sse": ("GET",),
    "/metrics": ("GET",), "/logs": ("GET",), "/logs/stream": ("GET",),
    "/tools": ("GET", "POST"), "/cors-proxy": ("GET", "POST"),
    "/v1/stream": ("GET", "DELETE"), "/v1/streams/lookup": ("POST",),
    "/activity": ("GET",), "/activity/totals": ("GET",), "/usage": ("GET",),
})
# Ollama's API on the same port (``edge.ollama``), each path with its methods: answered by
# the router, which translates a model's request into llama-server's and sends it down the
# proxied path (``forward.proxy``); the management ones (pull, delete) are role=admin's.
OLLAMA_ROUTES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "/api/version": ("GET",), "/api/tags": ("GET",), "/api/ps": ("GET",),
    "/api/show": ("POST",), "/api/chat": ("POST",), "/api/generate": ("POST",),
    "/api/embed": ("POST",), "/api/embeddings": ("POST",), "/api/pull": ("POST",),
    "/api/delete": ("DELETE",),
})
# Paths the router answers itself; every other path is proxied. /props and /metrics with
# ?model= are the model's own, and proxied too.
LOCAL_PATHS = frozenset({*LOCAL_ROUTES, *OLLAMA_ROUTES, *dashboard.DASHBOARD_PATHS})
# llama-server's endpoints the router proxies, by their paths.
PROXIED_ENDPOINTS = frozenset({
    "/slots", "/lora-adapters", "/v1/chat/completions", "/chat/completions",
    "/v1/completions", "/completions", "/completion", "/v1/responses", "/responses",
    "/v1/embeddings", "/embeddings", "/embedding", "/v1/rerank", "/rerank", "/v1/reranking",
    "/reranking", "/v1/messages", "/v1/messages/count_tokens", "/infill", "/v1/systemone",
    "/tokenize", "/detokenize", "/apply-template", "/v1/audio/transcriptions",
    "/audio/transcriptions"})
# llama-server's completion endpoints: a request there runs in a slot, keeps its prompt in it
# and takes an ``id_slot`` (the router places it where its model keeps its conversations;
# OpenAI's Responses and Anthropic's Messages are chat completions inside llama-server).
SLOT_PATHS = frozenset({
    "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
    "/completion", "/v1/responses", "/responses", "/v1/messages", "/infill"})
# Slot paths whose body reaches the slot without its ``id_slot`` (llama-server builds the chat
# request of an Anthropic Messages body from a few of its fields): the child chooses the slot.
UNPINNED_SLOT_PATHS = frozenset({"/v1/messages"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})  # OpenAI's Responses API
# The requests a model's slots run (completions, responses, embeddings, reranking,
# transcriptions), when POSTed: each waits in the router for a free slot, and counts against
# its team's quotas and in its usage (``teams``).
METERED_PATHS = SLOT_PATHS | frozenset({
    "/v1/embeddings", "/embeddings", "/embedding", "/v1/rerank", "/rerank", "/v1/reranking",
    "/reranking", "/v1/audio/transcriptions", "/audio/transcriptions", "/v1/systemone"})
# Endpoint label values for metrics; any other path is counted as "other".
KNOWN_ENDPOINTS = frozenset(LOCAL_ROUTES) | frozenset(OLLAMA_ROUTES) | PROXIED_ENDPOINTS
MODEL_SCOPED_PATHS = frozenset({"/props", "/metrics"})
# First segments of API paths: those never get the web UI's page as an SPA fallback.
API_ROOTS = frozenset({p.split("/")[1] for p in KNOWN_ENDPOINTS | LOCAL_PATHS | CHILD_GET_PATHS}
                      | {"v1", "tools", "cors-proxy", "api"})
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# What the roles of a scoped API key (keys.py) reach. role=infer: every proxied request to a
# model except those below, and these router paths with these methods (read-only listing,
# resumable streams, and the two disabled features llama.cpp's router answers with a 403).
_READ = frozenset({"GET", "HEAD"})
INFER_PATHS = {
    "/props": _READ, "/models": _READ, "/v1/models": _READ, "/models/sse": _READ,
    "/v1/stream": _READ | {"DELETE"}, "/v1/streams/lookup": frozenset({"POST"}),
    "/tools": _READ | {"POST"}, "/cors-proxy": _READ | {"POST"},
    # Ollama's API: everything but pulling and deleting models
    **{path: frozenset(methods) for path, methods in OLLAMA_ROUTES.items()
       if path not in ("/api/pull", "/api/delete")},
}
# The model listings: ?reload= on them re-reads the configuration, which is role=admin's.
LISTING_PATHS = frozenset({"/models", "/v1/models"})
# role=metrics: /metrics, the router's and (with ?model=) a child's own.
METRICS_PATHS = frozenset({"/metrics"})
# Proxied paths that are not inference, for role=admin only: a child's slots, with any method
# (they show other clients' prompts; save, restore, erase), and writes to a child's LoRA
# adapters or props (they change the model for everyone).
ADMIN_PROXIED_PREFIXES = ("/slots",)
ADMIN_PROXIED_WRITES = frozenset({"/lora-adapters", "/props", "/v1/props"})


def is_local(path: str, params: QueryParams) -> bool:
    """Answered by the router itself (not proxied): a local path, except ``/props`` and
    ``/metrics`` with ``?model=`` (the model's own). ``path`` and ``params`` are the decoded
    ones of the request's context (``requests.RequestContext.local``)."""
    if path not in LOCAL_PATHS:
        return False
    if path in MODEL_SCOPED_PATHS:
        return not params.get("model")
    return True
