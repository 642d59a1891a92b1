"""Memory estimation and measurement for memory-aware admission of llama-server children.

Estimate of one llama-server (build b11434), in bytes::

    total    = weights + kv_cache + overhead
    weights  = size of the GGUF file(s)                 (all shards of a split model)
    kv_cache = n_layer * cells * n_head_kv * (row(head_dim_k, type_k) + row(head_dim_v, type_v))
    overhead = 64 MiB + n_ubatch * (4 * n_vocab + 64 * n_embd)
                      + n_ubatch * cells_per_stream * (2 if flash attention else 4 * n_head + 4)

``row(d, t)`` is ggml's row size: ``d`` elements of cache type ``t`` (f32 4 bytes, f16/bf16 2,
q8_0 34/32, q4_0 18/32, q4_1 20/32, q5_0 22/32, q5_1 24/32, iq4_nl 18/32). ``--ctx-size`` is
the *total* context shared by all ``--parallel`` slots, padded as llama.cpp does
(``src/llama-context.cpp``): ``n_ctx = pad256(ctx or n_ctx_train)``; with a unified KV cache
``cells = cells_per_stream = n_ctx``; otherwise ``cells_per_stream = pad256(n_ctx // n_seq)``
and ``cells = cells_per_stream * n_seq``. ``--parallel`` unset (or -1, "auto") means 4 slots
with a unified cache, whatever ``--kv-unified`` says. The KV cache is allocated up front and
is independent of the slot count except through that padding.

The overhead is an allowance, not a measurement: 64 MiB for the runtime (binary, threads, HTTP
server, tokenizer; llama-server's own RSS minus weights, KV and compute buffer was ~16 MiB on
the tiny models), plus the compute buffer: logits (f32 per vocabulary entry per ubatch token),
activations (64 bytes per embedding element per ubatch token, measured ~20-40) and the KQ mask
(f16 per KV cell per ubatch token; without flash attention also the f32 KQ matrix per head).

Checked against the real server's ``llama_kv_cache: size = ...`` log line: exact for f16,
q8_0, q4_0/f16, unified and not, and padded contexts (e.g. 4 layers, 4 KV heads of 32,
``-c 4096 -np 2``: 8.00 MiB, q8_0: 4.25 MiB; ``-c 1000 -np 3`` -> 1536 cells). Measured RSS
after /health and after a request stayed below the estimate: 19-24 MiB vs 68-72 MiB for the
0.4 MiB model, 28-100 MiB vs 83-178 MiB for the 9.5 MiB one (``-c 32768``: 100 vs 178 MiB).

The server's prompt cache (``--cache-ram``: idle slots' KV state, kept in host RAM as it is
used) counts as its limit. llama-server's default limit is 8192 MiB for any model, so the router
passes ``--cache-ram`` = one KV cache's worth (in MiB) to every child whose preset does not set
it (``estimate_for_args``).

Not included: multimodal projectors, draft models and LoRA adapters. Sliding-window and MLA
models need less KV than estimated (it is an upper bound). Sizes here are binary: ``G`` and
``GiB`` (and ``GB``) all mean 2**30 bytes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..llama.flags import FALSEY, TRUTHY
from ..llama.ggufmeta import StringArray, read_metadata

RAM = "ram"  # the host-memory pool; GPUs are "gpu0", "gpu1", ...

__all__ = [
    "AUTO_PARALLEL",
    "BASE_OVERHEAD_BYTES",
    "CACHE_TYPE_BYTES",
    "DEFAULT_UBATCH",
    "Estimate",
    "GGUFShape",
    "default_budget_bytes",
    "estimate",
    "estimate_for_args",
    "format_size",
    "measure_rss",
    "option_value",
    "parse_size",
    "read_shape",
    "total_ram_bytes",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

BASE_OVERHEAD_BYTES = 64 * MiB
"""Fixed runtime allowance per llama-server process (see the module docstring)."""

DEFAULT_UBATCH = 512
"""llama-server's default ``--ubatch-size`` (and ``--batch-size`` is 2048)."""

AUTO_PARALLEL = 4
"""Slots llama-server uses when ``--parallel`` is unset or -1 (with a unified KV cache)."""

_KV_PAD = 256
_FALLBACK_CTX = 4096
_ACTIVATION_BYTES_PER_EMBD = 64

CACHE_TYPE_BYTES: Mapping[str, Fraction] = {
    "f32": Fraction(4),
    "f16": Fraction(2),
    "bf16": Fraction(2),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "q4_1": Fraction(20, 32),
    "q5_0": Fraction(22, 32),
    "q5_1": Fraction(24, 32),
    "iq4_nl": Fraction(18, 32),
}
"""Bytes per element of each KV cache type llama-server accepts (ggml block size / elements)."""

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<idx>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFShape:
    """What the estimate needs from a GGUF header."""

    file_bytes: int  # total size of all shard files (weights ≈ file size)
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int  # key_length if present, else n_embd // n_head
    head_dim_v: int  # value_length if present, else n_embd // n_head
    architecture: str
    n_vocab: int = 0  # vocab_size, else the tokenizer's token count (0 if unknown)


@dataclass(frozen=True)
class Estimate:
    """Estimated memory of one llama-server child, in bytes."""

    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    prompt_cache_bytes: int = 0  # the --cache-ram limit the child runs with
    n_layer: int = 0  # the model's layers (for partial GPU offload, see ``gpus``)
    prompt_cache_unbounded: bool = False  # --cache-ram -1: no limit, not in the total

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes
                + self.prompt_cache_bytes)

    @property
    def default_cache_ram_mib(self) -> int:
        """The router's ``--cache-ram`` for a child whose preset does not set it: room for
        one full KV cache of saved prompts (llama-server's own default is 8192 MiB for every
        model, which no estimate could afford)."""
        return max(1, -(-self.kv_cache_bytes // MiB))


# --------------------------------------------------------------------------- GGUF header


def shard_paths(path: Path) -> list[Path]:
    """All existing shards of a split model (``NAME-00001-of-0000N.gguf``), else ``[path]``."""
    m = _SHARD.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    names = (f"{m['stem']}-{i:05d}-of-{m['count']}.gguf" for i in range(1, count + 1))
    shards = [path.with_name(name) for name in names]
    return [p for p in shards if p.is_file()] or [path]


def _int(metadata: Mapping[str, Any], key: str) -> int | None:
    """An integer entry (the max of an array, e.g. per-layer head counts), or None."""
    value = metadata.get(key)
    items = value if isinstance(value, list) else [value]
    numbers = [int(v) for v in items if isinstance(v, int | float) and not isinstance(v, bool)]
    return max(numbers) if numbers else None


def read_shape(path: str | Path) -> GGUFShape:
    """Read the shape of the model at ``path`` from its GGUF header.

    Only the metadata is read (``ggufmeta``: no numpy, nothing kept mapped). For a
    split model (``NAME-00001-of-0000N.gguf``) the metadata comes from the first shard and
    ``file_bytes`` is the sum of all shards that exist. Raises ``ValueError`` for a missing,
    unreadable or non-GGUF file, or one without an architecture or block count.
    """
    p = Path(path)
    shards = shard_paths(p)
    first = shards[0] if _SHARD.match(p.name) else p
    if not first.is_file():
        raise ValueError(f"{path}: not a GGUF file (no such file)")
    try:
        with first.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:  # unreadable now (permissions, out of file descriptors)
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        fields = read_metadata(first)
    except ValueError as exc:
        if isinstance(exc.__cause__, OSError):
            raise ValueError(f"{path}: cannot be read ({exc.__cause__.strerror or exc})") \
                from exc
        raise ValueError(f"{path}: not a GGUF file ({exc})") from exc

    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{path}: not a GGUF model (no general.architecture)")
    n_layer = _int(fields, f"{arch}.block_count")
    if n_layer is None:
        raise ValueError(f"{path}: GGUF header lacks {arch}.block_count")
    n_ctx_train = _int(fields, f"{arch}.context_length") or 0
    n_embd = _int(fields, f"{arch}.embedding_length") or 0
    n_head = _int(fields, f"{arch}.attention.head_count") or 0
    n_head_kv = _int(fields, f"{arch}.attention.head_count_kv")
    if n_head_kv is None:
        n_head_kv = n_head
    default_dim = n_embd // n_head if n_head else 0
    head_dim_k = _int(fields, f"{arch}.attention.key_length") or default_dim
    head_dim_v = _int(fields, f"{arch}.attention.value_length") or default_dim
    n_vocab = _int(fields, f"{arch}.vocab_size")
    if n_vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        n_vocab = tokens.length if isinstance(tokens, StringArray) else 0
    return GGUFShape(
        file_bytes=sum(s.stat().st_size for s in shards),
        n_layer=n_layer,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        architecture=arch,
        n_vocab=n_vocab,
    )


# --------------------------------------------------------------------------- estimate


def _pad(n: int, to: int = _KV_PAD) -> int:
    return -(-n // to) * to


def _row_bytes(n_elements: int, cache_type: str) -> int:
    try:
        per = CACHE_TYPE_BYTES[cache_type.lower()]
    except KeyError:
        known = ", ".join(CACHE_TYPE_BYTES)
        raise ValueError(f"unknown KV cache type {cache_type!r} (known: {known})") from None
    return math.ceil(n_elements * per)


def estimate(
    shape: GGUFShape,
    *,
    ctx_size: int | None,
    parallel: int | None,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    kv_unified: bool | None = None,
    ubatch_size: int | None = None,
    flash_attn: bool | None = None,
) -> Estimate:
    """Estimate the memory of llama-server serving ``shape`` (see the module docstring).

    ``ctx_size`` None or <= 0 means the model's training context. ``parallel`` None or < 0
    means llama-server's auto mode (4 slots, unified KV cache). ``kv_unified`` None means
    llama-server's default (unified only in auto mode). ``ubatch_size`` None means 512;
    ``flash_attn`` None means auto, assumed on. Raises ``ValueError`` for an unknown cache type.
    """
    k_row = _row_bytes(shape.n_head_kv * shape.head_dim_k, cache_type_k)
    v_row = _row_bytes(shape.n_head_kv * shape.head_dim_v, cache_type_v)

    ctx = ctx_size if ctx_size is not None and ctx_size > 0 else shape.n_ctx_train
    n_ctx = _pad(ctx if ctx > 0 else _FALLBACK_CTX)
    if parallel is None or parallel < 0:
        n_seq, unified = AUTO_PARALLEL, True
    else:
        n_seq, unified = max(parallel, 1), bool(kv_unified)
    if unified:
        per_stream = cells = n_ctx
    else:
        per_stream = _pad(n_ctx // n_seq)
        cells = per_stream * n_seq
    kv = shape.n_layer * cells * (k_row + v_row)

    ubatch = ubatch_size if ubatch_size is not None and ubatch_size > 0 else DEFAULT_UBATCH
    per_token = 4 * shape.n_vocab + _ACTIVATION_BYTES_PER_EMBD * shape.n_embd
    per_cell = 2 if flash_attn is None or flash_attn else 4 * shape.n_head + 4
    overhead = BASE_OVERHEAD_BYTES + ubatch * per_token + ubatch * per_stream * per_cell
    return Estimate(weights_bytes=shape.file_bytes, kv_cache_bytes=kv, overhead_bytes=overhead,
                    n_layer=shape.n_layer)


def option_value(args: Mapping[str, str], *keys: str) -> str | None:
    """The value of the first of ``keys`` (spellings of one llama-server option) in ``args``,
    stripped; None if none is there."""
    for key in keys:
        value = args.get(key)
        if value is not None:
            return value.strip()
    return None


def _int_arg(args: Mapping[str, str], *keys: str) -> int | None:
    value = option_value(args, *keys)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--{keys[0]}: expected an integer, got {value!r}") from None


def _bool_arg(args: Mapping[str, str], *keys: str) -> bool | None:
    value = option_value(args, *keys)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in FALSEY:
        return False
    if lowered in TRUTHY or lowered == "":
        return True
    if lowered == "auto":
        return None
    raise ValueError(f"--{keys[0]}: expected on/off, got {value!r}")


def estimate_for_args(model_path: str | Path, args: Mapping[str, str]) -> Estimate:
    """Estimate llama-server's memory for ``model_path`` started with ``args``.

    ``args`` maps canonical long option names without dashes to string values (``ctx-size``,
    ``parallel``, ``cache-type-k``, ``cache-type-v``, ``kv-unified``, ``kv-unified-per-slot``,
    ``ubatch-size``, ``batch-size``, ``flash-attn``; the short spellings ``c``, ``np``, ``ctk``,
    ``ctv``, ``kvu``, ``ub``, ``b`` and ``fa`` are accepted too). Missing keys take
    llama-server's defaults. ``--kv-unified-per-slot N`` without ``--ctx-size`` sizes the
    context to ``parallel * N``, as llama-server does.

    The prompt cache counts as its limit: ``cache-ram`` (``cram``) MiB when set (0: disabled;
    -1: unbounded, so not counted and flagged), else the router's default for the child, one
    KV cache's worth (``Estimate.default_cache_ram_mib``).
    """
    shape = read_shape(model_path)
    ctx = _int_arg(args, "ctx-size", "c")
    parallel = _int_arg(args, "parallel", "np")
    per_slot = _int_arg(args, "kv-unified-per-slot")
    if (ctx is None or ctx <= 0) and per_slot is not None and per_slot > 0:
        slots = parallel if parallel is not None and parallel > 0 else AUTO_PARALLEL
        ctx = slots * per_slot
    ubatch = _int_arg(args, "ubatch-size", "ub")
    batch = _int_arg(args, "batch-size", "b")
    if batch is not None and batch > 0:
        ubatch = min(ubatch or DEFAULT_UBATCH, batch)
    base = estimate(
        shape,
        ctx_size=ctx,
        parallel=parallel,
        cache_type_k=option_value(args, "cache-type-k", "ctk") or "f16",
        cache_type_v=option_value(args, "cache-type-v", "ctv") or "f16",
        kv_unified=_bool_arg(args, "kv-unified", "kvu"),
        ubatch_size=ubatch,
        flash_attn=_bool_arg(args, "flash-attn", "fa"),
    )
    cache_ram = _int_arg(args, "cache-ram", "cram")
    if cache_ram is None:
        cache_ram = base.default_cache_ram_mib
    return replace(base, prompt_cache_bytes=max(cache_ram, 0) * MiB,
                   prompt_cache_unbounded=cache_ram < 0)


def kv_bytes_per_token(model_path: str | Path, args: Mapping[str, str]) -> int:
    """The bytes of KV cache one token takes in a child of ``model_path`` with ``args`` (its
    cache types), from the GGUF header: at least what a saved slot state holds per token."""
    shape = read_shape(model_path)
    k_row = _row_bytes(shape.n_head_kv * shape.head_dim_k,
                       option_value(args, "cache-type-k", "ctk") or "f16")
    v_row = _row_bytes(shape.n_head_kv * shape.head_dim_v,
                       option_value(args, "cache-type-v", "ctv") or "f16")
    return shape.n_layer * (k_row + v_row)


# --------------------------------------------------------------------------- measurement


def measure_rss(pid: int) -> int | None:
    """Resident set size of process ``pid`` plus all its descendants; None if it is gone.

    On Linux from ``/proc`` with raw reads: the accounting samples every child each second
    (a llama-server has a few dozen threads, each with its own children file), so this costs
    a few syscalls per file rather than psutil's objects and Python's buffered file layers."""
    if not _PROC_CHILDREN:  # not Linux, or an old kernel
        return _measure_rss_psutil(pid)
    own = _resident(pid)
    if not own:  # gone, or a zombie (which holds no memory)
        return None
    return own + sum(_resident(child) or 0 for child in _descendant_pids(pid))


def _resident(pid: int) -> int | None:
    """Resident bytes of process ``pid`` alone (``/proc/PID/statm``); None if it is gone."""
    data = _read_proc(f"/proc/{pid}/statm")
    return int(data.split(maxsplit=2)[1]) * _PAGE_SIZE if data else None


def _descendant_pids(pid: int) -> list[int]:
    """Every descendant of ``pid``, from ``/proc/PID/task/TID/children`` (one small file per
    thread of each descendant). psutil's ``children`` reads the stat file of every process
    on the machine instead: about 8 ms on a busy 2-core machine with 90 processes."""
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in _children_of(pending.pop()):
            found.append(child)
            pending.append(child)
    return found


def _children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children, started by any of its threads; none when it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for task in tasks:
        data = _read_proc(f"/proc/{pid}/task/{task}/children")  # None: a thread that ended
        if data:
            children += map(int, data.split())
    return children


def _read_proc(path: str) -> bytes | None:
    """A whole (small) /proc file in a few syscalls; None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        parts = []
        while part := os.read(fd, 4096):
            parts.append(part)
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def _measure_rss_psutil(pid: int) -> int | None:
    """``measure_rss`` where ``/proc`` lists no children (not Linux)."""
    import psutil  # only here: a router on Linux never needs it

    try:
        proc = psutil.Process(pid)
        total = int(proc.memory_info().rss)
        children = proc.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None
    for child in children:
        try:
            total += int(child.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return total


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PROC_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def total_ram_bytes() -> int:
    """Physical memory of this machine (the kernel's total RAM, as ``/proc/meminfo``'s
    ``MemTotal``)."""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        return int(os.sysconf("SC_PHYS_PAGES")) * _PAGE_SIZE
    import psutil  # elsewhere

    return int(psutil.virtual_memory().total)


def default_budget_bytes() -> int:
    """Default memory budget for children: total RAM minus max(1 GiB, 10% of RAM)."""
    total = total_ram_bytes()
    return max(0, total - max(GiB, total // 10))


# --------------------------------------------------------------------------- sizes

_UNITS: Mapping[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": TiB,
    "tb": TiB,
    "tib": TiB,
}
_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a memory size: ``"8G"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes.

    Units are case-insensitive and binary: K/KB/KiB = 2**10, M/MB/MiB = 2**20,
    G/GB/GiB = 2**30, T/TB/TiB = 2**40; no unit (or B) means bytes. Fractions are truncated
    to whole bytes. Raises ``ValueError`` for anything else.
    """
    m = _SIZE.match(text)
    scale = _UNITS.get(m["unit"].lower()) if m else None
    if m is None or scale is None:
        raise ValueError(f"invalid size {text!r} (expected e.g. 8G, 512MiB, 1.5GB or 1000000)")
    return int(Fraction(m["num"]) * scale)


def format_size(n: int) -> str:
    """Human-readable binary size: ``"1.5 GiB"``, ``"512.0 MiB"``, ``"100 B"``."""
    sign, m = ("-", -n) if n < 0 else ("", n)
    if m < KiB:
        return f"{sign}{m} B"
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if m >= scale:
            return f"{sign}{m / scale:.1f} {unit}"
    raise AssertionError("unreachable")
