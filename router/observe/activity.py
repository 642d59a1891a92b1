"""Per-request activity: the last requests the router answered, and per-model totals.

``RequestMetricsMiddleware`` (``app.py``) adds one ``Record`` when a recorded request ends:
its model, method, path, status, time queued for the model, time to the first response byte,
total time and the tokens the model generated. A record holds names and numbers only: never a
body, a prompt, a query string or a header. The token count comes from the end of the response
(``tail.ResponseTail.tokens``), read once the response has ended; whole bodies are never
buffered or parsed.

Memory is bounded: the last ``capacity`` records (a deque) and one ``Totals`` per model id ever
recorded. Totals carry the ``seq`` of their last change, so ``GET /activity/totals?since=S``
answers only the models that changed since the client's previous sample: sampling every second
stays cheap with hundreds of models.

Routes: ``GET /activity`` (records, newest first; ``?model=``, ``?limit=``, ``?after=ID``) and
``GET /activity/totals`` (``?since=SEQ``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import BadRequest
from ..http.requests import context

DEFAULT_CAPACITY = 500
MAX_PATH_CHARS = 200  # a record keeps at most this much of a path

@dataclass(slots=True)
class Record:
    """One finished request. Times in seconds; ``queue_s`` and ``tokens`` are None where they
    do not apply (not a model request, or no count in the response); ``ttft_s`` is None when
    no body byte was sent."""

    id: int
    time: float  # wall clock when the request arrived (Unix time)
    model: str  # the model id it went to ("" if none was resolved)
    method: str
    endpoint: str  # the path, without the query string
    status: int
    queue_s: float | None
    ttft_s: float | None
    total_s: float
    tokens: int | None


@dataclass(slots=True)
class Totals:
    """A model's running totals of the requests to it since the router started (for rates:
    sample and subtract)."""

    requests: int = 0
    errors: int = 0  # status >= 400
    tokens: int = 0
    ttft_sum: float = 0.0  # of the successful ones (status < 400)
    ttft_count: int = 0
    queue_sum: float = 0.0
    queue_count: int = 0
    seq: int = 0  # Activity.seq when these last changed


class Activity:
    """The last ``capacity`` records and per-model totals; event-loop only (no locking)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("activity capacity must be at least 1")
        self.capacity = capacity
        self.records: deque[Record] = deque(maxlen=capacity)
        self.totals: dict[str, Totals] = {}
        self.last_id = 0
        self.seq = 0
        self.started = time.time()

    def add(self, *, model: str, method: str, path: str, status: int, started: float,
            total_s: float, queue_s: float | None = None, ttft_s: float | None = None,
            tokens: int | None = None, proxied: bool = True) -> Record:
        """Record one finished request. Only requests to a model (``proxied``, with a
        ``model``) count in the totals; the router's own actions (a load, an unload) are
        listed only."""
        self.last_id += 1
        record = Record(self.last_id, started, model, method, path[:MAX_PATH_CHARS], status,
                        queue_s, ttft_s, total_s, tokens)
        self.records.append(record)
        if model and proxied:
            self.seq += 1
            totals = self.totals.get(model)
            if totals is None:
                totals = self.totals[model] = Totals()
            totals.seq = self.seq
            totals.requests += 1
            totals.errors += status >= 400
            if tokens:
                totals.tokens += tokens
            if ttft_s is not None and status < 400:  # as llamarouter_time_to_first_byte
                totals.ttft_sum += ttft_s
                totals.ttft_count += 1
            if queue_s is not None:
                totals.queue_sum += queue_s
                totals.queue_count += 1
        return record

    def recent(self, model: str | None = None, limit: int | None = None,
               after: int = 0) -> list[Record]:
        """Records newest first: only ``model``'s if given, at most ``limit``, and only those
        with an id above ``after`` (what a client that has seen ``after`` is missing)."""
        found: list[Record] = []
        for record in reversed(self.records):
            if record.id <= after or (limit is not None and len(found) >= limit):
                break
            if model is None or record.model == model:
                found.append(record)
        return found

    def changed(self, since: int = 0) -> dict[str, dict[str, Any]]:
        """The totals of every model that changed after ``seq`` ``since`` (all for 0)."""
        return {model: _rounded(asdict(totals)) for model, totals in self.totals.items()
                if totals.seq > since}


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}


def _int_param(request: Request, name: str) -> int | None:
    raw = context(request.scope).params.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise BadRequest(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)


def _activity(request: Request) -> Activity:
    activity: Activity = request.app.state.activity
    return activity


def _model_id(request: Request, name: str) -> str:
    """An alias names its model; an unknown name is kept (it may have been removed)."""
    state = getattr(request.app.state, "router", None)
    if state is None:
        return name
    resolved: str | None = state.models.model_id(name)
    return resolved or name


def _in_scope(request: Request) -> Callable[[str], bool] | None:
    """For a key limited to some models, whether a record's model is one of them (a record
    without a model, such as a reload, is not); None for a key that sees every model."""
    key_scope = context(request.scope).key_scope
    if key_scope is None or key_scope.pattern is None:
        return None
    state = getattr(request.app.state, "router", None)

    def allows(model_id: str) -> bool:
        view = state.models.view(model_id) if state is not None and model_id else None
        return bool(model_id) and key_scope.allows(model_id, view.aliases if view else ())
    return allows


async def list_activity(request: Request) -> Response:
    """``GET /activity``: ``{"requests": [...newest first], "capacity": N, "last_id": N}``;
    a key limited to some models sees only their requests (another model's name finds
    nothing, as a name nobody uses)."""
    activity = _activity(request)
    params = context(request.scope).params
    name = params.get("model") or None
    model = _model_id(request, name) if name else None
    limit = _int_param(request, "limit")
    after = _int_param(request, "after") or 0
    allows = _in_scope(request)
    if allows is None:
        records = activity.recent(model, limit, after)
    else:
        records = [r for r in activity.recent(model, None, after) if allows(r.model)][:limit]
    return JSONResponse({"requests": [_rounded(asdict(r)) for r in records],
                         "capacity": activity.capacity, "last_id": activity.last_id})


async def activity_totals(request: Request) -> Response:
    """``GET /activity/totals``: per-model totals since start; ``?since=SEQ`` answers only the
    models changed after the ``seq`` of an earlier answer (for a key limited to some models,
    only theirs)."""
    activity = _activity(request)
    since = _int_param(request, "since") or 0
    totals = activity.changed(since)
    allows = _in_scope(request)
    if allows is not None:
        totals = {model: values for model, values in totals.items() if allows(model)}
    return JSONResponse({"seq": activity.seq, "started": activity.started, "now": time.time(),
                         "models": totals})
