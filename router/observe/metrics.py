"""``GET /metrics``: the router's own metrics plus every loaded child's, in one exposition.

The router's metrics live in a prometheus-client registry of their own. Children (always
started with ``--metrics``) are scraped concurrently with a short timeout; each sample gains a
``model="<id>"`` label and samples of the same family from every child are written under one
``# HELP``/``# TYPE`` header, all of it written by prometheus-client (``generate_latest``
over the router's families and the children's, parsed and relabelled). Only loaded children
are scraped (scraping never loads or wakes a model); a child that fails to answer is left out
and counted in ``llamarouter_child_scrape_errors_total``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ..core.scheduler import Status
from ..events import Event
from ..teams.usage import Usage
from .genai import GenAIMetrics

if TYPE_CHECKING:
    from ..core.view import Models
    from ..http.http11 import Refusals
    from ..warm.swaps import WarmSwaps

SCRAPE_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                   60, 120, 300)
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    """The router's own counters and histograms, plus live gauges read from the models."""

    def __init__(self) -> None:
        # Not auto_describe: it would collect every collector once as it registers (the
        # process collector reads /proc) only to check names that are fixed here.
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        # The router process's own CPU seconds, memory and file descriptors
        # (llamarouter_process_*): what tells when one relay process runs out of core.
        ProcessCollector(namespace="llamarouter", registry=r)
        self.requests = Counter("llamarouter_requests", "Requests answered, by model, endpoint "
                                "and HTTP status", ["model", "endpoint", "status"], registry=r)
        self.request_seconds = Histogram(
            "llamarouter_request_duration_seconds", "Time from request to the end of the "
            "response body", ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram(
            "llamarouter_queue_wait_seconds", "Time a request waited for its model to be ready",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte_seconds = Histogram(
            "llamarouter_time_to_first_byte_seconds", "Time from request to the first response "
            "body byte of a successful proxied request (queue and prompt included)", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(
            "llamarouter_generated_tokens", "Tokens generated, as the model's responses report "
            "them (timings.predicted_n or usage)", ["model"], registry=r)
        self.loads = Counter("llamarouter_model_loads", "Models that became loaded", ["model"],
                             registry=r)
        self.unloads = Counter("llamarouter_model_unloads", "Children that stopped or exited",
                               ["model"], registry=r)
        self.failures = Counter("llamarouter_model_failures", "Failed loads and crashes",
                                ["model"], registry=r)
        self.load_seconds = Histogram("llamarouter_model_load_duration_seconds",
                                      "Time from spawn to healthy", ["model"],
                                      buckets=LOAD_BUCKETS, registry=r)
        self.unresponsive = Counter("llamarouter_child_unresponsive",
                                    "Children killed because they stopped answering health "
                                    "checks", ["model"], registry=r)
        self.scrape_errors = Counter("llamarouter_child_scrape_errors",
                                     "Child /metrics scrapes that failed", ["model"], registry=r)
        self.replica_routing = Counter(
            "llamarouter_replica_routing", "Requests to a model with several replicas routed "
            "by their prompt's prefix, by decision: prefix_hit (the replica that served its "
            "longest prefix), miss (none had: the least busy), override (that replica was "
            "saturated: the least busy with a free slot)", ["model", "decision"], registry=r)
        self.virtual_choices = Counter(
            "llamarouter_virtual_choices", "Requests to a virtual model, by the target chosen "
            "and why: conversation (its earlier turns' target), warm, first, spillover, "
            "least_loaded, fallback", ["model", "target", "reason"], registry=r)

        # The GenAI conventions' gen_ai_server_* histograms (also over OTLP when it is on).
        self.genai = GenAIMetrics(r)

        # Labelled children per (model, endpoint, status): a request is counted with one dict
        # lookup instead of a labels() call per family (the hot path; none are ever removed).
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]] = {}
        self._routing: dict[tuple[str, str], Any] = {}  # (model, decision): the labelled child

    def observe_request(self, model: str, endpoint: str, status: int, total_s: float,
                        ttft_s: float | None, tokens: int | None) -> None:
        """Count one answered request; ``ttft_s``/``tokens`` only for a model's requests (the
        per-model families get no series for requests without a model)."""
        key = (model, endpoint, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(model, endpoint, str(status)),
                self.request_seconds.labels(model, endpoint),
                self.first_byte_seconds.labels(model) if model else None,
                self.generated_tokens.labels(model) if model else None)
        requests, seconds, first_byte, generated = children
        requests.inc()
        seconds.observe(total_s)
        if first_byte is not None and ttft_s is not None and status < 400:
            first_byte.observe(ttft_s)
        if generated is not None and tokens:
            generated.inc(tokens)

    def observe_routing(self, model: str, decision: str) -> None:
        """Count one routing decision among replicas (``Leases.on_routed``; the hot path: one
        dict lookup, the labelled child cached like ``observe_request``'s)."""
        child = self._routing.get((model, decision))
        if child is None:
            child = self._routing[(model, decision)] = self.replica_routing.labels(model,
                                                                                  decision)
        child.inc()

    def attach(self, models: Models) -> None:
        self.registry.register(_LiveGauges(models))
        if models.warm is not None:
            self.registry.register(_WarmSwaps(models.warm))
        models.events.listeners.append(self.on_event)
        models.on_routed(self.observe_routing)

    def attach_teams(self, usage: Usage) -> None:
        """Expose what each team used (``teams.usage``), read at scrape time."""
        self.registry.register(_Teams(usage))

    def attach_edge(self, refusals: Refusals) -> None:
        """Expose what the HTTP/1.1 edge refused (``http11.Refusals``), read at scrape time."""
        self.registry.register(_EdgeRefusals(refusals))

    def on_event(self, event: Event) -> None:
        """Count lifecycle transitions from the models' status events (a peer's events,
        relayed with their ``node``, are counted by the peer)."""
        if "node" in event:
            return
        kind = event.get("event")
        if kind == "unresponsive":
            self.unresponsive.labels(event["model"]).inc()
        if kind != "status_change":
            return
        model, data = event["model"], event.get("data") or {}
        status = data.get("status")
        if status == Status.LOADED.value:
            self.loads.labels(model).inc()
            if "duration" in data:
                self.load_seconds.labels(model).observe(data["duration"])
        elif status == Status.UNLOADED.value:
            if data.get("was_running"):
                self.unloads.labels(model).inc()
            if data.get("failed"):
                self.failures.labels(model).inc()

    async def exposition(self, models: Models, client: httpx.AsyncClient) -> bytes:
        targets: list[tuple[dict[str, str], str]] = []
        for model in models.views():
            if model.status is not Status.LOADED:
                continue
            replicas = model.replicas()
            for index, replica in enumerate(replicas):
                if replica.missed_checks:
                    continue  # not answering now: a scrape would only wait for its timeout
                labels = {"model": model.id}
                if len(replicas) > 1:
                    labels["replica"] = str(index)
                targets.append((labels, replica.base_url))
        texts = await asyncio.gather(*(self._scrape(client, labels, url)
                                       for labels, url in targets))
        return merged_exposition(self.registry, [(labels, text) for labels, text in texts
                                                 if text is not None])

    async def _scrape(self, client: httpx.AsyncClient, labels: dict[str, str],
                      base_url: str) -> tuple[dict[str, str], str | None]:
        try:
            response = await client.get(base_url + "/metrics", timeout=SCRAPE_TIMEOUT_S,
                                        headers={"connection": "close"})
            response.raise_for_status()
            return labels, response.text
        except httpx.HTTPError:
            self.scrape_errors.labels(labels["model"]).inc()
            return labels, None


class _WarmSwaps(Collector):
    """What warm swaps did (``warm.Counts``) and the saved states on disk, per model."""

    COUNTERS = (("saved", "llamarouter_state_saves",
                 "Slot states saved: before a stop, or before another conversation took the "
                 "slot"),
                ("displaced", "llamarouter_state_displacement_saves",
                 "Slot states saved before another conversation took the slot"),
                ("on_demand", "llamarouter_state_restores_on_demand",
                 "Conversations restored into a slot for their next turn"),
                ("hits", "llamarouter_state_restore_hits",
                 "Restores whose next response found their tokens in the cache"),
                ("misses", "llamarouter_state_restore_misses",
                 "Restores whose next response computed their tokens again"),
                ("spared_tokens", "llamarouter_state_spared_tokens",
                 "Prompt tokens the restores that hit took from the cache"),
                ("displace_wait_s", "llamarouter_state_displacement_wait_seconds",
                 "What displacement saves held the requests that took their slots"),
                ("saved_bytes", "llamarouter_state_saved_bytes", "Bytes of slot states saved"),
                ("restored", "llamarouter_state_restores",
                 "Slot states restored: into a new child, or for a conversation's next turn"),
                ("restored_tokens", "llamarouter_state_restored_tokens",
                 "Prompt tokens restored instead of computed again"),
                ("refused", "llamarouter_state_refused",
                 "Slot states discarded: not matching the child's answer, refused by it, or made "
                 "with other weights or settings"),
                ("slow_saves", "llamarouter_state_slow_saves",
                 "Stops whose saves were cut by their bound"),
                ("slow_restores", "llamarouter_state_slow_restores",
                 "Loads whose restores were cut by their bound"))

    def __init__(self, warm: WarmSwaps) -> None:
        self.warm = warm

    def collect(self) -> Iterator[Metric]:
        for attr, name, text in self.COUNTERS:
            family = CounterMetricFamily(name, text, labels=["model"])
            for model, counts in sorted(self.warm.ledger.counts.items()):
                family.add_metric([model], getattr(counts, attr))
            yield family
        files = GaugeMetricFamily("llamarouter_state_files", "Saved slot states on disk",
                                  labels=["model"])
        size = GaugeMetricFamily("llamarouter_state_bytes", "Bytes of saved slot states on "
                                 "disk", labels=["model"])
        for model, (count, total) in sorted(self.warm.store.usage().items()):
            files.add_metric([model], count)
            size.add_metric([model], total)
        yield from (files, size)


class _LiveGauges(Collector):
    """Gauges computed at scrape time from the models' state."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("llamarouter_children_running",
                                    "llama-server processes alive")
        status = GaugeMetricFamily("llamarouter_model_status",
                                   "1 for the model's current status", labels=["model", "status"])
        in_flight = GaugeMetricFamily("llamarouter_requests_in_flight",
                                      "Requests being proxied", labels=["model"])
        queued = GaugeMetricFamily("llamarouter_queue_depth",
                                   "Requests waiting for their model", labels=["model"])
        memory = GaugeMetricFamily("llamarouter_model_memory_bytes",
                                   "Resident memory of the model's llama-server", labels=["model"])
        gpu = GaugeMetricFamily("llamarouter_model_gpu_memory_bytes",
                                "GPU memory the model's llama-server uses (nvidia-smi)",
                                labels=["model", "gpu"])
        alive = 0
        for view in self.models.views():
            model = view.id
            status.add_metric([model, view.status.public], 1)
            in_flight.add_metric([model], view.in_flight)
            queued.add_metric([model], view.waiting)
            alive += view.processes  # a remote upstream runs no process here
            rss = view.measured()
            if rss is not None:
                memory.add_metric([model], rss)
            for pool, used in sorted(view.measured_devices().items()):
                gpu.add_metric([model, pool], used)
        running.add_metric([], alive)
        turns = CounterMetricFamily("llamarouter_cpu_turns", "Turns given while models that "
                                    "share CPU cores computed at the same time (cpugate)")
        turns.add_metric([], self.models.cpu_turns)
        paused = GaugeMetricFamily("llamarouter_children_paused",
                                   "Children paused while another model has its CPU turn")
        paused.add_metric([], self.models.children_paused)
        yield from (running, status, in_flight, queued, memory, gpu, turns, paused)
        other = self.models.cpu_other_work
        if other is not None:
            work = GaugeMetricFamily(
                "llamarouter_cpu_other_work_cores", "Cores' worth of CPU the machine spent "
                "outside the router and its children over the last second; from 0.5 a new "
                "child's threads wait briefly (GOMP_SPINCOUNT=3000)")
            work.add_metric([], round(other, 3))
            yield work


ChildText = tuple[dict[str, str], str]  # (labels to add to each sample, exposition text)

# The text format's types as prometheus-client's model holds them ("untyped" is "unknown"); a
# child's family of another type (OpenMetrics-only types such as info, stateset) is exposed
# untyped under its own sample names, as the text format knows no such type.
_TEXT_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "unknown"})
_CREATED_TYPES = frozenset({"counter", "histogram", "summary"})  # families with a _created


class _EdgeRefusals(Collector):
    """``llamarouter_edge_refusals_total``: requests and connections the edge refused before
    the app saw them, by reason (``http11.REFUSAL_REASONS``)."""

    def __init__(self, refusals: Refusals) -> None:
        self.refusals = refusals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "llamarouter_edge_refusals", "Connections and requests the HTTP/1.1 edge refused "
            "with an error envelope before the app saw them, by reason (unparsable, "
            "target_too_long, header_too_large, too_many_headers, head_too_large, upgrade, "
            "head_timeout, body_timeout, connection_cap)", labels=["reason"])
        for reason, count in self.refusals.counts.items():
            family.add_metric([reason], count)
        yield family


class _Teams(Collector):
    """What each team (its keys' ``name=``, never a key) used per model, its weighted service
    over the last minute, and Jain's index over the teams that waited in it."""

    def __init__(self, usage: Usage) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        rows = self.usage.rows()
        for column, text in _TEAM_COLUMNS:
            family = CounterMetricFamily(f"llamarouter_team_{column}", text,
                                         labels=["name", "model"])
            for row in rows:
                family.add_metric([row.name, row.model], getattr(row, column))
            yield family
        service = GaugeMetricFamily(
            "llamarouter_team_service_recent", "Weighted tokens served to each team over the "
            "last minute (prompt tokens, generated tokens twice)", labels=["name"])
        for name, amount in sorted(self.usage.recent_service().items()):
            service.add_metric([name], amount)
        yield service
        index = self.usage.jain()
        if index is not None:
            yield GaugeMetricFamily(
                "llamarouter_fairness_jain_index", "Jain's index over the last minute's "
                "weighted service of the teams whose requests waited for a slot (1: equal)",
                value=index)


_TEAM_COLUMNS = (
    ("requests", "Requests of each team that reached a model"),
    ("prompt_tokens", "Prompt tokens of each team's requests, as the clients were told"),
    ("completion_tokens", "Generated tokens of each team's requests, as the clients were told"),
    ("queue_seconds", "Seconds each team's requests waited in the router for a slot or a load"),
    ("refusals", "Requests of each team refused by a quota (429) or the wait budget (503)"),
)


class _BareCounter(Metric):
    """A counter whose samples are not named ``<name>_total`` (llama-server's
    ``llamacpp:n_tokens_max``): prometheus-client's model has no such counter (its parser renames
    the samples to ``_total`` and ``generate_latest`` would declare ``<name>_total``), so it is
    held as a gauge under its own name and its ``# TYPE`` line is set back to counter once
    rendered (``exposition_of``)."""

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation, "gauge")


class _Families(Collector):
    """One exposition's families, in order: what ``generate_latest`` renders."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposed_name(family: Metric) -> str:
    """The family's name in the text format (``# TYPE`` line): a counter's is ``<name>_total``."""
    return family.name + "_total" if family.type == "counter" else family.name


def merge_child_metrics(texts: Iterable[ChildText],
                        families: dict[str, Metric] | None = None) -> dict[str, Metric]:
    """Parse each child's exposition and group its samples by family into ``families`` (by
    ``exposed_name``; a new dict if None), adding the child's labels (``model``, and
    ``replica`` for models with several) to each sample.

    A family keeps the HELP and type it was first seen with; a later one of the same name but
    another type is left out (one name, one ``# TYPE``). A child whose text does not parse is
    left out."""
    merged: dict[str, Metric] = {} if families is None else families
    mine: set[str] = set()
    for extra, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        bare = _bare_counters(text)
        for family in parsed:
            _add(merged, _relabelled(family, extra, family.name in bare), mine)
    return merged


def _bare_counters(text: str) -> set[str]:
    """Names declared counter by a ``# TYPE`` line that do not end in ``_total``."""
    names: set[str] = set()
    if "counter" not in text:
        return names
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) == 4 and parts[3] == "counter" and not parts[2].endswith("_total"):
                names.add(parts[2])
    return names


def _relabelled(family: Metric, extra: dict[str, str], bare: bool) -> Metric:
    if bare and family.type == "counter":  # the parser named its samples <name>_total
        out: Metric = _BareCounter(family.name, family.documentation)
        out.samples = [Sample(s.name.removesuffix("_total"), {**s.labels, **extra}, s.value)
                       for s in family.samples]
        return out
    out = Metric(family.name, family.documentation,
                 family.type if family.type in _TEXT_TYPES else "unknown")
    out.samples = [Sample(s.name, {**s.labels, **extra}, s.value) for s in family.samples]
    return out


def _add(families: dict[str, Metric], family: Metric, mine: set[str]) -> None:
    """Add ``family`` (new: of this merge) to ``families``; ``mine``: the names of the families
    there that this merge made (the others, handed in, are copied before they grow)."""
    name = exposed_name(family)
    known = families.get(name)
    if known is None:
        families[name] = family
        mine.add(name)
    elif (known.type == family.type
          and isinstance(known, _BareCounter) == isinstance(family, _BareCounter)):
        if name not in mine:
            known = families[name] = copy.copy(known)
            known.samples = list(known.samples)
            mine.add(name)
        known.samples.extend(family.samples)


def exposition_of(families: Iterable[Metric]) -> bytes:
    """The text exposition of ``families`` (``generate_latest``'s), a bare counter's ``# TYPE``
    line set back to counter."""
    families = list(families)
    body = generate_latest(_Families(families))
    for family in families:
        if isinstance(family, _BareCounter):
            name = family.name.encode()
            body = body.replace(b"\n# TYPE " + name + b" gauge\n",
                                b"\n# TYPE " + name + b" counter\n", 1)
    return body


def merged_exposition(own: Collector, texts: Iterable[ChildText]) -> bytes:
    """``own``'s families (the router's registry), then the children's, in one exposition.

    A child's family with the name of one of the router's own (a remote upstream that is a
    router itself) is written under the router's header; a child's ``<name>_created`` gauge for
    one of the router's counters or histograms is left out, as ``generate_latest`` writes the
    router's own under that name."""
    families: dict[str, Metric] = {}
    created: set[str] = set()
    for family in own.collect():
        families[exposed_name(family)] = family
        if family.type in _CREATED_TYPES:
            created.add(family.name + "_created")
    merged = merge_child_metrics(texts, families)
    return exposition_of(family for name, family in merged.items() if name not in created)


def render_merged(families: dict[str, Metric]) -> Iterator[str]:
    """The exposition of merged families, as text (the peers' merged ``/metrics``)."""
    yield exposition_of(families.values()).decode()


# The labels that name a model, each checked against a scoped key's models (``only_models``).
MODEL_LABELS = ("model", "gen_ai_request_model", "gen_ai_response_model")


def only_models(body: bytes, allows: Callable[[str], bool]) -> bytes:
    """The exposition ``body`` with only the series of the models ``allows`` (a key limited to
    some models): a series with a model label (``MODEL_LABELS``: the router's ``model``, the
    GenAI conventions' requested and answering model) naming another model, or empty
    (requests that named none), is left out, and so is a family left without series; series
    without one (the router's own, per CPU turn, …) stay."""
    families = merge_child_metrics([({}, body.decode())])
    kept: list[Metric] = []
    for family in families.values():
        samples = [s for s in family.samples
                   if all(s.labels[label] and allows(s.labels[label])
                          for label in MODEL_LABELS if label in s.labels)]
        if samples:
            family.samples = samples
            kept.append(family)
    return exposition_of(kept)

