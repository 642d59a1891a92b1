"""The numpy-free GGUF metadata reader, checked against the gguf package's own reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from router.llama.ggufmeta import StringArray, read_metadata
from router.llama.tinymodel import write_tiny_model


def reference(path: Path) -> dict[str, Any]:
    """What gguf.GGUFReader reads, in read_metadata's shapes."""
    reader = gguf.GGUFReader(path, "r")
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            continue
        kinds = field.types
        if kinds[0] == gguf.GGUFValueType.ARRAY:
            if kinds[-1] == gguf.GGUFValueType.STRING:
                out[key] = StringArray(len(field.data))
            else:
                out[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif kinds[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[key] = field.parts[field.data[0]].tolist()[0]
    return out


def write_model(path: Path, endianess: Any = None) -> Path:
    """A header with every value type, and a 150k-entry string array like a real vocab."""
    kw = {"endianess": endianess} if endianess is not None else {}
    writer = gguf.GGUFWriter(str(path), "llama", **kw)
    writer.add_block_count(3)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("llama.attention.head_count_kv", [8, 8, 4])
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(150_000)])
    writer.add_tensor("w", gguf.np.zeros((4, 4), dtype=gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_model_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    assert read_metadata(path) == reference(path)


def test_every_value_type_and_a_large_vocabulary(tmp_path: Path) -> None:
    path = write_model(tmp_path / "all.gguf")
    metadata = read_metadata(path)
    assert metadata == reference(path)
    assert metadata["t.u64"] == 1 << 40
    assert metadata["t.bool"] is True
    assert metadata["t.str"] == "héllo"
    assert metadata["llama.attention.head_count_kv"] == [8, 8, 4]
    assert metadata["tokenizer.ggml.tokens"] == StringArray(150_000)


def test_big_endian_file(tmp_path: Path) -> None:
    path = write_model(tmp_path / "be.gguf", gguf.GGUFEndian.BIG)
    metadata = read_metadata(path)
    assert metadata["general.architecture"] == "llama"
    assert metadata["t.i64"] == -(1 << 40)
    assert metadata["llama.block_count"] == 3
    assert metadata["tokenizer.ggml.tokens"] == StringArray(150_000)


@pytest.mark.parametrize("cut", [3, 8, 30, 200, 5000])
def test_truncated_header_is_a_value_error(tmp_path: Path, cut: int) -> None:
    data = write_model(tmp_path / "all.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError):
        read_metadata(tmp_path / "cut.gguf")


@pytest.mark.parametrize("content", [b"", b"GGML\x03\x00\x00\x00", b"GGUF\x01\x00\x00\x00" +
                                     bytes(16)])
def test_not_gguf_or_unsupported_version(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "bad.gguf").write_bytes(content)
    with pytest.raises(ValueError):
        read_metadata(tmp_path / "bad.gguf")


def test_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_metadata(tmp_path / "absent.gguf")


@pytest.mark.process
def test_reading_a_header_does_not_import_numpy(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    code = ("import sys; from router.host.memory import read_shape; read_shape(sys.argv[1]); "
            "print('numpy' in sys.modules, 'gguf' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
