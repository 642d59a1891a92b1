"""The benchmark harness: the targets it starts (a direct llama-server, llama.cpp's own
router mode, llama-router), the processes it owns, and the measurements every phase shares.

Every phase (``benchmarks.relay``, ``benchmarks.realmodel``, ...) and the runner
(``benchmarks.bench``) import this module; it imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from router.children.process import free_port
from router.host.cpus import CpuShare, OtherWork, machine_cores
from router.llama.tinymodel import write_tiny_model

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
PHASES = ("main", "relay", "real", "multiturn", "warmswap", "keptcache", "fairness", "bodies",
          "sharing")

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


def alike_environment() -> dict[str, str]:
    """The environment llama-router would give a lone child started now (``CHILD_CPU``):
    libgomp's own spin on a quiet machine, ``GOMP_SPINCOUNT=3000`` while other work keeps it
    busy (``cpus.OtherWork``, read over half a second, the harness itself not counted). The
    direct server and llama.cpp's router's children get it, so every child computes alike."""
    work = OtherWork()
    work.sample([os.getpid()], time.monotonic())
    time.sleep(0.5)
    work.sample([os.getpid()], time.monotonic())
    return CpuShare(CHILD_CPU.cores, shared=work.busy).environment()


_COMPILED: set[Path] = set()
# What llama-router reads at a spawn as the machine's other work is the last second's
# (``cpus.OtherWork``): a target's first request comes after this long with nothing running,
# so its child starts as on a machine used for nothing else (``Bench.quiet``).
QUIET_S = 2.5


def compile_once(src: Path) -> None:
    """Write ``src``'s ``router`` package's bytecode, as an install does (pip compiles every
    module; ``make run`` too): a router started where none is kept (``PYTHONDONTWRITEBYTECODE``)
    would otherwise compile all its modules at every start, and the start rows would measure
    the compiler."""
    if src not in _COMPILED:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "router")],
                       check=True, stdout=subprocess.DEVNULL)
        _COMPILED.add(src)


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
    keptcache: bool = True  # the kept-cache phase (benchmarks.keptcache)
    fairness_seconds: float = 20.0  # each scenario of the teams phase (benchmarks.fairness)
    keptcache_long_words: int = 0  # its long conversation's words (7200: ~8,000 tokens)
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


# Linux's CPU-time clock of a whole process: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED).
CPUCLOCK_SCHED = 2


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (not its children's), every thread's, those that
    ended included: on Linux the kernel's CPU-time clock of the process, in nanoseconds (a sum
    over the live threads' ``schedstat`` drops a thread that ended meanwhile, and psutil's
    clock ticks, 10 ms, are far coarser than one load's work); psutil elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            return time.clock_gettime_ns((~pid << 3) | CPUCLOCK_SCHED) / 1e9
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


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
    floor: Managed | None = None  # benchmarks.floorstart, from its start to the idle RSS

    # ------------------------------------------------------------ start

    def quiet(self) -> None:
        """``QUIET_S`` with nothing running (not in a ``--quick`` run)."""
        if not self.cfg.quick:
            time.sleep(QUIET_S)

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
                                env=alike_environment())
        return item, f"http://127.0.0.1:{port}"

    def _start_llamacpp(self, presets: Path, name: str) -> tuple[Managed, str]:
        port = free_port()
        cache = self.workdir / "llama-cache"  # empty: no HF cache models in the listing
        cache.mkdir(exist_ok=True)
        item = self.procs.start(name, [str(self.binary), "--host", "127.0.0.1", "--port",
                                       str(port), "--models-preset", str(presets),
                                       "--models-max", "1"],
                                env={"LLAMA_CACHE": str(cache), **alike_environment()},
                                cwd=self.workdir)
        return item, f"http://127.0.0.1:{port}"

    def _start_router(self, presets: Path, name: str, src: Path | None = None,
                      extra_args: Sequence[str] = ("--models-max", "1")
                      ) -> tuple[Managed, str]:
        """llama-router on ``presets``, from the source tree ``src`` if given, with
        ``extra_args`` (default: ``--models-max 1``)."""
        port = free_port()
        level = self.cfg.router_log_level
        compile_once(src or self.cfg.router_src or ROOT)
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
        # model alone (CHILD_CPU and its environment), so the rows measure the serving path.
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
        port = free_port()
        self.floor = self.procs.start("python-floor", [sys.executable, "-m",
                                                       "benchmarks.floorstart", str(port)],
                                      cwd=ROOT)
        self.startup_ms["python_floor"] = {
            ROUTER: wait_healthy(self.floor, f"http://127.0.0.1:{port}") * 1000.0}
        for column in ROUTERS:
            count = len(router_models(self.list_eps[column]))
            if count != self.cfg.presets:
                raise BenchError(f"{column} lists {count} models, expected {self.cfg.presets}")

    def warm_up(self) -> None:
        model = MODELS[0]
        chat, stream, tok = (chat_body(model, stream=False), chat_body(model, stream=True),
                             tokenize_body(model))
        for ep in self.eps.values():
            self.quiet()  # its child starts on a machine the other targets left alone
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
        if self.floor is not None:
            self.results["rss_idle_python_floor_mb"] = \
                psutil.Process(self.floor.proc.pid).memory_info().rss / MB
            self.procs.stop(self.floor)
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
        cold_cpu: dict[str, list[float]] = {c: [] for c in ROUTERS}
        swap_cpu: dict[str, list[float]] = {c: [] for c in ROUTERS}
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
                pid = ep.item.proc.pid
                unload_all(ep)
                time.sleep(0.2)
                used = process_cpu_s(pid)
                cold[column].append(attempt(partial(
                    timed_first_token, ep.client, chat_body(cold_model, stream=True)),
                    ep.tally("cold")))
                cold_cpu[column].append(process_cpu_s(pid) - used)
                self.procs.note_descendants()
                # A non-streaming request first, as in normal use: it may leave an idle
                # keep-alive connection to the child that is about to be evicted.
                attempt(partial(timed_request, ep.client, "POST", "/tokenize",
                                tokenize_body(cold_model)), ep.tally("swap"))
                time.sleep(0.2)
                used = process_cpu_s(pid)
                swap[column].append(attempt(partial(
                    timed_first_token, ep.client, chat_body(swap_model, stream=True)),
                    ep.tally("swap")))
                swap_cpu[column].append(process_cpu_s(pid) - used)
                self.procs.note_descendants()
        self.results["cold_ms"] = {
            "child_healthy": summary_ms(healthy), "child_first_token": summary_ms(direct_first),
            "cold": {c: summary_ms(v) for c, v in cold.items()},
            "swap": {c: summary_ms(v) for c, v in swap.items()},
            # the router process's own CPU (its children's excluded) from the request to its
            # first token: what it spends on a load, beside the child's own work
            "cold_cpu": {c: summary_ms(v) for c, v in cold_cpu.items()},
            "swap_cpu": {c: summary_ms(v) for c, v in swap_cpu.items()},
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


# ----------------------------------------------------------------- profile summary and table

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


@dataclass
class Row:
    key: str
    label: str
    unit: str
    kind: str  # "latency": added ms vs direct; "rate": ratio vs direct; "info": none
    values: dict[str, float]


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

