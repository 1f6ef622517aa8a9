"""ik_llama.cpp's trellis quant types IQ1_KT (158), IQ2_KT (153), IQ3_KT (154) and IQ4_KT (155): the reference
(float64, numpy) that quant.dequantize_ik and the Q8_0 rewrite (quant.ik_to_q8_0, moe_experts.c's ferry_ik_to_q8_0)
use, written from reading ik_llama.cpp (ggml-common.h, iqk/iqk_quantize.cpp, iqk/iqk_gemm_ktquants.cpp,
ggml-cuda/convert.cu, ggml-cuda/mmq.cuh). ferry runs the weights ik's kernels compute (kernel=True).

What all four share
-------------------
* A row is 4 bytes of row metadata -- one little-endian float32 row scale `d` -- followed by the row's 256-value
  super-blocks (ggml.c's type_traits: row_meta_size = 4 for all four types).
* A super-block is 8 blocks of 32 values; each block has a small integer scale `ls`.
* The values come in groups (8 values for IQ1/IQ2/IQ3_KT, 4 for IQ4_KT); each group stores only an index (13, 16,
  16, or 15+1 bits). The group's values are produced by a pseudo-random "trellis" generator seeded with the index:
  a 32-bit state  x = index + 4096  (IQ4_KT adds another 32768 when its block's offset bit is set) is advanced by
  one multiplication per value,  x <- x * 0xCBAC1FED  (mod 2**32),  and each value is read off the new state as the
  sum of its four bytes after masking each byte to 6 bits,  ((x & 0x3f3f3f3f) summed bytewise) - 126,  so an integer
  in [-126, 126]. IQ3_KT takes its absolute value and stores the sign separately.
* So every weight is   d (float32, per row) * ls (integer, per 32) * q (integer in [-126, 126])   -- times a fixed
  factor that ik's matmul kernels (not its reference dequantizer) apply for IQ2_KT and IQ3_KT; see KERNEL_FACTOR.

ik's older KT format drew the values from a different generator (x <- 89226354*x + 64248484, the two 16-bit halves
of (x & 0x8fff8fff) ^ 0x3b603b60 read as fp16 and added, times 31.75); that code survives in ik only in unused
kernels (Trellis1, the *_F32_T / *_F16_T matmuls, dmmv.cu) and files made with it are not readable by current ik
(the bytes carry no version). This module implements the current, integer generator only.

Reference dequantizer vs kernels
--------------------------------
ik's reference `dequantize_row_iq*_kt` (its type_traits to_float, which `llama-quantize ... F32` uses) computes
f32(f32(d * ls) * q). Its CPU matmul kernels (x86 AVX2/AVX512 `mul_mat_iq*_kt_q8_2_x4_T` for < 16 (24 for IQ4_KT;
32 without AVX512) activation columns, and `iqk_dequantize_iq*_kt_q80_r8` + Q8_0_R8 GEMM for more) and its CUDA
paths compute instead
      block scale  s = f32(f32(d * F) * ls),   F = 1.05f for IQ2_KT, 1.01f for IQ3_KT, 1 for IQ1_KT and IQ4_KT
      weight       s * q   (the integer q exactly; the small-batch path keeps s in float32, the large-batch Q8_0_R8
                            path rounds s to fp16, round-to-nearest-even, with q as int8).
Exceptions in ik itself: the CUDA mat-vec for IQ3_KT (mmvq) uses 1.015f, and the ARM NEON IQ3_KT kernels use
1.05f; the CUDA convert.cu IQ2_KT/IQ3_KT dequantizers use 1.05f/1.01f applied as f32(f32(d*ls)*F).
`kernel=True` (the default) gives the x86 CPU kernels' values, s * q with s in float32; `kernel=False` gives the
reference dequantizer's (= ik's F32 conversion) before its final float32 rounding.
"""

from __future__ import annotations

import numpy as np

from ferry.errors import FerryError

QK_K = 256
ROW_META = 4  # bytes of row metadata: the float32 row scale

# ik's IQ4_K value table (its iq4k_values, first 16 entries, as quant.IQ4K_VALUES; this package stays below quant): the
# block scales of IQ1_KT and IQ2_KT
IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

# the generator's multiplier and per-type offset; bytes per super-block
KA = np.uint32(0xCBAC1FED)
OFFSET = 4096
BLOCK_BYTES = {158: 56, 153: 68, 154: 100, 155: 128}
# the factor ik's CPU (x86) and CUDA kernels multiply the row scale by (float32 constants)
KERNEL_FACTOR = {158: np.float32(1.0), 153: np.float32(1.05), 154: np.float32(1.01), 155: np.float32(1.0)}


def trellis_values(seeds: np.ndarray, steps: int, absolute: bool = False) -> np.ndarray:
    """The trellis generator: for each uint32 starting state in `seeds`, `steps` values (int8, shape
    seeds.shape + (steps,)). Each step multiplies the state by KA modulo 2**32, masks each of its four bytes to its low
    6 bits, and yields their sum minus 126 (the byte sum is the top byte of (masked * 0x01010101): each partial sum
    stays below 256, so no carries cross bytes)."""
    x = np.asarray(seeds, dtype=np.uint32).copy()
    out = np.empty(x.shape + (steps,), dtype=np.int8)
    for k in range(steps):
        x *= KA  # wraps modulo 2**32
        s = ((x & np.uint32(0x3f3f3f3f)) * np.uint32(0x01010101)) >> np.uint32(24)
        v = s.astype(np.int16) - 126
        out[..., k] = np.abs(v) if absolute else v
    return out


_TABLES: dict[tuple[int, int, bool], np.ndarray] = {}


def _table(n_index: int, steps: int, absolute: bool = False) -> np.ndarray:
    """All groups the generator can give for indices 0..n_index-1 (seeded with index + 4096), as one row of `steps`
    int8 each, built once (64K x 8 bytes at most) so that decoding is a gather."""
    key = (n_index, steps, absolute)
    if key not in _TABLES:
        _TABLES[key] = trellis_values(np.arange(n_index, dtype=np.uint32) + OFFSET, steps, absolute)
    return _TABLES[key]


def _gather(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """table[idx] for a table of 8 (or 4) int8 per row, gathered as one uint64 (uint32) per group."""
    steps = table.shape[1]
    packed = table.view(np.uint64 if steps == 8 else np.uint32).reshape(-1)
    return packed[idx].view(np.int8).reshape(idx.shape + (steps,))


def _rows(raw: np.ndarray, raw_type: int, ne) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Split a tensor's bytes into the rows' float32 scales (rows,) and their super-blocks (rows, nsb, bytes)."""
    ne = tuple(int(n) for n in ne)
    if ne[0] % QK_K:
        raise FerryError(f"a trellis tensor's rows of {ne[0]} values are not whole blocks of {QK_K}; the file is corrupt")
    rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
    nsb = ne[0] // QK_K
    bb = BLOCK_BYTES[raw_type]
    r = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if r.size != rows * (ROW_META + nsb * bb):
        raise FerryError(f"a trellis tensor holds {r.size} bytes, not {rows * (ROW_META + nsb * bb)} for ne={ne}; the "
                         "file is corrupt")
    r = r.reshape(rows, ROW_META + nsb * bb)
    d = r[:, :ROW_META].copy().view("<f4").reshape(rows)
    return d, r[:, ROW_META:].reshape(rows, nsb, bb), rows, nsb


def _finish(d: np.ndarray, ls: np.ndarray, q: np.ndarray, raw_type: int, ne, kernel: bool) -> np.ndarray:
    """Weights = s * q with the per-32 block scale s = f32(f32(d * F) * ls) (F = 1 for the reference), in float64.
    d: (rows,) float32; ls: (rows, nblocks) integers; q: (rows, nblocks, 32) integers."""
    f = KERNEL_FACTOR[raw_type] if kernel else np.float32(1.0)
    s = (d * f).astype(np.float32)[:, None] * ls.astype(np.float32)  # float32 products, as ik computes them
    out = s.astype(np.float64)[:, :, None] * q  # exact: |q| <= 126 and s has 24 significant bits
    return out.reshape(tuple(int(n) for n in reversed(tuple(ne))))


def kt_parts(raw: np.ndarray, raw_type: int, ne, kernel: bool = True):
    """(s, q): per-32 block scales as ik computes them in float32 (rows, nblocks) and the integer values (rows,
    ne0) int8 in [-126, 126], with weights = s * q. ik's own large-batch CPU path stores exactly q and fp16(s)."""
    d, ls, q = _DECODERS[raw_type](raw, ne)
    f = KERNEL_FACTOR[raw_type] if kernel else np.float32(1.0)
    s = (d * f).astype(np.float32)[:, None] * ls.astype(np.float32)
    return s, q.reshape(q.shape[0], -1)


def _iq1_kt(raw, ne):
    d, sb, rows, nsb = _rows(raw, 158, ne)
    sh, ql, qh = sb[..., 0:8], sb[..., 8:40], sb[..., 40:56]
    ls = IQ4K_VALUES[sh & 0xf]  # (rows, nsb, 8)
    g = np.arange(32)
    idx = ql.astype(np.uint16)
    idx |= (((qh[..., g % 16] >> (4 * (g // 16))) & 0xf).astype(np.uint16) << 8)
    idx |= (((sh[..., g // 4] >> (4 + g % 4)) & 1).astype(np.uint16) << 12)
    q = _gather(_table(1 << 13, 8), idx)  # (rows, nsb, 32 groups, 8)
    return d, ls.reshape(rows, nsb * 8), q.reshape(rows, nsb * 8, 32)


def _iq2_kt(raw, ne):
    d, sb, rows, nsb = _rows(raw, 153, ne)
    sc = sb[..., 0:4]
    ls = IQ4K_VALUES[np.concatenate([sc & 0xf, sc >> 4], axis=-1)]  # block b: nibble b//4 of byte b%4
    idx = np.ascontiguousarray(sb[..., 4:68]).view("<u2")  # (rows, nsb, 32 groups)
    q = _gather(_table(1 << 16, 8), idx)
    return d, ls.reshape(rows, nsb * 8), q.reshape(rows, nsb * 8, 32)


def _iq3_kt(raw, ne):
    d, sb, rows, nsb = _rows(raw, 154, ne)
    sc = sb[..., 0:4]
    ls = np.concatenate([sc & 0xf, sc >> 4], axis=-1)  # unsigned 0..15, no table
    idx = np.ascontiguousarray(sb[..., 4:68]).view("<u2")
    qh = sb[..., 68:100]  # qh[k] bit b: the sign of value k of block b
    mag = _gather(_table(1 << 16, 8, absolute=True), idx).reshape(rows, nsb, 8, 32)
    neg = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
    q = np.where(neg.astype(bool), -mag, mag)
    return d, ls.reshape(rows, nsb * 8), q.reshape(rows, nsb * 8, 32)


def _iq4_kt(raw, ne):
    d, sb, rows, nsb = _rows(raw, 155, ne)
    w = np.ascontiguousarray(sb[..., 0:32]).view("<u4")  # (rows, nsb, 8): one word per block
    ql, qh = sb[..., 32:96], sb[..., 96:128]
    ls = ((w & 0xff) >> 1).astype(np.int16) - 64
    g = np.arange(64)
    idx = ql.astype(np.uint32)
    idx |= ((qh[..., g % 32] >> (4 * (g // 32))) & 0xf).astype(np.uint32) << 8
    idx |= ((w[..., g // 8] >> (8 + 3 * (g % 8)).astype(np.uint32)) & 7) << 12
    idx |= (w[..., g // 8] & 1) << 15  # the block's offset bit: 32768 more
    q = _gather(_table(1 << 16, 4), idx)  # (rows, nsb, 64 groups, 4)
    return d, ls.reshape(rows, nsb * 8), q.reshape(rows, nsb * 8, 32)


_DECODERS = {158: _iq1_kt, 153: _iq2_kt, 154: _iq3_kt, 155: _iq4_kt}


def dequantize_iq1_kt(raw: np.ndarray, ne, kernel: bool = True) -> np.ndarray:
    """IQ1_KT (type 158, 1.75 bpw): row = float32 d, then 56-byte super-blocks of 256 values:
    sh[8] | ql[32] | qh[16].
    Block b (32 values) has scale ls = IQ4K_VALUES[sh[b] & 15]; its 4 groups of 8 (group g = 4b + i) each have a
    13-bit index: ql[g] (bits 0-7), nibble g//16 of qh[g % 16] (bits 8-11; low nibble for g < 16), bit 4+i of sh[b]
    (bit 12). The group's 8 values are the trellis generator's first 8 outputs from index + 4096.
    Weight = d * ls * value; ik applies no extra factor for this type (kernel only kept for a uniform signature)."""
    d, ls, q = _iq1_kt(raw, ne)
    return _finish(d, ls, q, 158, ne, kernel)


def dequantize_iq2_kt(raw: np.ndarray, ne, kernel: bool = True) -> np.ndarray:
    """IQ2_KT (type 153, 2.125 bpw): row = float32 d, then 68-byte super-blocks: scales[4] | ql[64].
    Block b has ls = IQ4K_VALUES[nibble b//4 of scales[b % 4]] (low nibble for blocks 0-3); group g (0..31, 8 values)
    has the 16-bit index ql[2g] | ql[2g+1] << 8, expanded by the trellis generator from index + 4096.
    Weight = d * F * ls * value with F = 1.05f in ik's kernels (kernel=True) and 1 in its reference dequantizer."""
    d, ls, q = _iq2_kt(raw, ne)
    return _finish(d, ls, q, 153, ne, kernel)


def dequantize_iq3_kt(raw: np.ndarray, ne, kernel: bool = True) -> np.ndarray:
    """IQ3_KT (type 154, 3.125 bpw): row = float32 d, then 100-byte super-blocks: scales[4] | ql[64] | qh[32].
    Block b has the unsigned scale ls = nibble b//4 of scales[b % 4] (0..15, no table); group g (8 values) has the
    16-bit index of IQ2_KT; the generator's outputs are taken in absolute value, and value k (0..31) of block b is
    negated when bit b of qh[k] is set.
    Weight = d * F * ls * value with F = 1.01f in ik's x86 and CUDA kernels (kernel=True), 1 in its reference."""
    d, ls, q = _iq3_kt(raw, ne)
    return _finish(d, ls, q, 154, ne, kernel)


def dequantize_iq4_kt(raw: np.ndarray, ne, kernel: bool = True) -> np.ndarray:
    """IQ4_KT (type 155, 4.0 bpw + 32 bits a row): row = float32 d, then 128-byte super-blocks:
    w[8] (little-endian uint32, one per block) | ql[64] | qh[32].
    Block b: ls = ((w[b] & 255) >> 1) - 64 (-64..63); bit 0 of w[b] adds 32768 to the seeds of its groups; its 8
    groups of 4 values (group g = 8b + i) have a 15-bit index: ql[g] (bits 0-7), nibble g//32 of qh[g % 32] (bits
    8-11), bits 8+3i..10+3i of w[b] (bits 12-14). The group's 4 values are the trellis generator's first 4 outputs
    from index + 4096 (+ 32768).
    Weight = d * ls * value; no extra factor in ik's kernels (kernel only kept for a uniform signature)."""
    d, ls, q = _iq4_kt(raw, ne)
    return _finish(d, ls, q, 155, ne, kernel)


DEQUANTIZE = {158: dequantize_iq1_kt, 153: dequantize_iq2_kt, 154: dequantize_iq3_kt, 155: dequantize_iq4_kt}
