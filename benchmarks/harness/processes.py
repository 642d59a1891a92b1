"""The processes the harness starts: each with its log, readiness (``/health`` 200), CPU
clock, and a stop that leaves nothing behind (every descendant ever seen, checked with
psutil)."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from .errors import BenchError

# The repository root: the working directory of every Python process the harness starts
# (``-m router.cli``, ``-m benchmarks.bench --loadgen``), so both packages import from here.
ROOT = Path(__file__).resolve().parent.parent.parent
HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
# Linux's CPU-time clock of a whole process: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED).
CPUCLOCK_SCHED = 2


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
