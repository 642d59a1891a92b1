"""Every policy on every request shape, against the real llama-server: the lesson of red-team
pass 6. A policy that reads how the router happened to read a body holds only for the shapes
its author tried; each cell here asserts the same decision for one shape of one endpoint.

The shapes: JSON under and over the scan threshold (``requests.SMALL_JSON_BYTES``), with no
content type, as a form's media type, chunked, with ``id_slot`` named (each slot, ``null``,
escaped), and multipart in llama-server's spelling and in others. The endpoints: chat,
completions, ``/completion``, ``/v1/responses``, ``/v1/messages``, ``/infill``, embeddings.

* **Privacy** (keys and ``--state-dir``): another key's cached prompt never serves a request,
  whatever its shape: bob's request with alice's very prompt gets none of it from the cache
  (the cached tokens each endpoint reports), and every slot records its owner, short prompts
  too.
* **Scope**: a key scoped to one model is never served by another, whatever body and query
  name, and nothing else loads.
* **Metering**: what a request is charged is what the child did, whatever the answer was asked
  to show (``response_fields``), on every endpoint (``GET /usage``).
* **Teams' defaults**: keys without ``name=`` are teams of their own, ``key-N`` by their line.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, write_presets

from router.llama.tinymodel import write_tiny_model

pytestmark = pytest.mark.real

GUARD_S = 120.0  # a hang guard, never a measurement
LARGE_PAD = 300 * 1024  # pushes a body past the scan threshold (256 KiB)
KEYS = ("sk-ops-0123456789 name=ops\n"
        "sk-alice-0123456789 role=infer\n"
        "sk-bob-0123456789 role=infer\n"
        "sk-pub-0123456789 role=infer models=pub\n"
        + "".join(f"sk-tpm-{n}-0123456789 role=infer tokens-per-minute=400\n"
                  for n in range(32)))  # a team of its own for each cell
OPS, ALICE, BOB, PUB = ("sk-ops-0123456789", "sk-alice-0123456789", "sk-bob-0123456789",
                        "sk-pub-0123456789")
TPM_CELLS = iter(range(32))
ENDPOINTS = ("/completion", "/v1/completions", "/v1/chat/completions", "/v1/responses",
             "/v1/messages", "/infill")
SHAPES = ("small", "large", "no-type", "form", "chunked", "id_slot-0", "id_slot-1",
          "id_slot-null", "id_slot-escaped")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, llama_server: Path
           ) -> Iterator[RouterProcess]:
    """One router for every cell: ``pub`` (two slots, fill-in-the-middle tokens for
    ``/infill``), ``secret`` and ``embed``; four keys, three of them with no ``name=``."""
    tmp = tmp_path_factory.mktemp("matrix")
    pub = write_tiny_model(tmp / "pub.gguf", seed=11, name="pub", fim=True)
    secret = write_tiny_model(tmp / "secret.gguf", seed=12, name="secret")
    embed = write_tiny_model(tmp / "embed.gguf", seed=13, name="embed")
    presets = write_presets(tmp / "m.ini", "[*]\nctx-size = 4096\n"
                            f"[pub]\nmodel = {pub}\nparallel = 2\n"
                            f"[secret]\nmodel = {secret}\nparallel = 1\n"
                            f"[embed]\nmodel = {embed}\nembeddings = true\npooling = mean\n")
    keys = tmp / "keys"
    keys.write_text(KEYS)
    with start_router(tmp, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys), "--state-dir", str(tmp / "state"),
                      "--models-max", "3") as running:
        yield running


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status_of(router: RouterProcess, model: str) -> str:
    with router.client() as client:
        data = client.get("/models", headers=auth(OPS)).json()["data"]
    return str(next(m for m in data if m["id"] == model)["status"]["value"])


def body_of(endpoint: str, model: str, text: str, **more: Any) -> dict[str, Any]:
    """A request of ``endpoint`` whose prompt is ``text``, generating one token."""
    fields: dict[str, Any]
    if endpoint in ("/completion", "/v1/completions"):
        fields = {"prompt": text, "max_tokens": 1}
    elif endpoint == "/infill":
        fields = {"input_prefix": text, "input_suffix": "\n", "prompt": "", "n_predict": 1}
    elif endpoint == "/v1/responses":
        fields = {"input": text, "max_output_tokens": 1}
    else:  # chat and Anthropic's messages
        fields = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return {"model": model, "temperature": 0, **fields, **more}


def send(client: httpx.Client, endpoint: str, body: dict[str, Any], shape: str, key: str,
         query: str = "") -> httpx.Response:
    """POST ``body`` to ``endpoint`` in ``shape``."""
    headers = auth(key)
    raw = json.dumps(body).encode()
    if shape == "large":
        raw = json.dumps({**body, "pad": "p" * LARGE_PAD}).encode()
    elif shape.startswith("id_slot-"):
        value = shape.removeprefix("id_slot-")
        if value == "escaped":  # a key llama-server decodes: the router reads the same
            raw = raw[:-1] + b', "id\\u005fslot": 0}'
        else:
            raw = json.dumps({**body, "id_slot": None if value == "null" else int(value)}
                             ).encode()
    if shape == "no-type":
        return client.post(endpoint + query, content=raw, headers=headers)
    if shape == "form":
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif shape == "chunked":
        return client.post(endpoint + query, content=iter([raw[:7], raw[7:]]),
                           headers={**headers, "Content-Type": "application/json"})
    else:
        headers["Content-Type"] = "application/json"
    return client.post(endpoint + query, content=raw, headers=headers)


def cached(answer: dict[str, Any]) -> int:
    """The prompt tokens an answer says came from the cache, in its endpoint's own words."""
    if "timings" in answer:
        return int(answer["timings"]["cache_n"])
    usage = answer["usage"]
    if "cache_read_input_tokens" in usage:  # Anthropic's messages
        return int(usage["cache_read_input_tokens"])
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
    return int(details["cached_tokens"])


def prompt_of(answer: dict[str, Any]) -> int:
    """The prompt tokens an answer counts (computed and cached)."""
    if "timings" in answer:
        return int(answer["timings"]["prompt_n"]) + int(answer["timings"]["cache_n"])
    usage = answer["usage"]
    return int(usage.get("prompt_tokens", usage.get("input_tokens", 0))) + \
        int(usage.get("cache_read_input_tokens", 0))


def unique(length: int) -> str:
    """A prompt no other cell sent (its start differs), of about ``length`` characters."""
    tag = secrets.token_hex(8)
    return (f"[{tag}] the quick brown fox jumps over the lazy dog. " * (length // 50))[:length]


@pytest.mark.parametrize("length", [300, 1500])  # a short prompt has no prefix keys
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_no_key_is_served_another_keys_cached_prompt(router: RouterProcess, endpoint: str,
                                                     shape: str, length: int) -> None:
    text = unique(length)
    with router.client() as client:
        mine = send(client, endpoint, body_of(endpoint, "pub", text), "small", ALICE)
        assert mine.status_code == 200, mine.text
        again = send(client, endpoint, body_of(endpoint, "pub", text), "small", ALICE)
        assert again.status_code == 200, again.text
        # (alice's own next turn may come from her cache: the cache works in this cell)
        theirs = send(client, endpoint, body_of(endpoint, "pub", text), shape, BOB)
        assert theirs.status_code == 200, theirs.text
        answer = theirs.json()
    assert prompt_of(answer) >= prompt_of(mine.json()) - 1, (answer, mine.json())
    assert cached(answer) < 16, (endpoint, shape, answer)  # at most the template's start
    assert prompt_of(mine.json()) > length // 4


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_own_conversation_is_warm_on_every_endpoint(router: RouterProcess,
                                                    endpoint: str) -> None:
    """The other side of the privacy cells: a key's own next turn comes from the cache, so
    that those cells' zero could fail."""
    text = unique(1500)
    with router.client() as client:
        first = send(client, endpoint, body_of(endpoint, "pub", text), "small", ALICE)
        second = send(client, endpoint, body_of(endpoint, "pub", text), "large", ALICE)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert cached(second.json()) >= prompt_of(first.json()) // 2, second.json()


@pytest.mark.parametrize("media", ["multipart/form-data", "Multipart/Form-Data",
                                   "MULTIPART/FORM-DATA", "multipart/form-dataX",
                                   "multipart/mixed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_body_that_cannot_be_placed_or_could_be_read_two_ways_is_refused(
        router: RouterProcess, endpoint: str, media: str) -> None:
    """A multipart body cannot carry the slot the router places a keyed completion in (each
    form field reaches llama-server as a string): refused, 400; any other multipart
    spelling llama-server would read as JSON while the router took it as a form: refused,
    400, before anything loads."""
    json_body = json.dumps(body_of(endpoint, "secret", unique(300))).encode()
    form = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\npub\r\n'
            b'--zz\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhello\r\n--zz--\r\n')
    with router.client() as client:
        for content in (json_body, form):
            answer = client.post(f"{endpoint}?model=pub", content=content,
                                 headers={**auth(PUB), "Content-Type": f"{media}; boundary=zz"})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["type"] == "invalid_request_error"
    assert status_of(router, "secret") == "unloaded"


@pytest.mark.parametrize("shape", [s for s in SHAPES if not s.startswith("id_slot-")])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_scoped_key_is_never_served_by_another_model(router: RouterProcess, endpoint: str,
                                                       shape: str) -> None:
    """The key may use ``pub`` only: a body naming ``secret`` is refused whatever its shape,
    and whatever the query names (a 404: outside its scope no model exists for a key);
    ``secret`` never loads."""
    with router.client() as client:
        answer = send(client, endpoint, body_of(endpoint, "secret", unique(300)), shape, PUB,
                      query="?model=pub")
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"] == "model 'secret' not found"
    assert status_of(router, "secret") == "unloaded"


def usage_of(client: httpx.Client, name: str) -> tuple[int, int, int]:
    """A team's requests, prompt and generated tokens, over every model."""
    rows = [row for row in client.get("/usage", headers=auth(OPS)).json()["usage"]
            if row["name"] == name]
    return (sum(r["requests"] for r in rows), sum(r["prompt_tokens"] for r in rows),
            sum(r["completion_tokens"] for r in rows))


@pytest.mark.parametrize("fields", [None, ["content"], ["index"]])
@pytest.mark.parametrize("shape", ["small", "large", "chunked", "no-type"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_request_is_charged_what_the_child_did(router: RouterProcess, endpoint: str,
                                                 shape: str, fields: list[str] | None) -> None:
    """Whatever the answer is asked to show (``response_fields``), the usage counts what the
    child computed and generated; and bob (line 3, no ``name=``) is a team of his own."""
    more = {"response_fields": fields} if fields else {}
    body = body_of(endpoint, "pub", unique(600), **more)
    with router.client() as client:
        before = usage_of(client, "key-3")
        alice_before = usage_of(client, "key-2")
        answer = send(client, endpoint, body, shape, BOB)
        assert answer.status_code == 200, answer.text
        after = usage_of(client, "key-3")
        alice_after = usage_of(client, "key-2")
    assert alice_after == alice_before  # another team's row
    assert after[0] == before[0] + 1
    assert after[1] - before[1] >= prompt_of(answer.json()) - 16 > 100, (before, after)
    # (the answer counts: the child's whole answer, whatever fields it was asked to show)
    assert after[2] - before[2] >= 1, (before, after, answer.json())


@pytest.mark.parametrize("endpoint", ["/v1/embeddings", "/embedding", "/embeddings"])
def test_embeddings_are_charged(router: RouterProcess, endpoint: str) -> None:
    with router.client() as client:
        before = usage_of(client, "key-3")
        answer = client.post(endpoint, headers=auth(BOB),
                             json={"model": "embed", "input": unique(400),
                                   "content": unique(400)})
        assert answer.status_code == 200, answer.text
        after = usage_of(client, "key-3")
    assert after[0] == before[0] + 1 and after[1] - before[1] >= 50, (before, after)


@pytest.mark.parametrize("shape", ["small", "large", "chunked"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_one_request_cannot_overrun_its_teams_tokens_a_minute(router: RouterProcess,
                                                              endpoint: str, shape: str) -> None:
    """A team of 400 tokens a minute asks for 3,000 tokens that never stop (``ignore_eos``):
    the child generates at most a minute's worth less the prompt's estimate."""
    body = body_of(endpoint, "pub", unique(200), ignore_eos=True, n_predict=3000,
                   max_tokens=3000, max_output_tokens=3000)
    with router.client() as client:
        answer = send(client, endpoint, body, shape, f"sk-tpm-{next(TPM_CELLS)}-0123456789")
    assert answer.status_code == 200, answer.text
    generated = answer.json()
    tokens = generated.get("tokens_predicted") or generated["usage"].get(
        "completion_tokens", generated["usage"].get("output_tokens"))
    assert 1 <= tokens <= 400 - 50, generated
