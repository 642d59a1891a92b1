"""NVIDIA GPUs: which there are, what each process uses on them, and where a model's memory goes;
and, for any vendor's GPU, whether a process holds one open (``holds_gpu_device``).

Everything else here comes from ``nvidia-smi``; without it (or when it fails or hangs for
``NVIDIA_SMI_TIMEOUT_S``) there are no GPUs and admission counts host RAM only. Each GPU is a
memory pool named ``gpu<index>`` (nvidia-smi's index, which is CUDA's with the default
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` ordering) next to the ``ram`` pool.

``placement()`` is an upper-bound guess of where a llama-server child's memory goes, from its
arguments (b11434 semantics):

* ``n-gpu-layers`` (``ngl``): ``auto`` (the default), ``all`` or at least the layer count puts
  every layer and its KV cache on the GPUs; ``N`` puts ``N / n_layer`` of them there; ``0``
  none. (``auto`` lets llama-server's ``--fit`` offload less when memory is short; counting all
  of it keeps the estimate an upper bound.)
* ``device`` (``dev``): ``none`` keeps the model on the CPU; ``CUDA0,CUDA2`` uses those GPUs;
  unset uses every GPU.
* ``split-mode none`` puts everything on ``main-gpu`` (an index into those devices, default 0);
  otherwise ``tensor-split`` proportions, or an even split, divide it among them.
* The compute buffer goes to the first device used; the prompt cache (``--cache-ram``) and the
  runtime stay in host RAM with whatever is not offloaded.
* ``CUDA_VISIBLE_DEVICES`` in a preset's ``env`` (``visible_devices``) narrows and orders the
  GPUs its child sees: ``device = CUDA0`` is then the first GPU it lists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .memory import BASE_OVERHEAD_BYTES, RAM, Estimate, MiB, option_value, parse_size

NVIDIA_SMI_TIMEOUT_S = 5.0
# Device files a process holds open while it may hold GPU memory, whatever nvidia-smi sees:
# NVIDIA's, AMD ROCm's, DRM render nodes (Vulkan, SYCL, AMD, Intel), accelerators, WSL2's GPU.
GPU_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/", "/dev/accel/", "/dev/dxg")
DEFAULT_MARGIN_BYTES = 1024 * MiB  # kept free on each GPU (llama-server's --fit-target)


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int

    @property
    def pool(self) -> str:
        return f"gpu{self.index}"


def _nvidia_smi(*query: str) -> list[list[str]] | None:
    """Rows of an nvidia-smi CSV query, or None when there is no working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if proc.returncode != 0:
        return None
    return [[part.strip() for part in line.split(",")] for line in proc.stdout.splitlines()
            if line.strip()]


def holds_gpu_device(pid: int, proc: str = "/proc") -> bool | None:
    """Whether process ``pid`` has a GPU device open (``GPU_DEVICE_PREFIXES``), from
    ``/proc/PID/fd``; None when that cannot be read (not Linux, gone, not ours). A process
    that holds GPU memory keeps its device open until it has freed it; a zombie has none."""
    try:
        descriptors = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return None
    for descriptor in descriptors:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{descriptor}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(GPU_DEVICE_PREFIXES):
            return True
    return False


def detect() -> list[GpuDevice]:
    """The GPUs nvidia-smi reports; [] without one."""
    rows = _nvidia_smi("--query-gpu=index,uuid,name,memory.total") or []
    devices = []
    for row in rows:
        try:
            devices.append(GpuDevice(int(row[0]), row[1], row[2], int(float(row[3]) * MiB)))
        except (IndexError, ValueError):  # "[N/A]" and the like
            continue
    return devices


def usage_by_pid(devices: list[GpuDevice]) -> dict[int, dict[str, int]]:
    """GPU memory per process id and pool (``{pid: {"gpu0": bytes}}``); {} without GPUs."""
    if not devices:
        return {}
    rows = _nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory") or []
    pools = {d.uuid: d.pool for d in devices}
    usage: dict[int, dict[str, int]] = {}
    for row in rows:
        try:
            pid, pool, used = int(row[0]), pools[row[1]], int(float(row[2]) * MiB)
        except (IndexError, KeyError, ValueError):
            continue
        per_pool = usage.setdefault(pid, {})
        per_pool[pool] = per_pool.get(pool, 0) + used
    return usage


BudgetSpec = str | int | dict[int, int]  # "auto", "off", a size for all, or per GPU index


def parse_budget(spec: str | None) -> BudgetSpec:
    """Check and read ``--gpu-memory-budget`` (see ``budgets``). Raises ValueError."""
    text = (spec or "auto").strip()
    if text.lower() == "auto":
        return "auto"
    if text.lower() in ("off", "none", "0"):
        return "off"
    if "=" not in text:
        return parse_size(text)
    per_index: dict[int, int] = {}
    for item in text.split(","):
        index, sep, amount = item.partition("=")
        if not sep or not index.strip().isdigit():
            raise ValueError(f"expected INDEX=SIZE, got {item.strip()!r}")
        per_index[int(index)] = parse_size(amount)
    return per_index


def budgets(spec: str | None, devices: list[GpuDevice]) -> dict[str, int]:
    """Per-pool budgets from ``--gpu-memory-budget``.

    ``None``/``auto``: each GPU's memory less ``DEFAULT_MARGIN_BYTES``. ``off``/``0``: none.
    ``SIZE``: every GPU. ``0=20G,1=40G``: per GPU index (others: auto). Raises ValueError.
    """
    auto = {d.pool: max(d.total_bytes - DEFAULT_MARGIN_BYTES, 0) for d in devices}
    parsed = parse_budget(spec)
    if parsed == "auto":
        return auto
    if parsed == "off":
        return {}
    if isinstance(parsed, int):
        return {pool: parsed for pool in auto}
    assert isinstance(parsed, dict)
    result = dict(auto)
    for index, size in parsed.items():
        pool = f"gpu{index}"
        if pool not in auto:
            raise ValueError(f"there is no GPU {index} (nvidia-smi lists "
                             f"{', '.join(sorted(auto)) or 'none'})")
        result[pool] = size
    return result


def placement(estimate: Estimate, args: Mapping[str, str],
              devices: list[GpuDevice]) -> dict[str, int]:
    """Bytes per pool (``ram``, ``gpu<i>``) one child is expected to need (see the module)."""
    total = estimate.total_bytes
    used = devices_used(args, devices)
    if not used:
        return {RAM: total}
    layers = option_value(args, "n-gpu-layers", "gpu-layers", "ngl")
    fraction = 1.0
    if layers is not None and layers.lower() not in ("auto", "all", "-1", ""):
        n_layer = max(estimate.n_layer, 1)
        fraction = min(max(int(layers), 0), n_layer) / n_layer
    if fraction == 0:
        return {RAM: total}
    compute = max(estimate.overhead_bytes - BASE_OVERHEAD_BYTES, 0)
    offloaded = int(fraction * (estimate.weights_bytes + estimate.kv_cache_bytes))
    shares = _shares(args, len(used))
    result = {RAM: total - offloaded - compute}
    for device, share in zip(used, shares, strict=True):
        if share > 0:
            result[device.pool] = int(offloaded * share)
    result[used[shares.index(max(shares))].pool] += compute
    return result


def visible_devices(devices: list[GpuDevice], environ: Mapping[str, str]) -> list[GpuDevice]:
    """The GPUs a child with ``environ`` (its preset's ``env``) sees, in CUDA's order:
    ``CUDA_VISIBLE_DEVICES`` lists nvidia-smi indices or ``GPU-…`` UUIDs (or their prefixes);
    as in CUDA, an index of no GPU ends the list there. Unset, or with an entry this cannot
    map (a MIG instance), every GPU, as without it."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(devices)
    seen: list[GpuDevice] = []
    for entry in (e.strip() for e in listed.split(",") if e.strip()):
        if entry.lstrip("-").isdigit():
            found = next((d for d in devices if d.index == int(entry)), None)
            if found is None:
                break
        else:
            found = next((d for d in devices if entry.startswith("GPU-")
                          and d.uuid.startswith(entry)), None)
            if found is None:
                return list(devices)
        if found not in seen:
            seen.append(found)
    return seen


def devices_used(args: Mapping[str, str], devices: list[GpuDevice]) -> list[GpuDevice]:
    """The GPUs a child's ``device`` option selects among ``devices``, those it sees
    (``CUDAn`` is the n-th of them; all of them when unset)."""
    listed = option_value(args, "device", "dev")
    if listed is None or listed == "":
        return list(devices)
    if listed.lower() == "none":
        return []
    by_index = dict(enumerate(devices))
    chosen = []
    for name in listed.split(","):
        match = re.search(r"(\d+)$", name.strip())
        if match and int(match.group(1)) in by_index:
            chosen.append(by_index[int(match.group(1))])
    return chosen


def _shares(args: Mapping[str, str], count: int) -> list[float]:
    """Each used device's share of the offloaded bytes."""
    if (option_value(args, "split-mode", "sm") or "").lower() == "none":
        main = option_value(args, "main-gpu", "mg")
        index = int(main) if main is not None and main.isdigit() else 0
        index = index if index < count else 0
        return [1.0 if i == index else 0.0 for i in range(count)]
    split = option_value(args, "tensor-split", "ts")
    if split:
        try:
            weights = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
        except ValueError:
            weights = []
        weights = (weights + [0.0] * count)[:count]
        if sum(weights) > 0:
            return [w / sum(weights) for w in weights]
    return [1.0 / count] * count
