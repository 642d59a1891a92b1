"""Read the key/value metadata of a GGUF file, and nothing else.

The router needs a dozen integers from a model's header (see ``memory.read_shape``). The
``gguf`` package reads them too, but imports numpy, which would stay in the router's memory
for good (+19 MB RSS). This reader walks the header with ``struct`` over a memory map and
unmaps it when done.

Contract: ``read_metadata(path)`` returns ``{key: value}`` for every metadata entry. Numbers
and booleans are Python scalars, strings are ``str`` (invalid UTF-8 replaced), numeric arrays
are lists, and string arrays (tokenizer vocabularies: often 100k+ entries) are ``StringArray``
holding only their length. Raises ``ValueError`` for anything that is not a well-formed GGUF
v2/v3 header (either byte order).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value types: struct format of each scalar type (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


@dataclass(frozen=True)
class StringArray:
    """An array of strings, by its length only."""

    length: int


class _Header:
    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf = buf
        self.order = order
        self.offset = 0
        self._u64 = struct.Struct(order + "Q")
        self._u32 = struct.Struct(order + "I")
        self._scalars = {t: struct.Struct(order + f) for t, f in _SCALARS.items()}

    def u32(self) -> int:
        (value,) = self._u32.unpack_from(self.buf, self.offset)
        self.offset += 4
        return int(value)

    def u64(self) -> int:
        (value,) = self._u64.unpack_from(self.buf, self.offset)
        self.offset += 8
        return int(value)

    def string(self) -> str:
        length = self.u64()
        end = self.offset + length
        if end > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = self.buf[self.offset:end].decode("utf-8", "replace")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.u32(), self.u64()
            if item_kind == _STRING:
                self._skip_strings(count)
                return StringArray(count)
            scalar = self._scalars.get(item_kind)
            if scalar is None:
                raise ValueError(f"unsupported array item type {item_kind}")
            end = self.offset + scalar.size * count
            if end > len(self.buf):
                raise ValueError("array runs past the end of the file")
            items = [v for (v,) in scalar.iter_unpack(self.buf[self.offset:end])]
            self.offset = end
            return items
        scalar = self._scalars.get(kind)
        if scalar is None:
            raise ValueError(f"unsupported value type {kind}")
        (value,) = scalar.unpack_from(self.buf, self.offset)
        self.offset += scalar.size
        return value

    def _skip_strings(self, count: int) -> None:
        u64, buf, offset, size = self._u64, self.buf, self.offset, len(self.buf)
        for _ in range(count):
            (length,) = u64.unpack_from(buf, offset)
            offset += 8 + length
            if offset > size:
                raise ValueError("string array runs past the end of the file")
        self.offset = offset


def read_metadata(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf)
    except OSError as exc:
        raise ValueError(f"cannot read: {exc}") from exc
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"truncated or corrupt GGUF header ({exc})") from exc


def _parse(buf: mmap.mmap) -> dict[str, Any]:
    if buf[:4] != MAGIC:
        raise ValueError(f"bad magic {buf[:4]!r}")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    header = _Header(buf, order)
    header.offset = 8
    header.u64()  # tensor count
    kv_count = header.u64()
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = header.string()
        metadata[key] = header.value(header.u32())
    return metadata
