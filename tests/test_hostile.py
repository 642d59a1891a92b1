"""The hostile tier: malformed and hostile HTTP, the auth matrix and a key-leak scan, against
one router with real llama-server children. Figures: docs/reliability.md (each test also
writes its own under build/reliability/).

Every answer the router makes itself must be below 500 and, for an error, the OpenAI envelope
as JSON; no request may hang; pipelined and pooled requests never get each other's answers.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from hostile import exchange, judge, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import RouterProcess, start_router, write_presets

pytestmark = pytest.mark.real

KEY = "sk-hostile-3b9f0c2e"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"

# Every path the router answers itself, and a sample of the ones it proxies.
ROUTES = ["/", "/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics",
          "/models/load", "/models/unload", "/models/reload", "/logs", "/logs/stream",
          "/activity", "/activity/totals", "/dashboard/", "/tools", "/cors-proxy",
          "/v1/stream", "/v1/streams/lookup", "/v1/chat/completions", "/v1/completions",
          "/completion", "/v1/embeddings", "/tokenize", "/detokenize", "/slots", "/infill",
          "/v1/responses", "/v1/messages", "/no/such/path"]
ODD_METHODS = ["HEAD", "OPTIONS", "PUT", "PATCH", "DELETE", "TRACE"]
PASSWD = b"root:x:0:0"


def record(name: str, figures: dict[str, object]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path],
           llama_server: Path) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    text = "[*]\nctx-size = 1024\nparallel = 4\n"
    for name in ("alpha", "beta", "gamma"):
        text += f"[{name}]\nmodel = {tiny_models[name]}\n"
    presets = write_presets(tmp / "hostile.ini", text)
    with start_router(tmp, "--presets", str(presets), "--models-max", "2",
                      "--api-key", KEY) as router:
        with router.client(headers=AUTH) as client:
            assert client.post("/tokenize", json={"model": "alpha", "content": "hi"}) \
                .status_code == 200
        yield router


# ----------------------------------------------------------------------------- the cases

@dataclass
class Case:
    name: str
    data: bytes
    expect: int = 1
    head_only: list[bool] = field(default_factory=list)
    may_close: bool = False  # a request that cannot be framed: a 400, then the close
    answers_to: list[bytes] = field(default_factory=list)  # a marker each answer must hold


def authed(method: str, target: str, body: bytes = b"", /, **headers: str) -> bytes:
    return request(method, target, headers={**AUTH, **headers}, body=body)


def method_cases() -> Iterator[Case]:
    for path, method in itertools.product(ROUTES, ODD_METHODS):
        yield Case(f"{method} {path}", authed(method, path), head_only=[method == "HEAD"])
    for path in ROUTES:  # the same without a key
        yield Case(f"GET {path} (no key)", request("GET", path))
        yield Case(f"POST {path} (no key)", request("POST", path, body=b"{}"))
    for method in ("FOO", "get", "G ET", "CONNECT", "PRI"):
        yield Case(f"method {method!r}", f"{method} /models HTTP/1.1\r\nHost: x\r\n\r\n"
                   .encode(), may_close=True)


def target_cases() -> Iterator[Case]:
    targets = [
        "/%2e%2e/%2e%2e/etc/passwd", "/..%2f..%2fetc/passwd", "/../../etc/passwd",
        "//models", "///v1//models", "/v1/../models", "/models/", "/MODELS", "/%6dodels",
        "/dashboard/../../../etc/passwd", "/dashboard/%2e%2e/%2e%2e/etc/passwd",
        "/_app/../../etc/passwd", "/_app/%2e%2e/%2e%2e/%2e%2e/etc/passwd", "/index.html",
        "/favicon.ico", "/logs?model=../../etc/passwd", "/logs?model=%00",
        "/logs?lines=99999999999999999999", "/v1/models%00", "/%ff%fe%fd", "/%",
        "/models?model=" + "a" * 5000, "/" + "a" * 20000, "/models?" + "&".join(
            f"k{i}=v" for i in range(3000)), "/props?model=../../etc/passwd",
        "/metrics?model=%2e%2e", "/slots?model=nope", "/v1/stream?model=alpha",
        "/tokenize?model=alpha", "/logs/stream?model=" + "%" * 100,
    ]
    for target in targets:  # (GET /models/sse is a stream without end, by design)
        yield Case(f"GET {target[:60]}", authed("GET", target))
        yield Case(f"HEAD {target[:60]}", authed("HEAD", target), head_only=[True])
    for target in ("*", "http://evil.example/models", "models", "?", "/ models", "/\tx"):
        yield Case(f"target {target!r}", authed("GET", target), may_close=True)


def framing_cases() -> Iterator[Case]:
    chat = json.dumps({"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    smuggled = authed("GET", "/props")
    raw = {
        "CL and TE": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
        "TE and CL": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Length: 50\r\n\r\n0\r\n\r\n" + smuggled,
        "two CLs": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                   b"Content-Length: 40\r\n\r\n{}" + smuggled,
        "CL with sign": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}",
        "negative CL": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
        "CL not a number": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2x\r\n\r\n{}",
        "bad chunk size": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                          b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "chunk size overflow": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                               b"chunked\r\n\r\nffffffffffffffffffff\r\n{}\r\n0\r\n\r\n",
        "TE xchunked": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n"
                       b"Content-Length: 2\r\n\r\n{}",
        "TE chunked, identity": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                                b"chunked, identity\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "obs-fold": b"GET /models HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
        "space before colon": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length : 2\r\n"
                              b"\r\n{}",
        "no colon": b"GET /models HTTP/1.1\r\nHost: x\r\nJustAName\r\n\r\n",
        "NUL in value": b"GET /models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
        "CR in value": b"GET /models HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
        "bare LF lines": b"GET /health HTTP/1.1\nHost: x\n\n",
        "HTTP/2.0": b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
        "HTTP/9.9": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        "no version": b"GET /health\r\nHost: x\r\n\r\n",
        "h2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "binary garbage": bytes(range(256)) * 4,
        "TLS hello": bytes.fromhex("16030100c8010000c40303") + os.urandom(64),
        "only CRLFs": b"\r\n" * 200,
        "request line too long": b"GET /" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    }
    for name, data in raw.items():
        yield Case(name, data, expect=2, may_close=True)
    # Well framed but odd: every one of these gets its one answer.
    odd = {
        "HTTP/1.0 without Host": b"GET /health HTTP/1.0\r\n\r\n",
        "no Host": b"GET /health HTTP/1.1\r\n\r\n",
        "two Hosts": b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        "chunked body": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                        + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + hex(len(chat))[2:].encode() + b"\r\n" + chat + b"\r\n0\r\n\r\n",
        "Expect 100-continue": authed("POST", "/tokenize", b'{"model":"alpha","content":"x"}',
                                      Expect="100-continue"),
        "Connection names Authorization": authed("GET", "/models", Connection="Authorization"),
        "100 KB header": authed("GET", "/health", **{"X-Big": "a" * 100_000}),
        "Content-Type lies": authed("POST", "/v1/chat/completions", chat,
                                    **{"Content-Type": "multipart/form-data; boundary=zz"}),
        "Authorization twice": request("GET", "/models", headers={
            "Authorization": "Bearer wrong", "authorization": f"Bearer {KEY}"}),
    }
    many = "".join(f"X-H{i}: {i}\r\n" for i in range(1000))
    odd["1,000 headers"] = (f"GET /health HTTP/1.1\r\nHost: x\r\n{many}\r\n").encode()
    for name, data in odd.items():
        yield Case(name, data)


def body_cases() -> Iterator[Case]:
    bodies: dict[str, bytes] = {
        "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
        "nested objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        "invalid UTF-8": b'{"model": "\xff\xfe"}',
        "model a number": b'{"model": 5}', "model null": b'{"model": null}',
        "model a list": b'{"model": ["alpha"]}', "model an object": b'{"model": {}}',
        "model huge": json.dumps({"model": "a" * 100_000}).encode(),
        "model traversal": b'{"model": "../../etc/passwd"}',
        "model newline": b'{"model": "alpha\\n"}', "model NUL": b'{"model": "alpha\\u0000"}',
        "empty": b"", "null": b"null", "list": b"[]", "string": b'"alpha"', "number": b"1e999",
        "truncated JSON": b'{"model": "alp', "NaN": b'{"model": NaN}',
        "duplicate keys": b'{"model": "nope", "model": "nope2"}',
        "form": b"model=alpha&x=1", "whitespace": b" " * 10_000,
    }
    for (name, body), path in itertools.product(
            bodies.items(), ("/v1/chat/completions", "/tokenize", "/models/load",
                             "/models/unload")):
        yield Case(f"POST {path} {name}", authed("POST", path, body,
                                                 **{"Content-Type": "application/json"}))
    for name, boundary_body in {
        "multipart no boundary": (b"multipart/form-data", b"--x\r\n\r\n"),
        "multipart bad boundary": (b"multipart/form-data; boundary=zz", b"--yy\r\nbroken"),
        "multipart model field": (b"multipart/form-data; boundary=zz",
                                  b'--zz\r\nContent-Disposition: form-data; name="model"\r\n'
                                  b"\r\nnope\r\n--zz--\r\n"),
    }.items():
        content_type, body = boundary_body
        yield Case(name, authed("POST", "/v1/audio/transcriptions", body,
                                **{"Content-Type": content_type.decode()}))
    for name in ("a/..", "a/.", "a-/b", "a//b", "../../x", "a/b:../../q", "x" * 500):
        yield Case(f"pull {name!r}", authed("POST", "/models",
                                            json.dumps({"model": name}).encode()))


def pipelined_cases() -> Iterator[Case]:
    tokenize = json.dumps({"model": "alpha", "content": "pipelined words"}).encode()
    yield Case("three pipelined", authed("GET", "/health") + authed("GET", "/v1/models")
               + authed("POST", "/tokenize", tokenize), expect=3,
               answers_to=[b'"ok"', b'"data"', b'"tokens"'])
    yield Case("behind HEAD /models/sse", authed("HEAD", "/models/sse")
               + authed("GET", "/health"), expect=2, head_only=[True, False],
               answers_to=[b"", b'"ok"'])
    yield Case("behind a 404", authed("GET", "/no/such") + authed("GET", "/health"),
               expect=2, answers_to=[b'"error"', b'"ok"'])
    yield Case("behind a 401", request("GET", "/models") + authed("GET", "/health"),
               expect=2, answers_to=[b'"error"', b'"ok"'])
    models = ("alpha", "beta", "alpha", "beta")
    data = b"".join(authed("POST", "/detokenize", json.dumps(
        {"model": m, "tokens": [ord(c) for c in f"marker{i}"]}).encode())
        for i, m in enumerate(models))
    yield Case("four detokenizes over two models", data, expect=4,
               answers_to=[f"marker{i}".encode() for i in range(4)])


def all_cases() -> list[Case]:
    return [*method_cases(), *target_cases(), *framing_cases(), *body_cases(),
            *pipelined_cases()]


# ----------------------------------------------------------------------------- the tests

def check(router: RouterProcess, case: Case) -> list[str]:
    result = exchange(router.port, case.data, expect=case.expect,
                      head_only=case.head_only or None)
    problems = []
    if result.hung:
        problems.append("hung")
    if len(result.answers) < case.expect and not (case.may_close and result.answers):
        problems.append(f"{len(result.answers)} of {case.expect} answers "
                        f"(closed: {result.closed})")
    for index, answer in enumerate(result.answers):
        head = bool(case.head_only and case.head_only[index])
        problem = judge(answer, head=head)
        if problem:
            problems.append(problem)
        if PASSWD in answer.body:
            problems.append("a file outside the router's places was served")
        if index < len(case.answers_to) and case.answers_to[index] not in answer.body:
            problems.append(f"answer {index} is not the answer to request {index}: "
                            f"{answer.body[:100]!r}")
    if case.may_close and len(result.answers) > 1 and result.answers[0].status == 400:
        problems.append("answered a request smuggled behind one it could not frame")
    return problems


def test_hostile_requests_get_clear_answers(router: RouterProcess) -> None:
    cases = all_cases()
    assert len(cases) >= 300
    failures = {}
    with ThreadPoolExecutor(8) as pool:
        for case, problems in zip(cases, pool.map(lambda c: check(router, c), cases),
                                  strict=True):
            if problems:
                failures[case.name] = problems
    record("hostile_requests", {"cases": len(cases), "failures": len(failures)})
    assert not failures, json.dumps(failures, indent=1)[:6000]
    assert router.proc.poll() is None
    assert "Traceback" not in router.log()


def test_pooled_hop_never_mixes_answers(router: RouterProcess) -> None:
    """Many clients at once over the router's pooled connections to two children: each gets
    the answer to its own request (its marker comes back in the pieces)."""
    def one(i: int) -> bool:
        model = ("alpha", "beta")[i % 2]
        with httpx.Client(base_url=router.url, headers=AUTH, timeout=60) as client:
            response = client.post("/tokenize", json={
                "model": model, "content": f"marker {i} end", "with_pieces": True})
        pieces = "".join(t["piece"] for t in response.json()["tokens"])
        return response.status_code == 200 and pieces == f"marker {i} end"

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(2000)))
    record("pooled_hop", {"requests": len(results), "mixed_or_failed": results.count(False)})
    assert all(results)


AUTH_SPELLINGS = ["/models", "//models", "/models/", "/MODELS", "/%6dodels", "/v1/../models",
                  "/./models", "/models?", "/models#x", "/props", "/v1/models", "/metrics",
                  "/logs", "/logs/stream", "/activity", "/models/load", "/models/unload",
                  "/models/reload", "/v1/chat/completions", "/tokenize", "/slots?model=alpha",
                  "/props?model=alpha", "/metrics?model=alpha", "/v1/stream?model=alpha",
                  "/v1/streams/lookup", "/models/sse", "/health/../models",
                  "/dashboard/../models", "/v1/models/alpha"]
AUTH_HEADERS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "wrong"},
                {"Authorization": f"Basic {KEY}"}, {"X-Api-Key": "wrong"},
                {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}]


def test_no_route_spelling_or_method_gets_past_the_key(router: RouterProcess) -> None:
    probes = bypasses = 0
    failures = []
    for path, method, headers in itertools.product(
            AUTH_SPELLINGS, ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"], AUTH_HEADERS):
        body = b'{"model": "alpha", "content": "x"}' if method in ("POST", "PUT") else b""
        result = exchange(router.port, request(method, path, headers=headers, body=body),
                          head_only=[method == "HEAD"])
        probes += 1
        if not result.answers:
            failures.append(f"{method} {path} {headers}: no answer")
            continue
        answer = result.answers[0]
        if answer.status != 401 and not (method == "OPTIONS" and answer.status == 200
                                         and not answer.body):
            bypasses += 1  # (an OPTIONS carries no key: answered by the CORS policy, no data)
            failures.append(f"{method} {path} {headers}: {answer.status}")
    record("auth_matrix", {"probes": probes, "bypasses": bypasses})
    assert probes >= 1000 and not failures, failures[:20]


def test_the_key_appears_nowhere(router: RouterProcess) -> None:
    with router.client(headers=AUTH) as client:
        client.post("/v1/chat/completions", json={
            "model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": KEY}]})
        answers = {path: client.get(path).text for path in (
            "/props", "/models", "/v1/models", "/metrics", "/activity", "/logs?model=alpha")}
    leaks = [f"GET {path}" for path, text in answers.items() if KEY in text]
    children = [p for p in router.children() if "llama-server" in p.name()]
    assert children
    for child in children:
        try:
            if any(KEY in arg for arg in child.cmdline()):
                leaks.append(f"argv of {child.pid}")
            if any(KEY in value for value in child.environ().values()):
                leaks.append(f"environment of {child.pid}")
        except psutil.NoSuchProcess:
            continue
    # The prompt held the key: the children may log it (their output is theirs), but the
    # router's own lines must not carry it anywhere else.
    own = [line for line in router.log().splitlines()
           if KEY in line and not line.lstrip().startswith("[")]
    leaks += [f"router log: {line[:80]}" for line in own]
    record("key_leaks", {"places_scanned": len(answers) + 2 * len(children) + 1,
                         "leaks": len(leaks)})
    assert not leaks


def test_abandoned_requests_leave_the_router_serving(router: RouterProcess) -> None:
    """200 clients that send part of a request and go away (mid-headers, mid-body) do not
    take the router down or leave its connections open."""
    def abandon(i: int) -> None:
        data = authed("POST", "/tokenize", b'{"model": "alpha", "content": "x"}')
        with socket.create_connection(("127.0.0.1", router.port), timeout=5) as sock:
            sock.sendall(data[:len(data) * (i % 9 + 1) // 10])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(abandon, range(200)))
    with router.client(headers=AUTH) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/tokenize", json={"model": "alpha", "content": "x"}) \
            .status_code == 200
    connections = [c for c in psutil.Process(router.proc.pid).net_connections()
                   if c.laddr and c.laddr.port == router.port and c.status == "ESTABLISHED"]
    assert len(connections) < 20, len(connections)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)
NOT_A_MODEL = st.one_of(JSON, st.text().filter(lambda t: t.strip().lower() not in (
    "alpha", "beta", "gamma")))
PROPERTY_RUNS = {"bodies": 0}


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=st.dictionaries(st.text(max_size=12), JSON, max_size=6), model=NOT_A_MODEL,
       raw=st.binary(max_size=200), path=st.sampled_from(
           ["/v1/chat/completions", "/v1/completions", "/tokenize", "/models/load",
            "/models/unload", "/v1/embeddings"]))
def test_any_body_without_a_real_model_gets_an_envelope(router: RouterProcess,
                                                       body: dict[str, object], model: object,
                                                       raw: bytes, path: str) -> None:
    """Property: whatever JSON (or bytes) a client posts, a body naming no configured model
    is answered by the router itself with a 4xx envelope; it never reaches a child."""
    for data in (json.dumps({**body, "model": model}).encode(),
                 json.dumps({k: v for k, v in body.items() if k != "model"}).encode(), raw):
        answer = exchange(router.port, authed("POST", path, data,
                                              **{"Content-Type": "application/json"}))
        assert not answer.hung and answer.answers, data[:200]
        problem = judge(answer.answers[0])
        assert problem is None, (problem, data[:200])
        assert 400 <= answer.answers[0].status < 500, (answer.answers[0].status, data[:200])
        PROPERTY_RUNS["bodies"] += 1
    record("property_bodies", {"bodies": PROPERTY_RUNS["bodies"]})
