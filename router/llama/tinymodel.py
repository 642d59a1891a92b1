"""Generate tiny random-weight llama-architecture GGUF files for tests.

The files are a few hundred KB, load in a real ``llama-server`` and serve chat completions
(ChatML template), streaming, ``/completion``, ``/tokenize``/``/detokenize`` and, when the
server is started with ``--embeddings --pooling mean``, embeddings. The weights are random,
so the generated text is gibberish; only the plumbing is meaningful. The LM head is shaped so
that sampled text is printable ASCII and runs to ``max_tokens`` (see ``_output_head``).

Tokenizer: byte-level BPE (``tokenizer.ggml.model = "gpt2"``, pre-tokenizer ``"qwen2"``)
with the 256 GPT-2 byte tokens, a handful of merges (llama.cpp requires the merges key and
gguf's writer drops empty arrays) and three control tokens: ``<|endoftext|>`` (bos/pad),
``<|im_start|>`` and ``<|im_end|>`` (eos, so it ends generation).

Usage::

    python -m router.llama.tinymodel OUT.gguf [--seed N] [--name NAME]

Needs gguf and numpy, the optional extra ``tiny`` (``pip install 'llama-router[tiny]'``): only
``llama-router tiny-model``, the tests and the benchmark import this module, never the router.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "ensure_tiny_model",
    "main",
    "tokenizer_vocab",
    "write_tiny_model",
]

ARCH = "llama"

BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, IM_START, IM_END)
# Fill-in-the-middle tokens (Qwen's spelling, which llama.cpp recognises by their text), added
# after the others for a model that ``/infill`` serves (``fim``).
FIM_TOKENS: tuple[str, ...] = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# A few BPE merges, in rank order, written in GPT-2's byte-to-unicode alphabet
# ("Ġ" is a space). Every merge result is also a vocabulary token.
_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("o", "r"),
    ("e", "n"),
    ("Ġ", "w"),
    ("l", "l"),
    ("Ġ", "h"),
    ("i", "s"),
)


_LOGIT_STD = 6.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tokenizer_vocab(fim: bool = False) -> tuple[list[str], list[int], list[str]]:
    """Return ``(tokens, token_types, merges)`` for the tiny byte-level BPE tokenizer.

    Token ids: 0..255 are the byte tokens (id == byte value), then the merge results, then
    the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, and with ``fim``
    the fill-in-the-middle ones (``FIM_TOKENS``).
    """
    byte_map = _bytes_to_unicode()
    tokens = [byte_map[b] for b in range(256)]
    known = set(tokens)
    for left, right in _MERGES:
        if left not in known or right not in known:
            raise AssertionError(f"merge {left!r} {right!r} uses an unknown token")
        merged = left + right
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    special = SPECIAL_TOKENS + (FIM_TOKENS if fim else ())
    tokens.extend(special)
    types.extend([int(gguf.TokenType.CONTROL)] * len(special))
    merges = [f"{left} {right}" for left, right in _MERGES]
    return tokens, types, merges


def _tensor_name(kind: Any, bid: int | None = None) -> str:
    if kind not in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]:
        raise AssertionError(f"{kind} is not a llama tensor")
    base: str = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + ".weight"


def _output_head(
    weights: np.ndarray[Any, np.dtype[np.float32]], tokens: list[str]
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Make the LM head emit only printable ASCII text.

    Rows of every other token (control bytes, bytes >= 0x80, newline, special tokens) are
    zeroed, so their logit is exactly 0, while the printable rows are scaled so their logits
    have a standard deviation of about ``_LOGIT_STD``. With llama-server's default samplers
    (top-k 40, min-p 0.05) the zero-logit tokens are then never sampled: replies are valid
    ASCII, never contain special tokens and never stop early on ``<|im_end|>`` (generation
    runs to ``max_tokens``, finish_reason "length").
    """
    byte_map = _bytes_to_unicode()
    printable = {byte_map[b] for b in range(0x20, 0x7F)}
    allowed = np.array(
        [all(ch in printable for ch in tok) and tok not in SPECIAL_TOKENS for tok in tokens]
    )
    # output_norm leaves each hidden component ~N(0, 1); rows from mat() have unit norm.
    scale = np.float32(_LOGIT_STD)
    out: np.ndarray[Any, np.dtype[np.float32]] = weights * scale
    out[~allowed] = 0.0
    return out


def _validate(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ctx_train: int) -> None:
    if min(n_layer, n_embd, n_head, n_head_kv, n_ctx_train) < 1:
        raise ValueError("n_layer, n_embd, n_head, n_head_kv and n_ctx_train must be >= 1")
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    if n_head % n_head_kv:
        raise ValueError(f"n_head ({n_head}) must be divisible by n_head_kv ({n_head_kv})")
    if (n_embd // n_head) % 2:
        raise ValueError(f"head size ({n_embd // n_head}) must be even for RoPE")


_F32Array = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class _Shape:
    """The model's hyperparameters, as the tensors and the GGUF metadata both need them."""

    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_ff(self) -> int:
        return 2 * self.n_embd


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 2048,
    name: str = "tiny",
    fim: bool = False,
) -> Path:
    """Write a tiny random-weight llama GGUF to ``path`` (atomically) and return its path.

    The output is a pure function of the arguments: the same arguments give identical bytes,
    different seeds give different weights. With ``fim`` its vocabulary has the
    fill-in-the-middle tokens, so that llama-server serves ``/infill`` with it.
    """
    _validate(n_layer, n_embd, n_head, n_head_kv, n_ctx_train)
    out = Path(path)
    tokens, types, merges = tokenizer_vocab(fim)
    shape = _Shape(len(tokens), n_layer, n_embd, n_head, n_head_kv, n_ctx_train)
    tensors = _random_tensors(np.random.default_rng(seed), shape, tokens)
    with _replacing(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch=ARCH)
        _add_hyperparameters(w, name, shape)
        _add_tokenizer(w, tokens, types, merges)
        for tensor_name, data in tensors:
            w.add_tensor(tensor_name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _random_tensors(rng: np.random.Generator, shape: _Shape,
                    tokens: list[str]) -> list[tuple[str, _F32Array]]:
    """Every tensor of the model, by name, in file order: random matrices drawn from ``rng``
    in that order (so a seed gives the same weights), norms of ones."""

    def mat(rows: int, cols: int) -> _F32Array:
        # numpy shape (rows, cols) == ggml ne {cols, rows}
        scale = np.float32(1.0 / np.sqrt(cols))
        return rng.standard_normal((rows, cols), dtype=np.float32) * scale

    def ones(n: int) -> _F32Array:
        return np.ones((n,), dtype=np.float32)

    t = gguf.MODEL_TENSOR
    n_embd, head_dim, n_ff = shape.n_embd, shape.head_dim, shape.n_ff
    tensors: list[tuple[str, _F32Array]] = [
        (_tensor_name(t.TOKEN_EMBD), mat(shape.n_vocab, n_embd)),
    ]
    for i in range(shape.n_layer):
        tensors += [
            (_tensor_name(t.ATTN_NORM, i), ones(n_embd)),
            (_tensor_name(t.ATTN_Q, i), mat(shape.n_head * head_dim, n_embd)),
            (_tensor_name(t.ATTN_K, i), mat(shape.n_head_kv * head_dim, n_embd)),
            (_tensor_name(t.ATTN_V, i), mat(shape.n_head_kv * head_dim, n_embd)),
            (_tensor_name(t.ATTN_OUT, i), mat(n_embd, shape.n_head * head_dim)),
            (_tensor_name(t.FFN_NORM, i), ones(n_embd)),
            (_tensor_name(t.FFN_GATE, i), mat(n_ff, n_embd)),
            (_tensor_name(t.FFN_UP, i), mat(n_ff, n_embd)),
            (_tensor_name(t.FFN_DOWN, i), mat(n_embd, n_ff)),
        ]
    tensors += [
        (_tensor_name(t.OUTPUT_NORM), ones(n_embd)),
        (_tensor_name(t.OUTPUT), _output_head(mat(shape.n_vocab, n_embd), tokens)),
    ]
    return tensors


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A temporary file next to ``out`` to write: it replaces ``out`` when the block ends
    without an error, and is removed when it does not."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; make it look like a normal file
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _add_hyperparameters(w: gguf.GGUFWriter, name: str, shape: _Shape) -> None:
    w.add_name(name)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_vocab_size(shape.n_vocab)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(10000.0)


def _add_tokenizer(w: gguf.GGUFWriter, tokens: list[str], types: list[int],
                   merges: list[str]) -> None:
    """The byte-level BPE tokenizer and the ChatML template (see the module's docstring)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS_TOKEN))
    w.add_eos_token_id(tokens.index(EOS_TOKEN))
    w.add_eot_token_id(tokens.index(IM_END))
    w.add_pad_token_id(tokens.index(BOS_TOKEN))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def ensure_tiny_model(path: str | os.PathLike[str], **kw: Any) -> Path:
    """Write the tiny model to ``path`` unless a file already exists there."""
    out = Path(path)
    if out.is_file():
        return out
    return write_tiny_model(out, **kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router.llama.tinymodel",
        description="Write a tiny random-weight llama GGUF (for tests and smoke checks).",
    )
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the weights")
    parser.add_argument("--name", default="tiny", help="general.name metadata")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-head-kv", type=int, default=2)
    parser.add_argument("--n-ctx-train", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        out = write_tiny_model(
            args.out,
            seed=args.seed,
            name=args.name,
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            n_head=args.n_head,
            n_head_kv=args.n_head_kv,
            n_ctx_train=args.n_ctx_train,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
