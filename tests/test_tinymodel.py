"""Unit tests for router.llama.tinymodel (no llama-server needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from router.llama.tinymodel import (  # noqa: E402
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    ensure_tiny_model,
    main,
    tokenizer_vocab,
    write_tiny_model,
)


def _str(reader: Any, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _int(reader: Any, key: str) -> int:
    field = reader.fields[key]
    return int(field.parts[field.data[0]][0])


def _str_list(reader: Any, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _int_list(reader: Any, key: str) -> list[int]:
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0)


def test_same_seed_is_byte_identical(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=7)
    b = write_tiny_model(tmp_path / "b.gguf", seed=7)
    assert a.read_bytes() == b.read_bytes()


def test_different_seeds_differ(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=1)
    b = write_tiny_model(tmp_path / "b.gguf", seed=2)
    assert a.read_bytes() != b.read_bytes()


def test_small_and_no_temp_files_left(tmp_path: Path) -> None:
    out = write_tiny_model(tmp_path / "sub" / "m.gguf")
    assert out == tmp_path / "sub" / "m.gguf"
    assert 0 < out.stat().st_size < 1_000_000
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]
    assert out.read_bytes()[:4] == b"GGUF"


def test_metadata(model: Path) -> None:
    r = gguf.GGUFReader(model)
    assert _str(r, "general.architecture") == "llama"
    assert _str(r, "general.name") == "tiny"
    assert _int(r, "general.file_type") == 0
    assert _int(r, "llama.context_length") == 2048
    assert _int(r, "llama.embedding_length") == 64
    assert _int(r, "llama.block_count") == 2
    assert _int(r, "llama.attention.head_count") == 4
    assert _int(r, "llama.attention.head_count_kv") == 2
    assert _int(r, "llama.rope.dimension_count") == 16
    assert "llama.feed_forward_length" in r.fields
    assert "llama.attention.layer_norm_rms_epsilon" in r.fields
    assert _str(r, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert "<|im_start|>" in CHAT_TEMPLATE and "add_generation_prompt" in CHAT_TEMPLATE


def test_tokenizer(model: Path) -> None:
    r = gguf.GGUFReader(model)
    assert _str(r, "tokenizer.ggml.model") == "gpt2"
    tokens = _str_list(r, "tokenizer.ggml.tokens")
    types = _int_list(r, "tokenizer.ggml.token_type")
    merges = _str_list(r, "tokenizer.ggml.merges")
    assert len(tokens) == len(types) == _int(r, "llama.vocab_size")
    assert 256 < len(tokens) < 300
    assert len(set(tokens)) == len(tokens)
    assert merges
    for merge in merges:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens
    # byte tokens use GPT-2's byte-to-unicode alphabet
    assert tokens[ord("a")] == "a"
    assert tokens[ord(" ")] == "Ġ"
    assert tokens[ord("\n")] == "Ċ"
    control = int(gguf.TokenType.CONTROL)
    for special in (IM_START, IM_END, "<|endoftext|>"):
        assert types[tokens.index(special)] == control
    assert all(t == int(gguf.TokenType.NORMAL) for t in types[:256])
    assert tokens[_int(r, "tokenizer.ggml.eos_token_id")] == IM_END
    assert tokens[_int(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert (tokens, types, merges) == tokenizer_vocab()


def test_tensors(model: Path) -> None:
    r = gguf.GGUFReader(model)
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    n_vocab = _int(r, "llama.vocab_size")
    expected = {
        "token_embd.weight": [64, n_vocab],
        "output_norm.weight": [64],
        "output.weight": [64, n_vocab],
    }
    for i in range(2):
        expected |= {
            f"blk.{i}.attn_norm.weight": [64],
            f"blk.{i}.attn_q.weight": [64, 64],
            f"blk.{i}.attn_k.weight": [64, 32],
            f"blk.{i}.attn_v.weight": [64, 32],
            f"blk.{i}.attn_output.weight": [64, 64],
            f"blk.{i}.ffn_norm.weight": [64],
            f"blk.{i}.ffn_gate.weight": [64, 128],
            f"blk.{i}.ffn_up.weight": [64, 128],
            f"blk.{i}.ffn_down.weight": [128, 64],
        }
    assert shapes == expected
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)


def test_output_head_only_emits_printable_ascii(model: Path) -> None:
    r = gguf.GGUFReader(model)
    tokens = _str_list(r, "tokenizer.ggml.tokens")
    (head,) = [t for t in r.tensors if t.name == "output.weight"]
    rows = np.asarray(head.data).reshape(len(tokens), -1)
    printable = {tokens[b] for b in range(0x20, 0x7F)}
    for i, tok in enumerate(tokens):
        ok = tok not in (IM_START, IM_END, "<|endoftext|>") and all(c in printable for c in tok)
        assert bool(np.any(rows[i] != 0)) == ok, tok


def test_custom_shape_and_name(tmp_path: Path) -> None:
    out = write_tiny_model(
        tmp_path / "m.gguf",
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_head_kv=1,
        n_ctx_train=512,
        name="other",
    )
    r = gguf.GGUFReader(out)
    assert _str(r, "general.name") == "other"
    assert _int(r, "llama.block_count") == 1
    assert _int(r, "llama.context_length") == 512
    assert _int(r, "llama.rope.dimension_count") == 16
    assert len(r.tensors) == 3 + 9


@pytest.mark.parametrize(
    "kw",
    [{"n_embd": 63}, {"n_head": 4, "n_head_kv": 3}, {"n_layer": 0}, {"n_embd": 12, "n_head": 4}],
)
def test_invalid_shapes(tmp_path: Path, kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "m.gguf", **kw)
    assert list(tmp_path.iterdir()) == []


def test_ensure_only_writes_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    first = ensure_tiny_model(path, seed=1)
    data = first.read_bytes()
    again = ensure_tiny_model(path, seed=2)
    assert again == path
    assert path.read_bytes() == data


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert main([str(out), "--seed", "3", "--name", "cli"]) == 0
    assert "cli.gguf" in capsys.readouterr().out
    api = write_tiny_model(tmp_path / "api.gguf", seed=3, name="cli")
    assert out.read_bytes() == api.read_bytes()
    assert main([str(tmp_path / "bad.gguf"), "--n-embd", "63"]) == 1
