"""Scheduling with the real llama-server: swaps, budgets, crashes, memory, replicas, TTL."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import alive, fake_nvidia_smi, start_router, wait_until, write_presets

from router.host.cpus import machine_cores
from router.host.gpus import GpuDevice, placement
from router.host.memory import estimate_for_args

pytestmark = pytest.mark.real


def chat(model: str, tokens: int = 16) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Hello"}]}


def presets_for(tmp_path: Path, models: dict[str, Path], extra: dict[str, str] | None = None,
                names: tuple[str, ...] = ("alpha", "beta", "gamma")) -> Path:
    text = "[*]\nctx-size = 1024\nparallel = 2\n"
    for name in names:
        text += f"[{name}]\nmodel = {models[name]}\n{(extra or {}).get(name, '')}"
    return write_presets(tmp_path / "sched.ini", text)


def run_concurrently(router_url: str, bodies: list[dict[str, Any]],
                     headers: dict[str, str] | None = None) -> list[httpx.Response]:
    results: list[httpx.Response | None] = [None] * len(bodies)

    def one(i: int) -> None:
        with httpx.Client(base_url=router_url, timeout=120) as client:
            results[i] = client.post("/v1/chat/completions", json=bodies[i], headers=headers)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def test_alternating_requests_under_models_max_1_do_not_thrash(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = presets_for(tmp_path, tiny_models)
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router:
        bodies = [chat("alpha" if i % 2 == 0 else "beta", 32) for i in range(20)]
        responses = run_concurrently(router.url, bodies)
        for response, body in zip(responses, bodies, strict=True):
            assert response.status_code == 200, response.text
            reply = response.json()
            assert reply["model"] == body["model"]
            # Not cut mid-generation: every reply ran to its full length.
            assert reply["usage"]["completion_tokens"] == 32
            assert reply["choices"][0]["finish_reason"] == "length"
        swaps = router.log().count("event=evict")
        assert swaps <= 3, router.log()


def test_wait_budget_runs_out_while_a_busy_model_holds_the_slot(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    models = {**tiny_models, "alpha": tiny_models["long"]}
    # Context shift and no max_tokens: alpha's stream never ends by itself (a finite one, all
    # of it in the socket buffers of a client that reads nothing, could end before the
    # refusal on a busy machine: the slot would be free by then).
    presets = presets_for(tmp_path, models, {
        "alpha": "ctx-size = 512\nparallel = 1\ncontext-shift = true\n",
        "beta": "wait-budget = 1\n"})
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1",
                      "--fairness", "60") as router, router.client() as client:
        long = {"model": "alpha", "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Hello"}]}
        with client.stream("POST", "/v1/chat/completions", json=long) as stream:
            chunks = stream.iter_raw()
            next(chunks)
            refused = client.post("/v1/chat/completions", json=chat("beta"))
            assert refused.status_code == 503
            assert refused.headers["retry-after"]
            assert "wait budget of 1 s" in refused.json()["error"]["message"]
            # Refused while the busy model held the slot: its generation streams on.
            assert router.models()["alpha"]["status"]["in_flight"] == 1
            for _ in range(3):  # the running generation was not disturbed
                assert next(chunks)
        assert router.models()["beta"]["status"]["value"] == "unloaded"


def _stream_until_killed(router_url: str, model: str, kill: Any) -> bytes:
    body = {**chat(model, 8000), "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=router_url, timeout=60) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        received = next(chunks)
        kill()
        for chunk in chunks:
            received += chunk
    return received


def test_kill_9_during_a_stream_and_crash_loop(tmp_path: Path, tiny_models: dict[str, Path],
                                               llama_server: Path) -> None:
    # A long context, so the stream is still running when the child is killed.
    presets = presets_for(tmp_path, {**tiny_models, "alpha": tiny_models["long"]},
                          {"alpha": "ctx-size = 8192\nparallel = 1\n"})
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        for _ in range(5):
            assert client.post("/v1/chat/completions", json=chat("alpha")).status_code == 200
            pid = router.models()["alpha"]["status"]["pid"]
            received = _stream_until_killed(router.url, "alpha",
                                            lambda pid=pid: os.kill(pid, signal.SIGKILL))
            last_event = received.rstrip().split(b"\n\n")[-1]
            assert last_event.startswith(b"data: ")
            assert "error" in json.loads(last_event[len(b"data: "):]), last_event[-300:]
            assert client.get("/health").status_code == 200
            assert wait_until(lambda: router.models()["alpha"]["status"]["value"]
                              == "unloaded", 10)
            status = router.models()["alpha"]["status"]
            assert status["failed"] is True and status["exit_code"] == -9
        # Five crashes in a row: the model stays failed; no respawn loop.
        spawned = router.log().count("event=spawned model=alpha")
        refused = client.post("/v1/chat/completions", json=chat("alpha"))
        assert refused.status_code == 503
        assert "failed 5 times in a row" in refused.json()["error"]["message"]
        assert router.models()["alpha"]["status"]["crash_loop"] is True
        assert router.log().count("event=spawned model=alpha") == spawned
        # An explicit load clears the crash loop.
        assert client.post("/models/load?wait=true", json={"model": "alpha"}).status_code == 200
        assert client.post("/v1/chat/completions", json=chat("alpha")).status_code == 200


def test_memory_budget_evicts_by_bytes(tmp_path: Path, tiny_models: dict[str, Path],
                                       llama_server: Path) -> None:
    args = {"ctx-size": "1024", "parallel": "2"}
    estimate = estimate_for_args(tiny_models["alpha"], args)
    each = estimate.total_bytes  # includes the prompt cache the router allows the child
    budget = int(each * 2.5)  # two fit, three do not
    presets = presets_for(tmp_path, tiny_models)
    big = write_presets(tmp_path / "big.ini", f"[huge]\nmodel = {tiny_models['alpha']}\n"
                        "ctx-size = 100000000\n")
    with start_router(tmp_path, "--presets", str(presets), "--presets", str(big),
                      "--models-max", "0", "--memory-budget", str(budget)) as router, \
            router.client() as client:
        for name in ("alpha", "beta"):
            assert client.post("/v1/chat/completions", json=chat(name)).status_code == 200
        assert client.post("/v1/chat/completions", json=chat("gamma")).status_code == 200
        status = {m: d["status"]["value"] for m, d in router.models().items()}
        assert status["alpha"] == "unloaded"  # the least recently used idle one
        assert status["beta"] == "loaded" and status["gamma"] == "loaded"
        assert router.models()["gamma"]["status"]["memory"]["estimate"] == each
        argv = router.models()["gamma"]["status"]["args"]
        assert argv[argv.index("--cache-ram") + 1] == str(estimate.default_cache_ram_mib)
        started = time.monotonic()
        refused = client.post("/v1/chat/completions", json=chat("huge"))
        assert time.monotonic() - started < 30  # at once, not after the 120 s wait budget
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert "can never be loaded" in message and "memory budget is" in message
        assert router.models()["beta"]["status"]["value"] == "loaded"  # nothing was evicted


def test_gpu_budgets_evict_only_models_on_the_gpu_that_is_full(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Two GPUs (a fake nvidia-smi: this machine has none; the children are the real CPU
    llama-server, which accepts and ignores the GPU flags). Each GPU's budget fits two of the
    models by estimate."""
    env = fake_nvidia_smi(tmp_path, {
        "gpus": [[0, "GPU-a", "Fake GPU", 1000], [1, "GPU-b", "Fake GPU", 1000]],
        "per_process": {"name": "llama-server", "uuid": "GPU-a", "used_mib": 1}})

    args = {"ctx-size": "1024", "parallel": "2", "split-mode": "none"}
    devices = [GpuDevice(0, "GPU-a", "Fake GPU", 1000 << 20),
               GpuDevice(1, "GPU-b", "Fake GPU", 1000 << 20)]
    on_gpu = placement(estimate_for_args(tiny_models["alpha"], args), args, devices)["gpu0"]
    budget = int(on_gpu * 2.5)
    text = "[*]\nctx-size = 1024\nparallel = 2\nsplit-mode = none\n"
    for name, gpu in (("alpha", 0), ("beta", 0), ("gamma", 1), ("delta", 0)):
        model = tiny_models["embed" if name == "delta" else name]
        text += f"[{name}]\nmodel = {model}\nmain-gpu = {gpu}\n"
    text += f"[huge]\nmodel = {tiny_models['alpha']}\nctx-size = 100000000\n"
    presets = write_presets(tmp_path / "gpus.ini", text)
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "0",
                      "--memory-budget", "off", "--gpu-memory-budget",
                      f"0={budget},1={budget}", env=env) as router, router.client() as client:
        for name in ("alpha", "beta", "gamma"):
            assert client.post("/v1/chat/completions", json=chat(name)).status_code == 200
        status = {m: d["status"]["value"] for m, d in router.models().items()}
        assert [status[m] for m in ("alpha", "beta", "gamma")] == ["loaded"] * 3
        assert client.post("/v1/chat/completions", json=chat("delta")).status_code == 200
        status = {m: d["status"]["value"] for m, d in router.models().items()}
        assert status["alpha"] == "unloaded"  # least recently used on gpu0
        assert status["beta"] == status["gamma"] == status["delta"] == "loaded"  # gamma: gpu1

        memory = router.models()["gamma"]["status"]["memory"]
        assert memory["gpus"]["gpu1"]["estimate"] == on_gpu
        assert wait_until(lambda: router.models()["beta"]["status"]["memory"]["gpus"][
            "gpu0"].get("measured") == 1 << 20, timeout=10.0)  # the fake's 1 MiB per child
        assert 'llamarouter_model_gpu_memory_bytes{gpu="gpu0",model="beta"}' in \
            client.get("/metrics").text

        refused = client.post("/v1/chat/completions", json=chat("huge"))
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert "can never be loaded" in message and "on gpu0" in message
        assert "--gpu-memory-budget" in message
        assert "GPU 1: Fake GPU" in router.log()


def test_two_replicas_share_concurrent_streams(tmp_path: Path, tiny_models: dict[str, Path],
                                               llama_server: Path) -> None:
    # The router gives each replica its own cores: with llama.cpp's default thread count both
    # would spin on every core and crawl (3 tokens/s on 2 cores).
    presets = presets_for(tmp_path, tiny_models, {"alpha": "replicas = 2\n"},
                          names=("alpha",))
    with start_router(tmp_path, "--presets", str(presets)) as router:
        bodies = [{**chat("alpha", 200), "stream": True, "ignore_eos": True}
                  for _ in range(8)]
        responses = run_concurrently(router.url, bodies)
        assert all(r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
                   for r in responses)
        replicas = router.models()["alpha"]["status"]["replicas"]
        assert len(replicas) == 2 and len({r["pid"] for r in replicas}) == 2
        # each replica has half the machine (on 2 cores: one thread, free to move)
        assert [r["cpu"]["threads"] for r in replicas] == [max(len(machine_cores()) // 2, 1)] * 2
        spans = [set(r["cpu"]["cores"] or ()) for r in replicas]
        assert not spans[0] & spans[1]
        for replica in replicas:
            metrics = httpx.get(f"http://127.0.0.1:{replica['port']}/metrics").text
            line = next(x for x in metrics.splitlines()
                        if x.startswith("llamacpp:tokens_predicted_total"))
            assert float(line.split()[-1]) > 0, f"replica {replica['pid']} served nothing"


def test_a_crashed_replica_is_replaced_while_the_others_serve(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = presets_for(tmp_path, tiny_models, {"alpha": "replicas = 2\n"},
                          names=("alpha",))
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        assert client.post("/v1/chat/completions", json=chat("alpha")).status_code == 200
        before = [r["pid"] for r in router.models()["alpha"]["status"]["replicas"]]
        assert len(before) == 2
        os.kill(before[0], signal.SIGKILL)
        assert wait_until(lambda: "event=crashed" in router.log(), timeout=10.0)
        # The survivor serves while the replacement starts (or once it has: a tiny model
        # loads within milliseconds).
        assert client.post("/v1/chat/completions", json=chat("alpha")).status_code == 200

        def replaced() -> bool:
            replicas = router.models()["alpha"]["status"]["replicas"]
            return len(replicas) == 2 and before[0] not in {r["pid"] for r in replicas}

        assert wait_until(replaced, timeout=30.0)
        status = router.models()["alpha"]["status"]
        assert status["value"] == "loaded"
        assert before[1] in {r["pid"] for r in status["replicas"]}  # never restarted
        assert not alive(before[0])
        for replica in status["replicas"]:  # both answer
            assert httpx.get(f"http://127.0.0.1:{replica['port']}/health").status_code == 200
        # the replacement took the share its predecessor freed
        threads = max(len(machine_cores()) // 2, 1)
        assert [r["cpu"]["threads"] for r in status["replicas"]] == [threads, threads]
        assert "event=replica_restarted" in router.log()


def test_idle_ttl_unloads(tmp_path: Path, tiny_models: dict[str, Path],
                          llama_server: Path) -> None:
    presets = presets_for(tmp_path, tiny_models, {"alpha": "ttl = 1\n"})
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        assert client.post("/v1/chat/completions", json=chat("alpha")).status_code == 200
        assert client.post("/v1/chat/completions", json=chat("beta")).status_code == 200
        pid = router.models()["alpha"]["status"]["pid"]
        assert wait_until(lambda: router.models()["alpha"]["status"]["value"] == "unloaded",
                          10)
        assert not alive(pid)
        assert "event=idle_unload model=alpha" in router.log()
        assert router.models()["beta"]["status"]["value"] == "loaded"  # no ttl, no idle-timeout
