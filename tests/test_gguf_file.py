"""The GGUF reader: valid files load without copying, and every kind of bad file is a one-line FerryError."""

import struct

import numpy as np
import pytest

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.gguf.writer import TensorSpec, write_gguf
from ferry.quant import Q, quantize


def _valid(path, n_tensors=3, arch="llama"):
    rng = np.random.default_rng(0)
    specs = [TensorSpec(f"t{i}", Q.Q8_0, (64, 3), lambda: quantize(rng.standard_normal((3, 64)).astype(np.float32), Q.Q8_0))
             for i in range(n_tensors)]
    write_gguf(path, arch, {"llama.block_count": 1, "general.name": "x"}, specs)
    return path


def _header(version=3, n_tensors=0, n_kv=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _patch(path, tensor: str, field_offset: int, fmt: str, value) -> None:
    """Overwrite one field of a tensor's info entry; offsets count from the end of its name:
    +4 the dims (u64 each), +4+16 the type (u32), +4+16+4 the data offset (u64), for 2-dim tensors."""
    raw = bytearray(path.read_bytes())
    at = raw.index(tensor.encode()) + len(tensor) + field_offset
    raw[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(raw))


def _error(path) -> str:
    with pytest.raises(FerryError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_valid_file_loads_tensors_as_views_of_the_file(tmp_path):
    f = GGUFFile(_valid(tmp_path / "m.gguf"))
    assert f.architecture == "llama" and f.get("llama.block_count") == 1
    t = f.tensor("t1")
    assert t.ne == (64, 3) and t.qtype == Q.Q8_0 and t.offset % 32 == 0
    data = f.data(t)
    assert data.nbytes == 3 * 2 * 34 and not data.flags.owndata and not data.flags.writeable


def test_missing_file(tmp_path):
    assert "no such file" in _error(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert "not a GGUF file" in _error(tmp_path / "x.gguf")


def test_unsupported_version(tmp_path):
    (tmp_path / "x.gguf").write_bytes(_header(version=1) + b"\0" * 64)
    assert "unsupported GGUF version 1" in _error(tmp_path / "x.gguf")


def test_truncated_header(tmp_path):
    (tmp_path / "x.gguf").write_bytes(_header(n_kv=1) + struct.pack("<Q", 20) + b"gen")
    assert "truncated" in _error(tmp_path / "x.gguf")


def test_truncated_tensor_data(tmp_path):
    path = _valid(tmp_path / "m.gguf")
    raw = path.read_bytes()
    path.write_bytes(raw[:-40])
    assert "truncated or tensor data lies past its end" in _error(path)


def test_tensor_offset_past_end_of_file(tmp_path):
    path = _valid(tmp_path / "m.gguf", n_tensors=1)
    _patch(path, "t0", 4 + 16 + 4, "<Q", 1 << 20)
    assert "past its end" in _error(path)


def test_misaligned_tensor_data(tmp_path):
    path = _valid(tmp_path / "m.gguf", n_tensors=2)
    _patch(path, "t1", 4 + 16 + 4, "<Q", GGUFFile(path).tensors["t1"].offset - GGUFFile(path).tensors["t0"].offset + 4)
    assert "not aligned" in _error(path)


def test_overlapping_tensors(tmp_path):
    path = _valid(tmp_path / "m.gguf", n_tensors=2)
    _patch(path, "t1", 4 + 16 + 4, "<Q", 32)  # t0 starts at 0 and is 204 bytes long
    assert "overlap" in _error(path)


def test_unknown_quant_type(tmp_path):
    path = _valid(tmp_path / "m.gguf", n_tensors=1)
    _patch(path, "t0", 4 + 16, "<I", 250)
    assert "unknown quant type 250" in _error(path)


@pytest.mark.parametrize("raw,name", [(134, "IQ1_BN"), (219, "IQ1_S_R4"), (135, "IQ2_BN"),
                                      (229, "IQ1_M_R4")])
def test_an_ik_llama_cpp_quant_type_is_named_as_such_not_called_corrupt(tmp_path, raw, name):
    """A file ik_llama.cpp's llama-quantize wrote is valid: its type is named, as ik_llama.cpp's, with what to do."""
    path = _valid(tmp_path / "m.gguf", n_tensors=1)
    _patch(path, "t0", 4 + 16, "<I", raw)
    msg = _error(path)
    assert f"tensor 't0' is {name} (type {raw}), one of ik_llama.cpp's own quant types" in msg
    assert "corrupt" not in msg and "llama-quantize" in msg


def test_the_ik_type_table_gives_row_bytes_with_their_metadata():
    """Types that store a row scale before each row (IQ4_KS: 4 bytes) take more than blocks x block bytes; the
    table's block sizes are the static_asserts of ik_llama.cpp's ggml-common.h."""
    from ferry.quant import IK_TYPES, ik_type_bytes

    assert ik_type_bytes(144, (4096, 10)) == 10 * (4 + 16 * 136)
    assert ik_type_bytes(133, (64, 3)) == 3 * 2 * 26  # Q6_0: no row metadata
    assert ik_type_bytes(157, (512, 2, 3)) == 6 * (2 + 2 * 86)
    assert not set(IK_TYPES) & {q.value for q in Q}  # no id means another type in gguf-py's table
    assert {IK_TYPES[i][0] for i in (133, 137, 138, 139, 140, 141, 144, 145, 146, 152, 153, 154, 155, 156, 157,
                                     158)} == {"Q6_0", "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ4_KS",
                                               "IQ2_KS", "IQ4_KSS", "IQ5_KS", "IQ2_KT", "IQ3_KT", "IQ4_KT",
                                               "IQ3_KS", "IQ2_KL", "IQ1_KT"}


def test_row_length_not_a_multiple_of_the_block(tmp_path):
    path = _valid(tmp_path / "m.gguf", n_tensors=1)
    _patch(path, "t0", 4, "<Q", 65)
    assert "not a multiple" in _error(path)


@pytest.mark.parametrize("count_field", ["n_kv", "n_tensors"])
def test_absurd_counts_fail_before_any_allocation(tmp_path, count_field):
    (tmp_path / "x.gguf").write_bytes(_header(**{count_field: 1 << 60}) + b"\0" * 64)
    assert "absurd" in _error(tmp_path / "x.gguf")


def test_absurd_string_length(tmp_path):
    (tmp_path / "x.gguf").write_bytes(_header(n_kv=1) + struct.pack("<Q", 1 << 62) + b"\0" * 64)
    assert "absurd length" in _error(tmp_path / "x.gguf")


def test_absurd_array_count(tmp_path):
    key = b"tokenizer.ggml.tokens"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, 1 << 58)
    (tmp_path / "x.gguf").write_bytes(_header(n_kv=1) + body + b"\0" * 64)
    assert "absurd element count" in _error(tmp_path / "x.gguf")


def test_absurd_tensor_shape(tmp_path):
    name = b"w"
    info = struct.pack("<Q", 1) + name + struct.pack("<I", 2) + struct.pack("<QQ", 1 << 40, 1 << 40) + struct.pack("<IQ", 0, 0)
    (tmp_path / "x.gguf").write_bytes(_header(n_tensors=1) + info + b"\0" * 64)
    assert "absurd shape" in _error(tmp_path / "x.gguf")


def test_unsupported_architecture(tmp_path):
    from ferry.models import load_model

    path = tmp_path / "x.gguf"
    path.write_bytes(_header(n_kv=1) + _kv_string("general.architecture", "rwkv7"))
    with pytest.raises(FerryError, match="architecture 'rwkv7' is not supported; supported: deepseek2, deepseek32, deepseek4, gemma3, glm-dsa, glm4moe, gpt-oss, llama"):
        load_model(GGUFFile(path))


def test_shape_that_contradicts_the_metadata(tmp_path):
    from ferry.models import load_model
    from tests.fixtures.hf import tiny_hf_model, to_gguf

    path = tmp_path / "m.gguf"
    to_gguf(tiny_hf_model("qwen3"), "qwen3", path)
    raw = bytearray(path.read_bytes())
    key = b"qwen3.embedding_length"
    at = raw.index(key) + len(key) + 4
    raw[at:at + 4] = struct.pack("<I", 96)
    path.write_bytes(bytes(raw))
    with pytest.raises(FerryError, match="has shape .* but the metadata implies"):
        load_model(GGUFFile(path))


def test_split_files_load_as_one_model(tmp_path):
    from gguf import GGUFWriter

    # two parts written by gguf-py's own splitter, one tensor each
    w = GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=1)
    for i in range(2):
        w.add_tensor(f"t{i}", np.full((2, 32), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(p.name for p in tmp_path.glob("m-*.gguf"))
    assert parts == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    f = GGUFFile(tmp_path / parts[0])
    assert set(f.tensors) == {"t0", "t1"}
    assert f.data("t1").view(np.float32).tolist() == [1.0] * 64
    (tmp_path / parts[1]).unlink()
    assert "missing part 2" in _error(tmp_path / parts[0])
