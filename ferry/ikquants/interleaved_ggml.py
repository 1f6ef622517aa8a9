"""ik_llama.cpp's interleaved forms of llama.cpp's quant types (Q8_0_R8, Q4_K_R4, Q6_K_R4, Q5_K_R4, IQ4_XS_R8,
Q4_0_R8) back to the plain types' rows, in numpy (quant.ik_deinterleave calls these; ikquants/interleaved.py holds ik's
own types').

Each function takes an interleaved tensor's bytes (uint8, flat) and its ne (ggml order: ne[0] the row length, the
rows the product of the rest) and returns the plain type's rows' bytes, flat, as ggml's block_* structs (and gguf-py's
quants module) define them: rows R g .. R g + R - 1 (R = 4 or 8, the interleave) come from interleaved group g.

Written from reading ik's repack_q8_0 / repack_q4_0 / repack_q4_k / repack_q5_k / repack_q6_k / repack_iq4_xs
(iqk_quantize.cpp), which its quantize_*_r4 / _r8 (quantize the R rows plainly, then repack) and --repack both use,
and its dequantize_row_*_r4 / _r8. The common shape of all six, in this file's words:

A group of R rows is stored as a run of interleaved blocks, one per plain block column (32 columns for Q8_0 / Q4_0,
256 for the rest); interleaved block b holds the plain blocks b of the group's R rows, no padding, so it is exactly R
plain blocks long. Inside it, each per-row scalar (fp16 d, dmin) is an array of R (row k at k), and the quants of a
row's 32 columns sit in runs of 4 consecutive bytes (a "stripe" of 4 columns i = 0..3), the R rows' stripes side by
side (byte 4 k + i of each R * 4 bytes). The per-type docstrings say which columns each stripe byte holds.

No value changes anywhere: the interleaved forms hold exactly the plain blocks' fields, so the de-interleaved bytes
are the bytes ik's plain quantizer writes (its quantize_*_r* quantize rows with the plain quantizer first).
"""

from __future__ import annotations

import numpy as np

from ferry.errors import FerryError

QK_K = 256

# ggml type ids of the plain types
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = 2, 8, 12, 13, 14, 23


def groups(raw: np.ndarray, ne, rows_per_group: int, block: int, size: int) -> np.ndarray:
    """The interleaved tensor as (groups, blocks per row, R * size) bytes, size being one plain block's bytes, block
    its values (interleaved_other.py's types too)."""
    ne = tuple(int(x) for x in ne)
    if ne[0] % block:
        raise FerryError(f"an interleaved tensor's rows of {ne[0]} values are not whole blocks of {block}; the file is "
                         "corrupt")
    rows = int(np.prod(ne[1:], dtype=np.int64))
    if rows % rows_per_group:
        raise FerryError(f"an interleaved tensor has {rows} rows, not a multiple of the {rows_per_group} it interleaves; "
                         "the file is corrupt")
    nb = ne[0] // block
    g = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if g.size != rows * nb * size:
        raise FerryError(f"an interleaved tensor holds {g.size} bytes, not {rows} rows of {nb} blocks of {size} bytes; "
                         "the file is corrupt")
    return g.reshape(rows // rows_per_group, nb, rows_per_group * size)


def _rows(blocks: np.ndarray) -> np.ndarray:
    """(groups, nb, R, plain block bytes) -> the plain rows' bytes, flat (row-major: group, row k, block)."""
    return np.ascontiguousarray(blocks.astype(np.uint8).swapaxes(1, 2)).reshape(-1)


def _fp16_fields(a: np.ndarray, r: int) -> np.ndarray:
    """(..., n * r * 2): n fp16 arrays of r (d[k], then dmin[k]) -> (..., r, 2 n): row k's n fp16 values' bytes."""
    n = a.shape[-1] // (2 * r)
    return a.reshape(*a.shape[:-1], n, r, 2).swapaxes(-3, -2).reshape(*a.shape[:-1], r, 2 * n)


def _columns(v: np.ndarray, first) -> np.ndarray:
    """(..., F, 4): F fields of a 4-column stripe, field f holding columns first[f] + i -> (..., 4 F) by column
    (first[f] + i running over 0 .. 4 F - 1 once)."""
    cols = (np.asarray(first)[:, None] + np.arange(4)).reshape(-1)
    out = np.empty((*v.shape[:-2], cols.size), dtype=v.dtype)
    out[..., cols] = v.reshape(*v.shape[:-2], -1)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(...) bytes -> (..., 2): low nibble, high nibble."""
    q = q.astype(np.int32)
    return np.stack([q & 15, q >> 4], axis=-1)


# --- Q8_0_R8 (208), Q4_0_R8 (202): 8 rows, blocks of 32

def q8_0_r8(raw: np.ndarray, ne) -> np.ndarray:
    """Q8_0_R8 -> Q8_0 (d fp16, 32 int8 quants). Per 8 rows, per 32 columns, 272 bytes: the 8 rows' fp16 d (row k's
    at bytes 2 k), then 256 quant bytes in two halves of 128 (columns 0-15, then 16-31), each 4 stripes l of 32 bytes,
    row k's 4 bytes of stripe l at 32 l + 4 k: byte 128 h + 32 l + 4 k + i is column 16 h + 4 l + i of row k. The
    quants are the plain int8s (ik adds 127 to them on AVX512 only when it repacks while loading, never in a file)."""
    b = groups(raw, ne, 8, 32, 34)
    d = _fp16_fields(b[..., :16], 8)  # (g, nb, 8, 2)
    qs = b[..., 16:].reshape(*b.shape[:2], 2, 4, 8, 4).transpose(0, 1, 4, 2, 3, 5)  # (g, nb, k, h, l, i)
    return _rows(np.concatenate([d, qs.reshape(*b.shape[:2], 8, 32)], axis=-1))


def q4_0_r8(raw: np.ndarray, ne) -> np.ndarray:
    """Q4_0_R8 -> Q4_0 (d fp16, 16 bytes of nibbles: byte j holds column j low, j + 16 high). ik's struct is
    block_iq4_nl_r8. Per 8 rows, per 32 columns, 144 bytes: the 8 fp16 d, then 128 bytes, byte 32 l + 4 k + i being
    row k's plain byte 4 l + i unchanged (so columns 4 l + i, low nibble, and 16 + 4 l + i, high). The plain nibbles
    are the unsigned 0..15 (value - 8): the XOR with 0x88 ik applies for ARM only happens when it repacks while
    loading (online), never in a file."""
    b = groups(raw, ne, 8, 32, 18)
    d = _fp16_fields(b[..., :16], 8)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 8, 4).transpose(0, 1, 3, 2, 4)  # (g, nb, k, l, i)
    return _rows(np.concatenate([d, qs.reshape(*b.shape[:2], 8, 16)], axis=-1))


# --- the K-quants: 4 rows, blocks of 256 (8 sub-blocks ib of 32 columns)

# the nibble order of Q4_K_R4 / Q5_K_R4 / Q6_K_R4's low bits: byte 16 p + 4 k + i of a sub-block's 64 holds, low
# nibble then high, the columns i + these (p = 0..3)
_K_NIBBLE_FIRST = [0, 8, 16, 24, 4, 12, 20, 28]
# Q5_K_R4's high bits: bit b of byte 16 ib + 4 k + i holds column i + this[b]
_Q5_HIGH_FIRST = [0, 8, 4, 12, 16, 24, 20, 28]
# Q6_K_R4's high bit pairs: pair f of byte 32 ib + 16 h + 4 k + i holds column i + 16 h + this[f]
_Q6_HIGH_FIRST = [0, 8, 4, 12]


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 512) interleaved nibbles of 4 rows -> (..., k, ib, 32) 4-bit values by column."""
    q = qs.reshape(*qs.shape[:-1], 8, 4, 4, 4)  # (ib, p, k, i)
    v = np.moveaxis(_nibbles(q), -1, -3)  # (ib, p, n, k, i)
    v = v.reshape(*qs.shape[:-1], 8, 8, 4, 4)  # (ib, field 2 p + n, k, i)
    return _columns(v.transpose(*range(v.ndim - 4), -2, -4, -3, -1), _K_NIBBLE_FIRST)


def _k_scales(sh: np.ndarray, sl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K_R4 / Q5_K_R4's scales: (..., 16) scales_h and (..., 32) scales_l -> (..., k, ib) 6-bit scales and mins.
    Sub-block ib of row k is number s = 4 ib + k: byte s of scales_l holds its scale's low 4 bits (low nibble) and its
    min's (high nibble); nibble s // 16 of scales_h byte s % 16 holds the scale's top 2 bits (bits 0-1) and the
    min's (bits 2-3)."""
    s = 4 * np.arange(8)[None, :] + np.arange(4)[:, None]  # (k, ib)
    lo = sl[..., s].astype(np.int32)
    hi = (sh[..., s % 16].astype(np.int32) >> (4 * (s // 16))) & 15
    return (lo & 15) | (hi & 3) << 4, (lo >> 4) | (hi >> 2) << 4


def _plain_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(..., 8) 6-bit scales and mins -> ggml's 12 packed bytes (Q4_K / Q5_K): bytes 0-3 the scales 0-3, 4-7 the
    mins 0-3 (each with, at bits 6-7, the top 2 bits of scale / min j + 4), bytes 8-11 scale j + 4's low nibble | min
    j + 4's low nibble << 4."""
    a, b = sc[..., :4], sc[..., 4:]
    m, n = mn[..., :4], mn[..., 4:]
    return np.concatenate([a | (b >> 4) << 6, m | (n >> 4) << 6, (b & 15) | (n & 15) << 4], axis=-1)


def _plain_k_qs(v: np.ndarray) -> np.ndarray:
    """(..., 8, 32) 4-bit values -> Q4_K / Q5_K's 128 bytes: byte 32 c + j holds column j of sub-block 2 c (low
    nibble) and of sub-block 2 c + 1 (high)."""
    v = (v & 15).reshape(*v.shape[:-2], 4, 2, 32)
    return (v[..., 0, :] | v[..., 1, :] << 4).reshape(*v.shape[:-3], 128)


def q4_k_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q4_K_R4 -> Q4_K. Per 4 rows, per 256 columns, 576 bytes: fp16 d[4] then dmin[4] (row k at k); scales_h (16)
    and scales_l (32) holding the 4 rows' 8 unpacked 6-bit scales and mins (_k_scales); then 512 bytes of nibbles,
    64 per sub-block ib, byte 64 ib + 16 p + 4 k + i holding row k's columns 32 ib + i + (0, 8), (16, 24), (4, 12),
    (20, 28) for p = 0..3 (low nibble first). The plain block re-packs the 6-bit scales into ggml's 12 bytes."""
    b = groups(raw, ne, 4, QK_K, 144)
    d = _fp16_fields(b[..., :16], 4)  # (g, nb, k, 4): d, dmin
    sc, mn = _k_scales(b[..., 16:32], b[..., 32:64])
    v = _k_nibbles(b[..., 64:576])
    return _rows(np.concatenate([d, _plain_k_scales(sc, mn), _plain_k_qs(v)], axis=-1))


def q5_k_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q5_K_R4 -> Q5_K. Per 4 rows, per 256 columns, 704 bytes: as Q4_K_R4 (d[4], dmin[4], scales_h, scales_l) then
    128 bytes of high bits, byte 16 ib + 4 k + i holding at bit b row k's column 32 ib + i + (0, 8, 4, 12, 16, 24, 20,
    28)[b] (not the nibbles' order), then the 512 bytes of low nibbles as Q4_K_R4's. Plain qh: byte j, bit ib = the
    high bit of sub-block ib's column j."""
    b = groups(raw, ne, 4, QK_K, 176)
    d = _fp16_fields(b[..., :16], 4)
    sc, mn = _k_scales(b[..., 16:32], b[..., 32:64])
    qh = b[..., 64:192].reshape(*b.shape[:2], 8, 4, 4).astype(np.int32)  # (ib, k, i)
    bits = (qh[..., None] >> np.arange(8)) & 1  # (ib, k, i, bit)
    high = _columns(bits.transpose(0, 1, 3, 2, 5, 4), _Q5_HIGH_FIRST)  # (g, nb, k, ib, 32)
    v = _k_nibbles(b[..., 192:704])
    plain_qh = (high << np.arange(8)[:, None]).sum(axis=-2)  # (g, nb, k, 32)
    return _rows(np.concatenate([d, _plain_k_scales(sc, mn), plain_qh, _plain_k_qs(v)], axis=-1))


def q6_k_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q6_K_R4 -> Q6_K (ql 128, qh 64, int8 scales 16, d). Per 4 rows, per 256 columns, 840 bytes: fp16 d[4]; 64
    int8 scales, byte 8 ib + 4 h + k being row k's scale of columns 32 ib + 16 h .. + 15 (plain scale 2 ib + h); 256
    bytes of high bit pairs, byte 32 ib + 16 h + 4 k + i holding at bits 2 f row k's column 32 ib + 16 h + i + (0, 8,
    4, 12)[f]; then 512 bytes of low nibbles as Q4_K_R4's. Plain: column 128 n + 32 s + l has its low 4 bits in
    ql byte 64 n + 32 (s % 2) + l (nibble s // 2), its high 2 at bits 2 s of qh byte 32 n + l."""
    b = groups(raw, ne, 4, QK_K, 210)
    g, nb = b.shape[:2]
    d = _fp16_fields(b[..., :8], 4)
    scales = b[..., 8:72].reshape(g, nb, 8, 2, 4).transpose(0, 1, 4, 2, 3).reshape(g, nb, 4, 16)
    qh = b[..., 72:328].reshape(g, nb, 8, 2, 4, 4).astype(np.int32)  # (ib, h, k, i)
    pairs = (qh[..., None] >> 2 * np.arange(4)) & 3  # (ib, h, k, i, f)
    high = _columns(pairs.transpose(0, 1, 4, 2, 3, 6, 5), _Q6_HIGH_FIRST)  # (g, nb, k, ib, h, 16)
    high = high.reshape(g, nb, 4, QK_K)
    v = _k_nibbles(b[..., 328:840]).reshape(g, nb, 4, QK_K) | high << 4  # 6-bit values by column
    v = v.reshape(g, nb, 4, 2, 4, 32)  # (n, s, l)
    ql = (v[..., 0:2, :] & 15) | (v[..., 2:4, :] & 15) << 4  # (n, s % 2, l)
    qh_plain = ((v >> 4) << 2 * np.arange(4)[:, None]).sum(axis=-2)  # (n, l)
    return _rows(np.concatenate([ql.reshape(g, nb, 4, 128), qh_plain.reshape(g, nb, 4, 64), scales, d], axis=-1))


# --- IQ4_XS_R8 (223): 8 rows, blocks of 256

def iq4_xs_r8(raw: np.ndarray, ne) -> np.ndarray:
    """IQ4_XS_R8 -> IQ4_XS (d fp16, scales_h uint16, scales_l 4, qs 128). Per 8 rows, per 256 columns, 1088 bytes:
    fp16 d[8]; scales_h (16) and scales_l (32): sub-block ib of row k is number s = 8 ib + k, its 6-bit scale's low
    nibble being nibble s // 32 of scales_l byte s % 32, its top 2 bits pair s // 16 of scales_h byte s % 16; then
    1024 bytes of nibbles, 128 per sub-block, byte 128 ib + 32 l + 4 k + i holding row k's columns 32 ib + 8 l + i
    (low nibble) and + 4 (high). Plain: scales_l byte ib // 2 nibble ib % 2, scales_h bits 2 ib; qs byte 16 ib + j
    holds column j (low) and j + 16 (high) of sub-block ib."""
    b = groups(raw, ne, 8, QK_K, 136)
    g, nb = b.shape[:2]
    d = _fp16_fields(b[..., :16], 8)
    s = 8 * np.arange(8)[None, :] + np.arange(8)[:, None]  # (k, ib)
    sh = (b[..., 16:32][..., s % 16].astype(np.int32) >> (2 * (s // 16))) & 3
    sl = (b[..., 32:64][..., s % 32].astype(np.int32) >> (4 * (s // 32))) & 15
    sh16 = (sh << 2 * np.arange(8)).sum(axis=-1)
    plain_sh = np.stack([sh16 & 0xFF, sh16 >> 8], axis=-1)
    plain_sl = sl[..., 0::2] | sl[..., 1::2] << 4
    q = b[..., 64:].reshape(g, nb, 8, 4, 8, 4)  # (ib, l, k, i)
    v = np.moveaxis(_nibbles(q), -1, -3).reshape(g, nb, 8, 8, 8, 4)  # (ib, field 2 l + n, k, i)
    v = _columns(v.transpose(0, 1, 4, 2, 3, 5), 4 * np.arange(8))  # field 2 l + n: columns 8 l + 4 n + i
    qs = (v[..., :16] | v[..., 16:] << 4).reshape(g, nb, 8, 128)
    return _rows(np.concatenate([d, plain_sh, plain_sl, qs], axis=-1))


DEINTERLEAVE = {
    208: (Q8_0, q8_0_r8),
    212: (Q4_K, q4_k_r4),
    214: (Q6_K, q6_k_r4),
    213: (Q5_K, q5_k_r4),
    223: (IQ4_XS, iq4_xs_r8),
    202: (Q4_0, q4_0_r8),
}
