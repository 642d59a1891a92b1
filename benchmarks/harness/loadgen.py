"""Throughput runs: ``/tokenize`` on many keep-alive connections for a while, driven by wrk
(with a Lua script for the body) or by the Python generator (raw asyncio on uvloop, run as
``python -m benchmarks.bench --loadgen``), with the generator's and the target's CPU and the
target's peak RSS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from .config import Config
from .errors import BenchError
from .processes import ROOT
from .stats import MB, percentile
from .targets import Endpoint
from .timing import tokenize_body

# --------------------------------------------------------------------------- wrk

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


# --------------------------------------------------------------------------- the Python generator

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


# --------------------------------------------------------------------------- a run

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
