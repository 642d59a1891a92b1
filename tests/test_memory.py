"""Unit tests for router.host.memory (no llama-server needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from support import wait_until

pytest.importorskip("gguf")

from router.host import memory
from router.host.memory import (
    BASE_OVERHEAD_BYTES,
    Estimate,
    GGUFShape,
    default_budget_bytes,
    estimate,
    estimate_for_args,
    format_size,
    measure_rss,
    parse_size,
    read_shape,
    total_ram_bytes,
)
from router.llama.tinymodel import tokenizer_vocab, write_tiny_model

MiB = 1 << 20
GiB = 1 << 30
N_VOCAB = len(tokenizer_vocab()[0])


def shape(**kw: int) -> GGUFShape:
    """A llama-7B-like shape: 32 layers, 32 heads of 128, 8 KV heads, 4096 training context."""
    base: dict[str, int] = dict(
        file_bytes=4 * GiB, n_layer=32, n_ctx_train=4096, n_embd=4096, n_head=32,
        n_head_kv=8, head_dim_k=128, head_dim_v=128, n_vocab=32000,
    )
    base.update(kw)
    return GGUFShape(architecture="llama", **base)


# --------------------------------------------------------------------------- read_shape


def test_read_shape_default_tiny_model(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    s = read_shape(path)
    assert s == GGUFShape(
        file_bytes=path.stat().st_size, n_layer=2, n_ctx_train=2048, n_embd=64, n_head=4,
        n_head_kv=2, head_dim_k=16, head_dim_v=16, architecture="llama", n_vocab=N_VOCAB,
    )


def test_read_shape_other_shape(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "big.gguf", seed=2, n_layer=4, n_embd=256, n_head=8,
                            n_head_kv=4, n_ctx_train=1024)
    s = read_shape(str(path))
    assert (s.n_layer, s.n_ctx_train, s.n_embd, s.n_head, s.n_head_kv) == (4, 1024, 256, 8, 4)
    assert (s.head_dim_k, s.head_dim_v) == (32, 32)
    assert s.file_bytes == path.stat().st_size
    assert s.architecture == "llama"


def test_read_shape_sums_shards(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "m-00001-of-00003.gguf", seed=1)
    shutil.copyfile(first, tmp_path / "m-00002-of-00003.gguf")
    (tmp_path / "m-00003-of-00003.gguf").write_bytes(b"\0" * 1000)
    single = first.stat().st_size
    s = read_shape(first)
    assert s.file_bytes == 2 * single + 1000
    assert s.n_layer == 2
    # naming a later shard reads the metadata from the first one
    assert read_shape(tmp_path / "m-00002-of-00003.gguf") == s


def test_read_shape_counts_only_existing_shards(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "m-00001-of-00002.gguf", seed=1)
    assert read_shape(first).file_bytes == first.stat().st_size


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00"])
def test_read_shape_rejects_bad_files(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file"):
        read_shape(bad)


def test_read_shape_rejects_truncated_model(tmp_path: Path) -> None:
    data = write_tiny_model(tmp_path / "tiny.gguf", seed=1).read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:1000])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_shape(bad)


def test_read_shape_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_shape(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------- estimate


def test_estimate_f16() -> None:
    s = shape()
    e = estimate(s, ctx_size=8192, parallel=1)
    # 32 layers * 8192 cells * 8 kv heads * (128 * 2 + 128 * 2) bytes = 1 GiB
    assert e.kv_cache_bytes == 32 * 8192 * 8 * 512 == GiB
    assert e.weights_bytes == 4 * GiB
    assert e.overhead_bytes > BASE_OVERHEAD_BYTES
    assert e.total_bytes == e.weights_bytes + e.kv_cache_bytes + e.overhead_bytes


def test_estimate_q8_0_and_mixed_types() -> None:
    s = shape()
    q8 = estimate(s, ctx_size=8192, parallel=1, cache_type_k="q8_0", cache_type_v="q8_0")
    assert q8.kv_cache_bytes == 32 * 8192 * 8 * 2 * (128 * 34 // 32)
    mixed = estimate(s, ctx_size=8192, parallel=1, cache_type_k="q4_0", cache_type_v="f32")
    assert mixed.kv_cache_bytes == 32 * 8192 * 8 * (128 * 18 // 32 + 128 * 4)


def test_estimate_ctx_defaults_to_training_context() -> None:
    s = shape(n_ctx_train=2048)
    expected = estimate(s, ctx_size=2048, parallel=1)
    assert estimate(s, ctx_size=None, parallel=1) == expected
    assert estimate(s, ctx_size=0, parallel=1) == expected


def test_estimate_ctx_is_total_and_padded() -> None:
    s = shape()
    per_cell = 32 * 8 * 512
    # --ctx-size is the total for all slots: the KV cache does not grow with -np ...
    assert estimate(s, ctx_size=4096, parallel=2).kv_cache_bytes == 4096 * per_cell
    assert estimate(s, ctx_size=4096, parallel=4).kv_cache_bytes == 4096 * per_cell
    # ... except for padding to 256 cells: 1000 -> 1024; per slot 1024 // 3 = 341 -> 512, * 3
    assert estimate(s, ctx_size=1000, parallel=1).kv_cache_bytes == 1024 * per_cell
    assert estimate(s, ctx_size=1000, parallel=3).kv_cache_bytes == 1536 * per_cell
    assert estimate(s, ctx_size=1000, parallel=3, kv_unified=True).kv_cache_bytes == (
        1024 * per_cell
    )
    # auto parallel (None / -1): 4 slots sharing one unified cache of n_ctx cells
    assert estimate(s, ctx_size=1000, parallel=None).kv_cache_bytes == 1024 * per_cell
    assert estimate(s, ctx_size=1000, parallel=-1, kv_unified=False).kv_cache_bytes == (
        1024 * per_cell
    )


def test_estimate_matches_real_server_log() -> None:
    """Numbers from llama-server b11434's ``llama_kv_cache: size = ...`` line."""
    small = shape(n_layer=2, n_ctx_train=2048, n_embd=64, n_head=4, n_head_kv=2,
                  head_dim_k=16, head_dim_v=16, n_vocab=N_VOCAB)
    big = shape(n_layer=4, n_ctx_train=2048, n_embd=256, n_head=8, n_head_kv=4,
                head_dim_k=32, head_dim_v=32, n_vocab=N_VOCAB)
    assert estimate(small, ctx_size=4096, parallel=2).kv_cache_bytes == 1 * MiB
    assert estimate(small, ctx_size=1000, parallel=3).kv_cache_bytes == 384 * 1024
    assert estimate(big, ctx_size=8192, parallel=4).kv_cache_bytes == 16 * MiB
    q8 = estimate(big, ctx_size=4096, parallel=2, cache_type_k="q8_0", cache_type_v="q8_0")
    assert q8.kv_cache_bytes == 4.25 * MiB
    q4 = estimate(big, ctx_size=4096, parallel=2, cache_type_k="q4_0")
    assert q4.kv_cache_bytes == 5.125 * MiB
    assert estimate(big, ctx_size=None, parallel=None).kv_cache_bytes == 4 * MiB


def test_estimate_overhead_grows_with_ubatch_and_without_flash_attention() -> None:
    s = shape()
    base = estimate(s, ctx_size=4096, parallel=1)
    assert estimate(s, ctx_size=4096, parallel=1, ubatch_size=2048).overhead_bytes > (
        base.overhead_bytes
    )
    assert estimate(s, ctx_size=4096, parallel=1, flash_attn=True) == base
    no_fa = estimate(s, ctx_size=4096, parallel=1, flash_attn=False)
    assert no_fa.overhead_bytes - base.overhead_bytes == 512 * 4096 * (4 * 32 + 4 - 2)


@pytest.mark.parametrize("kind", ["q3_k", "f8", ""])
def test_estimate_unknown_cache_type(kind: str) -> None:
    with pytest.raises(ValueError, match="unknown KV cache type"):
        estimate(shape(), ctx_size=None, parallel=None, cache_type_k=kind)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        estimate(shape(), ctx_size=None, parallel=None, cache_type_v=kind)


def test_estimate_total_bytes() -> None:
    assert Estimate(weights_bytes=1, kv_cache_bytes=2, overhead_bytes=3).total_bytes == 6


# --------------------------------------------------------------------------- estimate_for_args


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "big.gguf", seed=1, n_layer=4, n_embd=256, n_head=8,
                            n_head_kv=4)


def cached(e: Estimate) -> Estimate:
    """``e`` with the prompt cache the router gives a child by default: one KV cache."""
    return replace(e, prompt_cache_bytes=e.default_cache_ram_mib * MiB)


def test_estimate_for_args_defaults(big_model: Path) -> None:
    s = read_shape(big_model)
    assert estimate_for_args(big_model, {}) == cached(estimate(s, ctx_size=None, parallel=None))
    assert estimate_for_args(big_model, {"model": str(big_model)}).kv_cache_bytes == 4 * MiB


def test_estimate_for_args_picks_up_options(big_model: Path) -> None:
    s = read_shape(big_model)
    args = {"model": str(big_model), "ctx-size": "4096", "parallel": "2",
            "cache-type-k": "q8_0", "cache-type-v": "q8_0", "kv-unified": "true"}
    got = estimate_for_args(big_model, args)
    assert got == cached(estimate(s, ctx_size=4096, parallel=2, cache_type_k="q8_0",
                                  cache_type_v="q8_0", kv_unified=True))
    assert got.kv_cache_bytes == 4.25 * MiB
    padded = estimate_for_args(big_model, {"ctx-size": "1000", "parallel": "3"})
    assert padded.kv_cache_bytes == 1536 * 4 * 4 * 32 * 2 * 2
    unified = estimate_for_args(big_model, {"ctx-size": "1000", "parallel": "3",
                                            "kv-unified": "on"})
    assert unified.kv_cache_bytes == 1024 * 4 * 4 * 32 * 2 * 2
    assert estimate_for_args(big_model, {"ctx-size": "1000", "parallel": "3",
                                         "kv-unified": "false"}) == padded


def test_estimate_for_args_per_slot_and_batches(big_model: Path) -> None:
    s = read_shape(big_model)
    per_slot = estimate_for_args(big_model, {"parallel": "2", "kv-unified-per-slot": "1000"})
    assert per_slot.kv_cache_bytes == 4 * MiB  # 2 * 1000 -> 2048 cells, as the server logs
    ub = estimate_for_args(big_model, {"ubatch-size": "2048"})
    assert ub == cached(estimate(s, ctx_size=None, parallel=None, ubatch_size=2048))
    capped = estimate_for_args(big_model, {"ubatch-size": "2048", "batch-size": "256"})
    assert capped == cached(estimate(s, ctx_size=None, parallel=None, ubatch_size=256))
    no_fa = estimate_for_args(big_model, {"flash-attn": "off"})
    assert no_fa == cached(estimate(s, ctx_size=None, parallel=None, flash_attn=False))


def test_estimate_counts_the_prompt_cache_limit(big_model: Path) -> None:
    default = estimate_for_args(big_model, {"ctx-size": "4096", "parallel": "2"})
    assert default.kv_cache_bytes == 8 * MiB
    assert default.default_cache_ram_mib == 8
    assert default.prompt_cache_bytes == 8 * MiB  # the router passes --cache-ram 8
    assert default.total_bytes == (default.weights_bytes + default.kv_cache_bytes
                                   + default.overhead_bytes + 8 * MiB)
    assert estimate_for_args(big_model, {"cache-ram": "512"}).prompt_cache_bytes == 512 * MiB
    assert estimate_for_args(big_model, {"cram": "0"}).prompt_cache_bytes == 0
    unbounded = estimate_for_args(big_model, {"cache-ram": "-1"})
    assert unbounded.prompt_cache_bytes == 0 and unbounded.prompt_cache_unbounded
    assert not default.prompt_cache_unbounded


def test_default_cache_ram_rounds_up_to_whole_mib() -> None:
    assert Estimate(0, kv_cache_bytes=1, overhead_bytes=0).default_cache_ram_mib == 1
    assert Estimate(0, kv_cache_bytes=MiB + 1, overhead_bytes=0).default_cache_ram_mib == 2
    assert Estimate(0, kv_cache_bytes=0, overhead_bytes=0).default_cache_ram_mib == 1


def test_estimate_for_args_rejects_junk(big_model: Path) -> None:
    with pytest.raises(ValueError, match="ctx-size"):
        estimate_for_args(big_model, {"ctx-size": "lots"})
    with pytest.raises(ValueError, match="unknown KV cache type"):
        estimate_for_args(big_model, {"cache-type-k": "q2"})


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8G", 8 * GiB),
        ("8g", 8 * GiB),
        ("8GiB", 8 * GiB),
        ("8 GB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("512M", 512 * MiB),
        ("1.5GB", 3 * GiB // 2),
        ("1000000", 1_000_000),
        ("100B", 100),
        ("4k", 4096),
        ("2T", 2 << 40),
        (" 0.5 mib ", MiB // 2),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "lots", "8X", "-1G", "1.2.3G", "8 G B", "nan", "inf"])
def test_parse_size_rejects_junk(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (512 * MiB, "512.0 MiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (2 << 40, "2.0 TiB"),
        (-512 * MiB, "-512.0 MiB"),
    ],
)
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


def test_format_parse_round_trip() -> None:
    assert parse_size(format_size(3 * GiB // 2)) == 3 * GiB // 2


# --------------------------------------------------------------------------- measurement


def test_measure_rss_of_self() -> None:
    rss = measure_rss(os.getpid())
    assert rss is not None
    assert rss > 0


@pytest.mark.process
def test_measure_rss_includes_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child_rss = measure_rss(child.pid)
        assert child_rss is not None and child_rss > 0
        total = measure_rss(os.getpid())
        assert total is not None
        assert total > psutil.Process().memory_info().rss
    finally:
        child.kill()
        child.wait()


@pytest.mark.process
def test_measure_rss_counts_grandchildren_and_what_threads_started() -> None:
    # A grandchild, and a child of a thread other than the main one (while that thread runs):
    # Linux lists each thread's children on its own (/proc/PID/task/TID/children).
    code = ("import subprocess, sys, threading, time\n"
            "subprocess.Popen(['sh', '-c', 'sleep 30 & wait'])\n"
            "threading.Thread(target=lambda: (subprocess.Popen(['sleep', '31']),\n"
            "                                 time.sleep(30))).start()\n"
            "time.sleep(30)\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        proc = psutil.Process(parent.pid)
        assert wait_until(lambda: len(proc.children(recursive=True)) == 3, timeout=10)
        with subprocess.Popen(["sleep", "32"]) as other:  # not a descendant
            try:
                expected = {p.pid for p in proc.children(recursive=True)}
                assert set(memory._descendant_pids(parent.pid)) == expected
                rss = measure_rss(parent.pid)
                assert rss is not None
                assert rss >= sum(p.memory_info().rss for p in [proc, *proc.children()])
            finally:
                other.kill()
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


@pytest.mark.process
def test_measure_rss_of_dead_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert measure_rss(child.pid) is None


def test_ram_and_budget() -> None:
    total = total_ram_bytes()
    assert total > 0
    budget = default_budget_bytes()
    assert budget == max(0, total - max(GiB, total // 10))
    assert 0 <= budget < total
