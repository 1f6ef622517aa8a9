"""ik_llama.cpp's interleaved ("_R4") forms of IQ5_KS, IQ2_K, IQ3_K and IQ5_K back to their plain types' rows, in
numpy (quant.ik_deinterleave holds IQ4_KS_R4's and IQ4_K_R4's and calls these for the rest).

Each function takes an interleaved tensor's bytes (uint8, flat) and its ne (ne[0] the row length, a multiple of 256;
the rows, the product of the rest, a multiple of 4) and returns the plain type's rows' bytes, flat: rows 4 g .. 4 g + 3
come from interleaved group g. The plain bytes are those ik's own plain quantization holds (ggml-common.h's block_*),
so ferry's dequantize_ik(plain, plain_type, ne) gives ik's dequantized values.

Written from reading ik's repack_iq2_k / repack_iq3_k / repack_iq5_k / repack_iq5_ks (iqk_quantize.cpp), which
quantize_*_r4 and --repack both use; the layouts, in this file's words:

A group of 4 rows is stored block by block: for each 256 columns one interleaved block holding the 4 rows' plain
blocks' contents. Within a block the 256 columns are 8 sub-blocks ib of 32 (each two halves h of 16, the halves
having a scale and a table-half bit each). Counting the 64 (row k, ib, h) halves as i = 8 ib + 4 h + k:
- a 4-bit scale field is nibble i // 32 of byte i % 32 of a 32-byte array;
- a 2-bit field (IQ5_K's scale highs) is bit pair i // 16 of byte i % 16 of a 16-byte array;
- a 1-bit field (the table-half bits `extra`, IQ3_K's scale signs) is bit ib of byte k + 4 h of an 8-byte array.
The quants of row k's sub-block ib sit in 4 consecutive bytes (one per column i < 4 of each 4-column stripe) of
every 16 that belong to ib:
- 4-bit quants (IQ5's low 4 bits): 64 bytes per ib, byte 64 ib + 16 p + 4 k + i holding the columns
  (i, i + 8), (i + 16, i + 24), (i + 4, i + 12), (i + 20, i + 28) for p = 0..3, low nibble first;
- 2-bit quants (IQ2_K / IQ3_K's low 2 bits): 32 bytes per ib, byte 32 ib + 16 h + 4 k + i holding the columns
  16 h + i + 4 f at bits 2 f (f = 0..3);
- the high bit (IQ3_K's third, IQ5's fifth): 16 bytes per ib, byte 16 ib + 4 k + i holding, at bit b, column
  i + (0, 4, 8, 12, 16, 20, 24, 28)[b] for IQ3_K and column i + (0, 8, 16, 24, 4, 12, 20, 28)[b] for IQ5_K / IQ5_KS
  (the IQ5 order is the 4-bit quants' order, p by p).
"""

from __future__ import annotations

import numpy as np

from ferry.errors import FerryError

QK_K = 256


def _groups(raw: np.ndarray, ne, meta: int, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Split into groups of 4 rows: (each group's 4 row headers (g, 4 meta), its blocks (g, nb, 4 size), nb)."""
    ne = tuple(int(x) for x in ne)
    if ne[0] % QK_K:
        raise FerryError(f"an interleaved tensor's rows of {ne[0]} values are not whole blocks of {QK_K}; the file is "
                         "corrupt")
    rows = int(np.prod(ne[1:], dtype=np.int64))
    if rows % 4:
        raise FerryError(f"an interleaved tensor has {rows} rows, not a multiple of 4; the file is corrupt")
    nb = ne[0] // QK_K
    g = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if g.size != rows * (meta + nb * size):
        raise FerryError(f"an interleaved tensor holds {g.size} bytes, not {rows} rows of {nb} blocks of {size} "
                         f"(+{meta}) bytes; the file is corrupt")
    g = g.reshape(rows // 4, 4 * (meta + nb * size))
    return g[:, :4 * meta], g[:, 4 * meta:].reshape(rows // 4, nb, 4 * size), nb


# --- the interleaved per-half fields, each returned as (..., row k, sub-block ib, half h)

_K = np.arange(4)[:, None, None]
_IB = np.arange(8)[None, :, None]
_H = np.arange(2)[None, None, :]
_I = 8 * _IB + 4 * _H + _K  # (k, ib, h): the half's position among the 64


def _nibble_fields(a: np.ndarray) -> np.ndarray:
    """(..., 32) bytes -> (..., k, ib, h) 4-bit fields."""
    return (a[..., _I % 32].astype(np.int32) >> (4 * (_I // 32))) & 15


def _pair_fields(a: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., k, ib, h) 2-bit fields."""
    return (a[..., _I % 16].astype(np.int32) >> (2 * (_I // 16))) & 3


def _bit_fields(a: np.ndarray) -> np.ndarray:
    """(..., 8) bytes -> (..., k, ib, h) bits: bit ib of byte k + 4 h."""
    return (a[..., _K + 4 * _H].astype(np.int32) >> _IB) & 1


def _u16_of_bits(bits: np.ndarray) -> np.ndarray:
    """(..., k, ib, h) bits -> (..., k, 2) the plain little-endian uint16 with bit 2 ib + h."""
    w = (bits << (2 * _IB + _H)).sum(axis=(-2, -1))
    return np.stack([w & 0xFF, w >> 8], axis=-1)


def _bytes_of_nibbles(n: np.ndarray) -> np.ndarray:
    """(..., k, ib, h) nibbles -> (..., k, 8) plain scale bytes: byte ib = h 0's | h 1's << 4."""
    return n[..., 0] | n[..., 1] << 4


# --- the interleaved quants, returned as (..., row k, ib, 32 columns) integers

_COLS4 = np.array([[0, 8], [16, 24], [4, 12], [20, 28]])  # p -> the (low, high) nibble's first column
_HIGH5 = np.array([0, 8, 16, 24, 4, 12, 20, 28])  # IQ5: bit b of a high byte -> its first column
_HIGH3 = np.arange(8) * 4  # IQ3_K: bit b -> its first column


def _quants4(qs: np.ndarray) -> np.ndarray:
    """(..., 512) interleaved nibbles -> (..., k, ib, 32) 4-bit values."""
    q = qs.reshape(*qs.shape[:-1], 8, 4, 4, 4).astype(np.int32)  # (..., ib, p, k, i)
    out = np.empty((*qs.shape[:-1], 4, 8, 32), dtype=np.int32)
    i = np.arange(4)
    for p in range(4):
        for n in range(2):
            out[..., _COLS4[p, n] + i] = np.swapaxes((q[..., p, :, :] >> (4 * n)) & 15, -3, -2)
    return out


def _quants2(qs: np.ndarray) -> np.ndarray:
    """(..., 256) interleaved 2-bit quants -> (..., k, ib, 32) values."""
    q = qs.reshape(*qs.shape[:-1], 8, 2, 4, 4).astype(np.int32)  # (..., ib, h, k, i)
    out = np.empty((*qs.shape[:-1], 4, 8, 32), dtype=np.int32)
    i = np.arange(4)
    for h in range(2):
        for f in range(4):
            out[..., 16 * h + 4 * f + i] = np.swapaxes((q[..., h, :, :] >> (2 * f)) & 3, -3, -2)
    return out


def _high_bits(qh: np.ndarray, first: np.ndarray) -> np.ndarray:
    """(..., 128) interleaved high bits -> (..., k, ib, 32) bits (bit b of byte 16 ib + 4 k + i: column first[b] + i)."""
    q = qh.reshape(*qh.shape[:-1], 8, 4, 4).astype(np.int32)  # (..., ib, k, i)
    out = np.empty((*qh.shape[:-1], 4, 8, 32), dtype=np.int32)
    i = np.arange(4)
    for b in range(8):
        out[..., first[b] + i] = np.swapaxes((q >> b) & 1, -3, -2)
    return out


# --- the plain layouts of the quants, from (..., k, ib, 32) values

def _plain_2bit(v: np.ndarray) -> np.ndarray:
    """IQ2_K / IQ3_K's qs: byte 32 c + j holds column j of sub-block 4 c + s at bits 2 s -> (..., k, 64)."""
    lo = (v & 3).reshape(*v.shape[:-2], 2, 4, 32)
    return (lo << (2 * np.arange(4))[:, None]).sum(axis=-2).reshape(*v.shape[:-2], 64)


def _plain_4bit(v: np.ndarray) -> np.ndarray:
    """IQ5's qs: byte 32 c + j holds column j of sub-block 2 c (low nibble) and 2 c + 1 (high) -> (..., k, 128)."""
    lo = (v & 15).reshape(*v.shape[:-2], 4, 2, 32)
    return (lo[..., 0, :] | lo[..., 1, :] << 4).reshape(*v.shape[:-2], 128)


def _plain_high(v: np.ndarray, bit: int) -> np.ndarray:
    """qh: byte j holds bit `bit` of column j of sub-block ib at bit ib -> (..., k, 32)."""
    return (((v >> bit) & 1) << np.arange(8)[:, None]).sum(axis=-2)


def _assemble(parts: list[np.ndarray], nb: int) -> np.ndarray:
    """(g, nb, k, n_i) pieces -> the plain rows' blocks (g, k, nb * size)."""
    blocks = np.concatenate([p.astype(np.uint8) for p in parts], axis=-1)  # (g, nb, k, size)
    return np.swapaxes(blocks, 1, 2).reshape(blocks.shape[0], 4, -1)


def _d_and_extra(b: np.ndarray) -> list[np.ndarray]:
    """The 4 rows' fp16 d (bytes 0..7, row k at 2 k) and table-half bits (8..15) as plain (.., k, 2) + (.., k, 2)."""
    d = b[..., :8].reshape(*b.shape[:-1], 4, 2)
    return [d, _u16_of_bits(_bit_fields(b[..., 8:16]))]


def iq5_ks_r4_to_iq5_ks(raw: np.ndarray, ne) -> np.ndarray:
    """IQ5_KS_R4 (352) -> IQ5_KS (152) rows.

    A group of 4 rows starts with the 4 rows' float32 scales (16 bytes), then per 256 columns a 672-byte block:
    32 scale bytes (byte 4 ib + k: row k's plain scale byte ib, unchanged), 512 bytes of 4-bit quants and 128 of
    fifth bits (the module docstring's IQ5 orders). Plain IQ5_KS row: its float32, then per 256 columns 8 scale
    bytes, 128 bytes of nibbles (byte 32 c + j: column j of sub-block 2 c low, 2 c + 1 high), 32 bytes of fifth bits
    (byte j, bit ib: column j of sub-block ib)."""
    head, b, nb = _groups(raw, ne, 4, 168)
    scales = np.swapaxes(b[..., :32].reshape(*b.shape[:-1], 8, 4), -1, -2)  # (g, nb, k, ib)
    v = _quants4(b[..., 32:544]) | _high_bits(b[..., 544:672], _HIGH5) << 4
    blocks = _assemble([scales, _plain_4bit(v), _plain_high(v, 4)], nb)
    return np.concatenate([head.reshape(-1, 4, 4), blocks], axis=-1).reshape(-1)


def iq2_k_r4_to_iq2_k(raw: np.ndarray, ne) -> np.ndarray:
    """IQ2_K_R4 (337) -> IQ2_K (137) rows.

    Per 4 rows and 256 columns a 304-byte block: the 4 rows' fp16 d (8), table-half bits (8), scale nibbles (32),
    2-bit quants (256), as the module docstring says. Plain IQ2_K block (76): d, uint16 extra (bit 2 ib + h),
    8 scale bytes (byte ib: h 0 low nibble, h 1 high), 64 bytes of quants (byte 32 c + j: column j of sub-block
    4 c + s at bits 2 s)."""
    _, b, nb = _groups(raw, ne, 0, 76)
    scales = _bytes_of_nibbles(_nibble_fields(b[..., 16:48]))
    v = _quants2(b[..., 48:304])
    return _assemble(_d_and_extra(b) + [scales, _plain_2bit(v)], nb).reshape(-1)


def iq3_k_r4_to_iq3_k(raw: np.ndarray, ne) -> np.ndarray:
    """IQ3_K_R4 (338) -> IQ3_K (138) rows.

    Per 4 rows and 256 columns a 440-byte block: d (8), table-half bits (8), scale sign bits (8, laid out as the
    table-half bits), scale nibbles (32), 2-bit quants (256), third bits (128). Plain IQ3_K block (110): d, uint16
    extra, uint16 scales_h (sign of half h of ib at bit 2 ib + h), 8 scale bytes, 64 bytes of low 2 bits (as IQ2_K),
    32 bytes of third bits (byte j, bit ib: column j of sub-block ib)."""
    _, b, nb = _groups(raw, ne, 0, 110)
    signs = _u16_of_bits(_bit_fields(b[..., 16:24]))
    scales = _bytes_of_nibbles(_nibble_fields(b[..., 24:56]))
    v = _quants2(b[..., 56:312]) | _high_bits(b[..., 312:440], _HIGH3) << 2
    return _assemble(_d_and_extra(b) + [signs, scales, _plain_2bit(v), _plain_high(v, 2)], nb).reshape(-1)


def iq5_k_r4_to_iq5_k(raw: np.ndarray, ne) -> np.ndarray:
    """IQ5_K_R4 (340) -> IQ5_K (140) rows.

    Per 4 rows and 256 columns a 704-byte block: d (8), table-half bits (8), the scales' high bit pairs (16), their
    low nibbles (32), 4-bit quants (512), fifth bits (128). Plain IQ5_K block (176): d, uint16 extra, 4 bytes of
    scale highs (byte ib // 2, nibble ib % 2: h 0's pair low, h 1's high), 8 bytes of scale lows, 128 bytes of
    nibbles and 32 of fifth bits (as IQ5_KS)."""
    _, b, nb = _groups(raw, ne, 0, 176)
    pairs = _pair_fields(b[..., 16:32])
    nib = pairs[..., 0] | pairs[..., 1] << 2  # (g, nb, k, ib)
    scales_h = nib[..., 0::2] | nib[..., 1::2] << 4
    scales_l = _bytes_of_nibbles(_nibble_fields(b[..., 32:64]))
    v = _quants4(b[..., 64:576]) | _high_bits(b[..., 576:704], _HIGH5) << 4
    return _assemble(_d_and_extra(b) + [scales_h, scales_l, _plain_4bit(v), _plain_high(v, 4)], nb).reshape(-1)


# interleaved type id -> (plain type id, function)
DEINTERLEAVE = {352: (152, iq5_ks_r4_to_iq5_ks), 337: (137, iq2_k_r4_to_iq2_k), 338: (138, iq3_k_r4_to_iq3_k),
                340: (140, iq5_k_r4_to_iq5_k)}
