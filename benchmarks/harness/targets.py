"""The targets a phase starts, alike: a direct llama-server, llama.cpp's own router mode and
llama-router (``Bench``, what every phase is handed), every child computing as llama-router
would run a model alone; each started target's HTTP endpoint, the preset files they read,
and a router's models listed and unloaded."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import psutil

from router.children.process import free_port
from router.host.cpus import CpuShare, OtherWork, machine_cores

from .config import Config
from .errors import BenchError
from .processes import ROOT, Managed, Processes, wait_healthy
from .timing import attempt, chat_body, request_json, timed_first_token

CHILD_FLAGS = ("-c", "2048", "-np", "4", "--metrics")
# What llama-router gives a model alone on this machine (``cpus``); the direct server and
# llama.cpp's router's children get the same.
CHILD_CPU = CpuShare(tuple(machine_cores()))
# What llama-router reads at a spawn as the machine's other work is the last second's
# (``cpus.OtherWork``): a target's first request comes after this long with nothing running,
# so its child starts as on a machine used for nothing else (``Bench.quiet``).
QUIET_S = 2.5
_COMPILED: set[Path] = set()


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


def compile_once(src: Path) -> None:
    """Write ``src``'s ``router`` package's bytecode, as an install does (pip compiles every
    module; ``make run`` too): a router started where none is kept (``PYTHONDONTWRITEBYTECODE``)
    would otherwise compile all its modules at every start, and the start rows would measure
    the compiler."""
    if src not in _COMPILED:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "router")],
                       check=True, stdout=subprocess.DEVNULL)
        _COMPILED.add(src)


def write_presets(path: Path, sections: dict[str, Path], extra: Sequence[str],
                  parallel: int = 4, ctx_size: int = 2048) -> Path:
    lines = ["version = 1", "", "[*]", f"ctx-size = {ctx_size}", f"parallel = {parallel}",
             *extra, ""]
    for name, model in sections.items():
        lines += [f"[{name}]", f"model = {model}", ""]
    path.write_text("\n".join(lines))
    return path


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


@dataclass
class Bench:
    """What every phase is handed: the run's configuration, its working folder, the
    processes, the llama-server binary and the models by name; and the starting of each kind
    of target on free 127.0.0.1 ports."""

    cfg: Config
    workdir: Path
    procs: Processes
    binary: Path
    models: dict[str, Path] = field(default_factory=dict)

    def quiet(self) -> None:
        """``QUIET_S`` with nothing running (not in a ``--quick`` run)."""
        if not self.cfg.quick:
            time.sleep(QUIET_S)

    def direct_cold_start(self, model: str, name: str, timeout: float) -> tuple[float, float]:
        """A new direct llama-server for ``model``: seconds from its spawn to ``/health`` 200,
        and to the first token of a streamed chat; then it is stopped."""
        # The client exists before the spawn: creating one costs ~15 ms.
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            item, url = self.start_direct(model, name)
            try:
                healthy = wait_healthy(item, url, interval=0.002)
                attempt(partial(timed_first_token, client, chat_body(model, stream=True),
                                url + "/v1/chat/completions"), {})
                return healthy, time.perf_counter() - item.started
            finally:
                self.procs.stop(item)

    def start_direct(self, model: str, name: str,
                     flags: Sequence[str] = CHILD_FLAGS) -> tuple[Managed, str]:
        port = free_port()
        item = self.procs.start(name, [str(self.binary), "-m", str(self.models[model]),
                                       *flags, *CHILD_CPU.argv(), "--host", "127.0.0.1",
                                       "--port", str(port), "--alias", model],
                                env=alike_environment())
        return item, f"http://127.0.0.1:{port}"

    def start_llamacpp(self, presets: Path, name: str) -> tuple[Managed, str]:
        port = free_port()
        cache = self.workdir / "llama-cache"  # empty: no HF cache models in the listing
        cache.mkdir(exist_ok=True)
        item = self.procs.start(name, [str(self.binary), "--host", "127.0.0.1", "--port",
                                       str(port), "--models-preset", str(presets),
                                       "--models-max", "1"],
                                env={"LLAMA_CACHE": str(cache), **alike_environment()},
                                cwd=self.workdir)
        return item, f"http://127.0.0.1:{port}"

    def start_router(self, presets: Path, name: str, src: Path | None = None,
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
