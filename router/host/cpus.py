"""CPU sharing: which cores each llama-server child computes on, and with how many threads.

Why: llama-server sizes its thread pool as if it owned the machine, and ggml's threads
spin-wait at every barrier of every graph. Two children whose thread sets overlap on a core
therefore stall each other: a spinning thread holds the core that the thread it waits for
needs (measured on 2 cores: 1,000 tokens each from two tiny models took 0.6 s one after the
other and 14 to 81 s at the same time).

Policy (``plan_shares``, a pure function; the supervisor calls it when it spawns children):

* The machine's cores are ``machine_cores()``: the router's own CPU affinity, one logical CPU
  per physical core (SMT siblings share a core's units, as llama.cpp's default thread count
  assumes), at most as many as a cgroup CPU quota allows (a container limited to 4 CPUs has 4).
* A model's children split those cores: one child gets all of them, ``replicas = N`` gives
  each replica 1/N, disjoint, one thread per core, confined to them with ``--cpu-mask``. So
  a model alone always has the whole machine, and replicas of one model never share a core.
* Different models do share cores; ``cpugate`` makes those with more than one thread take
  turns while several have requests in flight, so they never spin against each other.
* A child whose layers all run on a GPU computes little on the CPU: one thread on the least
  used core (single-threaded children never spin at a barrier, so sharing costs no stall).
* A preset (or ``--`` child argument) that sets any of ``CPU_KEYS`` places its child itself:
  the router adds nothing, does not count it and does not pause it.

Shares are decided at spawn and kept for the child's life (llama-server cannot change its
threads while running); a crashed replica's replacement takes the cores it freed.

How a child's threads wait (``CpuShare.shared``, decided by the spawner at each spawn): a
child whose cores no other model's child holds, on a machine that other work left idle in the
last second (``OtherWork``), computes alone and keeps libgomp's own spin, at a direct
llama-server's speed; a child spawned onto cores that another model's child already computes
on, or while other processes keep the machine busy, gets ``POLITE_SPIN`` (see there). While
two wide children compute, ``cpugate`` gives them turns, so a child spins only during its own
turn. The decision holds for the child's life: a model loaded alone keeps its spin when
another loads beside it, or when other work starts later.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .memory import option_value

# Preset keys (canonical llama-server option names) that mean "I place this child myself".
CPU_KEYS = frozenset({
    "threads", "threads-batch", "cpu-mask", "cpu-range", "cpu-strict",
    "cpu-mask-batch", "cpu-range-batch", "cpu-strict-batch"})
# Environment variables a child would read its thread count from.
CPU_ENV = ("LLAMA_ARG_THREADS",)
# How long a thread of an OpenMP build of llama-server (GCC's libgomp, the default on Linux)
# spins at a barrier before it sleeps, for a child that shares its cores: 3,000 rounds instead
# of libgomp's 300,000. When other work on the machine preempts one thread, its siblings then
# give their cores up within microseconds instead of milliseconds. Measured through the router
# on 2 cores kept busy by two other processes: 500 tokens of a tiny model took 0.11 to 1.6 s
# (default: up to 30 s), 64 of SmolLM2 0.75 to 1.24 s (default: up to 85 s). It costs a model
# computing alone 19-23 % of SmolLM2's tokens/s and about 2 ms of time to first token (each
# barrier a thread sleeps at is a futex wake-up), so a child alone on its cores keeps libgomp's
# default. 1,000 rounds made the tiny model's wake-ups show more (TTFT 3.3 ms, not 1.6-1.9).
POLITE_SPIN = {"GOMP_SPINCOUNT": "3000"}
SPIN_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

# Other work that makes a child's threads wait briefly even alone on its cores: this many
# cores' worth of CPU time, over the last sample, spent outside the router and its children
# (a spinning thread preempted by it stalls its siblings at every barrier).
BUSY_CORES = 0.5
# The shortest interval a reading is taken over (CPU time is counted in 10 ms ticks).
MIN_WINDOW_S = 0.05
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

_SYS_CPU = Path("/sys/devices/system/cpu")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuShare:
    """Where one child computes: one thread per core of ``cores``, on those cores; ``shared``
    when, at its spawn, another model's child held any of them or other work kept the machine
    busy (its threads then wait briefly, ``POLITE_SPIN``)."""

    cores: tuple[int, ...]
    shared: bool = False

    @property
    def threads(self) -> int:
        return len(self.cores)

    @property
    def wide(self) -> bool:
        """More than one thread: it spin-waits at barriers, so it needs its cores alone."""
        return len(self.cores) > 1

    def argv(self) -> list[str]:
        """llama-server options for this share. A wide share's threads are confined to its
        cores (``--cpu-mask``; batch threads inherit it) but not each to one core: the kernel
        may still move them within the set, away from a core the router itself needs for a
        moment (strict pinning measured slower). A single thread never spins at a barrier, so
        it is not confined at all."""
        n = str(self.threads)
        argv = ["--threads", n, "--threads-batch", n]
        if self.wide:
            argv += ["--cpu-mask", f"{sum(1 << core for core in self.cores):x}"]
        return argv

    def environment(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment the child gets on top of the router's: ``POLITE_SPIN`` for a shared
        share, nothing for one alone (libgomp's default) or where the router's own environment
        already says how OpenMP threads wait (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``)."""
        return spin_environment(environ) if self.shared else {}

    def describe(self) -> dict[str, object]:
        """What ``/models`` shows in ``status.cpu``: ``cores`` it is confined to (None: any)
        and ``spin``: ``short`` (``POLITE_SPIN``), ``full`` (libgomp's own) or
        ``environment`` (the router's environment decides)."""
        spin = "environment" if _spin_set_by(os.environ) else "short" if self.shared else "full"
        return {"threads": self.threads, "cores": list(self.cores) if self.wide else None,
                "placed_by": "router", "spin": spin}


def places_itself(args: Mapping[str, str], environ: Mapping[str, str] | None = None) -> bool:
    """True when the preset (or the environment) already says where the child computes."""
    env = os.environ if environ is None else environ
    return any(key in args for key in CPU_KEYS) or any(env.get(name) for name in CPU_ENV)


def spin_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``POLITE_SPIN``, unless the router's own environment already says how OpenMP threads
    wait (then the child inherits that)."""
    return {} if _spin_set_by(os.environ if environ is None else environ) else dict(POLITE_SPIN)


def _spin_set_by(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in SPIN_SETTINGS)


def shares_with(share: CpuShare, others: Iterable[CpuShare]) -> CpuShare:
    """``share`` marked ``shared`` when any share of ``others`` (other models' children)
    holds one of its cores: a wide one takes turns with it, and a one-thread GPU child is
    never paused, so its thread would preempt a spinning sibling. Pure."""
    held = {core for other in others for core in other.cores}
    return CpuShare(share.cores, shared=bool(held.intersection(share.cores)))


def all_layers_offloaded(args: Mapping[str, str], n_layer: int | None) -> bool:
    """Whether a child that uses a GPU runs every layer there (``n-gpu-layers`` unset, auto,
    all, -1, or at least the model's layer count)."""
    layers = option_value(args, "n-gpu-layers", "gpu-layers", "ngl")
    if layers is None or layers.lower() in ("", "auto", "all", "-1"):
        return True
    try:
        return n_layer is not None and int(layers) >= n_layer
    except ValueError:
        return False


def plan_shares(cores: Sequence[int], held: Iterable[CpuShare], count: int, *,
                fair_share: int, narrow: bool = False) -> list[CpuShare]:
    """Shares for ``count`` new children (the replicas of one load), given the shares that
    running children ``held``. Each gets up to ``fair_share`` cores that no wide child holds,
    least used first; ``narrow`` (a GPU child) gets one core. Pure; see the module."""
    if not cores:
        return [CpuShare(()) for _ in range(count)]
    use: Counter[int] = Counter()
    wide_held: set[int] = set()
    for share in held:
        use.update(share.cores)
        if share.wide:
            wide_held.update(share.cores)
    size = 1 if narrow else max(1, min(fair_share, len(cores)))
    out: list[CpuShare] = []
    for _ in range(count):
        free = [c for c in cores if c not in wide_held]
        free.sort(key=lambda c: (use[c], c))  # stable order: least used, then lowest number
        if size > 1 and len(free) >= 2:
            chosen = tuple(sorted(free[:size]))
        else:
            chosen = (min(cores, key=lambda c: (use[c], c)),)
        share = CpuShare(chosen)
        out.append(share)
        use.update(share.cores)
        if share.wide:
            wide_held.update(share.cores)
    return out


# ------------------------------------------------------------------------ reading the machine

def machine_cores() -> list[int]:
    """The cores children may use: one logical CPU per physical core in the router's affinity,
    at most as many as the cgroup CPU quota allows."""
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    return select_cores(affinity, {cpu: _core_id(cpu) for cpu in affinity}, cgroup_cpu_limit())


def select_cores(affinity: Sequence[int], core_of: Mapping[int, object],
                 limit: float | None) -> list[int]:
    """Pure part of ``machine_cores``: the first logical CPU of each physical core, then the
    first ``ceil(limit)`` of those."""
    seen: set[object] = set()
    cores: list[int] = []
    for cpu in sorted(affinity):
        key = core_of.get(cpu, cpu)
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    if limit is not None and limit > 0:
        cores = cores[:max(1, math.ceil(limit))]
    return cores


def _core_id(cpu: int) -> object:
    topology = _SYS_CPU / f"cpu{cpu}" / "topology"
    try:
        return ((topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip())
    except OSError:
        return cpu


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """CPUs' worth of time the router's cgroup may use (v2 ``cpu.max`` or v1 CFS quota, the
    tightest along the path), or None when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            limits += _walk(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in ("cpu,cpuacct", "cpu")
                         if (root / name).is_dir()), None)
            if base is not None:
                limits += _walk(base, path, _v1_limit)
    return min(limits) if limits else None


def _walk(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """``read`` of the cgroup's folder and of every folder above it."""
    found: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        value = read(base.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


# ------------------------------------------------------------------------ other work

class OtherWork:
    """How many cores' worth of CPU time the machine spent outside the router and its
    children between the last two samples (``cores``; None before two, or where ``/proc``
    does not say). ``sample`` is called about once a second (``accounting``) and by ``read``
    at each spawn; a process that ended between two samples counts as other work for its last
    interval (the safe side). Times are ``time.monotonic()`` (tests pass their own)."""

    def __init__(self, read: Callable[[str], str | None] | None = None) -> None:
        self._read = read or _read_text
        self.cores: float | None = None
        self._last: tuple[float, int, dict[int, int]] | None = None

    @property
    def busy(self) -> bool:
        """At least ``BUSY_CORES`` of other work, or nothing known yet (the safe side)."""
        return self.cores is None or self.cores >= BUSY_CORES

    def read(self, own_pids: Iterable[int], now: float | None = None) -> float | None:
        """The other work up to ``now``: sampled on the spot when the last sample is at least
        ``MIN_WINDOW_S`` old (a spawn right after the router started gets a reading), else
        the last reading."""
        now = time.monotonic() if now is None else now
        if self._last is None or now - self._last[0] >= MIN_WINDOW_S:
            self.sample(own_pids, now)
        return self.cores

    def sample(self, own_pids: Iterable[int], now: float | None = None) -> None:
        """Read the machine's and ``own_pids``' CPU time (the router and its children)."""
        now = time.monotonic() if now is None else now
        stat = self._read("/proc/stat")
        machine = machine_busy_ticks(stat) if stat else None
        if machine is None:
            self.cores, self._last = None, None
            return
        own: dict[int, int] = {}
        for pid in own_pids:
            text = self._read(f"/proc/{pid}/stat")
            ticks = process_ticks(text) if text else None
            if ticks is not None:
                own[pid] = ticks
        if self._last is not None and now > self._last[0]:
            then, machine_then, own_then = self._last
            spent = sum(t - own_then.get(pid, 0) for pid, t in own.items())
            self.cores = max(0, machine - machine_then - spent) / CLOCK_TICKS / (now - then)
        self._last = (now, machine, own)


def machine_busy_ticks(stat: str) -> int | None:
    """The machine's busy CPU time from ``/proc/stat`` (clock ticks of ``user``, ``nice``,
    ``system``, ``irq``, ``softirq`` and ``steal``: all but idle and I/O wait). Pure."""
    for line in stat.splitlines():
        if line.startswith("cpu "):
            fields = [int(f) for f in line.split()[1:9]]
            if len(fields) < 8:
                return None
            user, nice, system, _idle, _iowait, irq, softirq, steal = fields
            return user + nice + system + irq + softirq + steal
    return None


def process_ticks(stat: str) -> int | None:
    """A process's CPU time (``utime + stime``, every thread) from its ``/proc/PID/stat``.
    Pure; the name in parentheses may hold spaces and parentheses."""
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return None
