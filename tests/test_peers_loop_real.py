"""Routers that front each other, against the real llama-server: two routers on one machine,
each started with ``--peer`` at the other and the same (default) node name, list each other's
models out of the box, serve and load and unload them, and never relay a request round the
loop; an admin call to a frozen (SIGSTOPped) peer is answered within a deadline; a client
that sets ``x-llama-router-via`` itself gets a clear refusal. Figures: build/reliability/."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

from router.process import free_port

pytestmark = pytest.mark.real

FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
ANSWER_DEADLINE_S = 20.0  # generous: liveness checks below find a frozen peer in ~2 s
LIVENESS = ("--liveness-interval", "0.5", "--liveness-timeout", "1", "--liveness-misses", "2")


def record(name: str, figures: dict[str, object]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")


@contextlib.contextmanager
def two_routers(tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]
                ) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    """Router A (model alpha) and router B (model beta) on 127.0.0.1, each a peer of the
    other, both with the default node name (this machine's host name)."""
    port_a, port_b = free_port(), free_port()
    while port_b == port_a:
        port_b = free_port()
    presets = {}
    for name in ("alpha", "beta"):
        presets[name] = write_presets(tmp_path / f"{name}.ini", "version = 1\n[*]\n"
                                      f"ctx-size = 1024\n[{name}]\nmodel = {tiny_models[name]}\n")
    common = ("--llama-server", str(llama_server), *LIVENESS)
    with start_router(tmp_path, "--presets", str(presets["alpha"]), "--peer",
                      f"http://127.0.0.1:{port_b}", *common, port=port_a) as a, \
            start_router(tmp_path, "--presets", str(presets["beta"]), "--peer",
                         f"http://127.0.0.1:{port_a}", *common, port=port_b) as b:
        yield a, b


def listing(router: RouterProcess) -> dict[str, dict[str, object]]:
    with router.client() as client:
        return {m["id"]: m for m in client.get("/models").json()["data"]}


def connections_between(a: RouterProcess, b: RouterProcess) -> int:
    """TCP connections between the two routers' ports, in any state (TIME_WAIT included:
    those closed lately)."""
    ports = {a.port, b.port}
    found = 0
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.raddr and conn.raddr.port in ports and conn.laddr.port \
                not in ports:
            found += 1  # one side of a connection from a router to the other's port
    return found


def test_two_routers_that_front_each_other(tmp_path: Path, llama_server: Path,
                                           tiny_models: dict[str, Path]) -> None:
    with two_routers(tmp_path, llama_server, tiny_models) as (a, b):
        # Out of the box: each lists the other's model, under distinct labels.
        assert wait_until(lambda: "beta" in listing(a) and "alpha" in listing(b), 30), \
            (listing(a), listing(b))
        props_a = httpx.get(a.url + "/props").json()["llama_router"]
        props_b = httpx.get(b.url + "/props").json()["llama_router"]
        assert props_a["instance"] and props_a["instance"] != props_b["instance"]
        assert props_a["node"] == props_b["node"]  # the same host name
        seen_from_a = listing(a)
        assert seen_from_a["beta"]["node"] != seen_from_a["alpha"]["node"]
        assert seen_from_a["beta"]["instance"] == props_b["instance"]
        assert set(seen_from_a) == {"alpha", "beta"}  # its own model is not listed back
        assert "has the node name" in a.log() and "has the node name" in b.log()

        started = time.monotonic()
        before = connections_between(a, b)
        with a.client() as client_a, b.client() as client_b:
            for client, model in ((client_a, "beta"), (client_b, "alpha"),
                                  (client_a, "alpha"), (client_b, "beta")):
                answer = client.post("/v1/chat/completions", json={"model": model, **CHAT})
                assert answer.status_code == 200, (model, answer.text)
            # Unload through the router that does not have it: forwarded once, no bounce.
            for client, model in ((client_a, "beta"), (client_b, "alpha")):
                answer = client.post("/models/unload", json={"model": model})
                assert answer.status_code == 200, answer.text
                assert answer.json()["success"] is True
            assert wait_until(lambda: listing(b)["beta"]["status"]["value"] == "unloaded", 10)
            answer = client_a.post("/models/load", json={"model": "beta"})
            assert answer.status_code == 200 and answer.json()["success"], answer.text
            assert wait_until(lambda: listing(a)["beta"]["status"]["value"] == "loaded", 30)
            answer = client_b.post("/models/unload", json={"model": "beta"})  # its own
            assert answer.status_code == 200, answer.text
            metrics = client_a.get("/metrics").text  # each scrapes the other once
            assert 'node="' in metrics
        took = time.monotonic() - started
        time.sleep(1.0)  # anything still bouncing would show now
        after = connections_between(a, b)
        record("peers_front_each_other", {"connections_before": before,
                                          "connections_after": after,
                                          "seconds": round(took, 2)})
        assert after < 40, after  # a bounce opened thousands within seconds
        for router in (a, b):
            assert router.proc.poll() is None


def test_a_client_set_via_header_gets_a_clear_answer(tmp_path: Path, llama_server: Path,
                                                     tiny_models: dict[str, Path]) -> None:
    with two_routers(tmp_path, llama_server, tiny_models) as (a, b):
        assert wait_until(lambda: "beta" in listing(a), 30)
        own = httpx.get(a.url + "/props").json()["llama_router"]["instance"]
        other = httpx.get(b.url + "/props").json()["llama_router"]["instance"]
        with a.client() as client:
            for via, words in ((own, "passed through this router"),
                               (other, "nodes it passed through already")):
                for path, body in (("/v1/chat/completions", {"model": "beta", **CHAT}),
                                   ("/models/unload", {"model": "beta"})):
                    answer = client.post(path, json=body,
                                         headers={"x-llama-router-via": via})
                    assert answer.status_code == 409, (path, via, answer.text)
                    error = answer.json()["error"]
                    assert error["type"] == "invalid_request_error"
                    assert words in error["message"] and "x-llama-router-via" in \
                        error["message"], error
            # A via chain naming other routers only: its own model is served as usual.
            answer = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT},
                                 headers={"x-llama-router-via": "someone-else"})
            assert answer.status_code == 200, answer.text


def test_an_admin_call_to_a_frozen_peer_is_answered(tmp_path: Path, llama_server: Path,
                                                    tiny_models: dict[str, Path]) -> None:
    with two_routers(tmp_path, llama_server, tiny_models) as (a, b):
        assert wait_until(lambda: "beta" in listing(a), 30)
        with a.client() as client:
            assert client.post("/models/load", json={"model": "beta"}).status_code == 200
            assert wait_until(lambda: listing(a)["beta"]["status"]["value"] == "loaded", 30)
            frozen = [b.proc.pid, *(p.pid for p in b.children())]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                answer = client.post("/models/unload", json={"model": "beta"},
                                     timeout=ANSWER_DEADLINE_S + 10)
                took = time.monotonic() - started
                record("frozen_peer_admin", {"seconds_to_answer": round(took, 2),
                                             "status": answer.status_code})
                assert took < ANSWER_DEADLINE_S, took
                assert answer.status_code in (502, 503), answer.text
                assert set(answer.json()["error"]) == {"code", "message", "type"}
            finally:
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            # Awake: back (it may have carried out the unload it had been sent), and serving.
            assert wait_until(lambda: not listing(a)["beta"]["status"].get("unavailable"), 30)
            answer = client.post("/v1/chat/completions", json={"model": "beta", **CHAT})
            assert answer.status_code == 200, answer.text
