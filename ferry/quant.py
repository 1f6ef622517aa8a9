"""GGUF quant types: the table (from gguf-py), reference dequantization, and quantization through ggml."""

from __future__ import annotations

import ctypes
import enum

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


# ik_llama.cpp's value tables (its ggml-common.h); in each, the second half is the first shifted up by a constant, and
# a bit per 32 values picks the half
IQ2NL_VALUES = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.int8)
IQ3NL_VALUES = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], dtype=np.int8)
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                        -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], dtype=np.int8)
IQ5NL_VALUES = np.array([-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6, -1, 5, 11, 17,
                         23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121, -124, -112, -101, -90, -81, -72, -63, -55,
                         -48, -41, -34, -28, -22, -16, -10, -4, 1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99,
                         111, 123], dtype=np.int8)
# IQ6_K's 64 values as ik_llama.cpp's kernels use them (its reference dequantizer evaluates a cubic instead, which is
# within half a step of these); the second half is the first plus 1
IQ6NL_VALUES = np.array([-127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54, -51, -47,
                         -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5, -2, 0, 3, 6, 9, 12, 14, 17,
                         20, 23, 27, 30, 33, 36, 40, 44, 47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115,
                         121], dtype=np.int8)
# IQ2_KL's 32 pairs of values (each byte one of IQ3NL_VALUES' first half; the low byte is the first of the pair)
IQ2KL_PAIRS = np.array([0xe9c1, 0x0dc1, 0xc1d8, 0xf6d8, 0x0dd8, 0x2fd8, 0xd8e9, 0xe9e9, 0x01e9, 0x0de9, 0x1ce9, 0xc1f6,
                        0x01f6, 0x0df6, 0x2ff6, 0xe901, 0xf601, 0x0101, 0x0d01, 0x1c01, 0xd80d, 0xe90d, 0xf60d, 0x010d,
                        0x0d0d, 0xc11c, 0xe91c, 0x011c, 0x1c1c, 0x2f1c, 0xe92f, 0x0d2f],
                       dtype="<u2").view(np.int8).reshape(32, 2)


def _row_scale(r: np.ndarray, meta: int) -> np.ndarray:
    """Each row's scale, the `meta` bytes before its blocks (float32 or fp16), as float64 (rows, 1)."""
    return r[:, :meta].copy().view(np.float32 if meta == 4 else np.float16).astype(np.float64)


def _bits(a: np.ndarray, shift, n: int) -> np.ndarray:
    return (a.astype(np.int32) >> shift) & ((1 << n) - 1)


def _ik_parts(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The ik_llama.cpp types whose 32 consecutive weights share one scale, as (scale (rows, n / 32) float64, values
    (rows, n / 32, 32) int8): w = scale values, exactly as ik dequantizes (its layouts in ggml-common.h, its
    dequantize_row_* in iqk_quantize.cpp).
    - Q6_0: per 32 an fp16 d, 8 bytes of high bit pairs, 16 of nibbles: d (q - 32).
    - IQ4_KS / IQ5_KS: a float32 d before each row; per 256 eight scale bytes S (s = (S & 254) - 127, the half of the
      table S & 1), then 4- (and 5th-) bit indices into IQ4K_VALUES / IQ5NL_VALUES.
    - IQ4_KSS: as IQ4_KS with the scale bits and indices folded into 16-bit words (w & 0xfffe, then x ^ (x >> 1)).
    - IQ3_KS / IQ2_KS: an fp16 d a row; per 256 a 16-bit `extra` (5th scale bits, table halves), 4 bytes of scale
      nibbles (s = ls - 16), 2-bit indices (and 3rd bits) into IQ3NL / IQ2NL_VALUES.
    - IQ2_KL: an fp16 d a row; per 256 6-bit scales (s = ls - 32), 5-bit indices of IQ2KL_PAIRS, two values each."""
    name = ik_name(raw_type)
    if raw_type not in IK_RUN_AS:
        raise FerryError(f"{name} (type {raw_type}) is an ik_llama.cpp quant type ferry does not read yet")
    if raw_type in IK_TRELLIS:  # generated values, each 32's scale as ik's kernels compute it (ikquants/trellis.py)
        from ferry.ikquants.trellis import kt_parts

        s, q = kt_parts(raw, raw_type, ne)
        return s.astype(np.float64), q.reshape(q.shape[0], -1, 32)
    _, block, size, meta = IK_TYPES[raw_type]
    rows = int(np.prod(ne[1:], dtype=np.int64))
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if name == "Q6_0":
        b = raw.reshape(rows, -1, 26)
        d = b[..., :2].copy().view(np.float16).astype(np.float64)[..., 0]
        qh, qs = b[..., 2:10], b[..., 10:26]
        h = np.concatenate([qh, qh >> 4], axis=-1)  # byte j (j < 16): weight j's and j + 16's high bits
        lo = (qs & 0x0F) | ((h << 4) & 0x30)
        hi = (qs >> 4) | ((h << 2) & 0x30)
        return d, (np.concatenate([lo, hi], axis=-1).astype(np.int16) - 32).astype(np.int8)
    r = raw.reshape(rows, meta + ne[0] // block * size)
    d = _row_scale(r, meta)
    b = r[:, meta:].reshape(rows, -1, size)
    nb = b.shape[1]
    sub = np.arange(8)
    if name in ("IQ4_KS", "IQ5_KS", "IQ4_KSS"):
        if name == "IQ4_KSS":
            w = b.copy().view("<u2").reshape(rows, nb, 8, 8).astype(np.int32)  # sub-block, word
            ls = ((w & 1) << np.arange(8)).sum(axis=-1)
            x = w & 0xFFFE
            v = (x ^ (x >> 1)) & 0xFFFF
            qs = np.stack([v & 0xFF, v >> 8], axis=-1).reshape(rows, nb, 8, 16)
            idx = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        else:
            ls = b[:, :, :8].astype(np.int32)
            if name == "IQ4_KS":
                qs = b[:, :, 8:].reshape(rows, nb, 8, 16).astype(np.int32)
                idx = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
            else:
                qs = b[:, :, 8:136].reshape(rows, nb, 4, 1, 32)  # a 64's bytes: sub-block 2k low nibbles, 2k + 1 high
                low = _bits(qs, np.array([0, 4]).reshape(1, 1, 1, 2, 1), 4).reshape(rows, nb, 8, 32)
                qh = b[:, :, 136:168].reshape(rows, nb, 1, 32)
                idx = low | (_bits(qh, sub.reshape(1, 1, 8, 1), 1) << 4)
        table = IQ4K_VALUES if name != "IQ5_KS" else IQ5NL_VALUES
        half = len(table) // 2
        values = table[(ls & 1)[..., None] * half + idx]
        s = (ls & 254) - 127
    elif name in ("IQ3_KS", "IQ2_KS"):
        extra = b[:, :, :2].copy().view("<u2")[..., 0].astype(np.int32)[..., None]  # (rows, nb, 1)
        sc = b[:, :, 2:6].astype(np.int32)
        if name == "IQ3_KS":  # scales[k]: sub-block k low nibble, k + 4 high; extra: 5th scale bits 0-7, halves 8-15
            ls = _bits(sc[:, :, sub % 4], 4 * (sub // 4), 4) | (_bits(extra, sub, 1) << 4)
            half = _bits(extra, 8 + sub, 1)
            qs = b[:, :, 6:70].reshape(rows, nb, 2, 1, 32)
            q = _bits(qs, 2 * np.arange(4).reshape(1, 1, 1, 4, 1), 2).reshape(rows, nb, 8, 32)
            q = q | (_bits(b[:, :, 70:102].reshape(rows, nb, 1, 32), sub.reshape(1, 1, 8, 1), 1) << 2)
            values = IQ3NL_VALUES[half[..., None] * 8 + q]
        else:  # scales[k]: sub-block 2k low nibble, 2k + 1 high; extra: halves bits 0-7, 5th scale bits 8-15
            ls = _bits(sc[:, :, sub // 2], 4 * (sub % 2), 4) | (_bits(extra, 8 + sub, 1) << 4)
            half = _bits(extra, sub, 1)
            qs = b[:, :, 6:70].reshape(rows, nb, 2, 1, 32)
            q = _bits(qs, 2 * np.arange(4).reshape(1, 1, 1, 4, 1), 2).reshape(rows, nb, 8, 32)
            values = IQ2NL_VALUES[half[..., None] * 4 + q]
        s = ls - 16
    else:  # IQ2_KL
        scales_h = b[:, :, :2].copy().view("<u2")[..., 0].astype(np.int32)[..., None]
        ls = _bits(b[:, :, 2:6][:, :, sub % 4], 4 * (sub // 4), 4) | (_bits(scales_h, 2 * sub, 2) << 4)
        qs = b[:, :, 6:70].reshape(rows, nb, 4, 1, 16)
        low = _bits(qs, np.array([0, 4]).reshape(1, 1, 1, 2, 1), 4).reshape(rows, nb, 8, 16)
        idx = low | (_bits(b[:, :, 70:86].reshape(rows, nb, 1, 16), sub.reshape(1, 1, 8, 1), 1) << 4)
        values = IQ2KL_PAIRS[idx].reshape(rows, nb, 8, 32)
        s = ls - 32
    return (d * s.reshape(rows, -1)), values.reshape(rows, -1, 32).astype(np.int8)


IK_PER_16 = ("IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K")  # ik's types with a scale per 16 weights


def _ik_k_parts(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ik_llama.cpp's IQn_K types, whose 16 consecutive weights share one integer scale under a 256's fp16 d, as (d
    (rows, n / 256) float64, s (rows, n / 16) int16, values (rows, n / 16, 16) int8): w = d s values, as ik's kernels
    compute (its layouts in ggml-common.h, dequantize_row_* in iqk_quantize.cpp). Each 256 opens with d and a 16-bit
    `extra` whose bit k takes the second half of the table for the k-th 16; then, per 32 (ib):
    - IQ2_K: scale byte ib (nibbles less 8: first 16, second 16); indices 2 bits at 2 (ib % 4) of byte j of the
      32-byte group ib / 4; IQ2NL_VALUES.
    - IQ3_K: 16 sign bits (scales_h: bit 2 ib + h), a scale byte ib (nibble n: 2 n + 1); as IQ2_K's 2 bits, a third
      from bit ib of 32 bytes of qh; IQ3NL_VALUES.
    - IQ4_K: 2-bit highs (scales_h: byte ib / 2, nibble ib % 2, bits 2h) and a scale byte ib of low nibbles, less 32;
      nibbles in IQ4_XS's order (byte 16 ib + j: low j, high 16 + j); IQ4K_VALUES.
    - IQ5_K: IQ4_K's scales; nibble ib % 2 of byte j of the 32-byte group ib / 2, a fifth bit from bit ib of qh;
      IQ5NL_VALUES.
    - IQ6_K: 16 int8 scales; IQ5_K's nibbles, two bits more at 4 (ib / 2 % 2) + 2 (ib % 2) of byte j of qh's 32-byte
      group ib / 4; IQ6NL_VALUES, plus 1 for the second half."""
    name = ik_name(raw_type)
    _, block, size, _ = IK_TYPES[raw_type]
    rows = int(np.prod(ne[1:], dtype=np.int64))
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, ne[0] // block, size).astype(np.int32)
    d = b[..., :2].astype(np.uint8).copy().view(np.float16).astype(np.float64)[..., 0]
    extra = b[..., 2] | b[..., 3] << 8
    j = np.arange(32)
    scales, values = [], []
    for ib in range(8):
        if name == "IQ2_K":
            sc = b[..., 4 + ib]
            s = [(sc & 15) - 8, (sc >> 4) - 8]
            q = b[..., 12 + 32 * (ib // 4) + j] >> 2 * (ib % 4) & 3
            table, half = IQ2NL_VALUES.astype(np.int32), 4
        elif name == "IQ3_K":
            sign = (b[..., 4] | b[..., 5] << 8) >> 2 * ib
            sc = b[..., 6 + ib]
            s = [(2 * (sc & 15) + 1) * (1 - 2 * (sign & 1)), (2 * (sc >> 4) + 1) * (1 - 2 * (sign >> 1 & 1))]
            q = (b[..., 14 + 32 * (ib // 4) + j] >> 2 * (ib % 4) & 3) | (b[..., 78 + j] >> ib & 1) << 2
            table, half = IQ3NL_VALUES.astype(np.int32), 8
        elif name in ("IQ4_K", "IQ5_K"):
            high = b[..., 4 + ib // 2] >> 4 * (ib % 2)
            sc = b[..., 8 + ib]
            s = [((sc & 15) | (high << 4 & 0x30)) - 32, ((sc >> 4) | (high << 2 & 0x30)) - 32]
            if name == "IQ4_K":
                q = b[..., 16 + 16 * ib + j % 16] >> 4 * (j // 16) & 15
                table, half = IQ4K_VALUES.astype(np.int32), 16
            else:
                q = (b[..., 16 + 32 * (ib // 2) + j] >> 4 * (ib % 2) & 15) | (b[..., 144 + j] >> ib & 1) << 4
                table, half = IQ5NL_VALUES.astype(np.int32), 32
        else:  # IQ6_K
            sc = b[..., 4:20].astype(np.uint8).astype(np.int8).astype(np.int32)
            s = [sc[..., 2 * ib], sc[..., 2 * ib + 1]]
            qh = b[..., 148 + 32 * (ib // 4) + j] >> (4 * (ib // 2 % 2) + 2 * (ib % 2)) & 3
            q = (b[..., 20 + 32 * (ib // 2) + j] >> 4 * (ib % 2) & 15) | qh << 4
            table, half = np.concatenate([IQ6NL_VALUES, IQ6NL_VALUES + 1]).astype(np.int32), 64
        for h in range(2):
            scales.append(s[h])
            values.append(table[(extra >> (2 * ib + h) & 1)[..., None] * half + q[..., 16 * h:16 * h + 16]])
    s = np.stack(scales, axis=-1).reshape(rows, -1).astype(np.int16)
    return d, s, np.stack(values, axis=-2).reshape(rows, -1, 16).astype(np.int8)


# ik_llama.cpp's interleaved types (its `--repack` / -rtr layouts) ferry reads, and the type each interleaves: 4 rows
# at a time, de-interleaved at load (ik_deinterleave) into the plain type's rows
# IQ4_KS_R4 -> IQ4_KS, IQ4_K_R4 -> IQ4_K, IQ5_KS_R4 -> IQ5_KS, IQ2_K_R4 -> IQ2_K, IQ3_K_R4 -> IQ3_K, IQ5_K_R4 -> IQ5_K;
# and into llama.cpp's types: Q8_0_R8, Q4_K_R4, Q6_K_R4, Q5_K_R4, IQ4_XS_R8, Q4_0_R8 (a plain id below 100: gguf-py's)
IK_INTERLEAVED = {344: 144, 339: 139, 352: 152, 337: 137, 338: 138, 340: 140,
                  208: 8, 212: 12, 214: 14, 213: 13, 223: 23, 202: 2,
                  # Q6_0_R4, IQ4_NL_R4, MXFP4_R8, BF16_R16, Q5_0_R4, Q3_K_R4, Q2_K_R4, IQ3_XXS_R4, IQ3_S_R4,
                  # IQ2_XXS_R4, IQ2_XS_R4, IQ2_S_R4
                  233: 133, 220: 20, 353: 39, 230: 30, 206: 6, 211: 11, 210: 10, 218: 18, 221: 21, 216: 16, 217: 17,
                  222: 22}


def _iq4_nibbles(qs: np.ndarray) -> np.ndarray:
    """The interleaved IQ4 nibbles of one 256-column block of 4 rows (..., 512 bytes: sub-block ib's 64 hold at
    16 p + 4 k + i, i < 4, row k's plain bytes i and i + 8 (p = 0: their low nibbles, p = 1: their high), i + 4 and
    i + 12 (p = 2, 3), each pair as one byte's low and high nibble) as each row's plain 128 bytes (..., row k, 128),
    where byte j of a sub-block's 16 holds values j (low) and 16 + j (high)."""
    q = qs.reshape(*qs.shape[:-1], 8, 4, 4, 4)  # (..., sub-block, part p, row k, i)
    p0, p1, p2, p3 = (q[..., p, :, :] for p in range(4))
    plain = np.stack([(p0 & 15) | (p1 & 15) << 4, (p2 & 15) | (p3 & 15) << 4, (p0 >> 4) | (p1 & 0xF0),
                      (p2 >> 4) | (p3 & 0xF0)], axis=-2)  # (..., sub-block, row k, byte j // 4, j % 4)
    return np.moveaxis(plain, -4, -3).reshape(*qs.shape[:-1], 4, 128)


def ik_deinterleave(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """An interleaved tensor's bytes (IK_INTERLEAVED) as its plain type's rows, the same values (ik's repack_iq4_ks /
    repack_iq4_k, undone). Per 4 rows, per 256 columns:
    - IQ4_KS_R4: (after the 4 rows' float32 scales, once) the 4 rows' 8 scale bytes interleaved (byte 4 ib + k: row
      k's sub-block ib), then 512 bytes of nibbles (_iq4_nibbles);
    - IQ4_K_R4: the 4 rows' fp16 d; 8 bytes of table-half bits (byte k: row k's first 16 of each sub-block ib at bit
      ib, byte 4 + k its second 16s); 16 bytes of the scales' high bit pairs and 32 of their low nibbles, the 16 of
      row k at i = 8 ib + k (first) and i + 4 (second): nibble i / 32 of low byte i % 32, pair i / 16 of high byte
      i % 16; then the nibbles.
    The others: ikquants/interleaved.py (ik's types), ikquants/interleaved_ggml.py and interleaved_other.py (llama.cpp's, and
    Q6_0_R4)."""
    if raw_type not in (344, 339):
        from ferry.ikquants import interleaved, interleaved_ggml, interleaved_other

        return {**interleaved.DEINTERLEAVE, **interleaved_ggml.DEINTERLEAVE,
                **interleaved_other.DEINTERLEAVE}[raw_type][1](raw, ne)
    _, block, size, meta = IK_TYPES[raw_type]
    rows = int(np.prod(ne[1:], dtype=np.int64))
    if rows % 4:
        raise FerryError(f"an {ik_name(raw_type)} tensor has {rows} rows, not a multiple of 4; the file is corrupt")
    nb = ne[0] // block
    g = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows // 4, 4 * (meta + nb * size))
    out = np.empty((rows // 4, 4, meta + nb * size), dtype=np.uint8)
    if meta:
        out[:, :, :meta] = g[:, :4 * meta].reshape(-1, 4, meta)
    b = g[:, 4 * meta:].reshape(-1, nb, 4 * size)
    if IK_TYPES[raw_type][0] == "IQ4_KS_R4":
        head = b[..., :32].reshape(-1, nb, 8, 4).transpose(0, 3, 1, 2)  # (group, row k, block, scale byte ib)
        qs = b[..., 32:]
    else:
        d = b[..., :8].reshape(-1, nb, 4, 2)
        halves = b[..., 8:16].astype(np.int32)
        ib = np.arange(8)
        bits = [(halves[..., None, h * 4:h * 4 + 4, None] >> ib) & 1 for h in range(2)]  # (.., 1, row k, ib)
        extra = ((bits[0] << (2 * ib)) | (bits[1] << (2 * ib + 1))).sum(axis=-1)[..., 0, :]  # (group, block, row k)
        i1 = 8 * ib[None, :] + np.arange(4)[:, None]  # (row k, ib)
        sl, sh = b[..., 32:64].astype(np.int32), b[..., 16:32].astype(np.int32)
        low = [(sl[..., i % 32] >> 4 * (i // 32)) & 15 for i in (i1, i1 + 4)]  # (group, block, row k, ib)
        high = [(sh[..., i % 16] >> 2 * (i // 16)) & 3 for i in (i1, i1 + 4)]
        scales_l = low[0] | low[1] << 4
        pairs = high[0] | high[1] << 2  # ib's 4 high bits
        scales_h = pairs[..., 0::2] | pairs[..., 1::2] << 4
        head = np.concatenate([d, np.stack([extra & 0xFF, extra >> 8], axis=-1), scales_h, scales_l],
                              axis=-1).astype(np.uint8).transpose(0, 2, 1, 3)  # (group, row k, block, 16)
        qs = b[..., 64:]
    blocks = np.concatenate([head, np.moveaxis(_iq4_nibbles(qs), -2, 1)], axis=-1)  # (group, row k, block, size)
    out[:, :, meta:] = blocks.reshape(-1, 4, nb * size)
    return out.reshape(-1)


def dequantize_ik(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> np.ndarray:
    """ik_llama.cpp's quant types to float64 in torch order (reversed ne), the reference the rest is tested against
    (_ik_parts and _ik_k_parts say which and how; an interleaved type is de-interleaved first)."""
    if raw_type in IK_INTERLEAVED:
        raw, raw_type = ik_deinterleave(raw, raw_type, ne), IK_INTERLEAVED[raw_type]
        if raw_type not in IK_TYPES:  # one of llama.cpp's types: gguf-py's reference
            return dequantize(raw, GGMLQuantizationType(raw_type), ne).astype(np.float64)
    if ik_name(raw_type) in IK_PER_16:
        d, s, values = _ik_k_parts(raw, raw_type, ne)
        scale = np.repeat(d, 16, axis=-1) * s
    else:
        scale, values = _ik_parts(raw, raw_type, ne)
    return (scale[..., None] * values).reshape(tuple(reversed(ne)))


# The ik_llama.cpp types ferry runs, each rewritten at load as Q8_0 (ik_to_q8_0). Where 32 int8 values share one
# scale as they are stored, they are Q8_0's values: Q6_0's scale is Q8_0's fp16 already, the others' (the row's scale
# times the sub-block's integer) is rounded to fp16, a relative error of at most 2^-11 per 32 weights. The IQn_K
# types' 16-value sub-blocks have scales of their own, so a 32's products s t (beyond int8) are rounded to Q8_0's 255
# levels: exact where they fit, else within 1/254 of the 32's largest weight (and 2^-11 more, the scale's fp16).
# The trellis types (IQ1_KT..IQ4_KT: ikquants/trellis.py) generate int8 values too, each 32 under the row's scale times an
# integer (and, for IQ2_KT / IQ3_KT, the factor ik's kernels apply): Q8_0 with the scale rounded to fp16 as well.
IK_TRELLIS = (158, 153, 154, 155)
IK_RUN_AS = {t: Q.Q8_0 for t, v in IK_TYPES.items() if v[0] in ("Q6_0", "IQ4_KS", "IQ5_KS", "IQ4_KSS", "IQ3_KS",
                                                                  "IQ2_KS", "IQ2_KL") + IK_PER_16 or t in IK_TRELLIS}
IK_NOTE = {IK_TYPES[t][0]: "each 32 values' scale rounded to fp16: 2^-11 of a value, more below fp16's 6.1e-5"
           for t in IK_RUN_AS}
IK_NOTE["Q6_0"] = "the same values"
IK_NOTE["IQ2_KT"] += ", the scale times 1.05 as ik's kernels take it"
IK_NOTE["IQ3_KT"] += ", the scale times 1.01 as ik's kernels take it"
IK_NOTE.update({name: "each 32 values rounded to 255 levels, within 0.45% of their largest" for name in IK_PER_16})
# (a scale below fp16's normal range, 2^-14, keeps steps of 2^-24: as in any Q8_0 file)


def _per_16_as_q8_0(raw: np.ndarray, raw_type: int, ne: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """An IQn_K tensor's 32s as Q8_0's (scale (rows, n / 32) float64, values (rows, n / 32, 32) int8): the products
    p = s t of its two 16s, under d where all fit int8, else rounded (half away from zero, in integers) to 127 / m of
    themselves, m the largest |p|, under d m / 127."""
    d, s, t = _ik_k_parts(raw, raw_type, ne)
    rows = d.shape[0]
    p = (s.astype(np.int32)[..., None] * t).reshape(rows, -1, 32)
    m = np.abs(p).max(axis=-1, keepdims=True)
    fits = m <= 127
    mm = np.where(fits, 1, m)
    q = np.where(fits, p, np.sign(p) * ((2 * 127 * np.abs(p) + mm) // (2 * mm)))
    d8 = np.repeat(d, 8, axis=-1)
    scale = np.where(fits[..., 0], d8, d8 * m[..., 0] / 127.0)  # in C's order of operations
    return scale, q.astype(np.int8)


class IkQuant(enum.IntEnum):
    """ik_llama.cpp's types that ferry's kernels read in place (routed experts, where ferry's CPU kernels run): a
    Weight's qtype beside gguf-py's GGMLQuantizationType (none of these ids is one of its)."""

    IQ2_K = 137
    IQ3_K = 138
    IQ4_K = 139
    IQ4_KS = 144
    IQ2_KS = 145
    IQ4_KSS = 146
    IQ5_KS = 152
    IQ3_KS = 156
    IQ2_KL = 157


def block_size(qtype) -> int:
    """Values per block of a type (gguf-py's or IkQuant)."""
    return IK_TYPES[qtype][1] if isinstance(qtype, IkQuant) else GGML_QUANT_SIZES[qtype][0]


def qtype_named(name: str):
    """A type by its name: gguf-py's, or ik_llama.cpp's that ferry's kernels read (IkQuant)."""
    return IkQuant[name] if name in IkQuant.__members__ else Q[name]


def ik_name(raw_type: int) -> str:
    return IK_TYPES[raw_type][0] if raw_type in IK_TYPES else str(raw_type)


def ik_to_q8_0(raw: np.ndarray, raw_type: int, ne: tuple[int, ...], rows_at_once: int = 4096) -> np.ndarray:
    """A tensor of one of ik_llama.cpp's types IK_RUN_AS names as Q8_0 blocks (an fp16 scale and 32 int8 values
    each), the same weights in the same order, so many rows at a time (the intermediates are several times the rows'
    bytes); raises FerryError where a scale leaves fp16's range. kernels/cpu/native.py's ik_to_q8_0 does it in C, on
    every core, 10-50x faster (GGUFFile.data takes that one where it builds)."""
    rows = int(np.prod(ne[1:], dtype=np.int64))
    per_row = ik_type_bytes(raw_type, (ne[0], 1))
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, per_row)
    out = np.empty((rows, ne[0] // 32, 34), dtype=np.uint8)
    for r0 in range(0, rows, rows_at_once):
        part = raw[r0:r0 + rows_at_once]
        parts = _per_16_as_q8_0 if ik_name(raw_type) in IK_PER_16 else _ik_parts
        scale, values = parts(part, raw_type, (ne[0], len(part)))
        with np.errstate(over="ignore"):
            d = scale.astype(np.float16)
        if not np.isfinite(d).all():
            raise FerryError(f"an {ik_name(raw_type)} scale is beyond fp16's range; the file is corrupt, re-download it")
        out[r0:r0 + len(part), :, :2] = d[..., None].view(np.uint8)
        out[r0:r0 + len(part), :, 2:] = values.view(np.uint8)
    return out.reshape(-1)


AS_Q8_0 = (Q.Q5_0, Q.IQ4_NL)  # types whose values a Q8_0 block holds exactly, with the same d (as_q8_0)


def as_q8_0(raw: np.ndarray, qtype, blocks_at_once: int = 1 << 20) -> np.ndarray:
    """Blocks of one of AS_Q8_0's types as Q8_0 blocks (fp16 d, 32 int8) of exactly the same values, the same d:
    - Q5_0 (22 bytes: fp16 d, the 32-bit qh of fifth bits, 16 bytes of nibbles, byte j holding value j (low nibble,
      fifth bit j) and value j + 16 (high nibble, bit j + 16)) stands for d (q - 16), q of 5 bits;
    - IQ4_NL (18 bytes: fp16 d, 16 bytes of nibbles as Q5_0's) for d table[q], the table's 16 values int8."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    bit = np.arange(32, dtype=np.uint32)
    for b0 in range(0, len(blocks), blocks_at_once):
        part = blocks[b0:b0 + blocks_at_once]
        qs = part[:, size - 16:]
        nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=1)
        if qtype == Q.Q5_0:
            qh = np.ascontiguousarray(part[:, 2:6]).view("<u4")
            q = (nibbles | (((qh >> bit) & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        else:
            q = IQ4K_VALUES[:16][nibbles]
        out[b0:b0 + len(part), :2] = part[:, :2]
        out[b0:b0 + len(part), 2:] = q.view(np.uint8)
    return out.reshape(-1)


def parse_qtype(name: str) -> GGMLQuantizationType:
    """'q4_k' or 'Q4_K' -> GGMLQuantizationType.Q4_K, with an error that lists the valid names."""
    try:
        return Q[name.upper()]
    except KeyError:
        valid = ", ".join(t.name for t in Q if t in GGML_QUANT_SIZES)
        raise FerryError(f"unknown quant type '{name}'; valid types: {valid}") from None


def bytes_per_weight(qtype: GGMLQuantizationType) -> float:
    """Bytes one value takes in a type's blocks (Q4_0: 18 / 32; a row's metadata left out)."""
    if isinstance(qtype, IkQuant):
        return IK_TYPES[qtype][2] / IK_TYPES[qtype][1]
    block, type_size = GGML_QUANT_SIZES[qtype]
    return type_size / block


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    if isinstance(qtype, IkQuant):
        return ik_type_bytes(qtype, (n, 1))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, ne: tuple[int, ...]) -> np.ndarray:
    """Reference dequantization (gguf-py, numpy) to float32 in torch order (reversed ne)."""
    shape = tuple(reversed(ne))
    if isinstance(qtype, IkQuant):
        return dequantize_ik(raw, qtype, ne).astype(np.float32)
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
