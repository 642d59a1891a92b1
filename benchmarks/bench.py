"""Benchmark harness: a direct llama-server, llama.cpp's own router mode and llama-router.

One run generates tiny models, starts the three targets on free 127.0.0.1 ports (plus one
router of each kind with a large preset file for ``GET /models``), measures them in
interleaved rounds, prints a table and optionally writes JSON::

    python -m benchmarks.bench [--rounds N] [--duration S] [--quick] [--out PATH] [--profile]

Measured, round-robin across the targets so noise hits all of them alike:

* non-streaming chat latency (``max_tokens`` 1), streaming time to first content chunk (on a
  new connection per request, and on a keep-alive client) and ``POST /tokenize`` latency, one
  request at a time;
* ``/tokenize`` throughput with 32 keep-alive connections (``wrk`` when installed, else a raw
  asyncio generator run as a subprocess); the generator's own CPU use is recorded to show it is
  not the bottleneck;
* cold start (request to an unloaded model until its first token) and a swap under
  ``--models-max 1`` (after a non-streaming request to the loaded model), against a direct
  llama-server's own spawn → ``/health`` 200 time;
* router RSS (the router process alone) idle and under the throughput load;
* ``GET /models`` with a 500-section preset file.

Then, with the real SmolLM2-135M-Instruct (``benchmarks.realmodel``, ``benchmarks.multiturn``):
generated tokens/s at 1 and 4 streams, TTFT, byte-identical output and swap time; and a
multi-turn workload on ``replicas = 2`` (prefix vs least-busy replica routing). Last, the
CPU-sharing phase (``benchmarks.sharing``). ``--phases`` picks which run.

llama-router runs as users run it: at its default log level (every child line relayed to its
log at info), unless ``--router-log-level`` says otherwise.

Every process the harness starts is stopped in a ``finally`` block and checked with psutil.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from router.cpus import CpuShare, machine_cores, spin_environment
from router.install import find_llama_server
from router.process import free_port
from router.tinymodel import write_tiny_model

# The repository root: the working directory of every Python process the harness starts
# (``-m router.cli``, ``-m benchmarks.bench --loadgen``), so both packages import from here.
ROOT = Path(__file__).resolve().parent.parent
DIRECT, LLAMACPP, ROUTER = "direct", "llamacpp_router", "llama_router"
COLUMNS = (DIRECT, LLAMACPP, ROUTER)
ROUTERS = (LLAMACPP, ROUTER)
LABELS = {DIRECT: "direct", LLAMACPP: "llama.cpp router", ROUTER: "llama-router"}
MODELS = ("bench-a", "bench-b", "bench-c")  # a: warm latency; b: cold start; c: swap
CHILD_FLAGS = ("-c", "2048", "-np", "4", "--metrics")
# What llama-router gives a model alone on this machine (``cpus``); the direct server and
# llama.cpp's router's children get the same.
CHILD_CPU = CpuShare(tuple(machine_cores()))
JSON_HEADERS = {"content-type": "application/json"}
STREAM_HEADERS = {**JSON_HEADERS, "connection": "close"}
TOKENIZE_TEXT = "The quick brown fox jumps over the lazy dog."
HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
MB = 1_000_000
LATENCY_METRICS = ("chat", "ttft", "ttft_ka", "tokenize", "models")
PHASES = ("main", "relay", "real", "multiturn", "warmswap", "bodies", "sharing")

GOALS = {
    "tokenize_added_p50": "added p50 /tokenize latency over direct below llama.cpp router's",
    "tokenize_throughput": "/tokenize throughput at least 1.5x llama.cpp router's",
    "ttft_added_p50": "added streaming TTFT p50 at most 1 ms",
    "ttft_vs_llamacpp": "added streaming TTFT p50 below llama.cpp router's, new connection "
                        "per request",
    "ttft_ka_vs_llamacpp": "added streaming TTFT p50 below llama.cpp router's, keep-alive "
                           "client",
    "cold_start_added": "cold start p50 at most 30 ms above the child's own spawn -> healthy",
    "idle_rss": "idle router RSS at most 80 MB",
    "models_500_p50": "GET /models with 500 presets under 20 ms (p50)",
}


class BenchError(RuntimeError):
    pass


@contextlib.asynccontextmanager
async def chat_events(client: httpx.AsyncClient, url: str, body: dict[str, Any], what: str
                      ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """POST ``body`` to ``url``'s ``/v1/chat/completions`` as a stream; the parsed JSON of
    each of its ``data:`` events (BenchError, naming ``what``, for a status other than 200)."""
    async with client.stream("POST", url + "/v1/chat/completions", content=json.dumps(body),
                             headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            raise BenchError(f"{what}: HTTP {response.status_code}: "
                             f"{(await response.aread())[:300]!r}")

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    yield json.loads(line[6:])

        yield events()


@dataclass
class Config:
    rounds: int = 10
    samples: int = 40
    duration: float = 5.0
    throughput_rounds: int = 3
    cold_rounds: int = 5
    connections: int = 32
    presets: int = 500
    loadgen: str = "auto"
    profile: bool = False
    workdir: Path | None = None
    sharing_reps: int = 3  # repetitions of the CPU-sharing phase (benchmarks.sharing); 0 skips it
    only_sharing: bool = False
    stall_bound: float = 30.0  # seconds before a concurrent run counts as stalled
    quick: bool = False
    phases: tuple[str, ...] = PHASES
    # llama-router's --log-level; None: its default (info: every child line is logged too)
    router_log_level: str | None = None
    # Run llama-router from this source tree instead of this repository's (before/after runs)
    router_src: Path | None = None
    real_rounds: int = 4  # interleaved rounds of the real-model phase (benchmarks.realmodel)
    conversations: int = 4  # concurrent conversations of the multi-turn phase
    turns: int = 3  # turns per conversation (the first one is not a follow-up)
    multiturn_reps: int = 1  # runs of the multi-turn workload per target
    warmswap_reps: int = 3  # repetitions of the warm-swap scenario per target
    # The multi-turn phase's saturated configuration instead (benchmarks.multiturn), and a
    # llama-router source tree whose prefix routing it also runs (before/after in one run)
    multiturn_saturated: bool = False
    multiturn_baseline: Path | None = None
    multiturn_cache_ram: int | None = 512  # the saturated configuration's cache-ram (MiB)
    # The relay phase (benchmarks.relay): concurrent streams per run, events per run (all
    # streams together), interleaved rounds; None: the phase's defaults
    relay_streams: tuple[int, ...] | None = None
    relay_events: int | None = None
    relay_rounds: int | None = None


# --------------------------------------------------------------------------- processes

@dataclass
class Managed:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Processes:
    """Everything the harness starts; ``stop_all`` leaves nothing behind (checked by psutil)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.items: list[Managed] = []
        self.seen: dict[int, psutil.Process] = {}
        self._count = 0

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Managed:
        self._count += 1
        log_path = self.logdir / f"{self._count:02d}-{name}.log"
        with open(log_path, "wb") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **(env or {})}, cwd=cwd)
        managed = Managed(name, proc, log_path, started)
        self.items.append(managed)
        self._remember(proc.pid)
        return managed

    def _remember(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.seen.setdefault(pid, psutil.Process(pid))

    def note_descendants(self) -> None:
        for item in self.items:
            if item.proc.poll() is not None:
                continue
            try:
                for child in psutil.Process(item.proc.pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.Error:
                pass

    def stop(self, item: Managed) -> None:
        self.note_descendants()
        if item.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                item.proc.send_signal(signal.SIGTERM)
        self._reap(item)

    def _reap(self, item: Managed) -> None:
        try:
            item.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(item.proc.pid, signal.SIGKILL)
            item.proc.kill()
            item.proc.wait()

    def stop_all(self) -> list[str]:
        """Stop every process (SIGTERM, then SIGKILL); return what had to be killed after."""
        self.note_descendants()
        for item in self.items:
            if item.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    item.proc.send_signal(signal.SIGTERM)
        for item in self.items:
            self._reap(item)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(p) for p in self.seen.values()):
            time.sleep(0.05)
        leftovers = []
        for proc in self.seen.values():
            if _alive(proc):
                with contextlib.suppress(psutil.Error):
                    leftovers.append(f"{proc.pid} {' '.join(proc.cmdline()[:3])}")
                    proc.kill()
        return leftovers


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _health_ok(url: str) -> bool:
    """One ``GET /health`` on a fresh connection (stdlib: no TLS setup cost while timing)."""
    target = httpx.URL(url)
    conn = http.client.HTTPConnection(target.host, target.port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def wait_healthy(item: Managed, url: str, timeout: float = HEALTH_TIMEOUT_S,
                 interval: float = 0.01) -> float:
    """Poll ``/health`` until 200; seconds since the process was started."""
    while True:
        if item.proc.poll() is not None:
            raise BenchError(f"{item.name} exited with {item.proc.returncode}:\n{item.tail()}")
        if _health_ok(url):
            return time.perf_counter() - item.started
        if time.perf_counter() - item.started > timeout:
            raise BenchError(f"{item.name} not healthy after {timeout:g} s:\n{item.tail()}")
        time.sleep(interval)


# --------------------------------------------------------------------------- targets

@dataclass
class Endpoint:
    column: str
    url: str
    item: Managed
    client: httpx.Client = field(init=False)
    # A second keep-alive client, for streams only (``timed_first_token(keep_alive=True)``).
    stream_client: httpx.Client = field(init=False)
    failures: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120.0, trust_env=False)
        self.stream_client = httpx.Client(base_url=self.url, timeout=120.0, trust_env=False)

    def close(self) -> None:
        self.client.close()
        self.stream_client.close()

    def tally(self, phase: str) -> dict[str, int]:
        """Retry counts (``dropped``, ``http_502``) of one phase or metric."""
        return self.failures.setdefault(phase, {})

    def rss(self) -> int:
        """RSS of the server process alone (not its children)."""
        return int(psutil.Process(self.item.proc.pid).memory_info().rss)

    def cpu_seconds(self) -> float:
        """CPU time of the server process and all its children so far."""
        total = 0.0
        try:
            proc = psutil.Process(self.item.proc.pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = p.cpu_times()
                    total += times.user + times.system
        except psutil.Error:
            pass
        return total


def _body(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def chat_body(model: str, *, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4 if stream else 1}
    if stream:
        body["stream"] = True
    return _body(body)


def tokenize_body(model: str) -> bytes:
    return _body({"model": model, "content": TOKENIZE_TEXT})


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        raise BenchError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")


# A keep-alive connection the server closed (llama-server closes some after an SSE stream
# while announcing keep-alive) surfaces as one of these when the client reuses it.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Retry(Exception):
    """A sample worth another attempt: ``kind`` is ``dropped`` (connection closed under the
    client) or ``http_502`` (a router could not reach its child)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _classify(response: httpx.Response, what: str) -> None:
    if response.status_code == 502:
        raise Retry("http_502", f"{what}: {response.text[:200]}")
    _check(response, what)


T = TypeVar("T")


def attempt(measure: Callable[[], T], tally: dict[str, int], tries: int = 4) -> T:
    """Run ``measure`` until it succeeds (at most ``tries`` times), counting each retry."""
    for _ in range(tries - 1):
        try:
            return measure()
        except Retry as exc:
            tally[exc.kind] = tally.get(exc.kind, 0) + 1
    return measure()


def timed_request(client: httpx.Client, method: str, path: str, body: bytes | None) -> float:
    what = f"{method} {client.base_url}{path}"
    start = time.perf_counter()
    try:
        response = client.request(method, path, content=body,
                                  headers=JSON_HEADERS if body is not None else None)
    except DROPPED as exc:
        raise Retry("dropped", f"{what}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise BenchError(f"{what}: {exc!r}") from exc
    elapsed = time.perf_counter() - start
    _classify(response, what)
    return elapsed


def request_json(client: httpx.Client, method: str, path: str, tally: dict[str, int],
                 payload: dict[str, Any] | None = None) -> Any:
    """An untimed control request (listing, unload), retried like the samples."""
    body = None if payload is None else _body(payload)

    def once() -> Any:
        what = f"{method} {client.base_url}{path}"
        try:
            response = client.request(method, path, content=body,
                                      headers=JSON_HEADERS if body is not None else None)
        except DROPPED as exc:
            raise Retry("dropped", f"{what}: {exc!r}") from exc
        _classify(response, what)
        return response.json()

    return attempt(once, tally)


def _has_content(line: bytes) -> bool:
    if not line.startswith(b"data:"):
        return False
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return False
    try:
        event = json.loads(payload)
        return bool(event["choices"][0]["delta"].get("content"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False


def timed_first_token(client: httpx.Client, body: bytes,
                      url: str = "/v1/chat/completions", keep_alive: bool = False) -> float:
    """Seconds from sending a streaming chat request to its first ``data:`` with content.

    By default every sample opens a new connection (``Connection: close``): llama-server
    closes its side after a stream anyway while a router may keep it, and a connect in one
    column only would skew the comparison. ``keep_alive`` measures what a client with a
    connection pool sees instead: a server that keeps the connection saves the connect.
    """
    what = f"stream {client.base_url}{url}"
    start = time.perf_counter()
    first: float | None = None
    try:
        with client.stream("POST", url, content=body,
                           headers=JSON_HEADERS if keep_alive else STREAM_HEADERS) as response:
            if response.status_code != 200:
                response.read()
                _classify(response, what)
            buffer = b""
            for chunk in response.iter_raw():
                if first is not None:
                    continue  # drain, so the connection can be reused
                buffer += chunk
                while first is None and b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if _has_content(line.rstrip(b"\r")):
                        first = time.perf_counter() - start
    except DROPPED as exc:
        raise Retry("dropped", f"{what}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise BenchError(f"{what}: {exc!r}") from exc
    if first is None:
        raise BenchError(f"{what}: no content chunk")
    return first


# --------------------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "mean": sum(ms) / len(ms), "min": min(ms),
            "max": max(ms)}


def rotate(seq: Sequence[str], by: int) -> list[str]:
    by %= len(seq)
    return [*seq[by:], *seq[:by]]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --------------------------------------------------------------------------- load generation

def _duration_s(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not match:
        raise ValueError(f"unparsable wrk duration {text!r}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[match.group(2)]
    return float(match.group(1)) * scale


def parse_wrk(output: str) -> dict[str, float]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in ([\d.]+\w+)", output)
    if not rps or not total:
        raise BenchError(f"unexpected wrk output:\n{output}")
    result = {"rps": float(rps.group(1)), "requests": float(total.group(1)),
              "elapsed_s": _duration_s(total.group(2)), "errors": 0.0}
    for pct in ("50", "99"):
        found = re.search(rf"^\s+{pct}%\s+([\d.]+\w+)", output, re.MULTILINE)
        if found:
            result[f"p{pct}_ms"] = _duration_s(found.group(1)) * 1000.0
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if non2xx:
        result["errors"] += float(non2xx.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                     output)
    if sock:
        result["errors"] += sum(float(x) for x in sock.groups())
    return result


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one response; (status, whether the server keeps the connection open)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length: int | None = None
    chunked = False
    keep_alive = True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"connection" and b"close" in value.lower():
            keep_alive = False
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status, keep_alive


async def _loadgen(url: str, body: bytes, connections: int, duration: float) -> dict[str, float]:
    target = httpx.URL(url)
    host, port = target.host, target.port or 80
    request = (f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    latencies: list[float] = []
    errors = reconnects = 0
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration

    async def worker() -> None:
        nonlocal errors, reconnects
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while loop.time() < stop_at:
                start = time.perf_counter()
                writer.write(request)
                try:
                    status, keep_alive = await _read_response(reader)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise
                    status, keep_alive = 0, False  # closed while idle (keep-alive max)
                else:
                    latencies.append(time.perf_counter() - start)
                    errors += status != 200
                if not keep_alive:
                    reconnects += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.perf_counter() - began
    ms = [v * 1000.0 for v in latencies]
    return {"rps": len(latencies) / elapsed, "requests": float(len(latencies)),
            "elapsed_s": elapsed, "errors": float(errors), "reconnects": float(reconnects),
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def loadgen_main(url: str, body: bytes, connections: int, duration: float) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(_loadgen(url, body, connections, duration))))
    return 0


def _py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


@dataclass
class LoadTool:
    name: str
    script: Path

    def argv(self, url: str, model: str, connections: int, duration: float) -> list[str]:
        if self.name == "wrk":
            return ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--timeout", "10s",
                    "--latency",
                    "-s", str(self.script), url + "/tokenize"]
        return [sys.executable, "-m", "benchmarks.bench", "--loadgen", url + "/tokenize",
                "--loadgen-body", tokenize_body(model).decode(),
                "--connections", str(connections), "--duration", str(duration)]

    def parse(self, stdout: str) -> dict[str, float]:
        if self.name == "wrk":
            return parse_wrk(stdout)
        parsed: dict[str, float] = json.loads(stdout.strip().splitlines()[-1])
        return parsed


def choose_load_tool(preference: str, workdir: Path, model: str) -> LoadTool:
    script = workdir / "tokenize.lua"
    body = tokenize_body(model).decode().replace("\\", "\\\\").replace("'", "\\'")
    script.write_text(f"wrk.method = \"POST\"\nwrk.body = '{body}'\n"
                      "wrk.headers[\"Content-Type\"] = \"application/json\"\n")
    if preference in ("auto", "wrk") and shutil.which("wrk"):
        return LoadTool("wrk", script)
    if preference == "wrk":
        raise BenchError("--loadgen wrk: wrk is not installed (apt-get install wrk)")
    return LoadTool("python-asyncio", script)


def run_load(tool: LoadTool, ep: Endpoint, model: str, cfg: Config,
             watch_rss: bool) -> dict[str, float]:
    """One throughput run; also the generator's and the target's CPU use, and peak RSS."""
    argv = tool.argv(ep.url, model, cfg.connections, cfg.duration)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    target_before = ep.cpu_seconds()
    began = time.perf_counter()
    peak = 0
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          cwd=ROOT) as proc:
        while proc.poll() is None:
            if watch_rss:
                with contextlib.suppress(psutil.Error):
                    peak = max(peak, ep.rss())
            time.sleep(0.1)
        out, err = proc.communicate()
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise BenchError(f"{tool.name} failed ({proc.returncode}): {err.decode()[-500:]}")
    result = tool.parse(out.decode())
    if result["requests"] <= 0:
        raise BenchError(f"{tool.name} against {ep.column}: no request completed: {result}")
    generator_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result["generator_cores"] = generator_cpu / wall
    result["target_cores"] = (ep.cpu_seconds() - target_before) / wall
    if watch_rss:
        result["peak_rss_mb"] = peak / MB
    return result


# --------------------------------------------------------------------------- routers

def router_models(ep: Endpoint) -> dict[str, str]:
    data = request_json(ep.client, "GET", "/models", ep.tally("control"))["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def unload_all(ep: Endpoint, timeout: float = 30.0) -> None:
    """Unload every running model and wait until the router has no child left."""
    for model, status in router_models(ep).items():
        if status in ("loaded", "loading", "sleeping"):
            request_json(ep.client, "POST", "/models/unload", ep.tally("control"),
                         {"model": model})
    deadline = time.monotonic() + timeout
    while True:
        statuses = router_models(ep)
        children = psutil.Process(ep.item.proc.pid).children(recursive=True)
        if all(s == "unloaded" for s in statuses.values()) and not children:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{ep.column}: models still running: {statuses} {children}")
        time.sleep(0.02)


def write_presets(path: Path, sections: dict[str, Path], extra: Sequence[str],
                  parallel: int = 4, ctx_size: int = 2048) -> Path:
    lines = ["version = 1", "", "[*]", f"ctx-size = {ctx_size}", f"parallel = {parallel}",
             *extra, ""]
    for name, model in sections.items():
        lines += [f"[{name}]", f"model = {model}", ""]
    path.write_text("\n".join(lines))
    return path


@dataclass
class Bench:
    cfg: Config
    workdir: Path
    procs: Processes
    binary: Path
    models: dict[str, Path] = field(default_factory=dict)
    eps: dict[str, Endpoint] = field(default_factory=dict)
    list_eps: dict[str, Endpoint] = field(default_factory=dict)
    startup_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------ start

    def direct_cold_start(self, model: str, name: str, timeout: float) -> tuple[float, float]:
        """A new direct llama-server for ``model``: seconds from its spawn to ``/health`` 200,
        and to the first token of a streamed chat; then it is stopped."""
        # The client exists before the spawn: creating one costs ~15 ms.
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            item, url = self._start_direct(model, name)
            try:
                healthy = wait_healthy(item, url, interval=0.002)
                attempt(partial(timed_first_token, client, chat_body(model, stream=True),
                                url + "/v1/chat/completions"), {})
                return healthy, time.perf_counter() - item.started
            finally:
                self.procs.stop(item)

    def _start_direct(self, model: str, name: str,
                      flags: Sequence[str] = CHILD_FLAGS) -> tuple[Managed, str]:
        port = free_port()
        item = self.procs.start(name, [str(self.binary), "-m", str(self.models[model]),
                                       *flags, *CHILD_CPU.argv(), "--host", "127.0.0.1",
                                       "--port", str(port), "--alias", model],
                                env=spin_environment())
        return item, f"http://127.0.0.1:{port}"

    def _start_llamacpp(self, presets: Path, name: str) -> tuple[Managed, str]:
        port = free_port()
        cache = self.workdir / "llama-cache"  # empty: no HF cache models in the listing
        cache.mkdir(exist_ok=True)
        item = self.procs.start(name, [str(self.binary), "--host", "127.0.0.1", "--port",
                                       str(port), "--models-preset", str(presets),
                                       "--models-max", "1"],
                                env={"LLAMA_CACHE": str(cache), **spin_environment()},
                                cwd=self.workdir)
        return item, f"http://127.0.0.1:{port}"

    def _start_router(self, presets: Path, name: str, src: Path | None = None,
                      extra_args: Sequence[str] = ("--models-max", "1")
                      ) -> tuple[Managed, str]:
        """llama-router on ``presets``, from the source tree ``src`` if given, with
        ``extra_args`` (default: ``--models-max 1``)."""
        port = free_port()
        level = self.cfg.router_log_level
        item = self.procs.start(name, [sys.executable, "-m", "router.cli", "serve",
                                       "--presets", str(presets), "--port", str(port),
                                       *extra_args,
                                       *(["--log-level", level] if level else []),
                                       "--llama-server", str(self.binary)],
                                cwd=src or self.cfg.router_src or ROOT)
        return item, f"http://127.0.0.1:{port}"

    def lc_cpu_keys(self) -> list[str]:
        """llama.cpp preset lines giving a child what llama-router gives a model alone."""
        flags = CHILD_CPU.argv()
        return [f"{flag.lstrip('-')} = {value}"
                for flag, value in zip(flags[::2], flags[1::2], strict=True)]

    def setup(self) -> None:
        model_dir = self.workdir / "models"
        for seed, name in enumerate(MODELS, start=1):
            self.models[name] = write_tiny_model(model_dir / f"{name}.gguf", seed=seed,
                                                 name=name)
        chat = {name: self.models[name] for name in MODELS}
        many = {f"list-{i:03d}": self.models[MODELS[0]] for i in range(self.cfg.presets)}
        # llama-router always passes --metrics to its children; llama.cpp needs it in [*].
        # Every child, direct or behind either router, computes alike: as llama-router runs a
        # model alone (CHILD_CPU, spin_environment), so the rows measure the serving path.
        lc_cpu = self.lc_cpu_keys()
        lc_presets = write_presets(self.workdir / "llamacpp.ini", chat,
                                   ["metrics = true", *lc_cpu])
        lr_presets = write_presets(self.workdir / "llama-router.ini", chat, [])
        lc_many = write_presets(self.workdir / "llamacpp-many.ini", many,
                                ["metrics = true", *lc_cpu])
        lr_many = write_presets(self.workdir / "llama-router-many.ini", many, [])

        starts: list[tuple[str, bool, Callable[[], tuple[Managed, str]]]] = [
            (DIRECT, False, lambda: self._start_direct(MODELS[0], "direct")),
            (LLAMACPP, False, lambda: self._start_llamacpp(lc_presets, "llamacpp-router")),
            (ROUTER, False, lambda: self._start_router(lr_presets, "llama-router")),
            (LLAMACPP, True, lambda: self._start_llamacpp(lc_many, "llamacpp-router-many")),
            (ROUTER, True, lambda: self._start_router(lr_many, "llama-router-many")),
        ]
        for column, many_presets, start in starts:
            item, url = start()
            healthy = wait_healthy(item, url)
            key = "many_presets" if many_presets else "main"
            self.startup_ms.setdefault(key, {})[column] = healthy * 1000.0
            (self.list_eps if many_presets else self.eps)[column] = Endpoint(column, url, item)
        self.list_eps[DIRECT] = self.eps[DIRECT]
        for column in ROUTERS:
            count = len(router_models(self.list_eps[column]))
            if count != self.cfg.presets:
                raise BenchError(f"{column} lists {count} models, expected {self.cfg.presets}")

    def warm_up(self) -> None:
        model = MODELS[0]
        chat, stream, tok = (chat_body(model, stream=False), chat_body(model, stream=True),
                             tokenize_body(model))
        for ep in self.eps.values():
            tally = ep.tally("warmup")
            for _ in range(5):
                attempt(partial(timed_request, ep.client, "POST", "/v1/chat/completions", chat),
                        tally)
                attempt(partial(timed_first_token, ep.client, stream), tally)
                attempt(partial(timed_first_token, ep.stream_client, stream, keep_alive=True),
                        tally)
            for _ in range(20):
                attempt(partial(timed_request, ep.client, "POST", "/tokenize", tok), tally)
        for column, ep in self.list_eps.items():
            path = "/v1/models" if column == DIRECT else "/models"
            for _ in range(3):
                attempt(partial(timed_request, ep.client, "GET", path, None),
                        ep.tally("warmup"))
        time.sleep(1.0)

    # ------------------------------------------------------------ phases

    def measure_memory_idle(self) -> None:
        idle: dict[str, float] = {}
        for column, ep in self.eps.items():
            readings = []
            for _ in range(5):
                readings.append(ep.rss())
                time.sleep(0.1)
            idle[column] = percentile(readings, 50) / MB
        self.results["rss_idle_mb"] = idle
        self.results["rss_idle_many_presets_mb"] = {
            c: self.list_eps[c].rss() / MB for c in ROUTERS}

    def measure_latency(self) -> None:
        model = MODELS[0]
        chat, stream, tok = (chat_body(model, stream=False), chat_body(model, stream=True),
                             tokenize_body(model))
        metrics: dict[str, Callable[[str], float]] = {
            "chat": lambda c: timed_request(self.eps[c].client, "POST", "/v1/chat/completions",
                                            chat),
            "ttft": lambda c: timed_first_token(self.eps[c].client, stream),
            "ttft_ka": lambda c: timed_first_token(self.eps[c].stream_client, stream,
                                                   keep_alive=True),
            "tokenize": lambda c: timed_request(self.eps[c].client, "POST", "/tokenize", tok),
            "models": lambda c: timed_request(self.list_eps[c].client, "GET",
                                              "/v1/models" if c == DIRECT else "/models", None),
        }
        samples: dict[str, dict[str, list[float]]] = {m: {c: [] for c in COLUMNS}
                                                      for m in metrics}
        for rnd in range(self.cfg.rounds):
            order = rotate(COLUMNS, rnd)
            with no_gc():
                for name, measure in metrics.items():
                    for _ in range(self.cfg.samples):
                        for column in order:
                            tally = self._ep(name, column).tally(name)
                            samples[name][column].append(attempt(partial(measure, column),
                                                                 tally))
        self.results["latency_ms"] = {name: {c: summary_ms(v) for c, v in per.items()}
                                      for name, per in samples.items()}

    def _ep(self, metric: str, column: str) -> Endpoint:
        return (self.list_eps if metric == "models" else self.eps)[column]

    def measure_throughput(self) -> None:
        tool = choose_load_tool(self.cfg.loadgen, self.workdir, MODELS[0])
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in COLUMNS}
        for rnd in range(self.cfg.throughput_rounds):
            for column in rotate(COLUMNS, rnd):
                runs[column].append(run_load(tool, self.eps[column], MODELS[0], self.cfg,
                                             watch_rss=column != DIRECT))
                time.sleep(0.5)
        self.results["throughput"] = {
            "tool": tool.name, "connections": self.cfg.connections,
            "duration_s": self.cfg.duration, "runs": runs,
            "rps": {c: percentile([r["rps"] for r in runs[c]], 50) for c in COLUMNS},
            "p50_ms": {c: percentile([r["p50_ms"] for r in runs[c]], 50) for c in COLUMNS},
            "p99_ms": {c: percentile([r["p99_ms"] for r in runs[c]], 50) for c in COLUMNS},
            "generator_cores": {c: percentile([r["generator_cores"] for r in runs[c]], 50)
                                for c in COLUMNS},
            "target_cores": {c: percentile([r["target_cores"] for r in runs[c]], 50)
                             for c in COLUMNS},
            "errors": {c: sum(r["errors"] for r in runs[c]) for c in COLUMNS},
        }
        self.results["rss_load_mb"] = {c: max(r["peak_rss_mb"] for r in runs[c])
                                       for c in ROUTERS}
        self.results["rss_load_mb"][DIRECT] = self.eps[DIRECT].rss() / MB
        if self.cfg.profile:
            self.results["profile"] = self.profile_router(tool)

    def profile_router(self, tool: LoadTool) -> dict[str, Any]:
        """py-spy the llama-router process under the same /tokenize load (not counted)."""
        spy = _py_spy()
        if spy is None:
            return {"error": "py-spy not installed (pip install py-spy)"}
        ep = self.eps[ROUTER]
        raw = self.workdir / "profile.txt"
        argv = [spy, "record", "--pid", str(ep.item.proc.pid), "--rate", "250",
                "--duration", f"{max(1, round(self.cfg.duration))}", "--format", "raw",
                "--nonblocking", "--output", str(raw)]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as spy_p:
            time.sleep(0.3)
            load = run_load(tool, ep, MODELS[0], self.cfg, watch_rss=False)
            _, err = spy_p.communicate(timeout=60)
        if spy_p.returncode != 0 or not raw.exists():
            return {"error": f"py-spy failed: {err.decode()[-300:]}"}
        return {"rps_while_profiled": load["rps"], **summarize_profile(raw.read_text())}

    def measure_cold(self) -> None:
        cold: dict[str, list[float]] = {c: [] for c in ROUTERS}
        swap: dict[str, list[float]] = {c: [] for c in ROUTERS}
        healthy: list[float] = []
        direct_first: list[float] = []
        cold_model, swap_model = MODELS[1], MODELS[2]
        for rnd in range(self.cfg.cold_rounds):
            for column in rotate(COLUMNS, rnd):
                if column == DIRECT:
                    to_healthy, to_first = self.direct_cold_start(cold_model, "baseline", 60.0)
                    healthy.append(to_healthy)
                    direct_first.append(to_first)
                    continue
                ep = self.eps[column]
                unload_all(ep)
                time.sleep(0.2)
                cold[column].append(attempt(partial(
                    timed_first_token, ep.client, chat_body(cold_model, stream=True)),
                    ep.tally("cold")))
                self.procs.note_descendants()
                # A non-streaming request first, as in normal use: it may leave an idle
                # keep-alive connection to the child that is about to be evicted.
                attempt(partial(timed_request, ep.client, "POST", "/tokenize",
                                tokenize_body(cold_model)), ep.tally("swap"))
                time.sleep(0.2)
                swap[column].append(attempt(partial(
                    timed_first_token, ep.client, chat_body(swap_model, stream=True)),
                    ep.tally("swap")))
                self.procs.note_descendants()
        self.results["cold_ms"] = {
            "child_healthy": summary_ms(healthy), "child_first_token": summary_ms(direct_first),
            "cold": {c: summary_ms(v) for c, v in cold.items()},
            "swap": {c: summary_ms(v) for c, v in swap.items()},
        }

    def run(self) -> dict[str, Any]:
        self.setup()
        self.warm_up()
        self.measure_memory_idle()
        self.measure_latency()
        self.measure_throughput()
        self.measure_cold()
        self.results["startup_ms"] = self.startup_ms
        self.results["retries"] = {  # direct serves both lists: count it once
            c: {"main": self.eps[c].failures,
                "many_presets": self.list_eps[c].failures if c != DIRECT else {}}
            for c in COLUMNS}
        return self.results

    def close(self) -> None:
        for ep in [*self.eps.values(), *self.list_eps.values()]:
            ep.close()

    def stop_targets(self) -> None:
        """Stop the main phase's servers: the phases after it start their own."""
        self.close()
        for ep in [*self.eps.values(), *self.list_eps.values()]:
            self.procs.stop(ep.item)


# --------------------------------------------------------------------------- profile summary

def _frame_module(frame: str) -> tuple[str, str]:
    """``func (path:line)`` → (function, module-ish label)."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame, "?"
    func, path = match.groups()
    if "site-packages/" in path:
        rest = path.split("site-packages/", 1)[1]
    elif re.search(r"/lib/python3\.\d+/", path):
        rest = "stdlib/" + re.split(r"/lib/python3\.\d+/", path, maxsplit=1)[1]
    else:
        rest = path
    rest = rest.removesuffix(".py").replace("/__init__", "")
    return func, rest.replace("/", ".")


def summarize_profile(raw: str, top: int = 25) -> dict[str, Any]:
    """Self time by function and by package, inclusive time by package, from py-spy raw."""
    total = 0
    self_fn: dict[str, int] = {}
    self_pkg: dict[str, int] = {}
    incl_pkg: dict[str, int] = {}
    incl_fn: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame_module(f) for f in stack.split(";") if f]
        if not frames:
            continue
        func, module = frames[-1]
        self_fn[f"{module}:{func}"] = self_fn.get(f"{module}:{func}", 0) + count
        package = _package(module)
        self_pkg[package] = self_pkg.get(package, 0) + count
        for pkg in {_package(m) for _, m in frames}:
            incl_pkg[pkg] = incl_pkg.get(pkg, 0) + count
        for name in {f"{m}:{f}" for f, m in frames}:
            incl_fn[name] = incl_fn.get(name, 0) + count

    def ranked(table: dict[str, int]) -> list[tuple[str, float]]:
        items = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        return [(k, round(100.0 * v / total, 1)) for k, v in items]

    if total == 0:
        return {"samples": 0}
    return {"samples": total, "self_by_function_pct": ranked(self_fn),
            "self_by_package_pct": ranked(self_pkg),
            "inclusive_by_package_pct": ranked(incl_pkg),
            "inclusive_by_function_pct": ranked(incl_fn)}


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "stdlib":
        return "stdlib." + (parts[1] if len(parts) > 1 else "?")
    if "router" in parts[:-1]:
        return "router." + parts[parts.index("router") + 1]
    return parts[0]


# --------------------------------------------------------------------------- report

@dataclass
class Row:
    key: str
    label: str
    unit: str
    kind: str  # "latency": added ms vs direct; "rate": ratio vs direct; "info": none
    values: dict[str, float]


def build_rows(res: dict[str, Any], presets: int) -> list[Row]:
    lat = res["latency_ms"]
    rows: list[Row] = []
    for name, label in (("chat", "chat max_tokens=1"), ("ttft", "stream first token"),
                        ("ttft_ka", "stream first token, keep-alive client"),
                        ("tokenize", "POST /tokenize")):
        for stat in ("p50", "p99"):
            rows.append(Row(f"{name}_{stat}_ms", f"{label} {stat}", "ms", "latency",
                            {c: lat[name][c][stat] for c in COLUMNS}))
    tput = res["throughput"]
    conns = tput["connections"]
    rows.append(Row("tokenize_rps", f"/tokenize throughput, {conns} conns", "req/s", "rate",
                    tput["rps"]))
    rows.append(Row("tokenize_load_p99_ms", "/tokenize p99 under that load", "ms", "latency",
                    tput["p99_ms"]))
    rows.append(Row("target_cores", "server CPU under load (cores)", "cores", "info",
                    tput["target_cores"]))
    rows.append(Row("generator_cores", f"{tput['tool']} CPU (cores)", "cores", "info",
                    tput["generator_cores"]))
    cold = res["cold_ms"]
    healthy = cold["child_healthy"]["p50"]
    first = cold["child_first_token"]["p50"]
    rows.append(Row("cold_vs_healthy_ms", "cold start p50 [direct: spawn->/health 200]", "ms",
                    "latency", {DIRECT: healthy,
                                **{c: cold["cold"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("cold_vs_first_token_ms", "cold start p50 [direct: spawn->1st token]",
                    "ms", "latency",
                    {DIRECT: first, **{c: cold["cold"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("swap_ms", "swap (max 1) p50 [direct: spawn->1st token]", "ms",
                    "latency", {DIRECT: first, **{c: cold["swap"][c]["p50"] for c in ROUTERS}}))
    rows.append(Row("rss_idle_mb", "RSS idle, MB [direct: llama-server]", "MB", "info",
                    res["rss_idle_mb"]))
    rows.append(Row("rss_load_mb", "RSS under load (peak), MB", "MB", "info",
                    res["rss_load_mb"]))
    for stat in ("p50", "p99"):
        rows.append(Row(f"models_{stat}_ms", f"GET /models, {presets} presets {stat} "
                        "[direct: 1 model]", "ms", "latency",
                        {c: lat["models"][c][stat] for c in COLUMNS}))
    rows.append(Row("startup_ms", "start -> /health 200 (3 presets)", "ms", "latency",
                    res["startup_ms"]["main"]))
    total = sum(lat[m][DIRECT]["n"] for m in LATENCY_METRICS)
    rows.append(Row("tokenize_load_errors", "throughput errors (non-2xx, socket errors)",
                    "count", "info", tput["errors"]))
    for kind, label in (("dropped", "keep-alive conn closed under client"),
                        ("http_502", "HTTP 502 from the router")):
        counts = {c: float(sum(per.get(kind, 0)
                               for part in res["retries"][c].values()
                               for phase, per in part.items() if phase in LATENCY_METRICS))
                  for c in COLUMNS}
        rows.append(Row(f"retries_{kind}", f"retried: {label}, of {total} samples", "count",
                        "info", counts))
    return rows


def evaluate(res: dict[str, Any], rows: list[Row]) -> dict[str, dict[str, Any]]:
    by = {r.key: r.values for r in rows}
    tok = by["tokenize_p50_ms"]
    lr_added, lc_added = tok[ROUTER] - tok[DIRECT], tok[LLAMACPP] - tok[DIRECT]
    rps = by["tokenize_rps"]
    ttft = by["ttft_p50_ms"]
    cold = by["cold_vs_healthy_ms"]

    def ahead(metric: str) -> tuple[bool, str]:
        p50, p99 = by[f"{metric}_p50_ms"], by[f"{metric}_p99_ms"]
        lr, lc = p50[ROUTER] - p50[DIRECT], p50[LLAMACPP] - p50[DIRECT]
        return lr < lc, (f"llama-router {lr:+.3f} ms vs llama.cpp router {lc:+.3f} ms "
                         f"(p99 {p99[ROUTER]:.2f} vs {p99[LLAMACPP]:.2f} ms, direct "
                         f"{p99[DIRECT]:.2f} ms)")

    checks: dict[str, tuple[bool, str]] = {
        "tokenize_added_p50": (lr_added < lc_added,
                               f"llama-router +{lr_added:.3f} ms vs llama.cpp router "
                               f"+{lc_added:.3f} ms"),
        "tokenize_throughput": (rps[ROUTER] >= 1.5 * rps[LLAMACPP],
                                f"{rps[ROUTER]:.0f} vs {rps[LLAMACPP]:.0f} req/s = "
                                f"{rps[ROUTER] / rps[LLAMACPP]:.2f}x"),
        "ttft_added_p50": (ttft[ROUTER] - ttft[DIRECT] <= 1.0,
                           f"{ttft[ROUTER] - ttft[DIRECT]:+.3f} ms"),
        "ttft_vs_llamacpp": ahead("ttft"),
        "ttft_ka_vs_llamacpp": ahead("ttft_ka"),
        "cold_start_added": (cold[ROUTER] - cold[DIRECT] <= 30.0,
                             f"{cold[ROUTER]:.1f} ms vs child healthy {cold[DIRECT]:.1f} ms "
                             f"= +{cold[ROUTER] - cold[DIRECT]:.1f} ms"),
        "idle_rss": (by["rss_idle_mb"][ROUTER] <= 80.0, f"{by['rss_idle_mb'][ROUTER]:.1f} MB"),
        "models_500_p50": (by["models_p50_ms"][ROUTER] < 20.0,
                           f"{by['models_p50_ms'][ROUTER]:.2f} ms "
                           f"(p99 {by['models_p99_ms'][ROUTER]:.2f} ms)"),
    }
    return {k: {"goal": GOALS[k], "met": ok, "measured": text}
            for k, (ok, text) in checks.items()}


def _fmt(value: float) -> str:
    if value == int(value) and value < 1000:
        return str(int(value))
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


def render_table(rows: list[Row]) -> str:
    header = ["metric", LABELS[DIRECT], LABELS[LLAMACPP], LABELS[ROUTER],
              "llama.cpp vs direct", "llama-router vs direct", "llama-router / llama.cpp"]
    table = [header]
    for row in rows:
        v = row.values
        cells = [row.label if row.unit in row.label or row.unit == "count"
                 else f"{row.label} ({row.unit})",
                 *(_fmt(v[c]) for c in COLUMNS)]
        if row.kind == "latency":
            cells += [f"{v[c] - v[DIRECT]:+.3f} ms" for c in ROUTERS]
        elif row.kind == "rate":
            cells += [f"{v[c] / v[DIRECT]:.3f}x" for c in ROUTERS]
        else:
            cells += ["", ""]
        cells.append(f"{v[ROUTER] / v[LLAMACPP]:.2f}x"
                     if v[LLAMACPP] and row.unit != "count" else "")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |"
             for r in table]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + (":" if i else "-")
                                   for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def machine_info(binary: Path, router_src: Path | None = None) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=30)
    build = next((ln.strip() for ln in (version.stdout + version.stderr).splitlines()
                  if "build" in ln), "unknown")
    wrk = shutil.which("wrk")
    wrk_version = "not installed"
    if wrk:
        out = subprocess.run([wrk, "--version"], capture_output=True, text=True, timeout=10)
        wrk_version = (out.stdout + out.stderr).splitlines()[0] if out.stdout + out.stderr \
            else "unknown"
    root = router_src or ROOT  # the routers under test run from there
    source = str(root)
    if (root / ".git").exists():
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "router"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        source += f" @ {rev}{' (router/ modified)' if dirty else ''}"
    return {"nproc": os.cpu_count(), "cpu": cpu, "router_source": source,
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "llama_server": str(binary), "llama_cpp_build": build, "wrk": wrk_version}


def run_bench(cfg: Config) -> dict[str, Any]:
    binary = find_llama_server()
    keep = cfg.workdir is not None
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="llama-router-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = workdir / "logs"
    logdir.mkdir(exist_ok=True)
    procs = Processes(logdir)
    bench = Bench(cfg, workdir, procs, binary)
    began = time.perf_counter()
    load_before = os.getloadavg()
    leftovers: list[str] = []
    results: dict[str, Any] = {}
    sharing: dict[str, Any] | None = None
    phases: dict[str, dict[str, Any]] = {}
    phase_wall: dict[str, float] = {}
    mark = time.perf_counter()

    def took(phase: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phase_wall[phase] = round(now - mark, 1)
        mark = now

    try:
        if "main" in cfg.phases:
            results = bench.run()
            bench.stop_targets()
            took("main")
        if "relay" in cfg.phases:
            from . import relay

            settings = relay.Settings.quick() if cfg.quick else relay.Settings()
            if cfg.relay_streams:
                settings.streams = settings.ceiling_streams = cfg.relay_streams
            settings.events = cfg.relay_events or settings.events
            settings.rounds = cfg.relay_rounds or settings.rounds
            settings.profile = cfg.profile
            phases["relay"] = relay.run_phase(bench, settings)
            took("relay")
        if "real" in cfg.phases and cfg.real_rounds > 0:
            from . import realmodel  # imports this module

            real = realmodel.Settings.quick() if cfg.quick else realmodel.Settings()
            real.rounds = cfg.real_rounds if not cfg.quick else real.rounds
            phases["real_model"] = realmodel.run_phase(bench, real)
            took("real")
        if "multiturn" in cfg.phases and cfg.multiturn_reps > 0:
            from . import multiturn

            if cfg.multiturn_saturated:
                turns = multiturn.Settings.saturated(cfg.multiturn_reps,
                                                     cfg.multiturn_baseline)
                turns.cache_ram_mib = cfg.multiturn_cache_ram
                if cfg.quick:
                    turns.system_words, turns.max_tokens, turns.turns = 80, 4, 2
            else:
                turns = multiturn.Settings.quick() if cfg.quick else multiturn.Settings(
                    conversations=cfg.conversations, turns=cfg.turns, reps=cfg.multiturn_reps,
                    baseline_src=cfg.multiturn_baseline)
            phases["multiturn"] = multiturn.run_phase(bench, turns)
            took("multiturn")
        if "warmswap" in cfg.phases and cfg.warmswap_reps > 0:
            from . import warmswap

            swaps = warmswap.Settings.quick() if cfg.quick else warmswap.Settings(
                reps=cfg.warmswap_reps)
            phases["warmswap"] = warmswap.run_phase(bench, swaps)
            took("warmswap")
        if "bodies" in cfg.phases:
            from . import bodies

            phases["bodies"] = bodies.run_phase(bench, cfg.quick)
            took("bodies")
        if "sharing" in cfg.phases and cfg.sharing_reps > 0:
            from .sharing import run_phase

            sharing = run_phase(workdir, procs, binary, cfg.sharing_reps, cfg.stall_bound,
                                cfg.quick)
            took("sharing")
    except BaseException:
        for item in procs.items:
            print(f"--- {item.name} log tail ---\n{item.tail(15)}", file=sys.stderr)
        raise
    finally:
        bench.close()
        leftovers = procs.stop_all()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if leftovers:
            print(f"WARNING: killed leftover processes: {leftovers}", file=sys.stderr)
    report: dict[str, Any] = {
        "machine": machine_info(binary, cfg.router_src),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
        "columns": {c: LABELS[c] for c in COLUMNS},
        "details": results,
        "leftover_processes": leftovers,
        "loadavg_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - began, 1),
        "phase_wall_s": phase_wall,
        "targets": {},
    }
    if results:
        rows = build_rows(results, cfg.presets)
        report["metrics"] = {r.key: {"label": r.label, "unit": r.unit, "kind": r.kind,
                                     **r.values} for r in rows}
        report["targets"] = evaluate(results, rows)
        report["table"] = render_table(rows)
    for name, phase in phases.items():
        report[name] = phase
        report["targets"].update(phase["targets"])
    if sharing is not None:
        report["sharing"] = sharing
        report["targets"].update(sharing["targets"])
    return report


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print(f"\nmachine: {machine['nproc']} x {machine['cpu']}, {machine['ram_gb']} GB RAM, "
          f"Python {machine['python']}, llama.cpp {machine['llama_cpp_build']}")
    details = report["details"]
    print(f"llama-router source: {machine['router_source']}")
    tool = details["throughput"]["tool"] if details else "-"
    level = report["config"].get("router_log_level") or "its default (info)"
    phase_wall = ", ".join(f"{k} {v:g} s" for k, v in report.get("phase_wall_s", {}).items())
    print(f"throughput generator: {tool}; llama-router log level: {level}; "
          f"wall {report['wall_s']} s ({phase_wall}); "
          f"1-min load average {report['loadavg_1m']['start']} -> {report['loadavg_1m']['end']}\n")
    if "table" in report:
        print(report["table"])
        print()
    for name, title in (("relay", "Relaying streamed tokens (tiny model, parallel = N, "
                                  "threads = 1):"),
                        ("real_model", "Real model (SmolLM2-135M-Instruct Q4_1):"),
                        ("multiturn", "Multi-turn conversations, replicas = 2 (SmolLM2):"),
                        ("warmswap", "A conversation's next turn after its model was swapped "
                                     "out (SmolLM2, ~2,000 tokens):"),
                        ("bodies", "The largest request bodies, while /health is asked every "
                                   "10 ms (tiny model):")):
        phase = report.get(name)
        if phase is None:
            continue
        print(title)
        print(phase.get("table") or phase.get("skipped"))
        print()
    if "sharing" in report:
        print("Models generating at the same time on the CPU (seconds; '>' = stalled past "
              "the bound):")
        print(report["sharing"]["table"])
        print()
    for target in report["targets"].values():
        mark = {True: "MET   ", False: "MISSED", None: "NOTRUN"}[target["met"]]
        print(f"{mark} {target['goal']}: {target['measured']}")
    profile = details.get("profile")
    if profile and "self_by_function_pct" in profile:
        print(f"\nllama-router profile under /tokenize load ({profile['samples']} samples, "
              f"{profile['rps_while_profiled']:.0f} req/s while sampled):")
        print("  self time by package: " + ", ".join(
            f"{k} {v}%" for k, v in profile["self_by_package_pct"][:12]))
        print("  top self functions:")
        for name, pct in profile["self_by_function_pct"][:15]:
            print(f"    {pct:5.1f}%  {name}")
    elif profile:
        print(f"\nprofile: {profile.get('error')}")


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Benchmark a direct llama-server, llama.cpp's router mode and "
        "llama-router on this machine (tiny generated models).")
    parser.add_argument("--rounds", type=int, help="interleaved latency rounds (default 10)")
    parser.add_argument("--samples", type=int,
                        help="requests per target, metric and round (default 40)")
    parser.add_argument("--duration", type=float,
                        help="seconds per throughput run (default 5)")
    parser.add_argument("--throughput-rounds", type=int,
                        help="throughput runs per target (default 3)")
    parser.add_argument("--cold-rounds", type=int,
                        help="cold-start and swap samples per router (default 5)")
    parser.add_argument("--connections", type=int, help="throughput connections (default 32)")
    parser.add_argument("--presets", type=int,
                        help="sections in the GET /models preset file (default 500)")
    parser.add_argument("--load-tool", dest="loadgen_tool", choices=["auto", "wrk", "python"],
                        default="auto", help="throughput generator (default: wrk if installed)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy llama-router under the /tokenize load (extra run)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings for a smoke test (a few seconds per phase)")
    parser.add_argument("--sharing-reps", type=int,
                        help="repetitions of the CPU-sharing phase (default 3; 0 skips it)")
    parser.add_argument("--stall-bound", type=float,
                        help="seconds before a run of the CPU-sharing phase counts as stalled "
                        "(default 30)")
    parser.add_argument("--only-sharing", action="store_true",
                        help="run only the CPU-sharing phase (= --phases sharing)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma list of the phases to run, of {', '.join(PHASES)} "
                        "(default: all)")
    parser.add_argument("--real-rounds", type=int,
                        help="interleaved rounds of the real-model phase (default 4; 0 skips)")
    parser.add_argument("--conversations", type=int,
                        help="concurrent conversations of the multi-turn phase (default 4)")
    parser.add_argument("--turns", type=int,
                        help="turns per conversation of the multi-turn phase (default 3)")
    parser.add_argument("--multiturn-reps", type=int,
                        help="runs of the multi-turn workload per target (default 1; 0 skips)")
    parser.add_argument("--warmswap-reps", type=int,
                        help="repetitions of the warm-swap phase per target (default 3; 0 "
                        "skips it)")
    parser.add_argument("--multiturn-saturated", action="store_true",
                        help="the multi-turn phase's saturated configuration: 8 conversations "
                        "of ~1,000 tokens at once, shuffled each turn, two one-slot replicas")
    parser.add_argument("--multiturn-cache-ram",
                        help="each child's cache-ram in MiB in the saturated configuration "
                        "(default 512; 'default': the router's own, one KV cache's worth)")
    parser.add_argument("--multiturn-baseline", type=Path,
                        help="also run the multi-turn phase's prefix routing from this "
                        "llama-router source tree (before/after in one run)")
    parser.add_argument("--relay-streams",
                        help="comma list of concurrent streams of the relay phase "
                        "(default 8,64,256)")
    parser.add_argument("--relay-events", type=int,
                        help="events per run of the relay phase, all streams together "
                        "(default 8192; the ceiling's: 120000)")
    parser.add_argument("--relay-rounds", type=int,
                        help="interleaved rounds of the relay phase (default 3)")
    parser.add_argument("--router-log-level",
                        help="start llama-router with this --log-level (default: none given, "
                        "so its default, info)")
    parser.add_argument("--router-src", type=Path,
                        help="run llama-router from this source tree (a copy of the "
                        "repository) instead of this one: before/after comparisons")
    parser.add_argument("--workdir", type=Path, help="keep models, presets and logs here")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--loadgen", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen-body", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.loadgen:
        return loadgen_main(args.loadgen, (args.loadgen_body or "").encode(),
                            args.connections or 32, args.duration or 5.0)

    cfg = Config()
    if args.quick:
        cfg = Config(rounds=1, samples=5, duration=1.0, throughput_rounds=1, cold_rounds=1,
                     presets=500)
    for name in ("rounds", "samples", "duration", "throughput_rounds", "cold_rounds",
                 "connections", "presets"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.quick:
        cfg.sharing_reps = 1
        cfg.quick = True
    if args.sharing_reps is not None:
        if args.sharing_reps < 0:
            parser.error("--sharing-reps must be 0 or more")
        cfg.sharing_reps = args.sharing_reps
    cfg.only_sharing = args.only_sharing
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        parser.error(f"--phases: unknown {', '.join(unknown) or 'empty list'}; "
                     f"choose from {', '.join(PHASES)}")
    cfg.phases = ("sharing",) if args.only_sharing else phases
    for name in ("real_rounds", "conversations", "turns", "multiturn_reps", "warmswap_reps"):
        value = getattr(args, name)
        if value is not None:
            if value < (0 if name in ("real_rounds", "multiturn_reps", "warmswap_reps")
                        else 1):
                parser.error(f"--{name.replace('_', '-')} is out of range")
            setattr(cfg, name, value)
    if args.relay_streams is not None:
        try:
            cfg.relay_streams = tuple(int(n) for n in args.relay_streams.split(","))
        except ValueError:
            parser.error("--relay-streams: a comma list of numbers")
        if not cfg.relay_streams or min(cfg.relay_streams) < 1:
            parser.error("--relay-streams: each at least 1")
    for name in ("relay_events", "relay_rounds"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                parser.error(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.turns is not None and args.turns < 2:
        parser.error("--turns must be 2 or more (follow-up turns are measured)")
    cfg.router_log_level = args.router_log_level
    if args.router_src is not None:
        if not (args.router_src / "router" / "cli.py").is_file():
            parser.error(f"--router-src: no router/cli.py in {args.router_src}")
        cfg.router_src = args.router_src.resolve()
    cfg.multiturn_saturated = args.multiturn_saturated
    if args.multiturn_cache_ram is not None:
        if args.multiturn_cache_ram == "default":
            cfg.multiturn_cache_ram = None
        elif args.multiturn_cache_ram.isdigit():
            cfg.multiturn_cache_ram = int(args.multiturn_cache_ram)
        else:
            parser.error("--multiturn-cache-ram: a number of MiB, or 'default'")
    if args.multiturn_baseline is not None:
        if not (args.multiturn_baseline / "router" / "cli.py").is_file():
            parser.error(f"--multiturn-baseline: no router/cli.py in {args.multiturn_baseline}")
        cfg.multiturn_baseline = args.multiturn_baseline.resolve()
    if args.stall_bound is not None:
        if args.stall_bound <= 0:
            parser.error("--stall-bound must be positive")
        cfg.stall_bound = args.stall_bound
    cfg.loadgen = args.loadgen_tool
    cfg.profile = args.profile
    cfg.workdir = args.workdir

    try:
        report = run_bench(cfg)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    # Run the one ``benchmarks.bench`` that the phase modules import (``-m`` runs this file
    # as ``__main__``, a second copy whose BenchError they would not raise).
    from benchmarks.bench import main as _main

    raise SystemExit(_main())
