"""The merged ``/metrics`` exposition, in process: children's texts (the real llama-server's, in
tests/data) parsed, relabelled and written through prometheus-client, then parsed back."""

from __future__ import annotations

import asyncio
import re
from collections import Counter as Tally
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.observe.metrics import (
    RouterMetrics,
    merge_child_metrics,
    merged_exposition,
    render_merged,
)

LLAMA_SERVER = (Path(__file__).parent / "data" / "llama-server-metrics.txt").read_text()

Families = dict[str, tuple[str, str, list[tuple[str, tuple[tuple[str, str], ...], float]]]]


def child_text(seed: int) -> str:
    """The real llama-server text with values of its own (each sample ``seed*1000 + i``)."""
    lines, i = [], 0
    for line in LLAMA_SERVER.splitlines():
        if not line.startswith("#"):
            line = f"{line.rsplit(' ', 1)[0]} {seed * 1000 + i}"
            i += 1
        lines.append(line)
    return "\n".join(lines) + "\n"


def families(text: str, extra: dict[str, str] | None = None) -> Families:
    """Family name -> (type, help, samples with sorted labels), as the parser reads ``text``;
    ``extra`` labels added to every sample (what the merge is to add)."""
    out: Families = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, (family.type, family.documentation, []))[2]
        samples.extend((s.name, tuple(sorted({**s.labels, **(extra or {})}.items())), s.value)
                       for s in family.samples)
    return out


def combined(*parts: Families) -> Families:
    out: Families = {}
    for part in parts:
        for name, (kind, doc, samples) in part.items():
            out.setdefault(name, (kind, doc, []))[2].extend(samples)
    return out


def declared(text: str, kind: str) -> list[str]:
    """The ``# HELP``/``# TYPE`` lines of ``text`` (``kind``), in order."""
    return [line for line in text.splitlines() if line.startswith(f"# {kind} ")]


def grouped(text: str) -> None:
    """Each family's samples follow its one ``# TYPE`` line, none elsewhere."""
    types = [line.split()[2] for line in declared(text, "TYPE")]
    assert len(types) == len(set(types)), [n for n, c in Tally(types).items() if c > 1]
    current = ""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            current = line.split()[2]
        elif not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            assert name == current or name.startswith(current.removesuffix("_total") + "_") \
                or current.endswith("_created"), (current, line)


def test_two_llama_servers_parse_back_to_their_families_with_a_model_label() -> None:
    a, b = child_text(1), child_text(2)
    body = merged_exposition(CollectorRegistry(), [({"model": "a"}, a), ({"model": "b"}, b)])
    text = body.decode()
    assert families(text) == combined(families(a, {"model": "a"}), families(b, {"model": "b"}))
    # Names, HELP and TYPE exactly as llama-server wrote them, once per family, in its order.
    assert declared(text, "TYPE") == declared(LLAMA_SERVER, "TYPE")
    assert declared(text, "HELP") == declared(LLAMA_SERVER, "HELP")
    grouped(text)
    written = {line.split()[0] for line in LLAMA_SERVER.splitlines() if not line.startswith("#")}
    for model in ("a", "b"):
        names = {line.split("{")[0] for line in text.splitlines()
                 if f'{{model="{model}"}}' in line}
        assert names == written
    assert 'llamacpp:prompt_tokens_total{model="a"} 1000.0\n' in text
    assert 'llamacpp:prompt_tokens_total{model="b"} 2000.0\n' in text


def test_a_counter_without_total_keeps_its_name_and_type() -> None:
    # llamacpp:n_tokens_max is declared a counter without the _total suffix: prometheus-client
    # would name it llamacpp:n_tokens_max_total.
    assert "# TYPE llamacpp:n_tokens_max counter\n" in LLAMA_SERVER
    text = merged_exposition(CollectorRegistry(), [({"model": "a"}, child_text(1)),
                                                   ({"model": "b"}, child_text(2))]).decode()
    assert "# TYPE llamacpp:n_tokens_max counter\n" in text
    assert re.search(r'^llamacpp:n_tokens_max\{model="a"\} \d', text, re.M)
    assert re.search(r'^llamacpp:n_tokens_max\{model="b"\} \d', text, re.M)
    assert "n_tokens_max_total" not in text
    # ... and through a second merge (the gateway merging its nodes' expositions).
    again = "".join(render_merged(merge_child_metrics([({"node": "n1"}, text),
                                                       ({"node": "n2"}, text)])))
    assert "# TYPE llamacpp:n_tokens_max counter\n" in again
    assert "n_tokens_max_total" not in again
    assert 'llamacpp:n_tokens_max{model="a",node="n2"} ' in again


def test_replicas_labels_and_escaping() -> None:
    text = ('# HELP odd A "help" with \\\\ and \\n in it\n# TYPE odd gauge\n'
            'odd{path="C:\\\\x",quote="say \\"hi\\"",nl="a\\nb"} 1.5\n')
    parsed = families(text)
    assert parsed["odd"][2][0][1] == (("nl", "a\nb"), ("path", "C:\\x"), ("quote", 'say "hi"'))
    children = [({"model": "m", "replica": "0"}, text), ({"model": "m", "replica": "1"}, text)]
    merged = merged_exposition(CollectorRegistry(), children).decode()
    assert families(merged) == combined(families(text, {"model": "m", "replica": "0"}),
                                        families(text, {"model": "m", "replica": "1"}))
    assert declared(merged, "HELP") == ['# HELP odd A "help" with \\\\ and \\n in it']
    assert 'replica="1"' in merged


def test_untyped_families_and_samples_without_a_header() -> None:
    text = ("# HELP plain An untyped family\n# TYPE plain untyped\nplain{x=\"1\"} 3\n"
            "bare_sample 4\n# TYPE listed gauge\nlisted 5\n")
    merged = merged_exposition(CollectorRegistry(), [({"model": "a"}, text),
                                                     ({"model": "b"}, text)]).decode()
    assert families(merged) == combined(families(text, {"model": "a"}),
                                        families(text, {"model": "b"}))
    assert "# TYPE plain untyped\n" in merged and "# TYPE bare_sample untyped\n" in merged
    assert 'plain{model="b",x="1"} 3.0' in merged and 'bare_sample{model="a"} 4.0' in merged
    grouped(merged)


def test_histograms_and_summaries_from_a_child() -> None:
    text = ("# HELP lat Latency\n# TYPE lat histogram\nlat_bucket{le=\"1.0\"} 1\n"
            "lat_bucket{le=\"+Inf\"} 2\nlat_sum 3\nlat_count 2\n"
            "# TYPE sz summary\nsz{quantile=\"0.5\"} 1\nsz_sum 2\nsz_count 3\n")
    merged = merged_exposition(CollectorRegistry(), [({"model": "a"}, text),
                                                     ({"model": "b"}, text)]).decode()
    assert families(merged) == combined(families(text, {"model": "a"}),
                                        families(text, {"model": "b"}))
    assert declared(merged, "TYPE") == ["# TYPE lat histogram", "# TYPE sz summary"]
    grouped(merged)


def test_a_child_that_does_not_parse_or_disagrees_on_a_type_is_left_out() -> None:
    good = child_text(1)
    clash = "# TYPE llamacpp:requests_processing counter\nllamacpp:requests_processing 7\n"
    merged = merged_exposition(CollectorRegistry(), [
        ({"model": "a"}, good), ({"model": "bad"}, "not a {metrics text"),
        ({"model": "c"}, clash)]).decode()
    assert families(merged) == families(good, {"model": "a"})
    assert 'model="bad"' not in merged and 'model="c"' not in merged


def router_registry(requests: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("llamarouter_requests", "Requests answered", ["model"], registry=registry)
    counter.labels("x").inc(requests)
    Histogram("llamarouter_queue_wait_seconds", "Wait", ["model"], buckets=(1,),
              registry=registry).labels("x").observe(0.5)
    return registry


def test_a_child_family_named_like_the_routers_own_is_written_under_its_header() -> None:
    # A remote upstream that is itself a router: its families carry the router's names.
    own = router_registry(1)
    upstream = generate_latest(router_registry(5)).decode()
    merged = merged_exposition(own, [({"model": "remote"}, upstream),
                                     ({"model": "a"}, child_text(1))]).decode()
    grouped(merged)
    requests = [line for line in merged.splitlines()
                if line.startswith("llamarouter_requests_total")]
    assert requests == ['llamarouter_requests_total{model="x"} 1.0',
                        'llamarouter_requests_total{model="remote"} 5.0']
    assert merged.count("# TYPE llamarouter_requests_created gauge\n") == 1
    assert merged.count("# TYPE llamarouter_queue_wait_seconds histogram\n") == 1
    assert 'llamarouter_queue_wait_seconds_count{model="remote"} 1.0' in merged
    own_types = declared(generate_latest(own).decode(), "TYPE")
    assert declared(merged, "TYPE")[:len(own_types)] == own_types  # the router's first
    # The router's own families are not changed by a merge.
    assert generate_latest(own).decode().count('model="remote"') == 0


def test_the_gateway_merges_its_nodes_with_a_node_label() -> None:
    own = RouterMetrics()
    own.observe_request("a", "/v1/chat/completions", 200, 0.1, 0.01, 4)
    node = merged_exposition(own.registry, [({"model": "a"}, child_text(1))]).decode()
    texts = [({"node": "gw"}, node), ({"node": "n1"}, node)]
    gateway = "".join(render_merged(merge_child_metrics(texts)))
    grouped(gateway)
    assert families(gateway) == combined(families(node, {"node": "gw"}),
                                         families(node, {"node": "n1"}))
    assert declared(gateway, "TYPE") == declared(node, "TYPE")


def test_exposition_scrapes_the_loaded_children() -> None:
    texts = {"http://a": child_text(1), "http://b0": child_text(2), "http://b1": child_text(3)}

    def answer(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base == "http://down":
            return httpx.Response(500)
        return httpx.Response(200, text=texts[base])

    def view(model: str, status: str, *urls: str) -> Any:
        from router.core.scheduler import Status
        replicas = [SimpleNamespace(base_url=url, missed_checks=0) for url in urls]
        return SimpleNamespace(id=model, status=Status(status), replicas=lambda: replicas)

    supervisor: Any = SimpleNamespace(views=lambda: [
        view("a", "loaded", "http://a"), view("b", "loaded", "http://b0", "http://b1"),
        view("c", "unloaded", "http://c"), view("d", "loaded", "http://down")])
    metrics = RouterMetrics()

    async def scrape() -> bytes:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await metrics.exposition(supervisor, client)

    text = asyncio.run(scrape()).decode()
    grouped(text)
    expected = combined(families(child_text(1), {"model": "a"}),
                        families(child_text(2), {"model": "b", "replica": "0"}),
                        families(child_text(3), {"model": "b", "replica": "1"}))
    got = families(text)
    assert {name: got[name] for name in expected} == expected
    assert 'llamarouter_child_scrape_errors_total{model="d"} 1.0' in text
    assert 'model="c"' not in text


def test_a_scoped_key_sees_no_genai_series_of_another_model() -> None:
    """The GenAI histograms name their models in labels of their own: a key limited to some
    models sees neither another model's series nor one whose model label is empty."""
    from router.observe.metrics import only_models
    body = (
        b"# HELP gen_ai_server_request_duration_seconds d\n"
        b"# TYPE gen_ai_server_request_duration_seconds histogram\n"
        b'gen_ai_server_request_duration_seconds_count{gen_ai_request_model="alpha",'
        b'gen_ai_response_model="alpha"} 1.0\n'
        b'gen_ai_server_request_duration_seconds_count{gen_ai_request_model="beta",'
        b'gen_ai_response_model="beta"} 1.0\n'
        b'gen_ai_server_request_duration_seconds_count{gen_ai_request_model="a",'
        b'gen_ai_response_model="beta"} 1.0\n'
        b'gen_ai_server_request_duration_seconds_count{gen_ai_request_model="alpha",'
        b'gen_ai_response_model=""} 1.0\n'
        b"# HELP llamarouter_cpu_turns t\n# TYPE llamarouter_cpu_turns gauge\n"
        b"llamarouter_cpu_turns 2.0\n")
    text = only_models(body, lambda model: model in ("alpha", "a")).decode()
    assert text.count("gen_ai_server_request_duration_seconds_count{") == 1
    assert 'gen_ai_response_model="alpha"' in text and "beta" not in text
    assert "llamarouter_cpu_turns 2.0" in text
