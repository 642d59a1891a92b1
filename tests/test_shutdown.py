"""The end of the shutdown grace period: every request the router still holds ends with its
error envelope, and nothing hangs.

* In process: ``forward.proxy`` under uvicorn in front of a scripted child, with a
  ``shutdown.Shutdown`` the test ends itself (no signals, no waiting for a grace period).
* Through ``llama-router serve`` with fake children: requests waiting for a model load.
* Through ``llama-router serve`` with the real llama-server: a stream running and a request
  queued in the child for a slot when the grace period ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support import (
    RouterProcess,
    fake_binary,
    proxy_in_uvicorn,
    start_router,
    wait_until,
    write_presets,
)

from router.config.sources import Catalogue
from router.core.wait import NOTHING_ELSE, Ends, raise_if_ended, start_watchers
from router.edge.metering import Meter
from router.edge.virtual import Virtuals
from router.http.shutdown import Shutdown
from router.http.upstream import ChildConnections
from router.teams.usage import Usage

TIMEOUT = 10.0  # a hang guard, never a measurement
GRACE_S = 1.0
GRACE_MESSAGE = ("the router is shutting down; the request did not finish within the 1 s grace "
                 "period")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}

Child = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def sse_events(raw: bytes) -> list[str]:
    """The events of an event stream, each without its blank line."""
    return [e for e in raw.decode().replace("\r\n", "\n").split("\n\n") if e]


def assert_grace_envelope(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "5"
    assert response.json() == {"error": {"code": 503, "type": "unavailable_error",
                                          "message": GRACE_MESSAGE}}


def assert_ends_with_grace_event(raw: bytes) -> None:
    events = sse_events(raw)
    assert events, raw
    assert events[-1].startswith("data: "), events[-1]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last == {"error": {"code": 503, "type": "unavailable_error",
                              "message": GRACE_MESSAGE}}
    assert "data: [DONE]" not in events


# -- in process: forward.proxy in front of a scripted child -------------------------------


class FakeSupervisor:
    """What ``forward.proxy`` asks of the supervisor: model ``m`` is served by ``pool``; model
    ``loading`` never finishes loading."""

    settings = SimpleNamespace(max_body_bytes=1 << 20, models_autoload=True, state_dir=None)
    catalogue = Catalogue({})  # no profiles, no virtual models

    def __init__(self, pool: ChildConnections) -> None:
        self.pool = pool
        self.waiting = 0
        self.waits = asyncio.Event()  # set when a request starts waiting for ``loading``

    def find(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(id=model, preset=SimpleNamespace(id=model, prefix_routing=False,
                                                                  upstream=None, policy=None),
                               serving=model != "loading")

    def keeps_conversations(self, model: object) -> bool:
        return False

    def lease_now(self, model: SimpleNamespace, prefix: object = None, turn: object = None
                  ) -> SimpleNamespace | None:
        return None if model.id == "loading" else self._lease()

    def _lease(self) -> SimpleNamespace:
        return SimpleNamespace(child=SimpleNamespace(connections=self.pool),
                               release=lambda: None, learn=lambda tail: None,
                               spent=lambda cost: None)

    async def acquire(self, model: SimpleNamespace, *, autoload: bool, budget: float | None,
                      prefix: object = None, ends: Ends = NOTHING_ELSE, turn: object = None
                      ) -> SimpleNamespace:
        if model.id == "loading":  # the load never ends: only what ``ends`` names ends the wait
            self.waiting += 1
            self.waits.set()
            watchers = start_watchers(ends)
            try:
                await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
                raise_if_ended(watchers, ends)
            finally:
                for watcher in watchers:
                    watcher.cancel()
                self.waiting -= 1
        return SimpleNamespace(child=SimpleNamespace(connections=self.pool),
                               release=lambda: None, learn=lambda tail: None)


@contextlib.asynccontextmanager
async def proxy_before(child: Child, shutdown: Shutdown
                       ) -> AsyncIterator[tuple[httpx.AsyncClient, FakeSupervisor, asyncio.Event]]:
    """``forward.proxy`` served by uvicorn in front of ``child``; yields a client, the fake
    supervisor, and an event set once the child has read a request head."""
    arrived = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            arrived.set()
            await child(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    child_server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    async with child_server:
        pool = ChildConnections("127.0.0.1", child_server.sockets[0].getsockname()[1])
        supervisor = FakeSupervisor(pool)
        state = SimpleNamespace(router=SimpleNamespace(models=supervisor, default=None,
                                                       shutdown=shutdown,
                                                       peers=None,
                                                       meter=Meter(Usage()), virtuals=Virtuals()),
                                webui=None)
        try:
            async with proxy_in_uvicorn(state, TIMEOUT) as client:
                yield client, supervisor, arrived
        finally:
            await pool.aclose()


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A child whose slots are all busy: the request waits, no answer comes."""
    await reader.read()


def answer_then_hang(raw: bytes) -> Child:
    """A child that writes ``raw`` (a response head and part of its body), then nothing."""
    async def child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()
        await reader.read()

    return child


async def test_a_request_queued_in_the_child_gets_the_503_when_the_grace_period_ends() -> None:
    shutdown = Shutdown(GRACE_S)
    async with proxy_before(silent, shutdown) as (client, _, arrived):
        pending = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.wait_for(arrived.wait(), TIMEOUT)  # a 500 would never arrive
        shutdown.end()
        response = await pending
    assert_grace_envelope(response)
    assert not shutdown.relays  # every relay unregistered itself


async def test_a_request_waiting_for_its_model_gets_the_503_when_the_grace_period_ends() -> None:
    shutdown = Shutdown(GRACE_S)
    async with proxy_before(silent, shutdown) as (client, supervisor, arrived):
        pending = asyncio.ensure_future(
            client.post("/v1/chat/completions", json={**CHAT, "model": "loading"}))
        await asyncio.wait_for(supervisor.waits.wait(), TIMEOUT)
        shutdown.end()
        response = await pending
        assert supervisor.waiting == 0  # it left the wait
    assert_grace_envelope(response)
    assert not arrived.is_set()


@pytest.mark.parametrize("cut", [b"", b'data: {"n"'], ids=["between-events", "inside-event"])
async def test_a_running_event_stream_ends_with_an_error_event(cut: bytes) -> None:
    event = b'data: {"n": 1}\n\n' + cut
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
    shutdown = Shutdown(GRACE_S)
    async with proxy_before(answer_then_hang(head), shutdown) as (client, _, _), \
            client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        received = await anext(chunks)
        while not received.endswith(event):
            received += await anext(chunks)
        shutdown.end()
        async for chunk in chunks:
            received += chunk
    events = sse_events(received)
    assert events[0] == 'data: {"n": 1}'
    if cut:  # the cut-off event is ended first, so the error is an event of its own
        assert events[1] == cut.decode()
    assert len(events) == (3 if cut else 2)
    assert_ends_with_grace_event(received)


async def test_a_running_body_that_is_not_a_stream_is_aborted() -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
    shutdown = Shutdown(GRACE_S)
    async with proxy_before(answer_then_hang(head), shutdown) as (client, _, _), \
            client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        assert await anext(chunks) == b'{"a":'
        shutdown.end()
        with pytest.raises(httpx.RemoteProtocolError):  # never a complete-looking body
            async for _ in chunks:
                pass


async def test_a_request_that_arrives_while_stopping_is_refused() -> None:
    shutdown = Shutdown(GRACE_S)
    shutdown.closing.set()
    async with proxy_before(silent, shutdown) as (client, _, arrived):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.headers["connection"] == "close"
    assert response.json()["error"] == {
        "code": 503, "type": "unavailable_error",
        "message": "the router is shutting down and starts no new requests"}
    assert not arrived.is_set()  # never sent to the child


# -- through llama-router serve ------------------------------------------------------------


@contextlib.contextmanager
def in_threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def stop(router: RouterProcess) -> None:
    """SIGTERM; the router must exit 0 by itself (start_router then checks that no child is
    left behind)."""
    router.children()  # remember the children, for the check
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(60) == 0, router.log()


def grace_env(grace: float = GRACE_S) -> dict[str, str]:
    return {"LLAMA_ROUTER_SHUTDOWN_GRACE": f"{grace:g}"}


@pytest.mark.fake
def test_requests_waiting_for_a_load_get_the_503_when_the_grace_period_ends(
        tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, "--startup-delay", "600")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "fake.ini", f"[m]\nmodel = {model}\n")
    with start_router(tmp_path, "--llama-server", str(binary), "--presets", str(presets),
                      env=grace_env()) as router, router.client() as client, \
            in_threads() as pool:
        # A load route waiting for the load, and a proxied request waiting for the model.
        load: Future[httpx.Response] = pool.submit(client.post, "/models/load?wait=true",
                                                   json={"model": "m"})
        assert wait_until(lambda: router.models()["m"]["status"]["waiting"] == 1, TIMEOUT)
        chat: Future[httpx.Response] = pool.submit(client.post, "/v1/chat/completions",
                                                   json={"model": "m", **CHAT})
        assert wait_until(lambda: router.models()["m"]["status"]["waiting"] == 2, TIMEOUT)
        stop(router)
        assert_grace_envelope(chat.result(TIMEOUT))
        assert_grace_envelope(load.result(TIMEOUT))
    log = router.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert "the 1 s grace period is over: ending" in log


@pytest.mark.fake
def test_a_fake_stream_and_a_request_queued_for_the_slot_end_with_the_envelope(
        tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, "--token-delay", "0.01")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "fake.ini", f"[m]\nmodel = {model}\nparallel = 1\n")
    with start_router(tmp_path, "--llama-server", str(binary), "--presets", str(presets),
                      env=grace_env()) as router:
        stream_and_queued(router, {"model": "m", "max_tokens": 1_000_000})
    assert "Traceback" not in router.log()


def stream_and_queued(router: RouterProcess, request: dict[str, Any]) -> None:
    """A stream running and a second request queued behind it for the one slot (in the
    router's slot queue) when the router gets SIGTERM: the stream ends with the error event,
    the queued request gets the 503, the router exits 0."""
    body = {**request, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with router.client() as client, router.client() as other, in_threads() as pool, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        received = next(chunks)
        queued: Future[httpx.Response] = pool.submit(
            other.post, "/v1/chat/completions",
            json={**request, "max_tokens": 4, "messages": [{"role": "user", "content": "y"}]})
        model = str(request["model"])
        status = lambda: router.models()[model]["status"]  # noqa: E731
        assert wait_until(lambda: (status()["in_flight"], status()["waiting"]) == (1, 1),
                          TIMEOUT)
        stop_in_background = pool.submit(stop, router)
        for chunk in chunks:
            received += chunk
        stop_in_background.result(TIMEOUT * 6)
        assert_grace_envelope(queued.result(TIMEOUT))
    assert_ends_with_grace_event(received)


@pytest.mark.real
def test_the_grace_period_ends_a_real_stream_and_a_request_queued_for_a_slot(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    # Context shift and no max_tokens: a stream that never ends by itself.
    presets = write_presets(tmp_path / "real.ini", f"[a]\nmodel = {tiny_models['long']}\n"
                            "ctx-size = 512\nparallel = 1\ncontext-shift = true\n")
    with start_router(tmp_path, "--presets", str(presets), env=grace_env()) as router:
        stream_and_queued(router, {"model": "a", "ignore_eos": True})
    log = router.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
