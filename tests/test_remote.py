"""Remote upstreams as models (router.children.remote): preset keys, the RemoteUpstream against an
in-process HTTP server, and end to end with the real llama-server as the remote."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import httpx
import pytest
from support import llama_server_process, start_router, wait_until, write_presets

from router.children.process import ChildTimeout, free_port
from router.children.remote import GONE_CODE, RemoteUpstream, UpstreamUnreachable
from router.config.presets import ModelPreset, PresetsInvalid, load_preset_file
from router.config.reconfig import needs_restart
from router.config.sources import build_catalogue
from router.core.lifecycle import ModelState, Status
from router.core.liveness import Liveness
from router.core.runtime import ModelRuntime
from router.errors import UpstreamError
from router.http.jsonscan import scan_now
from router.http.proxy import for_remote
from router.llama.flags import FlagTable
from router.logs import LogRing
from router.serving.load import Replica

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
HANG_GUARD_S = 60.0


# ----------------------------------------------------------------------------- presets

def problems(tmp_path: Path, text: str, table: FlagTable) -> list[str]:
    path = write_presets(tmp_path / "models.ini", text)
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([path], [], table, hf_cache=False)
    return [str(p) for p in info.value.problems]


def test_upstream_preset_keys(tmp_path: Path, help_table: FlagTable) -> None:
    (tmp_path / "key.txt").write_text("# the key for box2\n\n  sk-remote \nsecond\n")
    path = write_presets(tmp_path / "models.ini", (
        "[*]\nctx-size = 4096\nreplicas = 2\n"
        "[remote]\nupstream = http://10.0.0.2:8080\nupstream-model = served-name\n"
        "upstream-api-key-file = key.txt\nalias = far\nttl = 60\n"
        "[plain]\nupstream = http://box3\n"))
    catalogue = build_catalogue([path], [], help_table, hf_cache=False)
    remote = catalogue.models["remote"]
    assert remote.upstream == "http://10.0.0.2:8080"
    assert remote.upstream_model == "served-name"
    assert remote.upstream_key == "sk-remote"
    assert "sk-remote" not in repr(remote)
    assert dict(remote.args) == {} and remote.replicas == 1  # [*] is not for a remote
    assert remote.ttl == 60 and catalogue.aliases["far"] == "remote"
    plain = catalogue.models["plain"]
    assert (plain.upstream, plain.upstream_model, plain.upstream_key) == (
        "http://box3:80", None, None)


@pytest.mark.parametrize(("text", "expected"), [
    ("[m]\nupstream = https://box:8443\n", "models.ini:2: [m] upstream: https upstreams are "
     "not supported yet"),
    ("[m]\nupstream = ftp://box\n", "models.ini:2: [m] upstream: bad upstream address"),
    ("[m]\nupstream = http://box:1/v1\n", "models.ini:2: [m] upstream: bad upstream address"),
    ("[m]\nupstream = http://u:p@box:1\n", "[m] upstream: bad upstream address"),
    ("[m]\nupstream = http://box:1\nmodel = /x.gguf\n",
     "models.ini:3: [m] model: 'model' cannot be set with 'upstream' (line 2)"),
    ("[m]\nhf-repo = a/b:Q4_K_M\nupstream = http://box:1\n",
     "models.ini:2: [m] hf-repo: 'hf-repo' cannot be set with 'upstream' (line 3)"),
    ("[*]\nupstream = http://box:1\n[m]\nupstream = http://box:2\n",
     "models.ini:2: [*] upstream: 'upstream' cannot be a default for every model"),
    ("[m]\nmodel = /dev/null\nupstream-model = x\n",
     "models.ini:3: [m] upstream-model: only for a model with 'upstream"),
    ("[m]\nupstream = http://box:1\nupstream-api-key-file = missing.txt\n",
     "models.ini:3: [m] upstream-api-key-file: file does not exist"),
])
def test_upstream_preset_errors(tmp_path: Path, help_table: FlagTable, text: str,
                                expected: str) -> None:
    found = problems(tmp_path, text, help_table)
    assert any(expected in p for p in found), found


def test_empty_key_file_is_an_error(tmp_path: Path, help_table: FlagTable) -> None:
    (tmp_path / "key.txt").write_text("# nothing here\n\n")
    path = write_presets(tmp_path / "models.ini",
                         "[m]\nupstream = http://box:1\nupstream-api-key-file = key.txt\n")
    with pytest.raises(PresetsInvalid, match="no key in"):
        load_preset_file(path, help_table)


def test_models_dir_model_cannot_be_remote(tmp_path: Path, help_table: FlagTable) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").touch()
    path = write_presets(tmp_path / "models.ini", "[m]\nupstream = http://box:1\n")
    with pytest.raises(PresetsInvalid, match="'upstream' cannot be set for a model that has"):
        build_catalogue([path], [models], help_table, hf_cache=False)


def test_reconfiguring_the_address_or_key_restarts() -> None:
    base = ModelPreset(id="m", args=MappingProxyType({}), upstream="http://a:1")
    assert needs_restart(base, ModelPreset(id="m", args=MappingProxyType({}),
                                           upstream="http://a:2"))
    assert needs_restart(base, ModelPreset(id="m", args=MappingProxyType({}),
                                           upstream="http://a:1", upstream_key="k"))
    assert not needs_restart(base, ModelPreset(id="m", args=MappingProxyType({}),
                                               upstream="http://a:1", upstream_model="x"))


def test_for_remote_adds_the_key_and_renames_the_model() -> None:
    headers = [(b"content-type", b"application/json")]
    sent = b'{"model" : "remote",\n "messages": [], "n": 1.50}'
    out_headers, body = for_remote(headers, sent, scan_now(sent), "sk", "served")
    assert out_headers[-1] == (b"authorization", b"Bearer sk")
    assert body == b'{"model" : "served",\n "messages": [], "n": 1.50}'  # only the name
    for sent, renamed in [(b'{}', {"model": "served"}),
                          (b'{"a": 1, "model": null}', {"a": 1, "model": "served"}),
                          (b'{"model": "x", "a": {"model": "y"}, "mod\\u0065l": 3}',
                           {"a": {"model": "y"}, "model": "served"})]:
        _, body = for_remote(headers, sent, scan_now(sent), None, "served")
        assert json.loads(body) == renamed, body
    same_headers, same_body = for_remote(headers, b"raw", None, None, "served")
    assert (same_headers, same_body) == (headers, b"raw")  # not JSON: unchanged


# ----------------------------------------------------------------------------- RemoteUpstream

class Upstream:
    """A stand-in upstream on a free port: answers each path with its status (404 unknown)."""

    def __init__(self, **statuses: int) -> None:
        self.statuses = {"/health": 200, "/v1/models": 200, **
                         {k.replace("_", "/"): v for k, v in statuses.items()}}
        self.seen: list[tuple[str, str | None]] = []  # (path, authorization)
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split(" ", 2)[1]
            auth = next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                         if line.lower().startswith("authorization:")), None)
            self.seen.append((path, auth))
            status = self.statuses.get(path, 404)
            body = json.dumps({"data": [{"id": "far-model", "owned_by": "x"}]}).encode()
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_probe_health_and_info() -> None:
    async with Upstream() as url, httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", url, LogRing(10), client, api_key="sk")
        await remote.start()
        await asyncio.wait_for(remote.wait_ready(5.0), HANG_GUARD_S)
        assert remote.pid is None and remote.cpu is None and remote.returncode is None
        assert remote.argv == ["upstream", url]
        assert remote.connections.host == "127.0.0.1"
        assert remote.ready_info == {"id": "far-model", "owned_by": "x"}
        assert await remote.probe(2.0) is None
        assert await remote.stop(1.0) == 0


async def test_probe_falls_back_to_v1_models() -> None:
    server = Upstream(_health=404)
    async with server as url, httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", url, LogRing(10), client, api_key="sk")
        await asyncio.wait_for(remote.wait_ready(5.0), HANG_GUARD_S)
        assert remote.health_path == "/v1/models"
        assert await remote.probe(2.0) is None
        assert ("/health", "Bearer sk") in server.seen
        assert ("/v1/models", "Bearer sk") in server.seen


async def test_not_ready_until_timeout_and_unreachable_at_once() -> None:
    async with Upstream(_health=503) as url, httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", url, LogRing(10), client)
        with pytest.raises(ChildTimeout, match="did not answer /health with 200"):
            await asyncio.wait_for(remote.wait_ready(0.5), HANG_GUARD_S)
        assert remote.logs.tail(1) == [f"{url}/health: /health answered 503"]
    async with httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", f"http://127.0.0.1:{free_port()}", LogRing(10), client)
        with pytest.raises(UpstreamUnreachable, match="unreachable"):
            await asyncio.wait_for(remote.wait_ready(HANG_GUARD_S), HANG_GUARD_S)


async def test_gone_after_missed_probes() -> None:
    server = Upstream()
    async with server as url, httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", url, LogRing(10), client)
        await remote.wait_ready(5.0)
        runtime = ModelRuntime(ModelPreset(id="m", args=MappingProxyType({}), upstream=url),
                               LogRing(10), state=ModelState(status=Status.LOADED))
        runtime.state = replace(runtime.state, replicas=tuple([Replica(remote)]))
        reasons: list[str] = []

        def unresponsive(model: ModelRuntime, child: object, why: str) -> None:
            reasons.append(why)
            assert child is remote
            remote.kill_now()

        liveness = Liveness(interval=0.01, timeout=1.0, misses=2,
                            is_paused=lambda child: False, on_unresponsive=unresponsive)
        exit_task = asyncio.ensure_future(remote.wait_exit())
        await liveness.probe_round([runtime])
        assert not exit_task.done() and liveness.missed(remote) == 0
        server.statuses["/health"] = 500
        await liveness.probe_round([runtime])
        assert liveness.missed(remote) == 1 and not reasons
        await liveness.probe_round([runtime])
        assert reasons and reasons[0].startswith(f"upstream {url} stopped answering: 2 ")
        assert await asyncio.wait_for(exit_task, HANG_GUARD_S) == GONE_CODE


# ----------------------------------------------------------------------------- real

@contextlib.contextmanager
def llama_server_on(binary: Path, model: Path, port: int, tmp_path: Path,
                    *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A plain llama-server on ``port``, healthy when yielded, stopped afterwards."""
    with llama_server_process([str(binary), "--host", "127.0.0.1", "--port", str(port), "-m",
                               str(model), "-c", "2048", "-np", "2", *args], port,
                              tmp_path / f"remote-{port}-{time.monotonic_ns()}.log") as proc:
        yield proc


def stream_text(client: httpx.Client, model: str) -> str:
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": model, "stream": True, **CHAT}) as response:
        assert response.status_code == 200, response.read()
        return "".join(response.iter_text())


FAST_LIVENESS = ("--liveness-interval", "0.2", "--liveness-timeout", "1",
                 "--liveness-misses", "2")


@pytest.mark.real
def test_remote_llama_server(tmp_path: Path, llama_server: Path,
                             tiny_models: dict[str, Path]) -> None:
    port = free_port()
    presets = write_presets(tmp_path / "models.ini", (
        f"[remote]\nupstream = http://127.0.0.1:{port}\n"
        f"[local]\nmodel = {tiny_models['alpha']}\nctx-size = 2048\n"))
    with llama_server_on(llama_server, tiny_models["beta"], port, tmp_path) as remote, \
            start_router(tmp_path, "--presets", str(presets), "--models-max", "1",
                         *FAST_LIVENESS) as router, \
            router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "remote", **CHAT})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        assert "data: [DONE]" in stream_text(client, "remote")
        entry = router.models()["remote"]
        assert entry["upstream"] == f"http://127.0.0.1:{port}"
        assert entry["status"]["value"] == "loaded"  # type: ignore[index]
        assert entry["status"]["args"] == ["upstream", f"http://127.0.0.1:{port}"]  # type: ignore[index]
        # --models-max 1: the local model loads beside the remote, and neither evicts the other.
        assert client.post("/v1/chat/completions",
                           json={"model": "local", **CHAT}).status_code == 200
        assert client.post("/v1/chat/completions",
                           json={"model": "remote", **CHAT}).status_code == 200
        status = {m: d["status"]["value"] for m, d in router.models().items()}  # type: ignore[index]
        assert status == {"remote": "loaded", "local": "loaded"}
        metrics = client.get("/metrics").text
        assert 'model="remote"' in metrics
        # The remote goes away: requests get the envelope, the liveness check unloads it.
        remote.kill()
        remote.wait()
        response = client.post("/v1/chat/completions", json={"model": "remote", **CHAT})
        assert response.status_code in (502, 503), response.text
        assert response.json()["error"]["message"]
        assert wait_until(lambda: router.models()["remote"]["status"]["value"]  # type: ignore[index]
                          == "unloaded", HANG_GUARD_S), router.log()
        failed = router.models()["remote"]["status"]
        assert failed["failed"] is True  # type: ignore[index]
        assert "stopped answering" in failed["message"]  # type: ignore[index]
        response = client.post("/v1/chat/completions", json={"model": "remote", **CHAT})
        assert response.status_code in (502, 503), response.text
        assert "unreachable" in response.json()["error"]["message"]
        assert router.models()["local"]["status"]["value"] == "loaded"  # type: ignore[index]
        # Back on the same port: the next request loads it again (after the backoff).
        with llama_server_on(llama_server, tiny_models["beta"], port, tmp_path):
            response = client.post("/v1/chat/completions", json={"model": "remote", **CHAT})
            assert response.status_code == 200, response.text
            assert router.models()["remote"]["status"]["value"] == "loaded"  # type: ignore[index]


@pytest.mark.real
def test_remote_with_api_key(tmp_path: Path, llama_server: Path,
                             tiny_models: dict[str, Path]) -> None:
    port = free_port()
    (tmp_path / "remote.key").write_text("# box2\nsk-remote-secret\n")
    presets = write_presets(tmp_path / "models.ini", (
        f"[keyed]\nupstream = http://127.0.0.1:{port}\nupstream-api-key-file = remote.key\n"
        f"upstream-model = whatever-the-remote-calls-it\n"
        f"[unkeyed]\nupstream = http://127.0.0.1:{port}\n"))
    with llama_server_on(llama_server, tiny_models["beta"], port, tmp_path,
                         "--api-key", "sk-remote-secret"), \
            start_router(tmp_path, "--presets", str(presets), *FAST_LIVENESS) as router, \
            router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "keyed", **CHAT},
                               headers={"authorization": "Bearer client-key"})
        assert response.status_code == 200, response.text
        assert "data: [DONE]" in stream_text(client, "keyed")
        response = client.post("/v1/chat/completions", json={"model": "unkeyed", **CHAT})
        assert response.status_code == 401, response.text
        assert response.json()["error"]
        listed = json.dumps(router.models()) + client.get("/props").text
        assert "sk-remote-secret" not in listed and "sk-remote-secret" not in router.log()


async def test_a_request_in_flight_ends_when_the_upstream_is_marked_gone() -> None:
    """``kill_now`` (the liveness check gave up on a frozen upstream) ends the requests
    still waiting on it: their connections are aborted, nothing hangs."""
    from test_peers import StandInPeer

    async with StandInPeer("far", {}) as stand_in, httpx.AsyncClient() as client:
        remote = RemoteUpstream("m", stand_in.url, LogRing(10), client)
        response = await remote.connections.send("GET", b"/stream", [], b"")
        await stand_in.chunks.put(b"data: 1\n\n")
        assert await response.next_chunk() == b"data: 1\n\n"
        remote.kill_now()
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(response.next_chunk(), HANG_GUARD_S)
        response.release()
        assert await asyncio.wait_for(remote.wait_exit(), HANG_GUARD_S) == GONE_CODE


# ------------------------------------------------------------------- connections to it


def test_upstream_connections_sets_the_cap_and_defaults_to_a_childs(
        tmp_path: Path, help_table: FlagTable) -> None:
    path = write_presets(tmp_path / "models.ini", (
        "[wide]\nupstream = http://box:1\nupstream-connections = 200\n"
        "[plain]\nupstream = http://box:2\n"))
    models = build_catalogue([path], [], help_table, hf_cache=False).models
    assert models["wide"].upstream_connections == 200
    assert ModelRuntime(models["wide"], LogRing(10)).max_connections == 200
    assert models["plain"].upstream_connections is None
    assert ModelRuntime(models["plain"], LogRing(10)).max_connections == 14  # 16 threads - 2
    for text, expected in [
            ("[m]\nupstream = http://box:1\nupstream-connections = 0\n",
             "models.ini:3: [m] upstream-connections: expected a whole number >= 1"),
            ("[m]\nmodel = /dev/null\nupstream-connections = 8\n",
             "models.ini:3: [m] upstream-connections: only for a model with 'upstream")]:
        found = problems(tmp_path, text, help_table)
        assert any(expected in p for p in found), found


@pytest.mark.process
def test_upstream_connections_lets_that_many_streams_reach_the_upstream_at_once(
        tmp_path: Path) -> None:
    """20 long streams through a remote with ``upstream-connections = 20`` all reach it at
    once (the default cap, 14, would hold 6 of them in the router until others end)."""
    port = free_port()
    standin = subprocess.Popen([sys.executable, "-m", "benchmarks.standin", str(port)],
                               cwd=Path(__file__).parent.parent)
    try:
        upstream = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _stats(upstream) is not None, HANG_GUARD_S)
        presets = write_presets(tmp_path / "models.ini",
                                f"[wide]\nupstream = {upstream}\nupstream-connections = 20\n")
        with start_router(tmp_path, "--presets", str(presets)) as router:
            body = {"model": "wide", "stream": True, "max_tokens": 100_000,
                    "standin_paced": True, "messages": [{"role": "user", "content": "x"}]}
            stop = threading.Event()

            def one() -> None:
                with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                                  timeout=HANG_GUARD_S) as response:
                    assert response.status_code == 200
                    for _ in response.iter_bytes():
                        if stop.is_set():
                            return

            threads = [threading.Thread(target=one) for _ in range(20)]
            for thread in threads:
                thread.start()
            try:
                reached = wait_until(lambda: (_stats(upstream) or {}).get("streams") == 20,
                                     HANG_GUARD_S)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(HANG_GUARD_S)
            assert reached, _stats(upstream)
            assert _stats(upstream)["streams"] == 20  # type: ignore[index]
    finally:
        standin.kill()
        standin.wait()


def _stats(upstream: str) -> dict[str, int] | None:
    try:
        answer: dict[str, int] = httpx.get(upstream + "/stats", timeout=5).json()
        return answer
    except httpx.TransportError:
        return None
