"""More of ik_llama.cpp's interleaved quant types back to their plain types' rows, in numpy (quant.ik_deinterleave
calls these): Q6_0_R4, IQ4_NL_R4, MXFP4_R8, BF16_R16, Q5_0_R4, Q3_K_R4, Q2_K_R4, IQ3_XXS_R4, IQ3_S_R4, IQ2_XXS_R4,
IQ2_XS_R4, IQ2_S_R4.

Every function takes an interleaved tensor's bytes (uint8, flat) and its ne (ggml order: ne[0] the row length, the
rows the product of the rest) and returns the plain type's rows' bytes, flat, as ggml's block_* structs lay them out
(gguf-py's quants module reads them; Q6_0 is ik's own type, ferry.quant.dequantize_ik reads it). Rows R g .. R g + R - 1
come from interleaved group g, R being 4, 8 or 16. FerryError (the file is corrupt) when the rows are not whole blocks,
the row count is not a multiple of R, or the byte count does not match.

Written from reading ik's ggml-common.h (block_*_r4 / _r8) and iqk_quantize.cpp (repack_* which --repack and most
quantize_*_r* use, dequantize_row_*_r*). The shape all of them share, in this file's words: a group of R rows is a
run of interleaved blocks, one per plain block column (32 columns, or 256 for the K- and IQ-types, or 2 for BF16_R16),
no padding, each exactly R plain blocks long and holding the same fields as those R blocks, only placed differently:
per-row scalars (fp16 d, dmin, MXFP4's exponent) as arrays of R, and the quants of a row in little runs (mostly 4
bytes, "stripes" of 4 columns) that sit side by side for the R rows. IQ3_XXS_R4 changes bits too: it stores each
7-bit sign field "scrambled" (see _unscramble); nothing else is recoded, so the plain bytes come back exactly (but for
BF16_R16, whose quantizer truncates where plain BF16 rounds: its values are ik's, 1 ulp from a plain file's).
IQ2_XXS_R4 and IQ2_XS_R4 scramble their sign fields alike.
"""

from __future__ import annotations

import numpy as np

from ferry.ikquants.interleaved_ggml import groups

QK_K = 256

# the plain types' ids (ggml's, and ik's own Q6_0)
Q5_0, Q2_K, Q3_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ4_NL, IQ3_S, IQ2_S, BF16, MXFP4, Q6_0 = (
    6, 10, 11, 16, 17, 18, 20, 21, 22, 30, 39, 133)


# --- shared pieces

def _rows(*fields: np.ndarray) -> np.ndarray:
    """Plain blocks from their fields, each (groups, nb, r, field bytes) -> the plain rows' bytes, flat (group, row
    k, block)."""
    blocks = np.concatenate([f.astype(np.uint8) for f in fields], axis=-1)
    return np.ascontiguousarray(blocks.swapaxes(1, 2)).reshape(-1)


def _by_row(a: np.ndarray, r: int) -> np.ndarray:
    """(..., r * w) bytes laid out row k's w bytes at k w -> (..., r, w)."""
    return a.reshape(*a.shape[:-1], r, a.shape[-1] // r)


def _pack_nibbles(v: np.ndarray) -> np.ndarray:
    """(..., 32) 4-bit values by column -> ggml's 16 bytes of a block of 32: byte j holds column j (low nibble) and
    j + 16 (high)."""
    return (v[..., :16] & 15) | (v[..., 16:] & 15) << 4


def _stripes32(qs: np.ndarray) -> np.ndarray:
    """The 64 nibble bytes of 4 rows' blocks of 32 in Q5_0_R4 / Q6_0_R4 / IQ4_NL_R4 -> (..., 4 rows, 32) 4-bit
    values by column. Byte 16 l + 4 k + i (l = 2 p + h) holds row k's column 16 h + 4 p + i in its low nibble and
    that column + 8 in its high nibble: so l = 0..3 cover columns 0-3 / 8-11, 16-19 / 24-27, 4-7 / 12-15, 20-23 /
    28-31."""
    q = qs.astype(np.int32).reshape(*qs.shape[:-1], 2, 2, 4, 4)  # (p, h, k, i)
    v = np.stack([q & 15, q >> 4], axis=-1)  # (p, h, k, i, n)
    n = v.ndim
    v = v.transpose(*range(n - 5), n - 3, n - 4, n - 1, n - 5, n - 2)  # (k, h, n, p, i): column 16 h + 8 n + 4 p + i
    return v.reshape(*qs.shape[:-1], 4, 32)


def _fp16s(a: np.ndarray, r: int) -> np.ndarray:
    """(..., 2 r) bytes of an fp16 array of r -> (..., r, 2): row k's fp16's two bytes."""
    return a.reshape(*a.shape[:-1], r, 2)


def _unscramble(g: np.ndarray) -> np.ndarray:
    """ik's scrambled 7-bit sign field (IQ3_XXS_R4's, IQ2_XXS_R4's, IQ2_XS_R4's) -> ggml's. ggml keeps the signs of 8
    values as 7 bits s (value j negative when bit j is set, j < 7; the eighth sign is the parity of s). ik stores
    instead g with g ^ (g << 1) = those 8 sign bits (s with the parity bit on top), so that one shift and xor give the
    signs; undone here as s = (g ^ (g << 1)) & 127."""
    g = g.astype(np.int32) & 127
    return (g ^ (g << 1)) & 127


# --- blocks of 32, 4 rows: Q6_0_R4, Q5_0_R4, IQ4_NL_R4

def q6_0_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q6_0_R4 (233) -> ik's Q6_0 (133: fp16 d, qh 8, qs 16; value = d (q - 32), q 6 bits). Per 4 rows, per 32
    columns, 104 bytes: the 4 rows' fp16 d (row k at 2 k); 32 bytes of high bit pairs, byte 16 h + 4 k + i holding at
    bits 2 p + 4 n (p, n = 0, 1) the top 2 bits of row k's column 16 h + 8 n + 4 p + i; then 64 bytes of low nibbles
    (_stripes32). Plain Q6_0: qs as ggml's 4-bit blocks (byte j: columns j, j + 16); the top bits of column c (j = c
    % 16) at bits 4 (j // 8) + 2 (c // 16) of qh byte j % 8."""
    b = groups(raw, ne, 4, 32, 26)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    qh = b[..., 8:40].astype(np.int32).reshape(g, nb, 2, 4, 4)  # (h, k, i)
    sh = 2 * np.arange(2)[None, :, None] + 4 * np.arange(2)[:, None, None]  # (n, p, 1): 2 p + 4 n
    hi = (qh[:, :, :, :, None, None, :] >> sh) & 3  # (h, k, n, p, i)
    hi = hi.transpose(0, 1, 3, 2, 4, 5, 6).reshape(g, nb, 4, 32)  # (k, column)
    v = _stripes32(b[..., 40:104]) | hi << 4  # 6-bit values by column
    c = np.arange(32)
    j = c % 16
    shift = 4 * (j // 8) + 2 * (c // 16)
    parts = ((v >> 4) << shift).reshape(g, nb, 4, 4, 8)  # the byte of column c is j % 8 = c % 8
    plain_qh = parts.sum(axis=-2)  # no two columns share bits
    return _rows(d, plain_qh, _pack_nibbles(v))


def q5_0_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q5_0_R4 (206) -> Q5_0 (fp16 d, qh 4, qs 16; value = d (q - 16), q 5 bits). Per 4 rows, per 32 columns, 88
    bytes: the 4 fp16 d; 16 bytes of high bits, byte 4 k + i holding at bit l + 4 n (l = 2 p + h = 0..3, n = 0, 1) the
    fifth bit of row k's column 16 h + 8 n + 4 p + i; then 64 bytes of low nibbles (_stripes32). Plain Q5_0: qh a
    little-endian uint32 whose bit c is column c's fifth bit; qs as ggml's 4-bit blocks."""
    b = groups(raw, ne, 4, 32, 22)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    qh = b[..., 8:24].astype(np.int32).reshape(g, nb, 4, 4)  # (k, i)
    # bit of column 16 h + 8 n + 4 p + i: 2 p + h + 4 n
    sh = (2 * np.arange(2)[None, None, :] + np.arange(2)[:, None, None] + 4 * np.arange(2)[None, :, None])
    hi = (qh[:, :, :, None, None, None, :] >> sh[..., None]) & 1  # (k, h, n, p, i)
    hi = hi.reshape(g, nb, 4, 32)
    v = _stripes32(b[..., 24:88]) | hi << 4
    bits = (v >> 4).reshape(g, nb, 4, 4, 8) << np.arange(8)  # byte c // 8, bit c % 8
    return _rows(d, bits.sum(axis=-1), _pack_nibbles(v))


def iq4_nl_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ4_NL_R4 (220) -> IQ4_NL (fp16 d, qs 16 of indices into the non-linear 16-value table). Per 4 rows, per 32
    columns, 72 bytes: the 4 fp16 d, then 64 bytes of nibbles laid out as _stripes32 (byte 16 l + 4 k + i: row k's
    column 16 (l % 2) + 4 (l // 2) + i, low nibble, and + 8, high)."""
    b = groups(raw, ne, 4, 32, 18)
    return _rows(_fp16s(b[..., :8], 4), _pack_nibbles(_stripes32(b[..., 8:72])))


# --- MXFP4_R8: blocks of 32, 8 rows

def mxfp4_r8(raw: np.ndarray, ne) -> np.ndarray:
    """MXFP4_R8 (353) -> MXFP4 (one E8M0 exponent byte, qs 16 as ggml's 4-bit blocks). Per 8 rows, per 32 columns,
    136 bytes: the 8 exponent bytes (row k at k), then 128 bytes in 4 stripes l of 32, byte 32 l + 4 k + i being row
    k's plain qs byte 4 l + i unchanged (columns 4 l + i, low nibble, and 16 + 4 l + i, high)."""
    b = groups(raw, ne, 8, 32, 17)
    g, nb = b.shape[:2]
    e = b[..., :8].reshape(g, nb, 8, 1)
    qs = b[..., 8:].reshape(g, nb, 4, 8, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, 8, 16)  # (k, l, i)
    return _rows(e, qs)


# --- BF16_R16: 16 rows, pairs of columns

def bf16_r16(raw: np.ndarray, ne) -> np.ndarray:
    """BF16_R16 (230) -> BF16. Per 16 rows, per 2 columns, 64 bytes: the 16 rows' two bf16 values side by side (row
    k's columns 2 j, 2 j + 1 at bf16 elements 32 j + 2 k, + 1). The values are unchanged (but ik's quantizer makes
    them from float32 by truncating, where plain BF16 rounds)."""
    b = groups(raw, ne, 16, 2, 4)  # a "block" of 2 columns, 4 bytes
    g, nb = b.shape[:2]
    return _rows(b.reshape(g, nb, 16, 4))


# --- the K-quants: 4 rows, blocks of 256

def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K_R4 / Q3_K_R4's 256 bytes of 2-bit quants -> (..., 4 rows, 256) by column: byte 32 ib + 16 h + 4 k + i
    holds at bits 2 m row k's column 32 ib + 16 h + 4 m + i."""
    q = qs.astype(np.int32).reshape(*qs.shape[:-1], 8, 2, 4, 4)  # (ib, h, k, i)
    v = (q[..., None] >> 2 * np.arange(4)) & 3  # (ib, h, k, i, m)
    n = v.ndim
    v = v.transpose(*range(n - 5), n - 3, n - 5, n - 4, n - 1, n - 2)  # (k, ib, h, m, i)
    return v.reshape(*qs.shape[:-1], 4, QK_K)


def _plain_two_bits(v: np.ndarray) -> np.ndarray:
    """(..., 256) values by column -> ggml's Q2_K / Q3_K 64 bytes: column 128 n + 32 j + l's low 2 bits at bits 2 j
    of byte 32 n + l."""
    v = (v & 3).reshape(*v.shape[:-1], 2, 4, 32)  # (n, j, l)
    return (v << 2 * np.arange(4)[:, None]).sum(axis=-2).reshape(*v.shape[:-3], 64)


def q2_k_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q2_K_R4 (210) -> Q2_K (scales 16, qs 64, fp16 d, dmin). Per 4 rows, per 256 columns, 336 bytes: fp16 d[4]
    then dmin[4] (row k at k); 64 scale bytes, byte 4 j + k being row k's plain scale byte j (16 columns j: scale
    nibble low, min high); then 256 bytes of 2-bit quants (_two_bits: byte 32 ib + 16 h + 4 k + i holds row k's
    columns 32 ib + 16 h + i + 0, 4, 8, 12 at bits 0, 2, 4, 6)."""
    b = groups(raw, ne, 4, QK_K, 84)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    dmin = _fp16s(b[..., 8:16], 4)
    scales = b[..., 16:80].reshape(g, nb, 16, 4).transpose(0, 1, 3, 2)
    qs = _plain_two_bits(_two_bits(b[..., 80:336]))
    return _rows(scales, qs, d, dmin)


def q3_k_r4(raw: np.ndarray, ne) -> np.ndarray:
    """Q3_K_R4 (211) -> Q3_K (hmask 32, qs 64, scales 12, fp16 d; value = d (s - 32) (q - 4), q 3 bits, s 6). Per 4
    rows, per 256 columns, 440 bytes: fp16 d[4]; scales_h (16) and scales_l (32), the 16 six-bit scales of row k's
    16-column sub-blocks j unpacked: with s = 4 j + k, the low 4 bits at nibble s // 32 of scales_l byte s % 32, the
    top 2 at bit pair s // 16 of scales_h byte s % 16; 128 bytes of third bits, byte 16 ib + 4 k + i holding at bit
    4 h + m row k's column 32 ib + 16 h + 4 m + i; then 256 bytes of low 2 bits (_two_bits, same columns). Plain:
    hmask byte l bit 4 n + j = third bit of column 128 n + 32 j + l; scales packed as ggml does (bytes 0-7 the low
    nibbles of scales 0-7 and, high nibbles, 8-15; bytes 8-11 the top 2 bits of scale j at bits 2 (j // 4) of byte
    8 + j % 4)."""
    b = groups(raw, ne, 4, QK_K, 110)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    sh, sl = b[..., 8:24].astype(np.int32), b[..., 24:56].astype(np.int32)
    s = 4 * np.arange(16)[None, :] + np.arange(4)[:, None]  # (k, j)
    sc = (sl[..., s % 32] >> 4 * (s // 32)) & 15 | ((sh[..., s % 16] >> 2 * (s // 16)) & 3) << 4  # (g, nb, k, j)
    plain_sc = np.concatenate([
        (sc[..., :8] & 15) | (sc[..., 8:] & 15) << 4,
        ((sc >> 4).reshape(g, nb, 4, 4, 4) << 2 * np.arange(4)[:, None]).sum(axis=-2),  # (j // 4, j % 4)
    ], axis=-1)
    qh = b[..., 56:184].astype(np.int32).reshape(g, nb, 8, 4, 4)  # (ib, k, i)
    hb = (qh[..., None] >> np.arange(8)) & 1  # (ib, k, i, 4 h + m)
    hb = hb.reshape(g, nb, 8, 4, 4, 2, 4).transpose(0, 1, 3, 2, 5, 6, 4).reshape(g, nb, 4, QK_K)  # (k, ib, h, m, i)
    low = _two_bits(b[..., 184:440])
    hmask = (hb.reshape(g, nb, 4, 2, 4, 32) << (4 * np.arange(2)[:, None, None] + np.arange(4)[:, None]))
    hmask = hmask.sum(axis=(-3, -2))  # (k, l): bit 4 n + j
    return _rows(hmask, _plain_two_bits(low), plain_sc, d)


# --- the i-quants: 4 rows, blocks of 256 (8 sub-blocks ib of 32 columns)

def _sas(sas: np.ndarray) -> np.ndarray:
    """IQ3_XXS_R4's 128 sign-and-scale bytes -> (..., 4 rows, 8 ib, 4) little-endian bytes of ggml's
    uint32 per sub-block (four 7-bit sign fields, then the 4-bit scale at bits 28-31). Byte 16 ib + 4 k + m holds
    row k's sign field m, scrambled (_unscramble), in bits 1-7 and bit m of its scale in bit 0."""
    a = sas.astype(np.int64).reshape(*sas.shape[:-1], 8, 4, 4).swapaxes(-3, -2)  # (k, ib, m)
    s = _unscramble(a >> 1).astype(np.int64)
    word = (s << 7 * np.arange(4)).sum(axis=-1) | ((a & 1) << np.arange(4)).sum(axis=-1) << 28
    return ((word[..., None] >> 8 * np.arange(4)) & 255)


def iq3_xxs_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ3_XXS_R4 (218) -> IQ3_XXS (fp16 d, 64 grid index bytes, 8 per sub-block, then 8 uint32 of signs and scale).
    Per 4 rows, per 256 columns, 392 bytes: the 4 fp16 d; 128 bytes of signs and scales (_sas); then 256 bytes of
    grid indices, byte 32 ib + 8 k + i being row k's index i of sub-block ib (columns 32 ib + 4 i .. + 3)."""
    b = groups(raw, ne, 4, QK_K, 98)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    sas = _sas(b[..., 8:136]).reshape(g, nb, 4, 32)
    grid = b[..., 136:392].reshape(g, nb, 8, 4, 8).swapaxes(2, 3).reshape(g, nb, 4, 64)
    return _rows(d, grid, sas)


def iq3_s_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ3_S_R4 (221) -> IQ3_S (fp16 d, qs 64, qh 8, signs 32, scales 4). Per 4 rows, per 256 columns, 440 bytes:
    the 4 fp16 d; 256 index bytes, byte 32 ib + 8 i + 4 h + k (a stride of 1 between rows here) being row k's index
    byte 8 ib + 4 h + i; 32 qh bytes, byte 4 ib + k being row k's qh byte ib; 128 sign bytes, byte 16 ib + 4 k + i
    holding at bit 2 m + h row k's sign bit i + 4 h of plain sign byte 4 ib + m; 16 scale bytes, the nibble of row
    k's sub-block ib (s = 4 ib + k) at nibble s // 16 of byte s % 16 (plain: nibble ib % 2 of byte ib // 2)."""
    b = groups(raw, ne, 4, QK_K, 110)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    qs = b[..., 8:264].reshape(g, nb, 8, 4, 2, 4).transpose(0, 1, 5, 2, 4, 3).reshape(g, nb, 4, 64)  # (k, ib, h, i)
    qh = b[..., 264:296].reshape(g, nb, 8, 4).swapaxes(2, 3)
    sg = b[..., 296:424].astype(np.int32).reshape(g, nb, 8, 4, 4)  # (ib, k, i)
    bit = (sg[..., None] >> np.arange(8)) & 1  # (ib, k, i, 2 m + h)
    bit = bit.reshape(g, nb, 8, 4, 4, 4, 2)  # (ib, k, i, m, h)
    shift = np.arange(4)[:, None, None] + 4 * np.arange(2)  # (i, m, h): bit i + 4 h of the plain byte
    signs = (bit << shift).sum(axis=(-1, -3))  # (ib, k, m)
    signs = signs.transpose(0, 1, 3, 2, 4).reshape(g, nb, 4, 32)
    sc = b[..., 424:440].astype(np.int32)
    s = 4 * np.arange(8)[None, :] + np.arange(4)[:, None]  # (k, ib)
    nib = (sc[..., s % 16] >> 4 * (s // 16)) & 15  # (g, nb, k, ib)
    scales = nib[..., 0::2] | nib[..., 1::2] << 4
    return _rows(d, qs, qh, signs, scales)


def iq2_xxs_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ2_XXS_R4 (216) -> IQ2_XXS (fp16 d, then per sub-block 4 grid index bytes and a uint32 of four 7-bit sign
    fields and the 4-bit scale). Per 4 rows, per 256 columns, 264 bytes: the 4 fp16 d; 128 bytes of signs and scales
    as IQ3_XXS_R4's (_sas); 128 index bytes, byte 16 ib + 4 k + i being row k's index i of sub-block ib."""
    b = groups(raw, ne, 4, QK_K, 66)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    sas = _sas(b[..., 8:136])  # (g, nb, k, ib, 4)
    idx = b[..., 136:264].reshape(g, nb, 8, 4, 4).swapaxes(2, 3)  # (g, nb, k, ib, i)
    return _rows(d, np.concatenate([idx, sas], axis=-1).reshape(g, nb, 4, 64))


def iq2_xs_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ2_XS_R4 (217) -> IQ2_XS (fp16 d, 32 uint16: a 9-bit grid index and a 7-bit sign field each, 8 scale bytes).
    Per 4 rows, per 256 columns, 296 bytes: the 4 fp16 d; 128 uint16, number 16 ib + 4 k + i being row k's number
    4 ib + i with its sign field scrambled (_unscramble); 32 scale bytes, byte 4 ib + k being row k's byte ib."""
    b = groups(raw, ne, 4, QK_K, 74)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    q = b[..., 8:264].copy().view("<u2").astype(np.int32).reshape(g, nb, 8, 4, 4).swapaxes(2, 3)  # (k, ib, i)
    q = (q & 511) | (_unscramble(q >> 9) << 9)
    qs = q.astype("<u2").reshape(g, nb, 4, 32).view(np.uint8)
    scales = b[..., 264:296].reshape(g, nb, 8, 4).swapaxes(2, 3)
    return _rows(d, qs, scales)


def iq2_s_r4(raw: np.ndarray, ne) -> np.ndarray:
    """IQ2_S_R4 (222) -> IQ2_S (fp16 d, 32 grid index bytes, 32 sign bytes, 8 qh, 8 scales). Per 4 rows, per 256
    columns, 328 bytes: the 4 fp16 d; 128 index bytes and (after 32 qh bytes) 128 sign bytes, byte 16 ib + 4 k + i
    of each being row k's byte 4 ib + i; qh and scale bytes 4 ib + k being row k's byte ib."""
    b = groups(raw, ne, 4, QK_K, 82)
    g, nb = b.shape[:2]
    d = _fp16s(b[..., :8], 4)
    by_row = lambda a, w: a.reshape(g, nb, 8, 4, w).swapaxes(2, 3).reshape(g, nb, 4, 8 * w)  # noqa: E731
    return _rows(d, by_row(b[..., 8:136], 4), by_row(b[..., 168:296], 4), by_row(b[..., 136:168], 1),
                 by_row(b[..., 296:328], 1))


DEINTERLEAVE = {
    233: (Q6_0, q6_0_r4),
    220: (IQ4_NL, iq4_nl_r4),
    353: (MXFP4, mxfp4_r8),
    230: (BF16, bf16_r16),
    206: (Q5_0, q5_0_r4),
    211: (Q3_K, q3_k_r4),
    210: (Q2_K, q2_k_r4),
    218: (IQ3_XXS, iq3_xxs_r4),
    221: (IQ3_S, iq3_s_r4),
    216: (IQ2_XXS, iq2_xxs_r4),
    217: (IQ2_XS, iq2_xs_r4),
    222: (IQ2_S, iq2_s_r4),
}
