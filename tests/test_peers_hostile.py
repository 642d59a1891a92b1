"""A broken or hostile peer against a real gateway router (a subprocess; the peer is a
stand-in in a thread of the test): a 100 MiB ``/models/sse`` line without a line end leaves
the gateway's memory bounded and gives up that peer's stream, not the gateway; a 57 MB
``/models`` listing is refused with its reason and the gateway's own ``/models`` stays fast.
Figures: build/reliability/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from standin_peer import StandInPeer
from support import start_router, wait_until

pytestmark = pytest.mark.process

FIGURES = Path(__file__).resolve().parent.parent / "build" / "reliability"
DEADLINE_S = 60.0


def record(name: str, figures: dict[str, object]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")


@contextlib.contextmanager
def stand_in_thread(models: dict[str, str]) -> Iterator[tuple[StandInPeer,
                                                             asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    stand_in = StandInPeer("hostile", models, instance="hostile-instance")
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(stand_in.__aenter__(), loop).result(10)
    try:
        yield stand_in, loop
    finally:
        async def shut() -> None:
            await stand_in.__aexit__()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def peers_of(url: str) -> list[dict[str, object]]:
    peers: list[dict[str, object]] = httpx.get(url + "/props", timeout=10).json()[
        "llama_router"]["peers"]
    return peers


def test_an_endless_event_line_leaves_the_gateway_bounded(tmp_path: Path) -> None:
    with stand_in_thread({"m": "loaded"}) as (stand_in, loop), \
            start_router(tmp_path, "--peer", stand_in.url, "--liveness-interval", "0.5") \
            as gateway:
        assert wait_until(lambda: peers_of(gateway.url)[0]["up"], DEADLINE_S), gateway.log()
        process = psutil.Process(gateway.proc.pid)
        before = process.memory_info().rss
        stand_in.endless_line = 100 << 20
        loop.call_soon_threadsafe(stand_in.events.put_nowait, {"model": "m", "event": "x"})
        peak = before
        deadline = time.monotonic() + DEADLINE_S
        subscribed = stand_in.subscriptions
        # Several rounds: each follow of its events reads up to the cap and gives up.
        while stand_in.subscriptions < subscribed + 4 and time.monotonic() < deadline:
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.05)
        peak = max(peak, process.memory_info().rss)
        assert stand_in.subscriptions >= subscribed + 4, gateway.log()
        # Each follow reads the stand-in's first event before the endless line, and /props
        # names the problem "until an event is read again": as a round starts it is gone for
        # as long as the gateway takes to read 1 MiB of the line (longer on a busy machine).
        given_up = "its /models/sse was given up: a line longer than 1048576 bytes"
        assert wait_until(lambda: given_up in str(peers_of(gateway.url)[0].get("events")),
                          DEADLINE_S), peers_of(gateway.url)
        (peer,) = peers_of(gateway.url)
        record("peer_endless_event_line", {
            "line_bytes_offered": 100 << 20, "rounds": stand_in.subscriptions - subscribed,
            "bytes_the_peer_got_out": stand_in.sent,
            "gateway_rss_before_mib": round(before / 2**20, 1),
            "gateway_rss_peak_mib": round(peak / 2**20, 1)})
        assert peak - before < 48 << 20, (before, peak)  # 110 MiB when the line was read whole
        assert peer["up"] is True  # the peer is fine; its stream was given up
        assert "given up" in gateway.log()
        assert httpx.get(gateway.url + "/models", timeout=10).json()["data"][0]["id"] == "m"


def test_a_huge_listing_is_refused_and_models_stays_fast(tmp_path: Path) -> None:
    entry = {"id": "", "object": "model", "status": {"value": "loaded"}, "pad": "p" * 500}
    listing = json.dumps({"object": "list", "data": [
        {**entry, "id": f"model-{i}"} for i in range(100_000)]}).encode()
    assert len(listing) > 57_000_000
    with stand_in_thread({}) as (stand_in, _):
        stand_in.listing = listing
        with start_router(tmp_path, "--peer", stand_in.url, "--liveness-interval", "0.5") \
                as gateway:
            assert wait_until(lambda: "listing refused" in str(peers_of(gateway.url)[0].get(
                "reason")), DEADLINE_S), gateway.log()
            (peer,) = peers_of(gateway.url)
            assert peer["up"] is False and peer["models"] == 0
            assert peer["reason"] == ("listing refused: its /models answer is over 16 MiB, "
                                      "the most a peer's listing may hold")
            times = []
            with httpx.Client(base_url=gateway.url, timeout=10) as client:
                for _ in range(20):  # while the peer keeps offering it
                    started = time.perf_counter()
                    answer = client.get("/models").json()
                    times.append(time.perf_counter() - started)
            assert answer["data"] == []
            assert answer["skipped_peers"] == [{"url": stand_in.url,
                                                "reason": peer["reason"]}]
            assert "listing refused, peer not used" in gateway.log()
            record("peer_huge_listing", {
                "listing_bytes": len(listing), "models_in_it": 100_000,
                "gateway_models_median_ms": round(sorted(times)[10] * 1000, 2),
                "gateway_models_max_ms": round(max(times) * 1000, 2)})
            assert max(times) < 2.0, times  # 6 s each when the listing was taken whole


def test_an_endless_response_head_is_cut_and_the_gateway_stays_responsive(
        tmp_path: Path) -> None:
    """A peer answering a relayed chat with a head that never ends (128 MiB on offer to each
    of 4 requests at once): each request gets an envelope naming the peer and the bound once
    64 KiB of head were read, the gateway's memory stays bounded and it answers its own routes
    meanwhile (the head used to grow the gateway to 3.8 GiB and starve its loop)."""
    with stand_in_thread({"m": "loaded"}) as (stand_in, _), \
            start_router(tmp_path, "--peer", stand_in.url, "--liveness-interval", "0.5") \
            as gateway:
        assert wait_until(lambda: peers_of(gateway.url)[0]["up"], DEADLINE_S), gateway.log()
        process = psutil.Process(gateway.proc.pid)
        before = process.memory_info().rss
        stand_in.endless_head = 128 << 20
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        answers: list[httpx.Response] = []
        health_s: list[float] = []

        def ask() -> None:
            answers.append(httpx.post(gateway.url + "/v1/chat/completions", json=chat,
                                      timeout=DEADLINE_S))

        askers = [threading.Thread(target=ask) for _ in range(4)]
        for asker in askers:
            asker.start()
        peak = before
        with httpx.Client(base_url=gateway.url, timeout=10) as client:
            while any(a.is_alive() for a in askers):
                started = time.perf_counter()
                assert client.get("/health").status_code == 200
                health_s.append(time.perf_counter() - started)
                peak = max(peak, process.memory_info().rss)
                time.sleep(0.02)
        for asker in askers:
            asker.join(DEADLINE_S)
        peak = max(peak, process.memory_info().rss)
        record("peer_endless_head", {
            "head_bytes_offered_each": 128 << 20, "requests": 4,
            "bytes_the_peer_got_out": stand_in.sent,
            "gateway_rss_before_mib": round(before / 2**20, 1),
            "gateway_rss_peak_mib": round(peak / 2**20, 1),
            "gateway_health_max_ms": round(max(health_s, default=0) * 1000, 1)})
        # A 502 naming the peer; a request arriving once the peer was found failing gets the
        # 503 of a model whose nodes are not answering, with the same reason.
        assert sorted({a.status_code for a in answers}) <= [502, 503], \
            "\n".join(a.text for a in answers)
        assert 502 in {a.status_code for a in answers}
        for answer in answers:
            message = answer.json()["error"]["message"]
            assert f"peer router {stand_in.url} sent a response head over 65536 bytes" \
                in message, message
        assert stand_in.sent < 16 << 20  # the gateway stopped reading; nothing near 4 x 128
        assert peak - before < 48 << 20, (before, peak)
        assert max(health_s, default=0) < 5.0, health_s


NON_FINITE = (b'{"object": "list", "data": [{"id": "m", "object": "model", "created": 1e999,'
              b' "status": {"value": "loaded", "load_s": NaN, "replicas": ['
              b'{"pace": {"prompt_ms_per_kchar": Infinity}}, {"in_flight": -Infinity}]}}]}')


def test_non_finite_numbers_in_a_listing_never_break_the_gateways_models(
        tmp_path: Path) -> None:
    """One ``NaN`` or ``Infinity`` in a peer's ``/models`` made the gateway's ``/models`` and
    ``/v1/models`` a plain 500 for every client: read as unknown (``null``) instead."""
    with stand_in_thread({}) as (stand_in, _):
        stand_in.listing = NON_FINITE
        with start_router(tmp_path, "--peer", stand_in.url, "--liveness-interval", "0.5") \
                as gateway:
            assert wait_until(lambda: peers_of(gateway.url)[0]["up"], DEADLINE_S), \
                gateway.log()
            for path in ("/models", "/v1/models"):
                answer = httpx.get(gateway.url + path, timeout=10)
                assert answer.status_code == 200, answer.text
                (entry,) = answer.json()["data"]
                assert entry["id"] == "m" and entry["created"] is None
                assert entry["status"]["value"] == "loaded"
                assert entry["status"]["load_s"] is None
                assert entry["status"]["replicas"] == [{"pace": {"prompt_ms_per_kchar": None}},
                                                       {"in_flight": None}]


def test_a_huge_entry_is_read_once_not_per_request(tmp_path: Path) -> None:
    """A peer entry with 2,500,000 replica records (7.5 MB, inside the 16 MiB cap) was walked
    again by every request: each took 1.3 s, ``/health`` waited 4.1 s, the gateway grew by
    174 MiB. Read once as the listing arrives, its lists cut to their first 256 items."""
    replicas = b",".join([b"{}"] * 2_500_000)
    listing = (b'{"object":"list","data":[{"id":"big","object":"model","status":{"value":'
               b'"loaded","states":{},"replicas":[' + replicas + b"]}}]}")
    assert len(listing) < 16 << 20
    with stand_in_thread({}) as (stand_in, _):
        stand_in.listing = listing
        with start_router(tmp_path, "--peer", stand_in.url, "--liveness-interval", "0.5") \
                as gateway:
            assert wait_until(lambda: peers_of(gateway.url)[0]["up"], DEADLINE_S), \
                gateway.log()
            process = psutil.Process(gateway.proc.pid)
            time.sleep(1.0)  # the follower's import again, once subscribed
            before = process.memory_info().rss
            health_s: list[float] = []
            done = threading.Event()

            def watch_health() -> None:
                with httpx.Client(base_url=gateway.url, timeout=30) as client:
                    while not done.is_set():
                        started = time.perf_counter()
                        assert client.get("/health").status_code == 200
                        health_s.append(time.perf_counter() - started)
                        time.sleep(0.01)

            watcher = threading.Thread(target=watch_health)
            watcher.start()
            models_s, chat_s = [], []
            chat = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
            try:
                with httpx.Client(base_url=gateway.url, timeout=30) as client:
                    for _ in range(10):
                        started = time.perf_counter()
                        answer = client.get("/models")
                        models_s.append(time.perf_counter() - started)
                        assert answer.status_code == 200
                        started = time.perf_counter()
                        assert client.post("/v1/chat/completions", json=chat).status_code \
                            == 200
                        chat_s.append(time.perf_counter() - started)
            finally:
                done.set()
                watcher.join(30)
            after = process.memory_info().rss
            (entry,) = answer.json()["data"]
            record("peer_huge_entry", {
                "replica_records": 2_500_000, "listing_bytes": len(listing),
                "replicas_kept": len(entry["status"]["replicas"]),
                "gateway_models_max_ms": round(max(models_s) * 1000, 1),
                "gateway_chat_max_ms": round(max(chat_s) * 1000, 1),
                "gateway_health_max_ms": round(max(health_s, default=0) * 1000, 1),
                "gateway_rss_after_import_mib": round(before / 2**20, 1),
                "gateway_rss_growth_over_20_requests_mib": round((after - before) / 2**20, 1)})
            assert len(entry["status"]["replicas"]) == 256
            assert max(models_s) < 0.5 and max(chat_s) < 0.5, (models_s, chat_s)
            assert max(health_s, default=0) < 1.0, health_s
            assert after - before < 16 << 20, (before, after)
            assert before < 200 << 20, before  # the entry read once is not kept whole
