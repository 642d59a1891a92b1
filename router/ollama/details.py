"""What Ollama says of a model, from its GGUF header (``ggufmeta``, read once per file
version): ``details`` (family, parameter size, quantization level, format), the scalar
``model_info``, its chat template and capabilities, its size, modification time and a
digest. The digest names the file's version (path, size, modification time), not its bytes:
hashing gigabytes per listing is out of the question."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from ..llama.ggufmeta import read_metadata

# llama.cpp's ``llama_ftype`` (``general.file_type``) as Ollama names quantization levels.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


@dataclass(frozen=True)
class Facts:
    """One GGUF file as Ollama describes it."""

    size: int = 0
    modified_at: str = "1970-01-01T00:00:00Z"
    digest: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    model_info: Mapping[str, Any] = field(default_factory=dict)
    template: str = ""
    context_length: int | None = None


NO_FACTS = Facts(details={"format": "gguf", "family": "", "families": None,
                          "parameter_size": "", "quantization_level": "",
                          "parent_model": ""})


def facts(path: str | None) -> Facts:
    """The facts of the GGUF file at ``path``; ``NO_FACTS`` when there is none (not
    downloaded yet, a remote upstream) or it cannot be read."""
    if not path:
        return NO_FACTS
    try:
        stat = os.stat(path)
    except OSError:
        return NO_FACTS
    return _facts(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)
def _facts(path: str, size: int, mtime_ns: int) -> Facts:
    try:
        meta = read_metadata(path)
    except ValueError:
        return NO_FACTS
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) else ""
    file_type = meta.get("general.file_type")
    context = meta.get(f"{arch}.context_length")
    info = {key: value for key, value in meta.items()
            if isinstance(value, (str, int, float, bool)) and not key.startswith("tokenizer.")}
    template = meta.get("tokenizer.chat_template")
    details = {"parent_model": "", "format": "gguf", "family": arch,
               "families": [arch] if arch else None,
               "parameter_size": _parameter_size(meta),
               "quantization_level": FILE_TYPES.get(file_type, "")
               if isinstance(file_type, int) else ""}
    stamp = datetime.fromtimestamp(mtime_ns / 1e9, UTC).isoformat().replace("+00:00", "Z")
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    return Facts(size, stamp, digest, details, info,
                 template if isinstance(template, str) else "",
                 context if isinstance(context, int) and context > 0 else None)


def _parameter_size(meta: Mapping[str, Any]) -> str:
    """``general.size_label`` (``135M``), else the parameter count written short."""
    label = meta.get("general.size_label")
    if isinstance(label, str) and label:
        return label
    count = meta.get("general.parameter_count")
    if not isinstance(count, int) or count <= 0:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(count)


def capabilities(args: Mapping[str, str], template: str) -> list[str]:
    """What the model can do, as Ollama lists it, from its preset's arguments and template."""
    embeds = args.get("embeddings", "").lower() in ("true", "1", "on", "")  \
        and "embeddings" in args
    found = ["embedding"] if embeds else ["completion"]
    if "tools" in template:
        found.append("tools")
    if any(args.get(k) for k in ("mmproj", "mmproj-url")):
        found.append("vision")
    if "enable_thinking" in template or "<think>" in template:
        found.append("thinking")
    return found


def context_of(args: Mapping[str, str], found: Facts) -> int | None:
    """The model's context as its preset starts it: ``ctx-size`` when set above 0, else the
    training context of its GGUF header; None when neither is known."""
    raw = args.get("ctx-size") or args.get("c")
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        value = 0
    return value if value > 0 else found.context_length
