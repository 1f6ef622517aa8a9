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


# ik_llama.cpp's own quant types (its ggml/include/ggml.h, the block sizes from its ggml-common.h and ggml.c's
# type_traits): id -> (name, values a block, bytes a block, bytes of metadata before each row). None of these ids
# means another type in mainline ggml (its 41, Q1_0, and ik's Q1_0_G128 are one layout under two names, and gguf-py
# reads it as Q1_0). The _R4 / _R8 / _R16 types are ik's interleaved layouts of other types.
QK_K = 256
IK_TYPES: dict[int, tuple[str, int, int, int]] = {
    36: ("I2_S", 1, 1, 0), 133: ("Q6_0", 32, 26, 0), 134: ("IQ1_BN", 64, 13, 2), 135: ("IQ2_BN", 64, 16, 4),
    137: ("IQ2_K", QK_K, 76, 0), 138: ("IQ3_K", QK_K, 110, 0), 139: ("IQ4_K", QK_K, 144, 0),
    140: ("IQ5_K", QK_K, 176, 0), 141: ("IQ6_K", QK_K, 212, 0), 144: ("IQ4_KS", QK_K, 136, 4),
    145: ("IQ2_KS", QK_K, 70, 2), 146: ("IQ4_KSS", QK_K, 128, 4), 152: ("IQ5_KS", QK_K, 168, 4),
    153: ("IQ2_KT", QK_K, 68, 4), 154: ("IQ3_KT", QK_K, 100, 4), 155: ("IQ4_KT", QK_K, 128, 4),
    156: ("IQ3_KS", QK_K, 102, 2), 157: ("IQ2_KL", QK_K, 86, 2), 158: ("IQ1_KT", QK_K, 56, 4),
    202: ("Q4_0_R8", 32, 18, 0), 206: ("Q5_0_R4", 32, 22, 0), 208: ("Q8_0_R8", 32, 34, 0),
    210: ("Q2_K_R4", QK_K, 84, 0), 211: ("Q3_K_R4", QK_K, 110, 0), 212: ("Q4_K_R4", QK_K, 144, 0),
    213: ("Q5_K_R4", QK_K, 176, 0), 214: ("Q6_K_R4", QK_K, 210, 0), 216: ("IQ2_XXS_R4", QK_K, 66, 0),
    217: ("IQ2_XS_R4", QK_K, 74, 0), 218: ("IQ3_XXS_R4", QK_K, 98, 0), 219: ("IQ1_S_R4", 32, 6, 2),
    220: ("IQ4_NL_R4", 32, 18, 0), 221: ("IQ3_S_R4", QK_K, 110, 0), 222: ("IQ2_S_R4", QK_K, 82, 0),
    223: ("IQ4_XS_R8", QK_K, 136, 0), 229: ("IQ1_M_R4", 32, 7, 2), 230: ("BF16_R16", 1, 2, 0),
    233: ("Q6_0_R4", 32, 26, 0), 335: ("IQ2_BN_R4", 64, 16, 4), 337: ("IQ2_K_R4", QK_K, 76, 0),
    338: ("IQ3_K_R4", QK_K, 110, 0), 339: ("IQ4_K_R4", QK_K, 144, 0), 340: ("IQ5_K_R4", QK_K, 176, 0),
    344: ("IQ4_KS_R4", QK_K, 136, 4), 352: ("IQ5_KS_R4", QK_K, 168, 4), 353: ("MXFP4_R8", 32, 17, 0),
    397: ("Q8_K_R16", QK_K, 258, 0), 398: ("Q8_KV_R8", 32, 32, 4), 399: ("Q8_K_R8", QK_K, 258, 0),
}


def ik_type_bytes(raw_type: int, ne: tuple[int, ...]) -> int:
    """Bytes a tensor of ik_llama.cpp's type raw_type and shape ne takes in the file: each row's metadata (a row
    scale) before its blocks."""
    _, block, size, meta = IK_TYPES[raw_type]
    rows = 1
    for d in ne[1:]:
        rows *= d
    return rows * (meta + ne[0] // block * size)


# ik_llama.cpp's non-linear 4-bit values (its iq4k_values): IQ4_KS's two tables, a sub-block's low scale bit picks one
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                        -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], dtype=np.float64)


def dequantize_ik(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """ik_llama.cpp's quant types to float64 in torch order (reversed ne), the reference the rest is tested against:
    Q6_0 (per 32 values an fp16 scale, 8 bytes of high bit pairs, 16 of nibbles: w = d (q - 32)) and IQ4_KS (a
    float32 scale before each row, then per 256 values 8 sub-block scales and 128 bytes of nibbles indexing
    IQ4K_VALUES: w = d ((s & 254) - 127) table[s & 1][q])."""
    name = IK_TYPES[raw_type][0] if raw_type in IK_TYPES else str(raw_type)
    rows = int(np.prod(ne[1:], dtype=np.int64))
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if name == "Q6_0":
        b = raw.reshape(-1, 26)
        d = b[:, :2].copy().view(np.float16).astype(np.float64)  # (blocks, 1)
        qh, qs = b[:, 2:10].astype(np.int32), b[:, 10:26].astype(np.int32)
        j = np.arange(16)
        h = qh[:, j % 8] >> (4 * (j // 8))
        lo = (qs & 0x0F) | ((h << 4) & 0x30)
        hi = (qs >> 4) | ((h << 2) & 0x30)
        out = (np.concatenate([lo, hi], axis=1) - 32) * d
    elif name == "IQ4_KS":
        per_row = 4 + ne[0] // QK_K * 136
        r = raw.reshape(rows, per_row)
        d = r[:, :4].copy().view(np.float32).astype(np.float64)  # (rows, 1)
        b = r[:, 4:].reshape(rows, -1, 136)
        scales, qs = b[:, :, :8].astype(np.int32), b[:, :, 8:].reshape(rows, -1, 8, 16).astype(np.int32)
        dl = d[:, :, None] * ((scales & 254) - 127)  # (rows, super-blocks, 8)
        table = (scales & 1) * 16  # each sub-block's table
        lo = IQ4K_VALUES[table[..., None] + (qs & 0x0F)]
        hi = IQ4K_VALUES[table[..., None] + (qs >> 4)]
        out = np.concatenate([lo, hi], axis=-1) * dl[..., None]
    else:
        raise FerryError(f"{name} (type {raw_type}) is an ik_llama.cpp quant type ferry does not dequantize yet")
    return out.reshape(tuple(reversed(ne)))


# The ik_llama.cpp types ferry runs, and the llama.cpp type each is rewritten into at load (ik_to_q8_0): Q6_0's values
# are Q8_0's exactly; IQ4_KS's come out as its table values under each sub-block's scale (the row's float32 times the
# sub-block's integer), which Q8_0 keeps in fp16: a relative rounding of at most 2^-11 per 32 weights.
IK_RUN_AS = {133: Q.Q8_0, 144: Q.Q8_0}
IK_NOTE = {"Q6_0": "the same values", "IQ4_KS": "each 32 values' scale rounded to fp16, at most 2^-11 of a value"}


def ik_name(raw_type: int) -> str:
    return IK_TYPES[raw_type][0] if raw_type in IK_TYPES else str(raw_type)


def ik_to_q8_0(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """A tensor of ik_llama.cpp's Q6_0 or IQ4_KS as Q8_0 blocks (an fp16 scale and 32 int8 values each), the same
    weights in the same order: by ferry's C file on every core where it builds, else by numpy
    (ik_to_q8_0_reference); raises FerryError where a scale leaves fp16's range."""
    from ferry.kernels.cpu import native

    if raw_type in IK_RUN_AS:
        rows = int(np.prod(ne[1:], dtype=np.int64))
        fast = native.ik_to_q8_0(raw, raw_type, rows, ne[0])
        if fast is not None:
            return fast
    return ik_to_q8_0_reference(raw, raw_type, ne)


def ik_to_q8_0_reference(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """ik_to_q8_0 in numpy."""
    name = ik_name(raw_type)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if name == "Q6_0":
        b = raw.reshape(-1, 26)
        d = b[:, :2]
        qh, qs = b[:, 2:10], b[:, 10:26]
        h = np.concatenate([qh, qh >> 4], axis=1)  # byte j (j < 16): weight j's and j + 16's high bits
        lo = (qs & 0x0F) | ((h << 4) & 0x30)
        hi = (qs >> 4) | ((h << 2) & 0x30)
        q = (np.concatenate([lo, hi], axis=1).astype(np.int16) - 32).astype(np.int8)
        return np.concatenate([d, q.view(np.uint8)], axis=1).reshape(-1)
    if name == "IQ4_KS":
        rows = int(np.prod(ne[1:], dtype=np.int64))
        r = raw.reshape(rows, 4 + ne[0] // QK_K * 136)
        d = r[:, :4].copy().view(np.float32)  # (rows, 1)
        b = r[:, 4:].reshape(rows, -1, 136)
        scales, qs = b[:, :, :8].astype(np.int32), b[:, :, 8:].reshape(rows, -1, 8, 16)
        with np.errstate(over="ignore"):
            d8 = (d[:, :, None].astype(np.float64) * ((scales & 254) - 127)).astype(np.float16)
        if not np.isfinite(d8).all():
            raise FerryError("an IQ4_KS scale is beyond fp16's range; the file is corrupt, re-download it")
        table = IQ4K_VALUES.astype(np.int8)[((scales & 1) * 16)[..., None] + np.arange(16)]  # (rows, blocks, 8, 16)
        lo = np.take_along_axis(table, (qs & 0x0F).astype(np.intp), axis=-1)
        hi = np.take_along_axis(table, (qs >> 4).astype(np.intp), axis=-1)
        q = np.concatenate([lo, hi], axis=-1)  # (rows, super-blocks, 8, 32)
        return np.concatenate([d8[..., None].view(np.uint8), q.view(np.uint8)], axis=-1).reshape(-1)
    raise FerryError(f"{name} (type {raw_type}) is an ik_llama.cpp quant type ferry does not read yet")


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
