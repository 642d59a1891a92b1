"""Teams against the real llama-server: one slot, the router's queue in front of it.

Who gets the slot next (the interactive key before the batch key, whatever the arrival), a
quota's 429 that never reaches the child, a class asked above the key's (403), a client that
leaves while queued (its place freed, nothing charged), ``GET /usage`` with the figures the
clients were told, admin only, and the same after a restart."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

TIMEOUT = 60.0
KEYS = ("sk-gateway-0123456789 name=gw\n"
        "sk-alice-0123456789 name=alice priority=interactive role=infer\n"
        "sk-etl-0123456789 name=etl priority=batch max-concurrent=2 role=infer\n")
GW, ALICE, ETL = "sk-gateway-0123456789", "sk-alice-0123456789", "sk-etl-0123456789"
BATCH_TOKENS = 10_000  # long enough to be running when the interactive request comes
BATCH_GUARD_S = 600.0  # a hang guard for it, run twice on two busy cores


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def ask(router: RouterProcess, key: str, text: str, done: list[str] | None = None,
        headers: dict[str, str] | None = None) -> httpx.Response:
    with router.client() as client:
        response = client.post(
            "/v1/chat/completions", headers=auth(key, **(headers or {})),
            json={"model": "m", "max_tokens": 8,
                  "messages": [{"role": "user", "content": text}]})
    if done is not None:
        done.append(text)
    return response


def status(router: RouterProcess) -> dict[str, Any]:
    with router.client() as client:
        data = client.get("/models", headers=auth(GW)).json()["data"]
    found: dict[str, Any] = next(m for m in data if m["id"] == "m")["status"]
    return found


def usage(router: RouterProcess, key: str = GW, form: str = "json") -> httpx.Response:
    with router.client() as client:
        return client.get(f"/usage?format={form}", headers=auth(key))


@pytest.mark.real
def test_one_slot_shared_by_teams(tmp_path: Path, tiny_models: dict[str, Path],
                                  llama_server: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 512\nparallel = 1\ncontext-shift = true\n")
    args = ("--presets", str(presets), "--llama-server", str(llama_server), "--api-key-file",
            str(keys), "--state-dir", str(tmp_path / "state"))
    with start_router(tmp_path, *args) as router:
        told = queue_behind_a_stream(router)
        rows = {row["name"]: row for row in usage(router).json()["usage"]}
        assert usage(router).json()["kept"] is True
        assert usage(router, ALICE).status_code == 403  # role=infer: no usage
        csv = usage(router, form="csv")
        assert csv.headers["content-type"].startswith("text/csv")
        assert "sk-" not in csv.text and "sk-" not in router.log()
    assert rows["alice"]["requests"] == 1  # the one that left while queued is not counted
    assert (rows["alice"]["prompt_tokens"], rows["alice"]["completion_tokens"]) == told
    assert rows["alice"]["queue_seconds"] > 0
    assert (rows["etl"]["requests"], rows["etl"]["refusals"]) == (2, 1)
    assert rows["gw"]["requests"] == 1 and rows["gw"]["completion_tokens"] > 0
    with start_router(tmp_path, *args) as router:  # the usage survives a restart
        again = {row["name"]: row for row in usage(router).json()["usage"]}
    assert again == rows


def queue_behind_a_stream(router: RouterProcess) -> tuple[int, int]:
    """An endless stream holds the one slot; two batch requests, then an interactive one,
    queue behind it; a third batch request is over its team's max-concurrent; another
    interactive one leaves while queued. When the stream ends, the interactive request runs
    first. What alice's client was told of its usage."""
    body = {"model": "m", "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on"}]}
    done: list[str] = []
    with router.client() as client, ThreadPoolExecutor(4) as pool, \
            client.stream("POST", "/v1/chat/completions", json=body,
                          headers=auth(GW)) as stream:
        chunks = stream.iter_raw()
        next(chunks)
        batch = [pool.submit(ask, router, ETL, f"batch {n}", done) for n in range(2)]
        assert wait_until(lambda: status(router)["waiting"] == 2, TIMEOUT)
        over = ask(router, ETL, "one too many")
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        assert "max-concurrent=2" in over.json()["error"]["message"]
        higher = ask(router, ETL, "me first", headers={"x-llama-router-priority": "interactive"})
        assert higher.status_code == 403
        interactive: Future[httpx.Response] = pool.submit(ask, router, ALICE, "hi", done)
        assert wait_until(lambda: status(router)["waiting"] == 3, TIMEOUT)
        leaves = threading.Thread(target=leave_while_queued, args=(router,))
        leaves.start()
        assert wait_until(lambda: status(router)["waiting"] == 4, TIMEOUT)
        leaves.join(TIMEOUT)
        assert wait_until(lambda: status(router)["waiting"] == 3, TIMEOUT)
        for _ in range(3):
            next(chunks)
        assert status(router)["in_flight"] == 1  # nothing more reached the child
    answers = [f.result(TIMEOUT) for f in (interactive, *batch)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert done[0] == "hi" and sorted(done[1:]) == ["batch 0", "batch 1"]
    told = answers[0].json()["usage"]
    return told["prompt_tokens"], told["completion_tokens"]


def leave_while_queued(router: RouterProcess) -> None:
    with router.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", headers=auth(ALICE), timeout=httpx.Timeout(
            TIMEOUT, read=1.0), json={"model": "m", "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "bye"}]})


@pytest.mark.real
def test_tokens_a_minute_settle_what_was_used(tmp_path: Path, tiny_models: dict[str, Path],
                                              llama_server: Path) -> None:
    """A request may take a full bucket, but no more: its generation is capped at a minute's
    worth less its prompt's estimate, whatever limit it asked for; the next waits for the
    bucket to fill (429 with the seconds it takes), and never reaches the child meanwhile."""
    keys = tmp_path / "keys"
    keys.write_text("sk-small-0123456789 name=small tokens-per-minute=60\n")
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {tiny_models['alpha']}\n"
                            "ctx-size = 512\nparallel = 1\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys)) as router, router.client() as client:
        body = {"model": "m", "max_tokens": 100, "ignore_eos": True,
                "messages": [{"role": "user", "content": "count"}]}
        first = client.post("/v1/chat/completions", json=body,
                            headers=auth("sk-small-0123456789"))
        assert first.status_code == 200
        used = first.json()["usage"]
        estimate = len(first.request.content) / 4  # the body's bytes over 4
        assert 0 < used["completion_tokens"] <= 60 - estimate + 1  # not the 100 it asked
        second = client.post("/v1/chat/completions", json=body,
                             headers=auth("sk-small-0123456789"))
        assert second.status_code == 429
        assert int(second.headers["retry-after"]) > 30  # the debt, at one token a second
        assert "tokens-per-minute=60" in second.json()["error"]["message"]
    # Read once the router has stopped: the child's lines reach its log asynchronously.
    assert router.log().count("launch_slot_") == 1  # the refused one never reached the child


@pytest.mark.real
def test_an_interactive_request_takes_the_slot_back_from_a_batch_one(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """One slot, a long batch request that is not streamed (nothing goes to its client
    before its end): an interactive request takes the slot back at once, and the batch
    request runs again after it, whole, its client none the wiser."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 512\nparallel = 1\ncontext-shift = true\n")
    done: list[str] = []
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys)) as router, ThreadPoolExecutor(2) as pool:
        def batch() -> httpx.Response:  # ~0.6 s on a quiet machine, twice: a hang guard only
            with httpx.Client(base_url=router.url,
                              timeout=httpx.Timeout(TIMEOUT, read=BATCH_GUARD_S)) as client:
                answer = client.post("/v1/chat/completions", headers=auth(ETL), json={
                    "model": "m", "max_tokens": BATCH_TOKENS, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "a long job"}]})
            done.append("batch")
            return answer

        long_job = pool.submit(batch)
        assert wait_until(lambda: status(router)["in_flight"] == 1, TIMEOUT)
        quick = ask(router, ALICE, "a quick question", done)
        answer = long_job.result(BATCH_GUARD_S + TIMEOUT)
    log = router.log()  # once the router has stopped: every line is in
    assert quick.status_code == 200 and answer.status_code == 200, answer.text
    assert done == ["a quick question", "batch"]
    assert answer.json()["usage"]["completion_tokens"] == BATCH_TOKENS  # whole, run again
    assert "event=preempted" in log and "Traceback" not in log


@pytest.mark.real
def test_a_slot_kept_for_the_interactive_class(tmp_path: Path, tiny_models: dict[str, Path],
                                               llama_server: Path) -> None:
    """Two slots, ``interactive-slots = 1``: a batch stream holds one, the next batch request
    waits in the router though a slot is free, and an interactive request takes that slot at
    once and is answered while the stream runs; the waiting batch request runs once the
    stream ends."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 1024\nparallel = 2\ninteractive-slots = 1\n"
                            "context-shift = true\n")
    body = {"model": "m", "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on"}]}
    with start_router(tmp_path, "--presets", str(presets), "--llama-server", str(llama_server),
                      "--api-key-file", str(keys)) as router, \
            router.client() as client, ThreadPoolExecutor(1) as pool, \
            client.stream("POST", "/v1/chat/completions", json=body,
                          headers=auth(ETL)) as stream:
        chunks = stream.iter_raw()
        next(chunks)
        queued: Future[httpx.Response] = pool.submit(ask, router, ETL, "next batch")
        assert wait_until(lambda: status(router)["waiting"] == 1, TIMEOUT)
        assert status(router)["in_flight"] == 1  # a slot is free, and kept
        answer = ask(router, ALICE, "hi")
        assert answer.status_code == 200, answer.text
        assert not queued.done() and status(router)["waiting"] == 1
        for _ in range(3):
            next(chunks)  # the stream ran on beside it
    assert queued.result(TIMEOUT).status_code == 200
