"""GGUF quant types: the table (from gguf-py), reference dequantization, and quantization through ggml."""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ferry.errors import FerryError

Q = GGMLQuantizationType

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
NUMPY_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
                Q.I32: np.int32}


def parse_qtype(name: str) -> GGMLQuantizationType:
    """'q4_k' or 'Q4_K' -> GGMLQuantizationType.Q4_K, with an error that lists the valid names."""
    try:
        return Q[name.upper()]
    except KeyError:
        valid = ", ".join(t.name for t in Q if t in GGML_QUANT_SIZES)
        raise FerryError(f"unknown quant type '{name}'; valid types: {valid}") from None


def bytes_per_weight(qtype: GGMLQuantizationType) -> float:
    """Bytes one value takes in a type's blocks (Q4_0: 18 / 32)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return type_size / block


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, ne: tuple[int, ...]) -> np.ndarray:
    """Reference dequantization (gguf-py, numpy) to float32 in torch order (reversed ne)."""
    shape = tuple(reversed(ne))
    if qtype in NUMPY_TYPES:
        return raw.view(NUMPY_TYPES[qtype]).astype(np.float32).reshape(shape)
    rows = raw.reshape(-1, row_bytes(qtype, ne[0]))
    return gguf_quants.dequantize(rows, qtype).astype(np.float32, copy=False).reshape(shape)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize float rows (last axis = row) with ggml's own C quantizers; returns the raw bytes."""
    import ggml

    values = np.ascontiguousarray(values, dtype=np.float32)
    n_per_row = values.shape[-1]
    n_rows = values.size // n_per_row
    if qtype == Q.F32:
        return values.view(np.uint8).reshape(-1).copy()
    if ggml.ggml_quantize_requires_imatrix(qtype.value):
        raise FerryError(f"{qtype.name} needs an importance matrix to quantize; pick another type")
    out = np.empty(n_rows * row_bytes(qtype, n_per_row), dtype=np.uint8)
    src = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    written = ggml.ggml_quantize_chunk(qtype.value, src, out.ctypes.data, 0, n_rows, n_per_row, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out
