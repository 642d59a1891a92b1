"""Helpers for tests that run the router and children as processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.children.process import free_port
from router.config.listen import url_host
from router.edge.forward import proxy

TESTS = Path(__file__).parent
FAKE_SERVER = TESTS / "fake_llama_server.py"
STARTUP_DEADLINE_S = 30.0
# A router told to stop (SIGTERM) has exited by then: its shutdown grace (30 s by default)
# and a margin. Past it the router is killed and the test fails: a shutdown that hangs.
EXIT_DEADLINE_S = 45.0


def fake_binary(directory: Path, *knobs: str, name: str = "fake-llama-server") -> Path:
    """An executable that runs tests/fake_llama_server.py with fault ``knobs``."""
    script = directory / name
    quoted = " ".join(f"'{k}'" for k in knobs)
    script.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{FAKE_SERVER}' {quoted} \"$@\"\n")
    script.chmod(0o755)
    return script


@dataclass
class RouterProcess:
    """A ``llama-router serve`` subprocess on a free port, logging to ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    seen_children: set[int] = field(default_factory=set)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0, **kw)  # type: ignore[arg-type]

    def children(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen_children.update(p.pid for p in found)
        return found

    def models(self) -> dict[str, dict[str, object]]:
        with self.client() as client:
            data = client.get("/models").json()["data"]
        return {m["id"]: m for m in data}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler], join_s: float = 60.0) -> Iterator[str]:
    """``handler`` served on a free port of 127.0.0.1 by a thread: its base URL; shut down,
    and its thread joined (within ``join_s``), on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(join_s)


@contextlib.contextmanager
def start_router(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                 child_args: tuple[str, ...] = (),
                 open_files: int | None = None, host: str = "127.0.0.1",
                 port: int | None = None,
                 launcher: list[str] | None = None) -> Iterator[RouterProcess]:
    """A router subprocess on ``host`` (another loopback address: another "machine") and
    ``port`` (default: a free one); ``open_files`` caps its file descriptors (``ulimit -n``);
    ``launcher`` runs Python (default: this interpreter)."""
    first = host.split(",")[0].strip().strip("[]")  # a list of addresses: URLs use the first
    port = port or free_port(first)
    log_path = tmp_path / f"router-{first}-{port}.log"
    argv = [*(launcher or [sys.executable]), "-m", "router.cli", "serve", "--host", host,
            "--port", str(port), *args]
    if child_args:
        argv += ["--", *child_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})},
                                preexec_fn=None if open_files is None else
                                (lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                            (open_files, open_files))))
    router = RouterProcess(proc, f"http://{url_host(first)}:{port}", log_path)
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"router exited with {proc.returncode}:\n{router.log()}")
            try:
                if httpx.get(router.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"router did not start:\n{router.log()}")
            time.sleep(0.02)
        yield router
    finally:
        router.children()
        hung = False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(EXIT_DEADLINE_S)
            except subprocess.TimeoutExpired:
                hung = True
                proc.kill()
                proc.wait()
        leftovers = [pid for pid in router.seen_children if alive(pid)]
        for pid in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        assert not hung, (f"the router did not exit within {EXIT_DEADLINE_S:g} s of SIGTERM "
                          f"(killed)\n{router.log()}")
        assert not leftovers, f"children left behind: {leftovers}\n{router.log()}"


@contextlib.contextmanager
def llama_server_process(argv: list[str], port: int, log_path: Path,
                         env: dict[str, str] | None = None
                         ) -> Iterator[subprocess.Popen[bytes]]:
    """A llama-server (plain, or llama.cpp's router) started with ``argv`` and listening on
    127.0.0.1:``port``: healthy when yielded, stopped afterwards."""
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=None if env is None else {**os.environ, **env})
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n"
                            f"{log_path.read_text(errors='replace')[-2000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        assert wait_until(healthy, STARTUP_DEADLINE_S), "llama-server did not start"
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def fake_nvidia_smi(directory: Path, config: dict[str, object]) -> dict[str, str]:
    """Install tests/fake_nvidia_smi.py as ``directory/bin/nvidia-smi`` answering from
    ``config``; the environment entries that put it first on PATH."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = Path(__file__).with_name("fake_nvidia_smi.py")
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!{sys.executable}\nimport runpy\n"
                   f"runpy.run_path({str(fake)!r}, run_name='__main__')\n")
    exe.chmod(0o755)
    config_path = directory / "nvidia-smi.json"
    config_path.write_text(json.dumps(config))
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_NVIDIA_SMI": str(config_path)}


def write_presets(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class SSEClient(threading.Thread):
    """Collects the router's ``/models/sse`` events in the background (``events``)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.headers = headers or {}
        self.events: list[dict[str, Any]] = []
        self.connected = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=None) as client, \
                client.stream("GET", self.url + "/models/sse", headers=self.headers) as response:
            self.connected.set()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                if self.stop.is_set():
                    return


@contextlib.asynccontextmanager
async def proxy_in_uvicorn(state: object, timeout: float) -> AsyncIterator[httpx.AsyncClient]:
    """``forward.proxy`` served by uvicorn on a free port (as the router serves it), with
    ``state`` as the app's state; a client for it. ``timeout`` guards every wait."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["app"] = SimpleNamespace(state=state)
            await proxy(scope, receive, send)

    async with serve_in_uvicorn(app, timeout, lifespan="off") as url, \
            httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        yield client


@contextlib.asynccontextmanager
async def serve_in_uvicorn(app: Any, timeout: float, **config: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free loopback port (``config``: more of uvicorn's
    settings); its URL. ``timeout`` guards the start and the stop."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, **config))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(timeout):
            while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout)
        sock.close()
