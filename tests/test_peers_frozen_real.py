"""A frozen peer under a proxied request, against the real llama-server: a gateway sends a
non-streamed chat to a peer that was just frozen (SIGSTOP: its connections stay open and
nothing comes back). The request gets its answer within the liveness deadline (a 502 or 503
envelope naming the peer, or the answer of another node that has the model), the next ones go
to another node or get a 503 at once while the peer stays frozen, and woken (SIGCONT) the peer
serves again. Figures: build/reliability/frozen_peer_*.json."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
# Probes every 0.5 s, 1 s each, 2 misses: a frozen peer is down ~1.5 to 2.5 s after it froze.
LIVENESS = ("--liveness-interval", "0.5", "--liveness-timeout", "1", "--liveness-misses", "2")
FOUND_FROZEN_S = 15.0  # generous (a busy machine): without the liveness abort it never ends
AT_ONCE_S = 5.0  # a refusal decided from what the gateway knows: no wait for the peer
HANG_GUARD_S = 60.0


def record(name: str, figures: dict[str, object]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")


def presets(tmp_path: Path, tiny_models: dict[str, Path], name: str, *models: str) -> Path:
    text = "version = 1\n[*]\nctx-size = 512\n" + "".join(
        f"[{model}]\nmodel = {tiny_models[model]}\n" for model in models)
    return write_presets(tmp_path / f"{name}.ini", text)


def listing(router: RouterProcess) -> dict[str, dict[str, object]]:
    return router.models()


def available(router: RouterProcess, model: str, *, loaded: bool = False) -> bool:
    status = listing(router).get(model, {}).get("status") or {}
    assert isinstance(status, dict)
    return bool(status) and not status.get("unavailable") and (
        not loaded or status.get("value") == "loaded")


@contextlib.contextmanager
def frozen(router: RouterProcess) -> Iterator[None]:
    """``router`` and its children stopped (SIGSTOP) until the block ends."""
    pids = [router.proc.pid, *(p.pid for p in router.children())]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def timed_chat(client: httpx.Client, model: str) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    answer = client.post("/v1/chat/completions", json={"model": model, **CHAT},
                         timeout=HANG_GUARD_S)
    return time.monotonic() - started, answer


def served_by(router: RouterProcess, model: str, node: str) -> float:
    """The requests for ``model`` that ``router`` (node name ``node``) has answered: its own
    metrics, without those of its peers."""
    with router.client() as client:
        text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llamarouter_requests_total{") and f'model="{model}"' in line
               and ("node=" not in line or f'node="{node}"' in line))


def test_a_frozen_peer_with_the_only_copy(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """The peer holds the only copy: the request in flight gets a 502 or 503 envelope naming
    it within the liveness deadline, the next ones a 503 at once; woken, it serves again."""
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models, "p", "alpha")),
                      "--node-name", "node-p", *LIVENESS) as peer, \
            start_router(tmp_path, "--peer", peer.url, "--node-name", "gw",
                         *LIVENESS) as gateway, gateway.client() as client:
        assert wait_until(lambda: "alpha" in listing(gateway), HANG_GUARD_S), gateway.log()
        took, answer = timed_chat(client, "alpha")  # loads it on the peer; the pool is warm
        assert answer.status_code == 200, answer.text
        with frozen(peer):
            took_frozen, answer = timed_chat(client, "alpha")
            assert answer.status_code in (502, 503), answer.text
            error = answer.json()["error"]
            assert set(error) == {"code", "message", "type"} and error["code"] == \
                answer.status_code
            assert "node-p" in error["message"], error
            assert took_frozen < FOUND_FROZEN_S, took_frozen
            frozen_status = answer.status_code
            next_times = []
            for _ in range(3):
                took_next, answer = timed_chat(client, "alpha")
                next_times.append(round(took_next, 3))
                assert answer.status_code == 503, answer.text
                assert "node-p" in answer.json()["error"]["message"]
                assert answer.headers.get("retry-after") == "5"
            assert max(next_times) < AT_ONCE_S, next_times
        started = time.monotonic()
        assert wait_until(lambda: available(gateway, "alpha"), HANG_GUARD_S), gateway.log()
        back = time.monotonic() - started
        before = served_by(peer, "alpha", "node-p")
        took_after, answer = timed_chat(client, "alpha")
        assert answer.status_code == 200, answer.text
        assert served_by(peer, "alpha", "node-p") == before + 1
    record("frozen_peer_only_copy", {
        "first_answer_s": round(took, 2), "frozen_answer_s": round(took_frozen, 2),
        "frozen_status": frozen_status, "next_answers_s": next_times,
        "back_after_sigcont_s": round(back, 2), "served_again_s": round(took_after, 2)})


@pytest.mark.parametrize("elsewhere", ["gateway", "other-peer"])
def test_a_frozen_peer_with_another_copy(tmp_path: Path, tiny_models: dict[str, Path],
                                         elsewhere: str) -> None:
    """The model is on the gateway too, or on another peer: the request in flight on the
    frozen peer is answered within the liveness deadline (by another node, or a 502 envelope
    naming the frozen one), the next ones by the other node; woken, the peer is used again."""
    frozen_presets = presets(tmp_path, tiny_models, "frozen", "alpha")
    other_presets = presets(tmp_path, tiny_models, "other", "alpha")
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(start_router(
            tmp_path, "--presets", str(frozen_presets), "--node-name", "node-p", *LIVENESS))
        peer_args: list[str] = ["--peer", peer.url]
        if elsewhere == "gateway":
            own: tuple[str, ...] = ("--presets", str(other_presets))
            other = None
        else:
            own = ()
            other = stack.enter_context(start_router(
                tmp_path, "--presets", str(other_presets), "--node-name", "node-q", *LIVENESS))
            peer_args += ["--peer", other.url]
        gateway = stack.enter_context(start_router(
            tmp_path, *own, *peer_args, "--node-name", "gw", *LIVENESS))
        client = stack.enter_context(gateway.client())
        assert wait_until(lambda: len(listing(gateway).get("alpha", {}).get("nodes", [])) == 2,
                          HANG_GUARD_S), (listing(gateway), gateway.log())
        # Loaded on the frozen-to-be peer only: the gateway sends the request there first.
        with peer.client() as direct:
            assert direct.post("/models/load", json={"model": "alpha"}).status_code == 200
        assert wait_until(lambda: available(gateway, "alpha", loaded=True), HANG_GUARD_S)
        served_before = served_by(peer, "alpha", "node-p")
        took, answer = timed_chat(client, "alpha")
        assert answer.status_code == 200, answer.text
        assert served_by(peer, "alpha", "node-p") == served_before + 1
        with frozen(peer):
            took_frozen, answer = timed_chat(client, "alpha")
            assert took_frozen < FOUND_FROZEN_S, took_frozen
            if answer.status_code != 200:  # failed over, or a clear envelope
                assert answer.status_code in (502, 503), answer.text
                assert "node-p" in answer.json()["error"]["message"], answer.text
            frozen_status = answer.status_code
            next_times = []
            for _ in range(3):
                took_next, answer = timed_chat(client, "alpha")
                next_times.append(round(took_next, 3))
                assert answer.status_code == 200, answer.text
            assert max(next_times) < AT_ONCE_S, next_times
        served_elsewhere = served_by(gateway, "alpha", "gw") if other is None \
            else served_by(other, "alpha", "node-q")
        assert served_elsewhere >= 3, served_elsewhere
        started = time.monotonic()
        assert wait_until(lambda: all(not n.get("unavailable") for n in listing(gateway)[
            "alpha"]["nodes"]), HANG_GUARD_S), listing(gateway)  # type: ignore[union-attr]
        back = time.monotonic() - started
        # Woken: the peer is used again (with nothing outstanding, loaded nodes take turns).
        for _ in range(4):
            assert timed_chat(client, "alpha")[1].status_code == 200
        assert served_by(peer, "alpha", "node-p") >= served_before + 2
    record(f"frozen_peer_copy_on_{elsewhere}", {
        "first_answer_s": round(took, 2), "frozen_answer_s": round(took_frozen, 2),
        "frozen_status": frozen_status, "next_answers_s": next_times,
        "back_after_sigcont_s": round(back, 2)})
