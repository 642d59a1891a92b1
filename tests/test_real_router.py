"""End to end against the real llama-server: the router as users run it, real HTTP clients."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support import alive, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def presets_for(tmp_path: Path, models: dict[str, Path], extra: str = "") -> Path:
    text = "version = 1\n[*]\nctx-size = 4096\nparallel = 2\n" + extra + "\n"
    for name in ("alpha", "beta", "gamma"):
        text += f"[{name}]\nmodel = {models[name]}\n"
    text += f"[embed]\nmodel = {models['embed']}\nembeddings = true\npooling = mean\n"
    text += f"[long]\nmodel = {models['long']}\nctx-size = 8192\nparallel = 1\n"
    return write_presets(tmp_path / "models.ini", text)


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> Path:
    return presets_for(tmp_path, tiny_models)


def loaded(router: object) -> list[str]:
    """The models holding a place against ``--models-max``: loading or loaded, not stopping
    (a stopping CPU child's place is the next load's at once)."""
    return [m for m, d in router.models().items()  # type: ignore[attr-defined]
            if d["status"]["value"] in ("loaded", "loading") and not d["status"].get("stopping")]


def test_models_max_evicts_least_recently_used(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "2") as router, \
            router.client() as client:
        for name in ("alpha", "beta", "alpha", "gamma"):
            response = client.post("/v1/chat/completions", json={"model": name, **CHAT})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"]
            assert len(loaded(router)) <= 2
        # beta was used less recently than alpha, so gamma replaced beta.
        status = {m: d["status"]["value"] for m, d in router.models().items()}
        assert status["alpha"] == "loaded"
        assert status["gamma"] == "loaded"
        assert status["beta"] == "unloaded"
        assert "failed" not in router.models()["beta"]["status"]
        assert wait_until(lambda: len([p for p in router.children()  # beta's has exited
                                       if "llama-server" in p.name()]) == 2, timeout=30.0)


def test_a_swap_starts_the_next_child_while_the_evicted_one_exits(tmp_path: Path,
                                                                  presets: Path) -> None:
    """Under ``--models-max 1`` the evicted CPU child's exit and the next model's load
    overlap: the next child is spawned before the old one is seen to stop, and both
    requests are answered."""
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router, \
            router.client() as client:
        for name in ("alpha", "beta"):
            response = client.post("/v1/chat/completions", json={"model": name, **CHAT})
            assert response.status_code == 200, response.text
        assert wait_until(lambda: "event=stopped model=alpha" in router.log(), timeout=30.0)
        log = router.log()
        assert log.index("event=evict model=alpha") < log.index("event=spawned model=beta") \
            < log.index("event=stopped model=alpha"), log
        status = {m: d["status"] for m, d in router.models().items()}
        assert status["beta"]["value"] == "loaded" and status["alpha"]["value"] == "unloaded"


def child_busy(client: httpx.Client, model: str) -> bool:
    """Whether any of the model's llama-server slots is processing (its own /slots)."""
    slots = client.get("/slots", params={"model": model}).json()
    return any(slot["is_processing"] for slot in slots)


def read_until_generating(chunks: Iterator[bytes]) -> bytes:
    """Read until a content token has arrived (the role chunk comes before decoding starts)."""
    received = b""
    while received.count(b'"content":"') < 2:
        received += next(chunks)
    return received


def _events(raw: bytes) -> list[dict[str, object] | str]:
    out: list[dict[str, object] | str] = []
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: "):
            continue
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _normalise(event: dict[str, object] | str) -> dict[str, object] | str:
    if isinstance(event, dict):
        return {k: v for k, v in event.items() if k not in ("id", "created", "timings")}
    return event


def test_stream_is_incremental_and_identical_to_the_child(tmp_path: Path,
                                                          presets: Path) -> None:
    request = {"model": "long", "stream": True, "max_tokens": 8000, "ignore_eos": True,
               "temperature": 0, "seed": 1,
               "messages": [{"role": "user", "content": "Tell me a story"}]}
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-accel-buffering"] == "no"
            chunks = response.iter_raw()
            first = read_until_generating(chunks)
            assert first.startswith(b"data: ")
            # The child is still generating while the client already holds the first chunk.
            assert wait_until(lambda: child_busy(client, "long"), timeout=5.0)
            via_router = first + b"".join(chunks)
        port = router.models()["long"]["status"]["port"]
        direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=request,
                            timeout=60).content
    routed_events, direct_events = _events(via_router), _events(direct)
    assert routed_events[-1] == "[DONE]"
    assert len(routed_events) > 100
    assert [_normalise(e) for e in routed_events] == [_normalise(e) for e in direct_events]


def test_client_disconnect_frees_the_slot(tmp_path: Path, presets: Path) -> None:
    request = {"model": "long", "stream": True, "max_tokens": 8000, "ignore_eos": True,
               "messages": [{"role": "user", "content": "Go on"}]}
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=request) as response:
            chunks = response.iter_raw()  # keep a reference: a dropped iterator closes it
            first = read_until_generating(chunks)
            assert first.startswith(b"data: ")
            assert wait_until(lambda: child_busy(client, "long"), timeout=5.0)
        assert wait_until(lambda: not child_busy(client, "long"), timeout=30.0)
        assert router.models()["long"]["status"]["in_flight"] == 0
        # The child stopped when the router closed the stream, not at the end of the 8000
        # tokens it was asked for (what llama-server predicted is in its own metrics).
        metrics = client.get("/metrics", params={"model": "long"}).text
        predicted = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("llamacpp:tokens_predicted_total"))
        assert predicted < 8000, predicted


def test_client_disconnect_closes_the_connection_of_a_non_streamed_request(
        tmp_path: Path, presets: Path) -> None:
    """No response has started yet, so only the router's disconnect watch can notice. It
    closes its connection to the child (which then stops generating:
    ``test_cancellation_real.py``) and releases the request."""
    request = json.dumps({"model": "long", "max_tokens": 8000, "ignore_eos": True,
                          "messages": [{"role": "user", "content": "Go on"}]}).encode()
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        client.post("/tokenize", json={"model": "long", "content": "x"})  # loaded
        child = psutil.Process(router.models()["long"]["status"]["pid"])  # type: ignore[index]

        def closed_by_the_router() -> bool:  # the child's end waits for its own close
            return any(c.status == psutil.CONN_CLOSE_WAIT for c in child.net_connections("tcp"))

        with socket.create_connection(("127.0.0.1", router.port)) as raw:
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(request), request))
            assert wait_until(lambda: child_busy(client, "long"), timeout=5.0)
            assert router.models()["long"]["status"]["in_flight"] == 1  # type: ignore[index]
            assert not closed_by_the_router()
        assert wait_until(lambda: closed_by_the_router() or not child_busy(client, "long"),
                          timeout=30.0)
        assert wait_until(
            lambda: router.models()["long"]["status"]["in_flight"] == 0,  # type: ignore[index]
            timeout=30.0)
        # Counted as the client's leaving (499), not as a server error.
        counted = client.get("/metrics").text
        assert ('llamarouter_requests_total{endpoint="/v1/chat/completions",model="long",'
                'status="499"} 1.0') in counted, counted
        assert 'status="500"' not in counted


def test_more_concurrent_requests_than_the_child_has_http_threads(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """llama-server may leave a connection beyond its fixed HTTP threads waiting until another
    one closes (up to its 5 s keep-alive timeout): the threads it counted as idle are about to
    take earlier connections, so it starts no extra thread. The router keeps its connections
    within the child's threads, so a burst never waits for that."""
    presets = write_presets(tmp_path / "models.ini", f"""
[small]
model = {tiny_models["long"]}
ctx-size = 8192
parallel = 1
threads-http = 4
""")
    # Short generations: a burst takes well under a second even on a loaded machine, so the
    # 5 s stall stands out (directly against the child the first burst still takes 5.1 s).
    request = {"model": "small", "max_tokens": 20, "ignore_eos": True,
               "messages": [{"role": "user", "content": "Hi"}]}

    async def bursts(url: str) -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client:
            await client.post("/tokenize", json={"model": "small", "content": "x"})

            async def one(started: float) -> float:
                response = await client.post("/v1/chat/completions", json=request)
                assert response.status_code == 200, response.text
                return time.monotonic() - started

            slowest = []
            for _ in range(3):
                started = time.monotonic()
                slowest.append(max(await asyncio.gather(*(one(started) for _ in range(12)))))
            return slowest

    with start_router(tmp_path, "--presets", str(presets)) as router:
        assert max(asyncio.run(bursts(router.url))) < 3.0
        args = router.models()["small"]["status"]["args"]  # the preset's value, once
        assert args.count("--threads-http") == 1  # type: ignore[union-attr]
        assert args[args.index("--threads-http") + 1] == "4"  # type: ignore[union-attr]


def test_openai_sdk(tmp_path: Path, presets: Path) -> None:
    openai = pytest.importorskip("openai")
    with start_router(tmp_path, "--presets", str(presets)) as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
        ids = {m.id for m in client.models.list()}
        assert {"alpha", "beta", "gamma", "embed"} <= ids
        reply = client.chat.completions.create(model="beta", max_tokens=4, **{
            "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.choices[0].message.content
        assert reply.model == "beta"
        stream = client.chat.completions.create(model="beta", max_tokens=6, stream=True,
                                                messages=[{"role": "user", "content": "Hi"}])
        pieces = [c.choices[0].delta.content for c in stream if c.choices and
                  c.choices[0].delta.content]
        assert len(pieces) >= 2
        embedding = client.embeddings.create(model="embed", input=["hello", "world"])
        assert len(embedding.data) == 2
        assert len(embedding.data[0].embedding) == 64
        client.close()


def test_concurrent_requests_share_one_spawn(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router:
        results: list[int] = []

        def chat() -> None:
            with router.client() as client:
                results.append(client.post("/v1/chat/completions",
                                           json={"model": "gamma", **CHAT}).status_code)

        threads = [threading.Thread(target=chat) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == [200] * 6
        assert router.log().count("event=spawned model=gamma") == 1


def test_every_endpoint_passes_through(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        model = {"model": "alpha"}
        tokens = client.post("/tokenize", json={**model, "content": "hello"})
        assert tokens.status_code == 200 and tokens.json()["tokens"]
        text = client.post("/detokenize", json={**model, "tokens": tokens.json()["tokens"]})
        assert text.json()["content"] == "hello"
        for path, body in [
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
            ("/completion", {"prompt": "Hi", "n_predict": 2}),
            ("/completions", {"prompt": "Hi", "max_tokens": 2}),
            ("/chat/completions", CHAT),
            ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
            ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
            ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
            ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
        ]:
            response = client.post(path, json={**model, **body})
            assert response.status_code == 200, (path, response.text)
        for path in ("/slots", "/props", "/metrics", "/lora-adapters"):
            response = client.get(path, params=model)
            assert response.status_code == 200, (path, response.text)
        # The child's own errors pass through untouched (this model has no FIM tokens).
        infill = client.post("/infill", json={**model, "input_prefix": "def f(",
                                               "input_suffix": ")", "n_predict": 2})
        assert infill.status_code == 501
        assert "Infill is not supported" in infill.json()["error"]["message"]
        metrics = client.get("/metrics", params=model).text
        assert "llamacpp:tokens_predicted_total" in metrics
        embed = client.post("/v1/embeddings", json={"model": "embed", "input": "hi"})
        assert embed.status_code == 200 and len(embed.json()["data"][0]["embedding"]) == 64
        embed = client.post("/embeddings", json={"model": "embed", "content": "hi"})
        assert embed.status_code == 200


def test_router_endpoints_have_llama_cpp_shapes(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        props = client.get("/props").json()
        assert props["role"] == "router"
        assert props["build_info"] == "b11434"
        assert client.post("/models/load", json={"model": "beta"}).json() == {"success": True}
        assert wait_until(lambda: router.models()["beta"]["status"]["value"] == "loaded", 30)
        again = client.post("/models/load", json={"model": "beta"})
        assert again.status_code == 400
        listing = client.get("/v1/models").json()
        assert listing["object"] == "list"
        beta = next(m for m in listing["data"] if m["id"] == "beta")
        assert beta["meta"]["n_embd"] == 64
        assert "--port" in beta["status"]["args"]
        assert beta["source"] == "preset"
        pid = beta["status"]["pid"]
        assert client.post("/models/unload", json={"model": "beta"}).json() == {"success": True}
        assert router.models()["beta"]["status"]["value"] == "unloaded"
        assert not alive(pid)
        assert client.post("/models/unload", json={"model": "beta"}).status_code == 400


def test_bad_requests_get_envelopes(tmp_path: Path, presets: Path,
                                    tiny_models: dict[str, Path]) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    extra = write_presets(tmp_path / "broken.ini", f"[broken]\nmodel = {broken}\n")
    env = {"LLAMA_ROUTER_MAX_BODY_BYTES": "4096"}
    with start_router(tmp_path, "--presets", str(presets), "--presets", str(extra),
                      env=env) as router, router.client() as client:

        def check(response: httpx.Response, status: int, type_: str) -> str:
            assert response.status_code == status, response.text
            body = response.json()["error"]
            assert body["code"] == status and body["type"] == type_
            return str(body["message"])

        check(client.post("/v1/chat/completions", json=CHAT), 400, "invalid_request_error")
        message = check(client.post("/v1/chat/completions", json={"model": "alpah", **CHAT}),
                        404, "not_found_error")
        assert "alpha" in message
        check(client.post("/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"}),
              400, "invalid_request_error")
        check(client.post("/v1/chat/completions",
                          json={"model": "alpha", "prompt": "x" * 10_000}),
              413, "invalid_request_error")
        message = check(client.post("/v1/chat/completions", json={"model": "broken", **CHAT}),
                        503, "unavailable_error")
        assert "exit" in message and "last log line" in message
        status = router.models()["broken"]["status"]
        assert status["failed"] is True and status["exit_code"] != 0
        check(client.get("/no/such/route"), 404, "not_found_error")
        # The router is still serving.
        assert client.post("/v1/chat/completions",
                           json={"model": "alpha", **CHAT}).status_code == 200


def test_api_keys(tmp_path: Path, presets: Path) -> None:
    secret, file_secret = "s3cret-key-1", "file-key-2"
    key_file = tmp_path / "keys"
    key_file.write_text(f"# comment\n{file_secret}\n")
    env = {"LLAMA_API_KEY": "inherited-secret", "HF_TOKEN": "hf_inherited",
           "HUGGING_FACE_HUB_TOKEN": "hf_inherited_too"}
    with start_router(tmp_path, "--presets", str(presets), "--api-key", secret,
                      "--api-key-file", str(key_file), env=env) as router, \
            router.client() as client:
        assert client.get("/health").status_code == 200
        denied = client.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}
                          ).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"}
                          ).status_code == 200
        response = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT},
                               headers={"X-Api-Key": file_secret})
        assert response.status_code == 200
        child = next(p for p in router.children() if "llama-server" in p.name())
        cmdline = " ".join(child.cmdline())
        environ = child.environ()
        for key in (secret, file_secret, "inherited-secret", "hf_inherited", "hf_inherited_too"):
            assert key not in cmdline
            assert key not in " ".join(environ.values())
            assert key not in router.log()


def test_sigkill_of_the_router_takes_its_children(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        for name in ("alpha", "beta"):
            assert client.post("/v1/chat/completions",
                               json={"model": name, **CHAT}).status_code == 200
        children = [p for p in router.children() if "llama-server" in p.name()]
        assert len(children) == 2
        router.proc.send_signal(signal.SIGKILL)
        router.proc.wait()
        assert wait_until(lambda: not any(alive(p.pid) for p in children), timeout=2.0)


def test_sigkill_of_the_router_takes_a_paused_child(tmp_path: Path, presets: Path) -> None:
    # A ready child also ends on the end of its stdin; a paused one (CPU sharing stops
    # children with SIGSTOP) cannot read it: only the parent-death signal ends it.
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "alpha", **CHAT}).status_code == 200
        child = next(p for p in router.children() if "llama-server" in p.name())
        child.suspend()
        router.proc.send_signal(signal.SIGKILL)
        router.proc.wait()
        assert wait_until(lambda: not alive(child.pid), timeout=5.0)


def test_load_on_startup_and_autoload_off(tmp_path: Path, tiny_models: dict[str, Path],
                                          llama_server: Path) -> None:
    presets = presets_for(tmp_path, tiny_models)
    text = presets.read_text().replace("[beta]\n", "[beta]\nload-on-startup = true\n")
    presets.write_text(text)
    with start_router(tmp_path, "--presets", str(presets), "--no-models-autoload") as router, \
            router.client() as client:
        assert wait_until(lambda: router.models()["beta"]["status"]["value"] == "loaded", 30)
        assert client.post("/v1/chat/completions",
                           json={"model": "beta", **CHAT}).status_code == 200
        refused = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
        assert refused.status_code == 400  # as llama.cpp's router answers
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert "not loaded" in refused.json()["error"]["message"]
        # ?autoload=true overrides per request.
        allowed = client.post("/v1/chat/completions?autoload=true",
                              json={"model": "alpha", **CHAT})
        assert allowed.status_code == 200


def test_pass_through_args_override_presets(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), child_args=("--ctx-size", "2048")
                      ) as router, router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "alpha", **CHAT}).status_code == 200
        props = client.get("/props", params={"model": "alpha"}).json()
        assert props["default_generation_settings"]["n_ctx"] == 1024  # 2048 over 2 slots
        args = router.models()["alpha"]["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "2048"


def test_children_are_in_their_own_process_group(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        assert client.post("/v1/chat/completions",
                           json={"model": "alpha", **CHAT}).status_code == 200
        child = next(p for p in router.children() if "llama-server" in p.name())
        import os

        assert os.getpgid(child.pid) == child.pid
        assert os.getpgid(child.pid) != os.getpgid(router.proc.pid)
        assert psutil.Process(child.pid).ppid() == router.proc.pid


def test_requests_after_streams_never_get_a_dead_connection(tmp_path: Path,
                                                            presets: Path) -> None:
    # llama-server closes the connection after each streamed response; the router must not
    # hand that connection to the next request (that showed as sporadic 502s).
    stream = {"model": "alpha", "stream": True, "max_tokens": 3,
              "messages": [{"role": "user", "content": "x"}]}
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        statuses = []
        for _ in range(60):
            statuses.append(client.post("/v1/chat/completions", json=stream).status_code)
            statuses.append(client.post("/tokenize", json={"model": "alpha",
                                                           "content": "hi"}).status_code)
        assert statuses == [200] * 120
